"""A DDP job whose loss is compiled with ``torch.compile`` (issue #32, "compilation is a
phase"): the first compile is slow on every rank (a backend that sleeps ``--compile-s``
before ``aot_eager``, as inductor's cold cache does for tens of seconds), and at step
``--recompile-at`` rank ``--rank``'s batch is one sample short, so that rank alone compiles
again while the others wait in DDP's gradient all-reduce.

    torchrun --nproc-per-node 2 tests/scripts/compiled_loss.py --compile-s 6

``--backend inductor`` compiles for real instead (no sleep; a cold cache takes ~20 s per
rank on 2 cores).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpwatch

BATCH = 32


def slow_backend(seconds: float) -> Any:
    """aot_eager, after ``seconds`` inside the compilation (dynamo's callbacks around it)."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm: Any, inputs: Any) -> Any:
        time.sleep(seconds)
        return aot_eager(gm, inputs)

    return backend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--compile-s", type=float, default=6.0)
    parser.add_argument("--recompile-at", type=int, default=20, help="0: never")
    parser.add_argument("--rank", type=int, default=1, help="the rank that recompiles")
    parser.add_argument(
        "--backend", default="slow", help="slow (aot_eager after a sleep), or a torch backend"
    )
    args = parser.parse_args()

    ddpwatch.attach()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    ddpwatch.attach(model)  # as examples/train_ddp.py: its forward counts step 1 before the compile
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    backend = slow_backend(args.compile_s) if args.backend == "slow" else args.backend
    loss_of = torch.compile(lambda out, target: ((out - target) ** 2).mean(), backend=backend)
    for step in range(1, args.steps + 1):
        short = step == args.recompile_at and rank == args.rank
        batch = BATCH - 1 if short else BATCH
        x, target = torch.randn(batch, 16), torch.randn(batch, 1)
        loss = loss_of(model(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ddpwatch.step(loss)
        time.sleep(0.02)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
