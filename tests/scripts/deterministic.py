"""A seeded DDP run that prints a checksum of its final parameters (rank 0) and its mean step time.

``STEP_SLEEP_S`` paces each step (an endless job shared by several tests: at full speed its two
ranks would take both of CI's cores from the other tests for as long as it runs)."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import ddpwatch

if os.environ.get("WATCH") == "1":
    ddpwatch.attach()
dist.init_process_group("gloo")
torch.manual_seed(1234)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
)
if os.environ.get("WATCH") == "1":
    ddpwatch.attach(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
generator = torch.Generator().manual_seed(100 + dist.get_rank())
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
pause_every_step = float(os.environ.get("STEP_SLEEP_S", "0"))  # a paced job: not a CPU burner
started = time.perf_counter()
for step in range(steps):
    x = torch.randn(16, 32, generator=generator)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ddpwatch.step(loss)
    if pause_every_step:
        time.sleep(pause_every_step)
    if os.environ.get("PAUSE_AT") == str(step):
        time.sleep(float(os.environ.get("PAUSE_S", "3")))
elapsed = time.perf_counter() - started
if dist.get_rank() == 0:
    checksum = sum(float(p.double().sum()) for p in model.parameters())
    print(f"CHECKSUM {checksum:.12f} STEP_MS {1e3 * elapsed / steps:.3f}", flush=True)
dist.destroy_process_group()
