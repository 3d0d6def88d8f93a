"""A DDP rank for the device checks of benchmarks/gpu/devices.py (checks 4-7 of issue #27).

Run under torchrun with DDPWATCH_ADDR set. It attaches ddpwatch first, chooses its device by
``--cuda-index`` (``local``: the right way; ``zero``: every rank on cuda:0, seed 002;
``rank``: the global rank as the index, seed 000), joins the process group, holds the memory
asked for, then steps a small DDP model until ``--seconds`` have passed. Every ``--every``
seconds it appends one JSON line to ``--report`` (``-rank<N>`` added before the suffix): its
pid, step, what torch's allocator says (``torch.cuda.memory_reserved()``), its resident memory
and the flight recorder's per-group status as this torch dumps it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddpwatch

MIB = 1 << 20


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--cuda-index", choices=("local", "zero", "rank"), default="local")
    p.add_argument("--hold-mib", type=int, default=0, help="held by every rank")
    p.add_argument("--extra-rank", type=int, default=-1)
    p.add_argument("--extra-mib", type=int, default=0, help="held on top by --extra-rank")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--every", type=float, default=0.25)
    p.add_argument("--pause", type=float, default=0.005, help="sleep per step (shared CPUs)")
    p.add_argument("--report", type=Path, required=True)
    return p.parse_args(argv)


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def pg_status() -> Any:
    """The flight recorder's ``pg_status`` as this torch dumps it (None if it cannot)."""
    from torch._C import _distributed_c10d as c10d

    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            return json.loads(dump(False, True)).get("pg_status")
        except Exception as exc:  # report it, do not fail the job
            return {"error": f"{name}: {type(exc).__name__}: {exc}"}
    return None


def main() -> None:
    args = parse()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    report = args.report.with_name(f"{args.report.stem}-rank{rank}{args.report.suffix}")
    out = report.open("a", buffering=1)

    def write(**fields: Any) -> None:
        out.write(json.dumps({"t": time.time(), "rank": rank, "pid": os.getpid(), **fields}))
        out.write("\n")

    ddpwatch.attach()
    write(event="start", world=world, local_rank=local_rank)
    if args.device == "cuda":
        index = {"local": local_rank, "zero": 0, "rank": rank}[args.cuda_index]
        torch.cuda.set_device(index)  # seed 000 fails here on a one-GPU machine
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    held = []
    mib = args.hold_mib + (args.extra_mib if rank == args.extra_rank else 0)
    if mib:
        held.append(torch.ones(mib * MIB, dtype=torch.uint8, device=device))
    model = DistributedDataParallel(
        torch.nn.Linear(256, 256).to(device),
        device_ids=[device.index] if device.type == "cuda" else None,
    )
    ddpwatch.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256, device=device)
    end = time.monotonic() + args.seconds
    next_report = 0.0
    step = 0
    while time.monotonic() < end:
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ddpwatch.step(loss)
        step += 1
        now = time.monotonic()
        if now >= next_report:
            next_report = now + args.every
            cuda = device.type == "cuda"
            write(
                event="beat",
                step=step,
                device=str(device),
                reserved=torch.cuda.memory_reserved(device) if cuda else None,
                allocated=torch.cuda.memory_allocated(device) if cuda else None,
                held_mib=mib,
                rss=rss_bytes(),
                pg_status=pg_status(),
            )
        if args.pause:
            time.sleep(args.pause)
    write(event="end", step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
