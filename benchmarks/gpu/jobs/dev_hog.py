"""A process outside any job that holds GPU memory: check 4b of benchmarks/gpu/devices.py.

Allocates ``--gib`` GiB on ``cuda:0``, writes its pid and ``torch.cuda.memory_reserved()`` as
one JSON line to ``--report`` and sleeps until it is stopped (or ``--seconds`` pass). It
never imports ddpwatch: it is the foreign process ``foreign_memory`` must name.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--report", type=Path, required=True)
    args = p.parse_args()
    held = torch.ones(int(args.gib * (1 << 30)), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    line = {"pid": os.getpid(), "reserved": torch.cuda.memory_reserved(0), "numel": held.numel()}
    args.report.write_text(json.dumps(line) + "\n")
    time.sleep(args.seconds)


if __name__ == "__main__":
    main()
