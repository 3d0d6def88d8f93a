"""A healthy two-rank job whose rank 0 draws a progress bar on stderr, as tqdm does: carriage
returns, colour codes, and a look at whether stderr is a terminal and how wide."""

import os
import sys

import torch
import torch.distributed as dist

STEPS = 5


def bar(step: int) -> str:
    return f"\rtrain {step}/{STEPS} \x1b[32m{'#' * step}\x1b[0m"


def main() -> None:
    dist.init_process_group("gloo")
    first = dist.get_rank() == 0
    if first:
        tty = sys.stderr.isatty()
        size = tuple(os.get_terminal_size(2)) if tty else None
        sys.stderr.write(f"stderr isatty={tty} size={size}\n")
    for step in range(1, STEPS + 1):
        dist.all_reduce(torch.ones(1))
        if first:
            sys.stderr.write(bar(step))
            sys.stderr.flush()
    if first:
        sys.stderr.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
