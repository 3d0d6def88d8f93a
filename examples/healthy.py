"""Healthy but unusual DDP jobs, one per ``--mode``: a correct monitor names no rank in any.

    torchrun --nproc-per-node 3 examples/healthy.py --mode checkpoint

``benchmarks/false_alarms.py`` runs each under a real server and counts the alerts that name a
rank (issue #32). Every mode is something ordinary jobs do that looks, to a naive rule, like a
stall, a straggler, a leak or a crash: a cold compile, a framework's start-up, deep prefetch,
a large but flat host footprint, checkpoints, evaluation, rank-0 logging, gradient
accumulation, changing batch sizes, uneven inputs under ``join()`` (that one is
``examples/failures.py --mode healthy-join``) and ranks that exit seconds apart.

The loop is ``failures.py``'s (its ``Net``): DDP on gloo, ``ddpwatch.step(loss)`` and a short
sleep a step, ~20 s of training at the defaults.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

MODES = (
    "compile",  # torch.compile (aot_eager): the first steps trace and compile on every rank
    "compile-inductor",  # the same with inductor and a fresh cache: a minute or more of it
    "lightning",  # Lightning's Trainer start-up and fit under torchrun
    "deepspeed",  # deepspeed.initialize (ZeRO 1, CPU, gloo) and its engine's steps
    "workers",  # DataLoader num_workers=2, prefetch_factor=8
    "memory",  # ~600 MiB of host memory taken at start, then flat
    "checkpoint",  # torch.save on every rank every --every steps
    "eval",  # a no-grad evaluation of some batches on every rank every --every steps
    "rank0-log",  # rank 0 prints and sleeps a few tens of ms every --every steps
    "accumulate",  # gradient accumulation on every rank: no_sync for k-1 micro-batches
    "batch-sizes",  # the batch size changes every --every steps
    "finish-apart",  # rank r sleeps r * 1.5 s after the loop before it exits
)
EVERY = {"checkpoint": 50, "eval": 60, "rank0-log": 20, "batch-sizes": 80, "accumulate": 4}


def scratch(prefix: str) -> str:
    """A temporary folder of this process, removed at its exit."""
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


if any(arg.startswith("compile") for arg in sys.argv[1:]):
    # before torch is imported: a cold cache, as on a fresh machine or a new torch version
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch("ddpwatch-inductor-")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ddpwatch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from failures import Net  # noqa: E402  the failure modes' model: one loop shape for both


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per rank")
    parser.add_argument("--step-time", type=float, default=0.05, help="extra seconds a step")
    parser.add_argument("--every", type=int, help="steps between the mode's events")
    parser.add_argument("--memory-mib", type=int, default=600, help="memory: MiB held")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    args.every = args.every or EVERY.get(args.mode, 50)
    args.backend = "inductor" if args.mode == "compile-inductor" else "aot_eager"
    return args


def batches(args: argparse.Namespace, me: int, workers: int = 0) -> Iterator[torch.Tensor]:
    """Synthetic batches of ``--batch`` without end, through a DataLoader (with workers and a
    deep prefetch when ``workers``)."""
    data = torch.randn(2048, args.width, generator=torch.Generator().manual_seed(me))
    loader = DataLoader(
        TensorDataset(data),
        batch_size=args.batch,
        shuffle=True,
        num_workers=workers,
        prefetch_factor=8 if workers else None,
    )
    while True:
        for (x,) in loader:
            yield x


def draw(data: Iterator[torch.Tensor], times: int) -> torch.Tensor:
    """One batch of ``times`` loader batches."""
    return torch.cat([next(data) for _ in range(times)])


def hold_memory(mib: int) -> torch.Tensor:
    """Host memory taken once and touched (every page resident), then kept: a large model's or
    dataset's footprint that settles at start and stays flat."""
    return torch.ones(mib << 18)  # float32: 4 bytes, 2**18 of them a MiB


def evaluate(model: nn.Module, args: argparse.Namespace, batches: int = 40) -> float:
    """A no-grad pass over some held-out batches, as an evaluation loop does on every rank."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(batches):
            total += float(model(torch.randn(args.batch * 4, args.width)).pow(2).mean())
            time.sleep(0.01)
    model.train()
    return total / batches


def between_steps(
    args: argparse.Namespace, me: int, step: int, ddp: DistributedDataParallel, folder: str
) -> None:
    """The mode's event every ``--every`` steps: a checkpoint, an evaluation, a log line."""
    if step % args.every:
        return
    if args.mode == "checkpoint":
        with ddpwatch.phase("checkpoint"):
            torch.save(ddp.module.state_dict(), os.path.join(folder, f"rank{me}-step{step}.pt"))
    elif args.mode == "eval":
        with ddpwatch.phase("eval"):
            evaluate(ddp.module, args)
    elif args.mode == "rank0-log" and me == 0:
        print(f"step {step}: logging", flush=True)
        time.sleep(0.04)  # writing a log line and a metrics file


def micro_batches(args: argparse.Namespace) -> int:
    """Micro-batches an optimizer step takes: ``--every`` when accumulating, else 1."""
    return args.every if args.mode == "accumulate" else 1


def batch_scale(args: argparse.Namespace, step: int) -> int:
    """Loader batches per micro-batch at ``step``: for ``batch-sizes`` it changes every
    ``--every`` steps (a curriculum, a batch-size warm-up), the same on every rank."""
    if args.mode != "batch-sizes":
        return 1
    return (1, 4, 2, 8)[(step // args.every) % 4]


def ddp_step(
    ddp: DistributedDataParallel,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    xs: list[torch.Tensor],
) -> torch.Tensor:
    """One optimizer step over ``xs``: all but the last micro-batch under ``no_sync`` (their
    gradients kept local), the last one all-reduced with DDP's hooks."""
    optimizer.zero_grad(set_to_none=True)
    loss = torch.zeros(())
    for i, x in enumerate(xs):
        sync = i == len(xs) - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = loss_of(ddp(x)) / len(xs)
            loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return loss


def mse(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def train_ddp(args: argparse.Namespace) -> int:
    """The plain DDP loop every mode but ``lightning`` and ``deepspeed`` runs."""
    ddpwatch.attach()
    dist.init_process_group("gloo")
    me = dist.get_rank()
    torch.manual_seed(0)
    held = hold_memory(args.memory_mib) if args.mode == "memory" else None
    ddp = DistributedDataParallel(Net(args.width))
    ddpwatch.attach(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    loss_of = mse
    if args.mode.startswith("compile"):  # the model and the loss, compiled at the first call
        ddp = torch.compile(ddp, backend=args.backend)  # type: ignore[assignment]
        loss_of = torch.compile(mse, backend=args.backend)
    data = batches(args, me, workers=2 if args.mode == "workers" else 0)
    folder = scratch("ddpwatch-ckpt-")
    for step in range(1, args.steps + 1):
        scale = batch_scale(args, step)
        xs = [draw(data, scale) for _ in range(micro_batches(args))]
        loss = ddp_step(ddp, loss_of, optimizer, xs)
        ddpwatch.step(loss)
        between_steps(args, me, step, ddp, folder)
        time.sleep(args.step_time)
    del held
    dist.barrier()
    dist.destroy_process_group()
    if args.mode == "finish-apart":
        time.sleep(me * 1.5)  # its own last work: a final save, an upload, a summary
    return 0


def train_lightning(args: argparse.Namespace) -> int:
    """Lightning's own start-up (strategy setup, sanity check) and fit under torchrun, with
    ``DDPWatchCallback``; an evaluation each epoch."""
    import lightning.pytorch as pl

    from ddpwatch.integrations.lightning import DDPWatchCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(args.width)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            time.sleep(args.step_time)
            return mse(self.net(batch[0]))

        def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
            self.log("val_loss", mse(self.net(batch[0])), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(2048, args.width, generator=torch.Generator().manual_seed(0)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        max_steps=args.steps,
        limit_val_batches=10,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[DDPWatchCallback()],
    )
    loader = DataLoader(data, batch_size=args.batch)
    trainer.fit(Module(), loader, DataLoader(data, batch_size=args.batch * 4))
    return 0


def train_deepspeed(args: argparse.Namespace) -> int:
    """``deepspeed.initialize`` (ZeRO stage 1, CPU accelerator, gloo) and its engine's steps,
    attached as a user does."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ddpwatch.attach()
    import deepspeed
    import deepspeed.ops

    # CPU: skip the shared-memory all-reduce op, which DeepSpeed would compile here (JIT)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model = Net(args.width)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.batch * dist.get_world_size(),
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    ddpwatch.attach(engine)
    data = batches(args, dist.get_rank())
    for _ in range(args.steps):
        loss = mse(engine(next(data)))
        engine.backward(loss)
        engine.step()
        time.sleep(args.step_time)
    dist.barrier()
    return 0


TRAIN: dict[str, Callable[[argparse.Namespace], int]] = {
    "lightning": train_lightning,
    "deepspeed": train_deepspeed,
}


def main() -> None:
    args = parse()
    sys.exit(TRAIN.get(args.mode, train_ddp)(args))


if __name__ == "__main__":
    main()
