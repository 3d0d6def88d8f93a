"""The demo's training job: a real CPU DDP run (gloo) that misbehaves on a script.

Run by ``ddpwatch demo`` as ``torchrun -m ddpwatch.demo.job``. Each fault is
real: a rank really sleeps inside forward while the others wait in DDP's
all-reduce, really stops (SIGSTOP), really raises. Only the NaN is staged: the
rank's loss is NaN but its gradients are zeroed so the others stay finite.
The script (which fault, on which rank, at which step) is ``demo/script.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpwatch
from ddpwatch.demo.script import BY_STEP, CRASH, NAN, STEP_TIME_S, STOP, STRAGGLER


class Model(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.sleep_once = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_once:
            time.sleep(self.sleep_once)  # a straggler: the others wait in DDP's all-reduce
            self.sleep_once = 0.0
        out: torch.Tensor = self.net(x)
        return out


def stop_for(seconds: float) -> None:
    """SIGSTOP this process; a helper process sends SIGCONT later."""
    pid = os.getpid()
    wake = f"import os, signal, time; time.sleep({seconds}); os.kill({pid}, signal.SIGCONT)"
    subprocess.Popen([sys.executable, "-c", wake])
    os.kill(pid, signal.SIGSTOP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--faults", action="store_true", help="play the fault script")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--step-time", type=float, default=STEP_TIME_S)
    args = parser.parse_args()

    ddpwatch.attach()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Model()
    ddp = DistributedDataParallel(model)
    ddpwatch.attach(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(rank)
    nan_until = 0
    for step in range(1, args.steps + 1):
        fault = BY_STEP.get(step) if args.faults else None
        if fault is not None and rank != fault.target(world):
            fault = None  # another rank's
        kind, arg = (None, 0.0) if fault is None else (fault.kind, fault.arg)
        if kind == STRAGGLER:
            model.sleep_once = float(arg)
        if kind == NAN:
            nan_until = step + int(arg)
        x = torch.randn(32, 128)
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step < nan_until:
            loss = loss * float("nan")  # what this rank logs; its gradients stay finite
        optimizer.step()
        ddpwatch.step(loss)
        if kind == STOP:
            stop_for(float(arg))
        if kind == CRASH:
            raise RuntimeError(str(arg))
        time.sleep(args.step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
