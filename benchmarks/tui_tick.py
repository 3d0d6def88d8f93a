"""What one 2 Hz dashboard tick costs at 1,024 and 8,192 ranks, as a fraction of one core.

Two measurements per size, both on the real ``DashboardApp`` running headless:

* per tick, timed step by step: fetch (decode the status JSON, as ``RemoteSource``
  does), apply (alert index, history rings, filter and sort of every rank, header,
  alerts panel) and render (``render_line`` of every visible table line; every row
  changed since the last tick, so no strip comes from the cache);
* end to end: the app polling every 0.5 s for a while, process CPU time (every
  thread, Textual's compositor included) divided by wall time.

Run: ``python benchmarks/tui_tick.py [--seconds 10] [--size 200x60]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tui_fixtures import big

from ddpwatch.status.schema import StatusDocument
from ddpwatch.tui.app import DashboardApp
from ddpwatch.tui.widgets.rank_table import RankTable

TICK_S = 0.5


class EncodedSource:
    """Plays back pre-encoded status documents, decoding each like ``RemoteSource.fetch``."""

    label = "benchmark"
    started = None

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = payloads
        self.fetches = 0
        self.decoder = msgspec.json.Decoder(StatusDocument)

    def fetch(self) -> StatusDocument | None:
        payload = self.payloads[self.fetches % len(self.payloads)]
        self.fetches += 1
        return self.decoder.decode(payload)


async def measure(
    n: int, seconds: float, size: tuple[int, int], ticks: int = 20
) -> dict[str, float]:
    payloads = [msgspec.json.encode(big(n, tick)) for tick in range(8)]
    source = EncodedSource(payloads)
    app = DashboardApp(source, interval=TICK_S)
    async with app.run_test(size=size) as pilot:
        while source.fetches < 2:
            await pilot.pause(0.05)
        await app.workers.wait_for_complete()
        screen = app.dashboard
        screen.paused = True  # stop the timer's polls while timing steps by hand
        await pilot.pause()
        table = screen.query_one(RankTable)
        fetch_s, apply_s, render_s = [], [], []
        for _ in range(ticks):
            t0 = time.perf_counter()
            document = source.fetch()
            t1 = time.perf_counter()
            screen.apply_document(document)
            t2 = time.perf_counter()
            table._strips.clear()  # worst case: no strip from the cache
            for y in range(table.size.height):
                table.render_line(y)
            t3 = time.perf_counter()
            fetch_s.append(t1 - t0)
            apply_s.append(t2 - t1)
            render_s.append(t3 - t2)
            await pilot.pause()
        visible = table.size.height
        screen.paused = False
        screen.poll_now()
        await pilot.pause(1.0)
        fetched = source.fetches
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        polls = source.fetches - fetched
    fetch, apply, render = (statistics.median(v) for v in (fetch_s, apply_s, render_s))
    per_tick = fetch + apply + render
    return {
        "ranks": n,
        "visible_rows": visible - 1,
        "fetch_ms": fetch * 1e3,
        "apply_ms": apply * 1e3,
        "render_ms": render * 1e3,
        "tick_ms": per_tick * 1e3,
        "tick_core_fraction": per_tick / TICK_S,
        "e2e_core_fraction": cpu / wall,
        "e2e_polls_per_s": polls / wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="end-to-end run per size (10)")
    parser.add_argument("--size", default="200x60", help="terminal size, WxH (200x60)")
    parser.add_argument("--ranks", type=int, nargs="*", default=[1024, 8192])
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    print(f"dashboard tick at {1 / TICK_S:g} Hz, terminal {width}x{height}, median of 20 ticks")
    print(
        f"{'ranks':>6} {'rows':>5} {'fetch':>8} {'apply':>8} {'render':>8} {'tick':>8}"
        f" {'tick/core':>10} {'e2e/core':>9} {'polls/s':>8}"
    )
    for n in args.ranks:
        r = asyncio.run(measure(n, args.seconds, (width, height)))
        print(
            f"{r['ranks']:>6} {r['visible_rows']:>5}"
            f" {r['fetch_ms']:>6.1f}ms {r['apply_ms']:>6.1f}ms"
            f" {r['render_ms']:>6.1f}ms {r['tick_ms']:>6.1f}ms {r['tick_core_fraction']:>9.1%}"
            f" {r['e2e_core_fraction']:>9.1%} {r['e2e_polls_per_s']:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
