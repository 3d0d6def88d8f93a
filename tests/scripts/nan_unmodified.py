"""A DDP script that knows nothing of ddpwatch and never names its loss; one rank's loss turns
NaN at one step. Under ``ddpwatch run`` the agent finds that step from ``loss.backward()``.

    torchrun --nproc-per-node 2 tests/scripts/nan_unmodified.py --rank 1 --at 12
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=1, help="the rank whose loss turns NaN")
    parser.add_argument("--at", type=int, default=12, help="the step (from 1) at which it does")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-time", type=float, default=0.01)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    me = int(os.environ["RANK"])
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, args.steps + 1):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        if me == args.rank and step == args.at:
            loss = loss * float("nan")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
