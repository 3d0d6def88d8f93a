"""The training job of the GPU checks: a small DDP model, one rank per device.

    torchrun --nproc-per-node 1 benchmarks/gpu/jobs/train.py --device cuda --backend nccl \
        [--steps 200] [--min-seconds S] [--sync-debug error|warn] [--warmup 3] [--no-attach] \
        [--nan-at K] [--nan-rank R] [--step-sleep S] [--hold-s S] [--identity]

With ``--sync-debug error``, ``torch.cuda.set_sync_debug_mode("error")`` is on from step
``warmup + 1``: any synchronising CUDA call in the training thread raises and the job fails.
The first steps run without it because DDP itself synchronises in its second iteration (it
rebuilds its buckets and copies their indices to the host). ``warn`` records the warnings of
every thread instead (the agent's own thread swallows its exceptions, so only a warning shows a
sync there) and prints ``SYNCWARN {json}`` at the end: per thread, how many.

Without ``--no-attach`` it calls ``ddpwatch.attach(model)`` and ``ddpwatch.step(loss)`` (steps
count from 1); with it, ddpwatch is never imported (zero-code mode: ``ddpwatch run`` attaches
it). ``--nan-at K`` makes rank ``--nan-rank``'s loss NaN at step K without a sync (a device
tensor indexed by the step scales the loss, so the weights and every later loss are NaN
too). ``--identity`` prints ``IDENTITY {json}``: torch's view of the device. The job prints
``DONE {json}`` after its last step, then idles ``--hold-s`` seconds so that heartbeats report
it.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import warnings
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SYNC_WORDS = "synchroniz"  # "called a synchronizing CUDA operation"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--min-seconds", type=float, default=0.0)
    parser.add_argument("--sync-debug", choices=["off", "error", "warn"], default="off")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-attach", action="store_true")
    parser.add_argument("--nan-at", type=int, default=0)
    parser.add_argument("--nan-rank", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--hold-s", type=float, default=2.0)
    parser.add_argument("--identity", action="store_true")
    parser.add_argument("--width", type=int, default=64)
    return parser.parse_args()


def identity(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"device": str(device)}
    props = torch.cuda.get_device_properties(device)
    parts = [getattr(props, n, None) for n in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    pci = None
    if all(isinstance(p, int) for p in parts):
        pci = f"{parts[0]:08X}:{parts[1]:02X}:{parts[2]:02X}.0"
    return {
        "device": f"cuda:{device.index}",
        "name": props.name,
        "uuid": str(getattr(props, "uuid", "")) or None,
        "pci_bus_id": pci,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


class SyncWarnings:
    """Every sync-debug warning, from any thread, counted by thread name."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []
        self._lock = threading.Lock()
        self._show = warnings.showwarning

    def install(self) -> None:
        warnings.simplefilter("always")
        warnings.showwarning = self._record  # type: ignore[assignment]

    def _record(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        text = str(message)
        if SYNC_WORDS not in text:
            self._show(message, category, filename, lineno, *rest)
            return
        with self._lock:
            name = threading.current_thread().name
            self.counts[name] += 1
            if len(self.examples) < 5:
                self.examples.append(f"{name}: {filename}:{lineno}: {text[:160]}")

    def report(self) -> str:
        main = threading.main_thread().name
        return json.dumps(
            {
                "main": self.counts.get(main, 0),
                "other": sum(n for t, n in self.counts.items() if t != main),
                "threads": dict(self.counts),
                "examples": self.examples,
            }
        )


def main() -> None:
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    if args.identity:
        print("IDENTITY " + json.dumps(identity(device)), flush=True)
    torch.manual_seed(0)
    width = args.width
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)).to(device)
    ids = [local_rank] if device.type == "cuda" else None
    model = nn.parallel.DistributedDataParallel(net, device_ids=ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, width, device=device)
    y = torch.randn(32, 1, device=device)
    total = max(args.steps, args.nan_at) + 1
    scale = torch.ones(total + 1, device=device)  # NaN at --nan-at: the gradients too, so the
    if args.nan_at and rank == args.nan_rank:  # weights and every later loss are NaN
        scale[args.nan_at] = float("nan")
    ddpwatch: Any = None
    if not args.no_attach:
        import ddpwatch

        ddpwatch.attach(model)
    warned = SyncWarnings()
    cuda = device.type == "cuda"
    started = time.monotonic()
    step = 0
    while step < args.steps or time.monotonic() - started < args.min_seconds:
        step += 1
        if step == args.warmup + 1 and cuda and args.sync_debug != "off":
            if args.sync_debug == "warn":
                warned.install()
            torch.cuda.set_sync_debug_mode(args.sync_debug)
        loss = (model(x) - y).pow(2).mean() * scale[min(step, total)]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if ddpwatch is not None:
            ddpwatch.step(loss)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    elapsed = time.monotonic() - started
    print("DONE " + json.dumps({"rank": rank, "steps": step, "seconds": elapsed}), flush=True)
    if args.sync_debug == "warn":  # the agent's heartbeats after the last step count too
        time.sleep(args.hold_s)
        print("SYNCWARN " + warned.report(), flush=True)
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    if args.sync_debug != "warn":
        time.sleep(args.hold_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
