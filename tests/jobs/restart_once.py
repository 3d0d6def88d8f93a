"""A job torchrun restarts once (``--max-restarts 1``): in its first attempt rank 1 fails
while it starts (a bad config, a missing file), before it joins the process group; the second
attempt trains to the end. Unmodified: ``ddpwatch run`` attaches.

(A first attempt that fails mid-training leaves torch 2.13's second attempt failing in gloo's
connectFullMesh now and then, ddpwatch or not: the test needs the second attempt to be sure.)"""

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ["RANK"] == "1":
    time.sleep(1.0)  # its peer is in the rendezvous by now
    raise RuntimeError("config file not found: /data/run.yaml")
dist.init_process_group("gloo")
model = DistributedDataParallel(nn.Linear(8, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(20):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(0.05)
dist.destroy_process_group()
