"""A DDP job under ``serve`` + ``attach(model)`` (no launcher wrapper) whose rank 0 validates
alone at step ``--at`` for ``--seconds`` (its own loop: ``model.eval()``, ``torch.no_grad()``,
a batch every 50 ms) while the other ranks wait for it in the next step's gradient all-reduce
(issue #33: rank 0 was shown "in 'backward'" and no stack ever came)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpwatch


def validate(model: nn.Module, seconds: float) -> float:
    model.eval()
    total = 0.0
    deadline = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < deadline:
            total += float(model(torch.randn(4, 8)).sum())
            time.sleep(0.05)
    model.train()
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--at", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
    ddpwatch.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == args.at and dist.get_rank() == 0:
            validate(model, args.seconds)  # the attached model: its hooks run
        time.sleep(0.02)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
