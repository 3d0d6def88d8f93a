"""The agent's cost on the training thread, in instructions: callgrind counts, not timings.

    python benchmarks/agent_instructions.py [--steps 100] [--warmup 100] [--size small]
                                            [--arms ...] [--jobs 2]

On a shared 2-core machine a few hundred µs a step do not resolve in wall or CPU time (the
A/A band of ``agent_overhead.py`` is ±2-13 %), but the number of instructions a thread runs
does not move with load. Each arm is one process under ``valgrind --tool=callgrind``: one
gloo rank (world size 1) training the ``agent_overhead.py`` MLP with its batches drawn from a
``DataLoader``. Counting starts after ``--warmup`` steps (the hooks' learning steps are over)
and stops after ``--steps`` steps, through callgrind's client requests (a 10-line C library
built here with ``cc``). Counted per thread (``--separate-threads``): the training thread's
instructions per step are the figure. The publisher thread is left out: under valgrind a step
takes ~50 times longer, so heartbeats (every 0.5 s of wall time) fall 50 times more often
per step than in a real job.

Arms: ``bare`` (no agent; ``ddpwatch.step`` still called, a no-op), ``ddpwatch`` (attached,
every part on) and ``ddpwatch-<part>`` (that part off, ``DDPWATCH_PROBES=-<part>``), and
``ddpwatch-none`` (every part off: the hooks that always run). Needs valgrind with its
headers and a C compiler; without them it says so and exits 0. ~1 min an arm (small).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_overhead import SIZES, _Repeat

from ddpwatch.agent.switches import PARTS
from ddpwatch.core.ports import free_port_pair

FULL = "ddpwatch"
NONE = f"{FULL}-none"
WARMUP_STEPS = 100
CONTROL_C = """
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void stop(void) { CALLGRIND_DUMP_STATS_AT("steps"); CALLGRIND_STOP_INSTRUMENTATION; }
"""
HEADER = Path("/usr/include/valgrind/callgrind.h")


def worker(args: argparse.Namespace) -> None:
    import ctypes

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port_pair())
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader

    import ddpwatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    width, layers, batch = SIZES[args.size]
    torch.manual_seed(0)
    body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*body, nn.Linear(width, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = iter(DataLoader(_Repeat(torch.randn(batch, width)), batch_size=None))

    def step() -> None:
        loss = model(next(batches)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ddpwatch.step(loss)

    if args.arm != "bare":
        os.environ["DDPWATCH_PROBES"] = _probes(args.arm)
        ddpwatch.attach(model, addr=f"127.0.0.1:{free_port_pair()}")  # nobody listens
    for _ in range(args.warmup):
        step()
    control = ctypes.CDLL(args.lib)
    control.start()
    for _ in range(args.steps):
        step()
    control.stop()
    ddpwatch.detach()
    dist.destroy_process_group()


def _probes(arm: str) -> str:
    if arm == NONE:
        return ",".join(f"-{part}" for part in PARTS)
    part = arm.removeprefix(FULL).removeprefix("-")
    if part and part not in PARTS:
        raise SystemExit(f"unknown arm {arm!r}: parts are {', '.join(PARTS)}, or none")
    return f"-{part}" if part else ""


def missing_tools() -> str | None:
    if shutil.which("valgrind") is None:
        return "valgrind is not installed"
    if not HEADER.exists():
        return f"{HEADER} is missing (valgrind's development headers)"
    if shutil.which("cc") is None:
        return "no C compiler (cc)"
    return None


def build_control(folder: Path) -> Path:
    source, library = folder / "control.c", folder / "control.so"
    source.write_text(CONTROL_C)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], check=True)
    return library


def count(arm: str, args: argparse.Namespace, folder: Path, library: Path) -> int:
    """Instructions of the training thread over the counted steps."""
    out = folder / f"cg.{arm}"
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
        f"--callgrind-out-file={out}", sys.executable, __file__, "--worker", "--arm", arm,
        "--steps", str(args.steps), "--size", args.size, "--lib", str(library),
        "--warmup", str(args.warmup),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    dumps = sorted(folder.glob(f"cg.{arm}.*-01"))  # the dump at "steps", the main thread's
    if done.returncode != 0 or not dumps:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise SystemExit(f"{arm}: callgrind run failed (exit {done.returncode}):\n{tail}")
    match = re.search(r"^(?:summary|totals):\s+(\d+)", dumps[0].read_text(), re.MULTILINE)
    if match is None:
        raise SystemExit(f"{arm}: no totals in {dumps[0]}")
    return int(match.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument(
        "--warmup", type=int, default=WARMUP_STEPS, help="steps before counting (>= 12)"
    )
    parts = ",".join(f"{FULL}-{part}" for part in PARTS if part != "publisher")
    parser.add_argument("--arms", default=f"bare,{FULL},{NONE},{parts}")
    parser.add_argument("--jobs", type=int, default=2, help="arms run at once")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", default="bare", help=argparse.SUPPRESS)
    parser.add_argument("--lib", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    missing = missing_tools()
    if missing is not None:
        print(f"agent_instructions: skipped: {missing}")
        return 0
    arms = args.arms.split(",")
    if "bare" not in arms:
        arms.insert(0, "bare")
    with tempfile.TemporaryDirectory(prefix="ddpwatch-cg-") as tmp:
        folder = Path(tmp)
        library = build_control(folder)
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            counts = pool.map(lambda arm: count(arm, args, folder, library), arms)
            totals = dict(zip(arms, counts, strict=True))
    report(totals, args)
    return 0


def report(totals: dict[str, Any], args: argparse.Namespace) -> None:
    per_step = {arm: total / args.steps for arm, total in totals.items()}
    bare = per_step["bare"]
    print(f"training-thread instructions a step, {args.size} model, {args.steps} steps counted")
    print(f"{'arm':28s} {'per step':>12s} {'over bare':>11s} {'share':>8s}")
    for arm, value in per_step.items():
        extra = value - bare
        print(f"{arm:28s} {value:12,.0f} {extra:+11,.0f} {extra / bare:+8.1%}")
    full = per_step.get(FULL)
    if full is not None:
        for arm, value in per_step.items():
            if arm.startswith(f"{FULL}-") and arm != NONE:
                print(f"  part {arm.removeprefix(FULL + '-'):12s} {full - value:+10,.0f} a step")
        print(f"RATIO agent_instructions {args.size} {FULL}/bare {full / bare:.4f}")


if __name__ == "__main__":
    raise SystemExit(main())
