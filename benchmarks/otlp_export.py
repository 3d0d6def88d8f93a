"""What one OTLP export costs at a job's size (``serve --otlp``, issue #36 item 2).

A real ``Server`` holding N ranks (8 a host, every 97th stalled so some are flagged), ticked
once; then, as the exporter does each interval: the summary (``status?view=summary``), its
encoding as an ``ExportMetricsServiceRequest`` and the body's bytes, raw and gzipped. The
export is bounded by ``--max-ranks`` ranks and the summary's hosts (``MAX_HOSTS``), not by N.

    python benchmarks/otlp_export.py --sizes 1024,8192,65536
"""

from __future__ import annotations

import argparse
import gzip
import socket
import time

from ddpwatch.core.protocol import Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.outputs.otlp_encode import metrics_request
from ddpwatch.outputs.prometheus import summary_from_query
from ddpwatch.server.service import Server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def measure(size: int, max_ranks: int, repeats: int) -> dict[str, float]:
    clock = Clock()
    server = Server("127.0.0.1", free_port(), Thresholds(stall_after=10.0), clock=clock)
    try:
        for step, at in ((1, 1000.0), (2, 1020.0)):
            for rank in range(size):
                stalled = rank % 97 == 5
                beat = Sample(
                    v=1, rank=rank, t=0, world_size=size, local_rank=rank % 8,
                    host=f"node{rank // 8:05d}", pid=10_000 + rank, device=f"cuda:{rank % 8}",
                    step=1 if stalled else step, loss=0.5, step_time_s=0.1,
                    mem_allocated_bytes=1 << 30, gpu_mem_used_bytes=2 << 30,
                )  # fmt: skip
                server.state.apply(beat, at)
        clock.now = 1021.0
        server.tick()
        summary = summary_from_query(server.query_json)
        read_s, encode_s = [], []
        body = b""
        for _ in range(repeats):
            started = time.perf_counter()
            reply = summary(max_ranks)
            read_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            body = metrics_request(reply, {"service.name": "ddpwatch"}, 0).SerializeToString()
            encode_s.append(time.perf_counter() - started)
        return {
            "ranks": size,
            "exported": len(reply.ranks),
            "hosts": len(reply.summary.hosts),
            "summary_ms": 1000 * min(read_s),
            "encode_ms": 1000 * min(encode_s),
            "bytes": len(body),
            "gzip_bytes": len(gzip.compress(body)),
        }
    finally:
        server.collector.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,8192,65536")
    parser.add_argument("--max-ranks", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| ranks | ranks exported | hosts | summary (ms) | encode (ms) | body | gzipped |")
    print("|---|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        m = measure(size, args.max_ranks, args.repeats)
        print(
            f"| {m['ranks']:,} | {m['exported']:,} | {m['hosts']:,} | {m['summary_ms']:.1f} | "
            f"{m['encode_ms']:.1f} | {m['bytes'] / 1024:,.0f} KiB | "
            f"{m['gzip_bytes'] / 1024:,.0f} KiB |"
        )


if __name__ == "__main__":
    main()
