"""Collector ingest vs. a raw pyzmq PULL loop, on identical frames from the same sender process.

    python benchmarks/ingest.py [--messages 200000] [--rounds 5] [--ranks 1024] [--profile]

A sender process (multiprocessing, spawn) encodes ``--messages`` valid ``Sample`` frames
once, as a GPU rank's agent sends them (identity, device, memory, step, loss, timings;
ranks cycle through ``--ranks`` and every frame is a new step). For each run it connects
a PUSH socket (no high-water mark) to a freshly bound receiver, sends every frame, and
says so; the receiver then drains them all and is timed from that moment to the last
frame. Receivers, in a rotated order every round:

* ``raw``: a PULL socket with the collector's options, ``sock.recv()`` and nothing else;
* ``decode``: the same loop plus ``protocol.decode`` (msgspec decode + validation);
* ``collector``: ddpwatch's ``Collector.poll`` into a ``ServerState`` under a lock, as
  ``Server.run`` does: receive, decode and validate every frame, apply the newest heartbeat
  of each rank per batch (with 1,024 ranks a 10,000-frame batch holds ~10 per rank: the
  backlog case coalescing is for; ``--ranks 20000`` measures it with none to coalesce).

Prints the median msgs/s of each and ``RATIO collector/raw``; targets: ratio >= 0.5 and
collector >= 2e5 msgs/s. ``--profile`` adds a cProfile of one collector run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import pstats
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ddpwatch.core.ports import free_port_pair

TARGET_RATIO = 0.5
TARGET_RATE = 2e5
ARMS = ("raw", "decode", "collector")


def gpu_identity(rank: int, world: int, *, host: str, pid: int) -> dict[str, Any]:
    """The identity an agent on an 8-GPU H100 node sends (``scale.py`` sends it too)."""
    local = rank % 8
    return dict(
        local_rank=local,
        world_size=world,
        local_world_size=8,
        node_rank=rank // 8,
        host=host,
        pid=pid,
        launcher="torchrun",
        job_id="bench",
        backend="nccl",
        torch_version="2.13.0+cu128",
        cuda_visible_devices="0,1,2,3,4,5,6,7",
        device=f"cuda:{local}",
        device_index=local,
        device_name="NVIDIA H100 80GB HBM3",
        device_count=8,
    )


def make_frames(count: int, ranks: int) -> list[bytes]:
    """Valid, realistic heartbeat frames: 8 GPUs per host, every frame a new step, the identity
    in every ``IDENTITY_EVERY``-th frame of a rank, as the agent sends it."""
    from ddpwatch.agent.watcher import IDENTITY_EVERY
    from ddpwatch.core.protocol import PROTOCOL_VERSION, Collective, Sample, encode

    frames = []
    t0 = 1.7e9
    for i in range(count):
        rank, step = i % ranks, i // ranks + 1
        local = rank % 8
        identity = gpu_identity(rank, ranks, host=f"gpu-node-{rank // 8:04d}", pid=20000 + rank)
        identity.update(
            job_id="bench-ingest",
            device_uuid=f"GPU-{rank:08x}-1b2c-3d4e-5f60-{local:012x}",
            device_pci_bus_id=f"00000000:{0x18 + local:02X}:00.0",
        )
        sample = Sample(
            v=PROTOCOL_VERSION,
            rank=rank,
            t=t0 + i * 1e-4,
            **(identity if step % IDENTITY_EVERY == 1 else {}),
            phase="train",
            step=step,
            loss=2.5 / (1 + step * 1e-3),
            step_time_s=0.25 + (rank % 7) * 1e-3,
            avg_step_time_s=0.25,
            data_wait_s=0.002,
            collective_time_s=0.03,
            collective=Collective(op="all_reduce", seq=step * 3, since_s=0.01)
            if i % 5 == 0
            else None,
            forwards=step,
            mem_allocated_bytes=40_000_000_000 + rank,
            mem_reserved_bytes=48_000_000_000,
            mem_peak_bytes=45_000_000_000,
            gpu_mem_used_bytes=50_000_000_000,
            gpu_mem_total_bytes=85_000_000_000,
            gpu_pids=[20000 + rank],
        )
        frames.append(encode(sample))
    return frames


def sender(conn: Connection, count: int, ranks: int) -> None:
    """Child process: send every frame to each endpoint it is given."""
    import zmq

    frames = make_frames(count, ranks)
    conn.send(("ready", sum(len(f) for f in frames) / len(frames)))
    context = zmq.Context()
    while True:
        command, endpoint = conn.recv()
        if command == "quit":
            break
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(endpoint)
        for frame in frames:
            sock.send(frame, copy=False)
        conn.send("sent")
        conn.recv()  # "close": the receiver has every frame
        sock.close(linger=0)
        conn.send("closed")
    context.term()


def _raw_socket(port: int) -> tuple[Any, Any]:
    import zmq

    from ddpwatch.core.protocol import MAX_FRAME_BYTES

    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    return context, sock


def run_once(
    arm: str,
    conn: Connection,
    count: int,
    live: bool,
    profile: cProfile.Profile | None = None,
) -> float:
    """Bind a receiver, have the sender push every frame, time the receipt; returns msgs/s.

    ``live``: the clock starts when the sender is told to go and the receiver takes frames
    while they are being sent (the sender is part of the pipeline). Otherwise (``drain``)
    the sender has queued every frame before the clock starts: the receiver alone.
    """
    from ddpwatch.core.protocol import decode
    from ddpwatch.server.collector import Collector
    from ddpwatch.state.state import ServerState

    port = free_port_pair()
    if arm == "collector":
        state = ServerState(started=time.time())
        collector = Collector(state, lambda: b"{}", "127.0.0.1", port)
        lock = threading.Lock()
    else:
        context, sock = _raw_socket(port)
    started = time.perf_counter()
    conn.send(("send", f"tcp://127.0.0.1:{port}"))
    if not live:
        if conn.recv() != "sent":
            raise RuntimeError("sender failed")
        started = time.perf_counter()
    if profile is not None:
        profile.enable()
    try:
        if arm == "raw":
            recv = sock.recv
            for _ in range(count):
                recv()
        elif arm == "decode":
            recv = sock.recv
            for _ in range(count):
                decode(recv())
        else:
            received = 0
            while received < count:
                received += collector.poll(1.0, lock)
        elapsed = time.perf_counter() - started
    finally:
        if profile is not None:
            profile.disable()
    if live and conn.recv() != "sent":
        raise RuntimeError("sender failed")
    if arm == "collector":
        if state.rejected or state.received != count:
            raise RuntimeError(f"{arm}: received {state.received}, rejected {state.rejected}")
        collector.close()
    else:
        sock.close()
        context.term()
    conn.send(("close", None))
    conn.recv()
    return count / elapsed


def breakdown(count: int, ranks: int, reps: int = 5) -> dict[str, float]:
    """Microseconds per message of each ingest stage on frames already in memory, in steady
    state (every rank already known, histories full); median of ``reps`` interleaved runs."""

    from ddpwatch.core.protocol import decode
    from ddpwatch.state import state as state_module
    from ddpwatch.state.state import ServerState

    frames = make_frames(min(count, 20_000), ranks)
    messages = [decode(f) for f in frames]
    state = ServerState(started=0.0)
    for _ in range(3):
        for message in messages:
            state.apply(message, 1.0)
    pairs = [(state.ranks[m.rank], m) for m in messages]

    stages: dict[str, Any] = {
        "protocol.decode (msgspec, validated)": lambda: [decode(f) for f in frames],
        "ServerState.apply (identity unchanged: skipped)": lambda: [
            state.apply(m, 2.0) for m in messages
        ],
        "  _apply_identity when it changed (18 fields)": lambda: [
            state_module._apply_identity(r, m) for r, m in pairs
        ],
        "  _apply_sample (13 fields, phase, history)": lambda: [
            state_module._apply_sample(r, m, 3.0, state.marks) for r, m in pairs
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in stages}
    for _ in range(reps):
        for name, stage in stages.items():
            started = time.perf_counter()
            stage()
            times[name].append((time.perf_counter() - started) / len(frames) * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--mode", choices=("live", "drain", "both"), default="both")
    parser.add_argument("--profile", action="store_true", help="cProfile one collector run")
    args = parser.parse_args(argv)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sender, args=(child, args.messages, args.ranks), daemon=True)
    proc.start()
    modes = ("live", "drain") if args.mode == "both" else (args.mode,)
    rates: dict[str, dict[str, list[float]]] = {m: {arm: [] for arm in ARMS} for m in modes}
    profile = cProfile.Profile() if args.profile else None
    try:
        _, frame_bytes = parent.recv()
        run_once("raw", parent, args.messages, True)  # warm up sockets and imports
        for round_ in range(args.rounds):
            order = ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]
            for mode in modes:
                for arm in order:
                    rates[mode][arm].append(run_once(arm, parent, args.messages, mode == "live"))
        if profile is not None:
            run_once("collector", parent, args.messages, False, profile)
        parent.send(("quit", None))
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()

    print(
        f"ingest: {args.messages} Sample frames of {frame_bytes:.0f} B from {args.ranks} ranks, "
        f"one sender process (spawn), {args.rounds} interleaved rounds"
    )
    verdicts = []
    for mode in modes:
        mode_rates = rates[mode]
        medians = {arm: statistics.median(values) for arm, values in mode_rates.items()}
        what = "sender streaming while received" if mode == "live" else "sender queued all first"
        print(f" {mode} ({what}):")
        for arm in ARMS:
            values = mode_rates[arm]
            ratio = statistics.median(a / b for a, b in zip(values, mode_rates["raw"], strict=True))
            print(
                f"  {arm:<10} median {medians[arm]:>9.0f} msgs/s  "
                f"(min {min(values):>8.0f}, max {max(values):>8.0f})  ratio to raw {ratio:.3f}"
            )
        ratio = statistics.median(
            c / r for c, r in zip(mode_rates["collector"], mode_rates["raw"], strict=True)
        )
        ok = ratio >= TARGET_RATIO and medians["collector"] >= TARGET_RATE
        verdicts.append(
            f"RATIO collector/raw {mode} = {ratio:.3f} (target >= {TARGET_RATIO}), collector "
            f"{medians['collector']:.3g} msgs/s (target >= {TARGET_RATE:.0e}): "
            f"{'ok' if ok else 'MISS'}"
        )
    print(" per message, frames in memory (no sockets):")
    for name, us in breakdown(args.messages, args.ranks).items():
        print(f"  {name:<46} {us:6.2f} us")
    for line in verdicts:
        print(line)
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
