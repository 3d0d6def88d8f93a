"""A DDP script as people write it for mpirun and srun: rank and size from the launcher's
variables, rendezvous over TCP at the port given as the first argument."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def first(*names: str) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    raise SystemExit("none of " + ", ".join(names) + " is set")


def main() -> None:
    rank = first("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
    size = first("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
    print(f"rank {rank}: loading data", flush=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=rank, world_size=size
    )
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
