"""Agent overhead on a small transformer's training step: bare vs. attached, in one process.

    torchrun --nproc-per-node 1 benchmarks/gpu/jobs/overhead.py [--device cuda|cpu]
        [--sizes small,medium] [--trials 12] [--block-s 0.5]

One DDP rank (NCCL on a GPU, gloo on the CPU). Per size, the batch is chosen so that a step
takes about the size's target (2 ms, 15 ms), then every trial times one block of steps per arm,
the arms in a rotated order: ``bare`` (no agent; ``ddpwatch.step`` is still called, a no-op),
``bare-again`` (the noise floor) and ``ddpwatch`` (attached before its block, with 0.25 s of
untimed steps to hold the attach-time heartbeat, detached after). Blocks are timed with CUDA
events on a GPU (``perf_counter`` on the CPU). Prints ``RESULT {json}``: per size, the bare
step time, the median of the per-trial ratios arm/bare and their quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ddpwatch

# d_model, heads, layers, sequence, target step seconds
SIZES = {
    "small": (256, 4, 2, 64, 0.002),
    "medium": (768, 12, 4, 256, 0.015),
    "cpu": (32, 2, 1, 8, 0.002),  # the --cpu dry run: the orchestration, not a figure
}
SETTLE_S = 0.25
MAX_BATCH = 512


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--block-s", type=float, default=0.5)
    return parser.parse_args()


class Timer:
    """Seconds of a block of work: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, work: Callable[[], None]) -> float:
        if not self.cuda:
            started = time.perf_counter()
            work()
            return time.perf_counter() - started
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        work()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


def measure(name: str, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    d_model, heads, layers, seq, target = SIZES[name]
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, device=device
    )
    body = nn.Sequential(nn.TransformerEncoder(layer, layers), nn.Linear(d_model, 1, device=device))
    ids = [device.index] if device.type == "cuda" else None
    model = nn.parallel.DistributedDataParallel(body, device_ids=ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    timer = Timer(device)
    x = torch.randn(1, seq, d_model, device=device)

    def run(steps: int) -> None:
        for _ in range(steps):
            loss = model(x).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            ddpwatch.step(loss)  # a no-op when detached: the call is in every arm

    batch, step_s = 1, 0.0
    while True:  # the smallest batch whose step takes the target, or the largest tried
        x = torch.randn(batch, seq, d_model, device=device)
        run(3)
        step_s = timer.time(lambda: run(10)) / 10
        if step_s >= target or batch >= MAX_BATCH:
            break
        batch *= 2
    steps = max(5, round(args.block_s / step_s))
    settle = max(2, round(SETTLE_S / step_s))
    arms = ["bare", "ddpwatch", "bare-again"]
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for trial in range(args.trials):
        for arm in arms[trial % 3 :] + arms[: trial % 3]:
            if arm == "ddpwatch":
                ddpwatch.attach(model)
            run(settle)
            times[arm].append(timer.time(lambda: run(steps)))
            if arm == "ddpwatch":
                ddpwatch.detach()
    result: dict[str, Any] = {
        "batch": batch,
        "steps": steps,
        "trials": args.trials,
        "target_ms": target * 1e3,
        "bare_ms": statistics.median(times["bare"]) / steps * 1e3,
    }
    for arm in ("ddpwatch", "bare-again"):
        ratios = [a / b for a, b in zip(times[arm], times["bare"], strict=True)]
        quart = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        result[arm] = {"median": statistics.median(ratios), "q1": quart[0], "q3": quart[-1]}
    return result


def main() -> None:
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    results = {name: measure(name, device, args) for name in args.sizes.split(",")}
    print("RESULT " + json.dumps({"device": str(device), "sizes": results}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
