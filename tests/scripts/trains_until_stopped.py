"""A healthy two-rank DDP job that trains until someone stops it (Ctrl-C, "Stop the job" in
run --tui): rank 0 says "training" on stdout once it is past its first steps. Unmodified:
``ddpwatch run`` attaches."""

import time

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(100_000):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step == 20 and dist.get_rank() == 0:
        print("training", flush=True)
    time.sleep(0.05)
