"""A plain DDP training script with ddpwatch attached.

    ddpwatch serve                                   # in one terminal
    torchrun --nproc-per-node 4 examples/train_ddp.py  # in another

Runs on CPU with gloo, or on GPUs with NCCL when CUDA is available.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpwatch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    ddpwatch.attach()  # before init_process_group: the rendezvous is watched too
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    model = nn.Sequential(
        nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1)
    ).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    ddpwatch.attach(ddp)  # same watcher: adds the model's hooks
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.width, device=device)
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ddpwatch.step(loss)  # optional: without it steps are counted from optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
