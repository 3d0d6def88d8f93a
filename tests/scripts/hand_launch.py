"""Ranks started by hand, as a Slurm batch script's ``srun`` line or a shell loop starts them:
each process gets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from its own environment, and
one of them may get a value of its own (PyTorch #76069, #53395: every process picked its
own MASTER_PORT, and init_process_group hung on every rank).

    python hand_launch.py --world 3 --port 29500 [--odd 2:MASTER_PORT=41233]
                          [--in-code 2:MASTER_PORT=41233] [--init-timeout 20] [--steps 20]

``--odd`` sets a variable in one rank's environment at start (a launch line of its own);
``--in-code`` has that rank's script set it in ``os.environ`` just before
``init_process_group``, as scripts that pick their own free port do. Each rank trains a
small DDP model for ``--steps`` steps; the launcher exits with the worst exit code.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def overrides(items: list[str]) -> dict[int, dict[str, str]]:
    """'2:MASTER_PORT=41233' items as {2: {'MASTER_PORT': '41233'}}."""
    found: dict[int, dict[str, str]] = {}
    for item in items:
        rank, assignment = item.split(":", 1)
        name, value = assignment.split("=", 1)
        found.setdefault(int(rank), {})[name] = value
    return found


def rank_main(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    me = int(os.environ["RANK"])
    os.environ.update(overrides(args.in_code).get(me, {}))
    print(f"rank {me}: MASTER_PORT={os.environ['MASTER_PORT']}", flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.init_timeout))
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(args.steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
    return 0


def launch(args: argparse.Namespace) -> int:
    odd = overrides(args.odd)
    procs = []
    for rank in range(args.world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.world),
            "LOCAL_WORLD_SIZE": str(args.world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(args.port),
            "OMP_NUM_THREADS": "1",
            **odd.get(rank, {}),
        }
        command = [sys.executable, __file__, "--rank-main", *sys.argv[1:]]
        procs.append(subprocess.Popen(command, env=env))
    return max(abs(proc.wait()) for proc in procs)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--odd", action="append", default=[])
    parser.add_argument("--in-code", action="append", default=[])
    parser.add_argument("--init-timeout", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank-main", action="store_true")
    args = parser.parse_args()
    return rank_main(args) if args.rank_main else launch(args)


if __name__ == "__main__":
    sys.exit(main())
