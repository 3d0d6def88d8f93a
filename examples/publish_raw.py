"""Publish to ``ddpwatch serve`` without torch or ddpwatch: only pyzmq and msgspec.

The wire protocol is in docs/protocol.md. Run ``ddpwatch serve`` first, then
one copy of this script per rank::

    python examples/publish_raw.py --addr 127.0.0.1:5599 --rank 0 --steps 40 &
    python examples/publish_raw.py --addr 127.0.0.1:5599 --rank 1 --steps 40 &
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import time

import msgspec
import zmq


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:5599", help="host:port of ddpwatch serve")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, help="default: rank + 1")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds per step/heartbeat")
    args = parser.parse_args()

    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1000)  # bounded queue while the server is away
    sock.setsockopt(zmq.LINGER, 500)  # ms; never hang at exit
    sock.connect(f"tcp://{args.addr}")

    def send(kind: str, **fields: object) -> None:
        frame = {"v": 1, "type": kind, "rank": args.rank, "t": time.time(), **fields}
        with contextlib.suppress(zmq.Again):  # queue full: drop it, never block the job
            sock.send(msgspec.msgpack.encode(frame), zmq.NOBLOCK)

    identity = {
        "local_rank": args.rank,
        "world_size": args.world_size or args.rank + 1,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": "cpu",
    }
    send("hello", **identity)
    for step in range(1, args.steps + 1):
        started = time.time()
        time.sleep(args.interval)  # the "work" of one step
        send(
            "sample",
            **identity,
            phase="train",
            step=step,
            loss=2.0 * math.exp(-step / 10),
            step_time_s=time.time() - started,
        )
    send("event", event="exit", exit_code=0)
    sock.close()
    context.term()  # waits up to LINGER for the last frames to leave
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
