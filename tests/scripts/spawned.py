"""Ranks started with torch.multiprocessing.spawn: no rank in the environment until init."""

import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int) -> None:
    time.sleep(0.5)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    for _ in range(40):
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, int(sys.argv[1])), nprocs=2)
