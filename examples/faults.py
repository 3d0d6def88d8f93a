"""A DDP job that injects one real fault on one rank, for demos and tests.

    torchrun --nproc-per-node 3 examples/faults.py --fault straggler --rank 1 --at 20

Faults:
  none               healthy run
  straggler          the rank sleeps before an explicit all_reduce the others wait in
  slow-forward       the rank sleeps inside forward; the others wait in DDP's backward all-reduce
  exception          the rank raises an exception (``--message`` sets its text)
  kill               the rank kills itself with SIGKILL (no goodbye)
  nan                the rank's loss becomes NaN
  stop               the rank SIGSTOPs itself for ``--sleep`` seconds (a paused process)
  exit-early         the rank leaves the loop early: the others hang in the final barrier
  hang-startup       the rank sleeps before init_process_group: the others wait in rendezvous
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

FAULTS = (
    "none",
    "straggler",
    "slow-forward",
    "exception",
    "kill",
    "nan",
    "stop",
    "exit-early",
    "hang-startup",
)


class SlowOnCue(nn.Module):
    """A model whose forward sleeps once when asked: a straggler inside DDP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.sleep_once = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_once:
            time.sleep(self.sleep_once)
            self.sleep_once = 0.0
        return self.net(x)


def inject(args: argparse.Namespace, model: SlowOnCue, loss: torch.Tensor) -> torch.Tensor:
    """Apply the fault on this step; returns the (possibly poisoned) loss."""
    fault = args.fault
    if fault == "straggler":
        time.sleep(args.sleep)
    elif fault == "exception":
        raise RuntimeError(args.message)
    elif fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "nan":
        return loss * float("nan")
    elif fault == "stop":
        # a helper process wakes us up again: a paused process cannot wake itself
        pid = os.getpid()
        wake = f"import os, signal, time; time.sleep({args.sleep}); os.kill({pid}, signal.SIGCONT)"
        subprocess.Popen([sys.executable, "-c", wake])
        os.kill(os.getpid(), signal.SIGSTOP)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--rank", type=int, default=1, help="the rank that misbehaves")
    parser.add_argument("--at", type=int, default=20, help="the step at which it does")
    parser.add_argument("--sleep", type=float, default=30.0, help="seconds a straggler sleeps")
    parser.add_argument("--message", default="injected fault: something went wrong on this rank")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--step-time", type=float, default=0.05, help="extra seconds of work per step"
    )
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()

    ddpwatch.attach()
    me = int(os.environ.get("RANK", 0))
    if args.fault == "hang-startup" and me == args.rank:
        time.sleep(args.sleep)
    dist.init_process_group("gloo")
    model = SlowOnCue(args.width)
    ddp = DistributedDataParallel(model)
    ddpwatch.attach(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    metric = torch.zeros(1)
    for step in range(1, args.steps + 1):
        faulty = me == args.rank and step == args.at
        if faulty and args.fault == "slow-forward":
            model.sleep_once = args.sleep
        if faulty and args.fault == "exit-early":
            break
        x = torch.randn(16, args.width)
        loss = ddp(x).pow(2).mean()
        if faulty:
            loss = inject(args, model, loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        metric += loss.detach()
        dist.all_reduce(metric)  # an explicit collective every step, as metric logging does
        ddpwatch.step(loss)
        time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
