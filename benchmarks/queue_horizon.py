"""Does "the queue was found empty" still mean "everything sent has been read" with a small
per-connection queue at the server?

    python benchmarks/queue_horizon.py [--hwms 8,64,1000,100000] [--frames 15000] [--trials 10]

The collector tells diagnosis it has heard everything sent so far (``heard_until``) when a
receive finds its PULL socket empty. That holds when ZeroMQ has moved all that was sent into
the server's queue. A small receive queue (``RCVHWM``) would bound the server's memory while
it is behind, but leaves the rest with the sender and the kernel, and ZeroMQ's I/O thread
refills the queue only after the reader has taken half of it: a reader faster than the
refill finds the queue empty while the sender still holds a backlog.

For each ``RCVHWM``, per trial: one sender PUSHes ``--frames`` heartbeats of ~350 bytes
while nothing reads, waits 0.5 s (ZeroMQ moves what it may), then the reader takes frames
without blocking until it first finds the socket empty. Printed: how many it had taken
then, as a fraction of what was sent (1.0: "empty" meant "all read"), median and worst over
the trials; and how many trials found it empty early.
"""

from __future__ import annotations

import argparse
import statistics
import time

import zmq

from ddpwatch.core.protocol import Sample, encode


def read_before_empty(hwm: int, frames: int) -> int:
    """Frames taken before the first empty receive, one sender holding ``frames``."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, hwm)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    frame = encode(Sample(v=1, rank=0, t=0.0, step=1, gpu_pids=list(range(60))))
    try:
        for _ in range(frames):
            push.send(frame)
        time.sleep(0.5)
        taken = 0
        while taken < frames:
            try:
                pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            taken += 1
        while pull.poll(200):  # drain the rest, so the sender can close
            pull.recv()
        return taken
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hwms", default="8,64,1000,100000")
    parser.add_argument("--frames", type=int, default=15_000)
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"queue_horizon: {args.frames} frames queued by one sender, {args.trials} trials")
    print(f"{'RCVHWM':>8} {'median':>7} {'worst':>7} {'early':>7}")
    for hwm in (int(h) for h in args.hwms.split(",")):
        fractions = [read_before_empty(hwm, args.frames) / args.frames for _ in range(args.trials)]
        early = sum(f < 1.0 for f in fractions)
        median, worst = statistics.median(fractions), min(fractions)
        print(f"{hwm:>8} {median:>7.3f} {worst:>7.3f} {early:>4}/{args.trials}")
        print(
            f"RATIO queue_horizon rcvhwm={hwm}: read before found empty / sent ="
            f" {median:.3f} median, {worst:.3f} worst; empty early in {early} of {args.trials}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
