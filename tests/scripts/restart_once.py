"""A job torchrun restarts once (``--max-restarts 1``): in its first attempt rank 1 fails
while it starts (a bad config, a missing file), before it joins the process group; the second
attempt trains to the end. Unmodified: ``ddpwatch run`` attaches.

torch 2.13's static rendezvous keeps one store for all attempts, so the second attempt's gloo
connectFullMesh can read the address rank 0 of the first attempt wrote before it was stopped,
and fail with "Connection refused" (seen in CI, ddpwatch or not). The job gives each attempt its
own key prefix, as a job that must survive restarts does: the test needs the second attempt to
be sure."""

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ["RANK"] == "1":
    time.sleep(1.0)  # its peer is in the rendezvous by now
    raise RuntimeError("config file not found: /data/run.yaml")
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
    is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0,
)  # fmt: skip
dist.init_process_group(
    "gloo", store=dist.PrefixStore(f"attempt_{restart}", store), rank=rank, world_size=world_size
)
model = DistributedDataParallel(nn.Linear(8, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(20):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(0.05)
dist.destroy_process_group()
