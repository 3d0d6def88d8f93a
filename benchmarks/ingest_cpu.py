"""CPU time per heartbeat on the server's ingest thread, at thousands of distinct ranks.

    python benchmarks/ingest_cpu.py [--sizes 8192,65536] [--beats 8] [--ranks-per-relay 8]
        [--backlog 4] [--profile] [--quick]

At 32,768+ ranks at 2 Hz the one Python thread that receives and applies heartbeats is the
server's bottleneck; this measures what each heartbeat costs it, in CPU time, not msgs/s (so
the number holds whatever else the machine runs). For each size, every rank beats ``--beats``
times (0.5 s of simulated time per beat, two 0.25 s steps), as the real agent builds its beat
(``agent/watcher.py``: identity on a rank's first beat and every ``IDENTITY_EVERY``-th after,
staggered across ranks as in a running job; memory; step, loss, timings; collective counts
with the agent's step marks; a quarter of the ranks inside an all-reduce) and encoded with
``protocol.encode``, the agent's encoder. Beat 0 makes every rank new; the table reports it
apart ("first"); after beat 1 a ``gc.collect()`` (untimed) settles what the new records cost the
cyclic garbage collector once, as in a server that has run for a while, and beats 2.. are the
mean reported ("steady", the 2 Hz load). Arms:

* ``collector direct`` / ``collector relay``: a sender process (spawn) connects a PUSH socket
  to a real ``Collector`` on 127.0.0.1 and, each beat, pushes every rank's frame, alone
  (``direct``) or in ``Batch`` frames of ``--ranks-per-relay`` ranks as ``relay.Relay._send``
  builds them (``relay``). The sender has queued a whole beat before the receiver starts on it;
  the receiver calls ``Collector.poll`` under a lock, as ``Server.run`` does, until every
  heartbeat of the beat is counted. Each rank beats once per beat, so nothing is coalesced
  (``Collector._receive``), as at 2 Hz. Columns: the ingest thread's CPU (``time.thread_time``
  around ``poll``), the process's (``time.process_time``, with libzmq's I/O thread), and the
  part of the thread's spent in Python's cyclic garbage collector (``gc.callbacks``), with
  the number of full (oldest-generation) collections;
* ``backlog direct`` / ``backlog relay``: the same, but the steady beats are sent
  ``--backlog`` at a time before the collector reads them, so it falls behind and reads up
  to ``BEHIND_BEATS`` heartbeats per rank a receive, coalescing (``Collector._receive``);
* ``shedding direct`` / ``shedding relay``: that backlog, with the collector's queue last
  found empty ``FAR_BEHIND_S`` ago (``state.heard_until``): it sheds (``SHED_AFTER_S``);
* ``backlog unhinted`` / ``shedding unhinted``: the relay arms of the two above, with
  batches that do not say their frames' ranks and plain heartbeats (relays before
  ``Batch.ranks``): every heartbeat is read, none left out as superseded unread;
* ``decode direct`` / ``decode relay``: ``protocol.decode`` of each frame, or
  ``decode_wire`` of each batch and ``decode`` of its frames, on frames in memory, each
  dropped at once;
* ``ServerState.apply``: ``apply`` alone on a whole beat of messages decoded beforehand (so
  they are no longer in the CPU's caches: at these sizes that is part of the cost).

A warm-up run (1,024 ranks, untimed) goes first. Prints µs per heartbeat, ``RATIO
apply/collector`` (the share of the thread's ingest cost a whole beat of ``apply`` would be)
``RATIO shedding/backlog`` (what a heartbeat costs a server far behind against one just
behind) and ``RATIO hinted/unhinted`` (a relay's backlog with the batches' hints against
without: what leaving superseded batches unread saves).
``--profile`` adds a cProfile of the direct collector arm's steady beats. Compare versions by
running the same command on each; on a shared machine, repeat and compare medians.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import multiprocessing as mp
import pstats
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ingest import gpu_identity  # benchmarks/ is on the path: these run as scripts

BEAT_S = 0.5
STEP_S = 0.25
T0 = 1.7e9
RELAY_PID = 4242
POLL_S = 0.2
FAR_BEHIND_S = 100.0  # the shedding arm: the collector last found its queue empty this long ago
STEADY_FROM = 2  # beat 0: every rank new; beat 1: settling, then a full collection


# ------------------------------------------------------------------------------ heartbeats


def sample(rank: int, world: int, beat: int) -> Any:
    """Rank ``rank``'s heartbeat number ``beat``, as the agent builds it."""
    from ddpwatch.agent.watcher import IDENTITY_EVERY
    from ddpwatch.core.protocol import (
        MARK_EVERY,
        PROTOCOL_VERSION,
        Collective,
        CollectiveCounts,
        Sample,
    )

    local = rank % 8
    step = 2 * beat + 1
    identity: dict[str, Any] = {}
    if beat == 0 or (beat + rank) % IDENTITY_EVERY == 0:
        identity = gpu_identity(rank, world, host=f"gpu-node-{rank // 8:05d}", pid=20_000 + rank)
        identity.update(
            job_id="bench-ingest-cpu",
            device_uuid=f"GPU-{rank:08x}-1b2c-3d4e-5f60-{local:012x}",
            device_pci_bus_id=f"00000000:{0x18 + local:02X}:00.0",
            pg_timeout_s=600.0,
        )
    last = step // MARK_EVERY
    marks = [(m * MARK_EVERY, m * MARK_EVERY) for m in range(max(1, last - 15), last + 1)]
    waiting = rank % 4 == 0
    return Sample(
        v=PROTOCOL_VERSION,
        rank=rank,
        t=T0 + beat * BEAT_S + rank * 1e-6,
        **identity,
        mem_allocated_bytes=40_000_000_000 + rank * 4096 + beat,
        mem_reserved_bytes=48_000_000_000,
        mem_peak_bytes=45_000_000_000,
        gpu_mem_used_bytes=50_000_000_000 + beat,
        gpu_mem_total_bytes=85_000_000_000,
        gpu_pids=[20_000 + rank],
        phase="train",
        step=step,
        loss=2.5 / (1 + step * 1e-3),
        nan_step=None,
        step_time_s=STEP_S + (rank % 7) * 1e-3,
        avg_step_time_s=STEP_S,
        data_wait_s=0.002,
        collective_time_s=0.03,
        collective=Collective(
            op="all_reduce", seq=step + 1, since_s=0.01, source="fr", group="0", shape=[1 << 20]
        )
        if waiting
        else None,
        collectives=CollectiveCounts(py=step, fr={"0": 3 * step}, marks=marks or None),
        forwards=step,
    )


def beat_frames(ranks: int, beat: int, per_relay: int, hints: bool = True) -> list[bytes]:
    """Every rank's frame of one beat: alone (``per_relay`` 0) or in relays' ``Batch`` frames,
    built as ``relay.Relay._send`` builds them (without ``hints``: as relays before
    ``Batch.ranks`` and ``Batch.plain`` did, which a server behind reads whole)."""
    from ddpwatch.core.protocol import PROTOCOL_VERSION, Batch, encode, plain_beat

    messages = [sample(rank, ranks, beat) for rank in range(ranks)]
    frames = [encode(message) for message in messages]
    if not per_relay:
        return frames
    batches = []
    for node, lo in enumerate(range(0, ranks, per_relay)):
        inner = frames[lo : lo + per_relay]
        told = messages[lo : lo + per_relay]
        batch = Batch(
            v=PROTOCOL_VERSION,
            relay=f"gpu-node-{node:05d}:{RELAY_PID}",
            t=T0 + beat * BEAT_S + 0.49,
            host=f"gpu-node-{node:05d}",
            seq=beat,
            frames=inner,
            ages_us=[(lo + i) % 500_000 for i in range(len(inner))],
            rejected=0,
            dropped=0,
            ranks=[m.rank for m in told] if hints else [],
            plain=[i for i, m in enumerate(told) if plain_beat(m)] if hints else [],
        )
        batches.append(encode(batch))
    return batches


def sender(conn: Connection) -> None:
    """Child process: ``("beat", ranks, beat, per_relay, hints)`` builds that beat's frames
    (untimed), then pushes them once told ``go``; ``("connect", endpoint)`` opens a fresh
    socket."""
    import zmq

    context = zmq.Context()
    sock: Any = None
    while True:
        command = conn.recv()
        if command[0] == "quit":
            break
        if command[0] == "connect":
            if sock is not None:
                sock.close(linger=0)
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(command[1])
            conn.send("connected")
            continue
        _, ranks, beat, per_relay, hints = command
        frames = beat_frames(ranks, beat, per_relay, hints)
        conn.send("built")
        conn.recv()  # "go"
        for frame in frames:
            sock.send(frame, copy=False)
        conn.send("sent")
    if sock is not None:
        sock.close(linger=0)
    context.term()


# ------------------------------------------------------------------------------ arms


@dataclass
class Cost:
    """CPU seconds and heartbeats of the first beat and of the steady ones after it."""

    first_s: float = 0.0
    first_n: int = 0
    steady_s: float = 0.0
    steady_n: int = 0
    steady_process_s: float = 0.0
    steady_gc_s: float = 0.0
    full_collections: int = 0

    def add(self, beat: int, cpu_s: float, n: int, process_s: float = 0.0) -> None:
        if beat == 0:
            self.first_s, self.first_n = self.first_s + cpu_s, self.first_n + n
        elif beat >= STEADY_FROM:
            self.steady_s, self.steady_n = self.steady_s + cpu_s, self.steady_n + n
            self.steady_process_s += process_s

    @property
    def first_us(self) -> float:
        return self.first_s / max(1, self.first_n) * 1e6

    @property
    def steady_us(self) -> float:
        return self.steady_s / max(1, self.steady_n) * 1e6

    @property
    def process_us(self) -> float:
        return self.steady_process_s / max(1, self.steady_n) * 1e6

    @property
    def gc_us(self) -> float:
        return self.steady_gc_s / max(1, self.steady_n) * 1e6


class GcClock:
    """CPU time the cyclic garbage collector takes while on (``gc.callbacks``), and how many
    full (oldest-generation) collections it ran: part of what ingest costs."""

    def __init__(self) -> None:
        self.on = False
        self.spent_s = 0.0
        self.full = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.spent_s += time.thread_time() - self._started
            self.full += info["generation"] == 2


def collector_arm(
    conn: Connection,
    ranks: int,
    beats: int,
    per_relay: int,
    profile: cProfile.Profile | None,
    backlog: int = 1,
    far_behind: bool = False,
    hints: bool = True,
) -> Cost:
    """A real ``Collector`` fed by the sender process over TCP, one beat at a time; steady
    beats ``backlog`` at a time (all sent before the collector reads: it falls behind and
    coalesces), its queue last found empty ``FAR_BEHIND_S`` ago when ``far_behind`` (it
    sheds: ``collector.SHED_AFTER_S``)."""
    from ddpwatch.core.ports import free_port_pair
    from ddpwatch.server.collector import Collector
    from ddpwatch.state.state import ServerState

    port = free_port_pair()
    state = ServerState(started=time.time())
    collector = Collector(state, lambda: b"{}", "127.0.0.1", port)
    lock = threading.Lock()
    cost = Cost()
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        conn.send(("connect", f"tcp://127.0.0.1:{port}"))
        conn.recv()
        queued = 0  # steady beats sent and not yet read
        for beat in range(beats):
            conn.send(("beat", ranks, beat, per_relay, hints))
            if conn.recv() != "built":
                raise RuntimeError("sender failed")
            conn.send("go")
            if conn.recv() != "sent":
                raise RuntimeError("sender failed")
            if beat >= STEADY_FROM:
                queued += 1
                if queued < backlog and beat < beats - 1:
                    continue  # the collector reads once the backlog is in
            if far_behind:
                state.heard_until = time.time() - FAR_BEHIND_S
            expected = ranks * (beat + 1)
            cpu = 0.0
            process_started = time.process_time()
            if profile is not None and beat >= STEADY_FROM:
                profile.enable()
            clock.on = beat >= STEADY_FROM
            while state.received + state.rejected < expected:
                started = time.thread_time()
                collector.poll(POLL_S, lock)
                cpu += time.thread_time() - started
            clock.on = False
            if profile is not None:
                profile.disable()
            cost.add(beat, cpu, ranks * max(1, queued), time.process_time() - process_started)
            queued = 0
            if beat == STEADY_FROM - 1:
                gc.collect()  # the new records' one-time promotion, out of the steady beats
        if state.rejected or state.received != ranks * beats or len(state.ranks) != ranks:
            raise RuntimeError(
                f"received {state.received}, rejected {state.rejected}, ranks {len(state.ranks)}"
            )
    finally:
        gc.callbacks.remove(clock)
        collector.close()
    cost.steady_gc_s, cost.full_collections = clock.spent_s, clock.full
    return cost


def memory_arms(ranks: int, beats: int, per_relay: int) -> dict[str, Cost]:
    """Decode (direct and relay) and ``ServerState.apply`` alone, on frames in memory."""
    from ddpwatch.core.protocol import Batch, decode, decode_wire
    from ddpwatch.state.state import ServerState

    costs = {"decode direct": Cost(), "decode relay": Cost(), "ServerState.apply": Cost()}
    state = ServerState(started=0.0)
    clock = time.thread_time
    for beat in range(beats):
        frames = beat_frames(ranks, beat, 0)
        batches = beat_frames(ranks, beat, per_relay)
        started = clock()
        for frame in frames:
            decode(frame)  # dropped at once, as the collector drops a coalesced one
        costs["decode direct"].add(beat, clock() - started, ranks)
        messages = [decode(frame) for frame in frames]
        started = clock()
        for frame in batches:
            batch = decode_wire(frame)
            assert isinstance(batch, Batch)
            for inner in batch.frames:
                decode(inner)
        costs["decode relay"].add(beat, clock() - started, ranks)
        now = T0 + beat * BEAT_S
        apply = state.apply
        started = clock()
        for message in messages:
            apply(message, now)
        costs["ServerState.apply"].add(beat, clock() - started, ranks)
        if beat == STEADY_FROM - 1:
            gc.collect()
    return costs


def measure(
    conn: Connection,
    ranks: int,
    beats: int,
    per_relay: int,
    profile: cProfile.Profile | None,
    backlog: int,
) -> dict[str, Cost]:
    costs: dict[str, Cost] = {}
    arms: list[tuple[str, Callable[[], Cost]]] = [
        ("collector direct", lambda: collector_arm(conn, ranks, beats, 0, profile)),
        ("collector relay", lambda: collector_arm(conn, ranks, beats, per_relay, None)),
        ("backlog direct", lambda: collector_arm(conn, ranks, beats, 0, None, backlog)),
        ("backlog relay", lambda: collector_arm(conn, ranks, beats, per_relay, None, backlog)),
        ("shedding direct", lambda: collector_arm(conn, ranks, beats, 0, None, backlog, True)),
        (
            "shedding relay",
            lambda: collector_arm(conn, ranks, beats, per_relay, None, backlog, True),
        ),
        (
            "backlog unhinted",
            lambda: collector_arm(conn, ranks, beats, per_relay, None, backlog, hints=False),
        ),
        (
            "shedding unhinted",
            lambda: collector_arm(conn, ranks, beats, per_relay, None, backlog, True, False),
        ),
    ]
    for name, arm in arms:
        gc.collect()
        costs[name] = arm()
    gc.collect()
    costs.update(memory_arms(ranks, beats, per_relay))
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="8192,65536", help="ranks, comma-separated")
    parser.add_argument("--beats", type=int, default=8, help="heartbeats per rank (>= 3)")
    parser.add_argument("--ranks-per-relay", type=int, default=8, help="ranks in one batch")
    parser.add_argument(
        "--backlog", type=int, default=4, help="beats queued at once in the backlog arms (4)"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the direct collector")
    parser.add_argument("--quick", action="store_true", help="1,024 ranks, 3 beats")
    args = parser.parse_args(argv)
    sizes = [1024] if args.quick else [int(s) for s in args.sizes.split(",")]
    beats = 3 if args.quick else max(STEADY_FROM + 1, args.beats)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sender, args=(child,), daemon=True)
    proc.start()
    profile = cProfile.Profile() if args.profile else None
    results: dict[int, dict[str, Cost]] = {}
    try:
        collector_arm(parent, 1024, 3, 0, None)  # warm up sockets, imports and the heap
        for size in sizes:
            results[size] = measure(
                parent, size, beats, args.ranks_per_relay, profile, args.backlog
            )
        parent.send(("quit",))
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()

    print(
        f"ingest CPU per heartbeat: {beats} beats per rank, relay batches of "
        f"{args.ranks_per_relay} ranks; us of CPU per heartbeat; first = beat 0 (every rank "
        f"new), steady = beats {STEADY_FROM}.."
    )
    print(
        "  process: the whole receiving process (libzmq's I/O thread too); gc: of steady, in the"
        " cyclic garbage collector (full: collections of the oldest generation)"
    )
    header = f"{'ranks':>7}  {'arm':<18} {'first':>8} {'steady':>8} {'process':>8} {'gc':>7}"
    print(f"  {header} {'full':>5}")
    for size, costs in results.items():
        for name, cost in costs.items():
            line = f"{size:>7}  {name:<18} {cost.first_us:8.2f} {cost.steady_us:8.2f}"
            if not name.startswith(("decode", "ServerState")):
                line += f" {cost.process_us:8.2f} {cost.gc_us:7.2f} {cost.full_collections:5d}"
            print(f"  {line}")
    for size, costs in results.items():
        apply_us = costs["ServerState.apply"].steady_us
        for mode in ("direct", "relay"):
            total = costs[f"collector {mode}"].steady_us
            print(
                f"RATIO apply/collector {mode} {size} = {apply_us / total:.3f} "
                f"(collector {total:.2f} us/heartbeat, apply {apply_us:.2f})"
            )
    for size, costs in results.items():
        for mode in ("direct", "relay"):
            backlog, shedding = costs[f"backlog {mode}"], costs[f"shedding {mode}"]
            print(
                f"RATIO shedding/backlog {mode} {size} = "
                f"{shedding.steady_us / backlog.steady_us:.3f} (backlog of {args.backlog} beats:"
                f" {backlog.steady_us:.2f} us/heartbeat coalescing, {shedding.steady_us:.2f}"
                " shedding)"
            )
    for size, costs in results.items():
        for arm in ("backlog", "shedding"):
            hinted, unhinted = costs[f"{arm} relay"], costs[f"{arm} unhinted"]
            print(
                f"RATIO hinted/unhinted {arm} relay {size} = "
                f"{hinted.steady_us / unhinted.steady_us:.3f} ({hinted.steady_us:.2f} us/heartbeat"
                f" with the relays' Batch.ranks and Batch.plain, {unhinted.steady_us:.2f} without)"
            )
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
