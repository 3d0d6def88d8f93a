"""A job torchrun restarts once (``--max-restarts 1``) and that fails again: rank 1 raises at
step 30 in both attempts, so torchrun exits 1 (issue #33's reproduction: the first attempt's
last reports arrive while the second attempt's processes start, and ingest once died on
them). Each attempt has its own rendezvous key prefix (see ``restart_once.py``)."""

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

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
for step in range(40):
    if step == 30 and rank == 1:
        raise RuntimeError(f"bad batch at step 30 (attempt {int(restart) + 1})")
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(0.02)
dist.destroy_process_group()
