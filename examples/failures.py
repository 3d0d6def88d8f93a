"""One DDP job, one real failure mode from users' public bug reports, chosen by ``--mode``.

    torchrun --nproc-per-node 3 examples/failures.py --mode exit-zero
    torchrun --nproc-per-node 2 examples/failures.py --mode missing-rank   # world size 3

Every mode is a bug people reported against PyTorch, Lightning, DeepSpeed or Accelerate (the
issue is cited at each mode below); ``benchmarks/diagnosis.py`` runs them all under a real
server and scores whether ddpwatch names the right rank. Just before it injects its fault,
the faulty rank (or its data-loader worker) prints one line, so a harness can time
detection from it::

    DDPWATCH_FAULT rank=<r> t=<time.time()>

The training loop is what real scripts do: a DataLoader, a DDP model, the loss all-reduced
for logging every step (an explicit collective besides DDP's own gradient all-reduce),
``optimizer.step()`` and ``ddpwatch.step(loss)``, then a final ``dist.barrier()``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import ddpwatch

# mode -> (faulty rank, step of the fault): defaults chosen so each run stays short
DEFAULTS: dict[str, tuple[int, int]] = {
    "healthy": (1, 0),
    # healthy, unevenly busy: rank 0 writes its logs to disk every 50 steps (0.3 s), as
    # rank-zero-only logging does, and the others wait that long in the next collective
    # (the flapping straggler verdicts of TraceML #374's kind must not come of it)
    "healthy-busy": (0, 50),
    # healthy, uneven inputs: the faulty rank has 5 batches fewer and the loop runs under
    # DDP's ``join()``, which shadows its all-reduces until every rank is done (PyTorch's
    # Join RFC, https://github.com/pytorch/pytorch/issues/38174)
    "healthy-join": (2, 0),
    # healthy, with a subgroup: ranks 0 and 2 all-reduce on ``new_group([0, 2])`` every step
    # while rank 1 does not (a tensor-parallel pair beside data parallelism)
    "healthy-subgroup": (2, 0),
    # Lightning #379: an early-stopping decision met on one rank only stops that process and
    # the others hang (https://github.com/Lightning-AI/pytorch-lightning/issues/379)
    "exit-early": (1, 50),
    # PyTorch #138322: a rank with nothing left to do returns (exit code 0) and the others
    # hang in their barrier (https://github.com/pytorch/pytorch/issues/138322)
    "exit-zero": (1, 20),
    # PyTorch #41067: the launcher keeps waiting while the surviving ranks block on one that
    # is already gone (https://github.com/pytorch/pytorch/issues/41067); os._exit runs no
    # exception hook and no atexit handler
    "os-exit": (1, 20),
    # Lightning #5243 / PR #5359: a NaN/invalid loss on one DDP process poisons the others
    # through the gradient all-reduce (https://github.com/Lightning-AI/pytorch-lightning/issues/5243)
    "nan": (1, 15),
    # PyTorch #2421: the gradient of a zero distance is NaN (the square root's is infinite at
    # 0), "that will propagate to make all updates nan"
    # (https://github.com/pytorch/pytorch/issues/2421; ``norm`` itself now returns 0 there, a
    # distance written as ``sqrt(sum((a - b) ** 2))`` does not): a batch holding the same sample
    # twice gives a finite loss and NaN gradients on that rank alone; DDP's all-reduce averages
    # them into every rank's update, and every rank's loss is NaN from the next step
    "nan-grad": (1, 15),
    # DeepSpeed #4488: one rank busy for a long time (a dataset map) while the others wait in
    # a barrier (https://github.com/deepspeedai/DeepSpeed/issues/4488)
    "barrier-sleep": (1, 20),
    # Lightning #7773: all_gather of tensors with different sizes per rank freezes or fails,
    # and gloo refuses uneven sizes (PyTorch #156627)
    # (https://github.com/Lightning-AI/pytorch-lightning/issues/7773)
    "allgather-size": (2, 20),
    # Lightning #19045 (fixed by PR #19056): self.log(..., sync_dist=True) called on rank 0
    # only deadlocks (https://github.com/Lightning-AI/pytorch-lightning/pull/19056)
    "rank0-only-collective": (0, 20),
    # Accelerate #1359 / #2690: the main process saves or downloads alone while the others
    # wait in wait_for_everyone() (https://github.com/huggingface/accelerate/issues/1359,
    # https://github.com/huggingface/accelerate/issues/2690)
    "rank0-checkpoint": (0, 20),
    # LLaMA-Factory #2424: the same with a process-group timeout shorter than rank 0's solo
    # work: the others' wait times out ("Timed out waiting ... for recv operation") and
    # torchrun's "Root Cause" names them, the victims
    # (https://github.com/hiyouga/LLaMA-Factory/issues/2424); ``--no-barrier``: the others
    # wait in the next step's collectives instead
    "rank0-checkpoint-timeout": (0, 20),
    # RETURNN #1621: evaluation on rank 0 only, every epoch, while the others wait for it
    # (https://github.com/rwth-i6/returnn/issues/1621): not a failure, each rank exits 0, but
    # the others lose the time; three evaluations, the first at ``--at``, every 10 steps
    "rank0-eval-epochs": (0, 10),
    # PyTorch #130102: hierarchical communication, a subgroup's collective then the world's,
    # hangs (https://github.com/pytorch/pytorch/issues/130102); here rank 2 is slow, rank 0
    # waits for it in an all-reduce on ``new_group([0, 2])`` and rank 1 waits for rank 0 in
    # the world's next collective: the blame runs through rank 0 to rank 2
    "subgroup-cascade": (2, 20),
    # PyTorch #87995: one rank hangs in its DataLoader, all others wait in all_reduce
    # (https://github.com/pytorch/pytorch/issues/87995)
    "dataloader-hang": (1, 20),
    # PyTorch #8976: "DataLoader worker (pid N) is killed by signal: Killed" in DDP training
    # (https://github.com/pytorch/pytorch/issues/8976)
    "dataloader-killed": (1, 20),
    # PyTorch #43259: "Expected to have finished reduction in the prior iteration ...
    # Parameter indices which did not receive grad for rank N"
    # (https://github.com/pytorch/pytorch/issues/43259)
    "unused-params": (1, 20),
    # PyTorch #44353: catching an OOM on one rank and skipping the batch desyncs the
    # collectives (https://github.com/pytorch/pytorch/issues/44353)
    "skipped-batch": (1, 20),
    # PyTorch #39708: an unsupported reduce op became SUM under NCCL with no error, labelled
    # "correctness (silent)" (https://github.com/pytorch/pytorch/issues/39708): ranks that
    # reduce with different ops get mixed values; here, from ``--at`` on, the faulty rank
    # all-reduces its logged metric with MAX where the others sum it: gloo completes it,
    # nothing fails, nobody waits, and the ranks log different numbers
    "reduce-op": (2, 20),
    # PyTorch #39706: a collective's root that differs on one rank (a reduce's dst there:
    # https://github.com/pytorch/pytorch/issues/39706); here every step broadcasts rank 0's
    # decision (a flag, as early stopping shares it) and, from ``--at`` on, the faulty rank
    # passes src=rank, itself: under gloo (torch 2.13) rank 0 and it hang in the broadcast,
    # each sending to a rank that does not receive, while rank 1, which rank 0 reached, goes
    # on to the next all-reduce and waits there
    "broadcast-src": (2, 20),
    # PyTorch #150248's family (https://github.com/pytorch/pytorch/issues/150248: all_reduce
    # of tensors whose dtype differs between ranks): from ``--at`` on, the faulty rank
    # all-reduces its logged metric in float64 where the others use float32; gloo aborts a
    # rank from C++ ("Received data size doesn't match expected size", SIGABRT), too fast for
    # a heartbeat to tell how it called it
    "metric-dtype": (1, 20),
    # healthy: the same broadcast with src=1 on every rank (a root other than 0 is no fault)
    "healthy-broadcast": (1, 0),
    # FunASR PR #3472: DDP's no_sync() and gradient accumulation out of line, rank-local
    # accumulated gradients (https://github.com/modelscope/FunASR/pull/3472); here the faulty
    # rank accumulates 2 micro-batches a step (the first under no_sync) where the others take
    # 1: steps and all-reduces still pair up, nothing fails, the data no longer does
    "accumulate-uneven": (1, 20),
    # NVIDIA-NeMo/Automodel #2468, ecmwf/WeatherGenerator #2724: a skip decided on one rank's
    # own loss or gradients; here after its backward, so DDP's all-reduce ran and only its
    # optimizer step is skipped: its weights drift from the others', nothing fails
    # (https://github.com/NVIDIA-NeMo/Automodel/pull/2468)
    "skipped-step": (1, 20),
    # the issue's own one-rank evaluation through the DDP wrapper, with a BatchNorm model:
    # DDP broadcasts the buffers before every forward, no_grad too (pytorch/pytorch#175024),
    # and rank 0's broadcasts have no partner; gloo may let them complete and the job runs
    # on, every later collective paired one off
    # (https://github.com/pytorch/pytorch/issues/175024)
    "ddp-eval-alone": (0, 20),
    # its healthy twin: every rank validates through the wrapper every 20 steps
    "healthy-ddp-eval": (1, 0),
    # Lightning #8130: one DDP process raises and the script hangs
    # (https://github.com/Lightning-AI/pytorch-lightning/issues/8130)
    "raise": (1, 20),
    # TraceML #252: one rank's backward takes 200 ms more every step; DDP's gradient
    # all-reduce evens out every rank's step time, so the culprit's backward looks like its
    # peers' and only their wait inside the all-reduce tells them apart
    # (https://github.com/traceopt-ai/traceml/issues/252)
    "slow-backward": (1, 20),
    # TraceML #252's positive control and PR #158's input-straggler demo: one rank's input
    # pipeline is ~150 ms a batch slower and the other ranks wait for it every step
    # (https://github.com/traceopt-ai/traceml/issues/252,
    # https://github.com/traceopt-ai/traceml/pull/158); here its dataset's __getitem__ is
    # 0.16 s slower per batch
    "slow-input": (2, 20),
    # PyTorch #13246: host memory that grows every step (there, DataLoader workers copying a
    # Python list of objects as they read it; here, 1 MiB of outputs kept "for logging" each
    # step) until the kernel's OOM killer ends the rank with SIGKILL and the others hang
    # (https://github.com/pytorch/pytorch/issues/13246); ``--oom-mib``: where it is killed
    "host-leak": (1, 20),
    # PyTorch #52848: init_process_group hangs when the world size says more ranks than were
    # started (https://github.com/pytorch/pytorch/issues/52848)
    # diffusion-pipe#409: the first stage sends the targets to the last with dist.send and
    # one step it does not (a branch on its own data); the receiver waits in dist.recv while
    # the others go on to DDP's all-reduce, which it must enter
    # (https://github.com/tdrussell/diffusion-pipe/issues/409)
    "p2p-skip-send": (0, 20),
    # the same hand-off, the receiver skipping its dist.recv: the sender blocks in its send
    "p2p-skip-recv": (1, 20),
    # the same hand-off, the first stage slow before its send (a slow read of its next shard):
    # the receiver waits in its recv, the others in DDP's all-reduce, for the one stage
    "p2p-slow-send": (0, 20),
    # PiPPy #969: ranks exchange by batch_isend_irecv in a ring, and one rank does not post
    # its half; its neighbours' requests never complete while it waits in the all-reduce
    # (https://github.com/pytorch/PiPPy/issues/969)
    "p2p-batch-skip": (0, 20),
    # PyTorch #109401 (interleaved isend and irecv hang) and Megatron's _p2p_ops: the same
    # ring written with dist.isend and dist.irecv posted one by one, then waited for; rank 0
    # does not post its half one step (https://github.com/pytorch/pytorch/issues/109401)
    "p2p-isend-skip": (0, 20),
    # healthy: every hand-off, matched on every step
    "healthy-p2p": (1, 0),
    "missing-rank": (2, 0),
    # PyTorch #53395 and #76069: each process picks a free port itself and sets MASTER_PORT
    # just before init_process_group (or each node's launch line has its own), so one rank
    # looks for the rendezvous where nobody listens and every rank hangs until the timeout
    # (https://github.com/pytorch/pytorch/issues/53395,
    # https://github.com/pytorch/pytorch/issues/76069)
    "port-of-its-own": (2, 0),
    "port-of-its-own-rank0": (0, 0),  # rank 0: the store's host in a static rendezvous
}
MODES = tuple(DEFAULTS)
SLOW_BACKWARD_S = 0.2  # slow-backward: extra seconds of backward a step
SLOW_INPUT_S = 0.16  # slow-input: extra seconds of input a batch


def fault_line(rank: int) -> None:
    """Tell the harness when the fault begins (the faulty rank's own clock)."""
    print(f"DDPWATCH_FAULT rank={rank} t={time.time()!r}", flush=True)


class Samples(Dataset[torch.Tensor]):
    """Synthetic samples; on the faulty rank one index blocks or kills the worker."""

    def __init__(self, size: int, width: int, seed: int, bad_index: int, how: str) -> None:
        self.data = torch.randn(size, width, generator=torch.Generator().manual_seed(seed))
        self.bad_index = bad_index
        self.how = how
        self.rank = seed
        self.slow_from = -1  # slow-input: the first index of the first slow batch
        self.batch = 1

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        if 0 <= self.slow_from <= index and index % self.batch == 0:
            if index == self.slow_from:
                fault_line(self.rank)
            time.sleep(SLOW_INPUT_S)  # a slow read or decode, once per batch
        if index == self.bad_index:
            fault_line(self.rank)
            if self.how == "dataloader-hang":
                while True:  # a read that never returns (a dead NFS mount, a stuck decoder)
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)  # the kernel's OOM killer, as users see it
        return self.data[index]


class Net(nn.Module):
    """A small MLP with an auxiliary head that one rank may skip (``unused-params``)."""

    def __init__(self, width: int, batchnorm: bool = False) -> None:
        super().__init__()
        norm: list[nn.Module] = [nn.BatchNorm1d(width)] if batchnorm else []
        self.body = nn.Sequential(
            nn.Linear(width, width), *norm, nn.ReLU(), nn.Linear(width, width)
        )
        self.aux = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, use_aux: bool = True) -> torch.Tensor:
        h = self.body(x)
        if use_aux:
            h = h + self.aux(h)
        return self.head(h)


def solo_work(model: nn.Module, seconds: float) -> None:
    """Real work on one rank only: serialize the model again and again, as a slow save does."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        torch.load(io.BytesIO(buffer.getvalue()))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=MODES, default="healthy")
    parser.add_argument("--rank", type=int, help="the faulty rank (default: per mode)")
    parser.add_argument("--at", type=int, help="the step of the fault (default: per mode)")
    parser.add_argument("--steps", type=int, help="steps per rank (default: at + 30, min 60)")
    parser.add_argument("--step-time", type=float, help="extra seconds per step (0.03; nan 0.01)")
    parser.add_argument(
        "--sleep", type=float, help="barrier-sleep 20 s, rank0-checkpoint 25 s, each evaluation 6 s"
    )
    parser.add_argument("--world-size", type=int, default=3, help="missing-rank: the wrong size")
    parser.add_argument(
        "--init-timeout",
        type=float,
        default=30.0,
        help="missing-rank, port-of-its-own: rendezvous timeout (s)",
    )
    parser.add_argument("--leak-mib", type=int, default=1, help="host-leak: MiB kept a step")
    parser.add_argument(
        "--oom-mib", type=int, default=1024, help="host-leak: SIGKILL once this much is kept"
    )
    parser.add_argument(
        "--pg-timeout",
        type=float,
        help="the process group's timeout (s): *-timeout modes 8 s; any other mode given it "
        "times out instead of hanging",
    )
    parser.add_argument(
        "--no-barrier", action="store_true", help="rank0-checkpoint*: no barrier after it"
    )
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--batchnorm", action="store_true", help="a BatchNorm layer (buffers DDP broadcasts)"
    )
    parser.add_argument(
        "--own-data",
        action="store_true",
        help="the loop makes its own tensors (synthetic data), no DataLoader",
    )
    parser.add_argument(
        "--odd-dtype",
        choices=("float64", "float16"),
        default="float64",
        help="metric-dtype: the faulty rank's metric dtype (float16: gloo aborts that rank)",
    )
    parser.add_argument(
        "--p2p-subgroup",
        action="store_true",
        help="p2p-isend-skip: ranks 0 and 1 exchange on a group of their own, by group rank",
    )
    parser.add_argument(
        "--no-metric",
        action="store_true",
        help="skip the loss all-reduce: DDP's gradient all-reduce is the one collective a step",
    )
    args = parser.parse_args(argv)
    default_rank, default_at = DEFAULTS[args.mode]
    args.rank = default_rank if args.rank is None else args.rank
    args.at = default_at if args.at is None else args.at
    if args.mode in ("slow-backward", "slow-input") and not args.steps:
        args.steps = args.at + 50  # ~12 s at the slow rank's pace
    # host-leak: steps enough to reach the OOM kill (its rank dies, the others hang)
    leaking = 2 * args.oom_mib // max(1, args.leak_mib) if args.mode == "host-leak" else 0
    args.steps = args.steps or max(60, args.at + 30 + leaking)
    if args.mode == "healthy-busy":
        args.steps = max(args.steps, 200)  # four logs
    silent = ("accumulate-uneven", "skipped-step")
    if args.mode in silent or (args.mode == "skipped-batch" and args.no_metric):
        args.steps = max(args.steps, args.at + 120)  # a silent desync: the job runs on
    if args.step_time is None:
        args.step_time = 0.01 if args.mode in ("nan", "nan-grad") else 0.03
    if args.sleep is None:
        sleeps = {
            "rank0-checkpoint": 25.0,
            "rank0-eval-epochs": 6.0,
            "healthy-busy": 0.3,
            "p2p-slow-send": 8.0,
        }
        args.sleep = sleeps.get(args.mode, 20.0)
    return args


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init(args: argparse.Namespace, me: int) -> None:
    if args.mode == "missing-rank":
        # the script's own config says 3 ranks where the launcher started 2: the rendezvous
        # waits for a rank that never comes, until the timeout
        if me == 0:
            fault_line(args.rank)
        dist.init_process_group(
            "gloo",
            rank=me,
            world_size=args.world_size,
            timeout=timedelta(seconds=args.init_timeout),
        )
    elif args.mode.startswith("port-of-its-own"):
        if me == args.rank:
            fault_line(args.rank)
            os.environ["MASTER_PORT"] = str(_free_port())  # nobody listens there
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.init_timeout))
    elif args.mode.endswith("-timeout") or args.pg_timeout is not None:
        timeout = args.pg_timeout if args.pg_timeout is not None else 8.0
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    else:
        dist.init_process_group("gloo")


def train(args: argparse.Namespace) -> int:
    """The training loop with the fault; returns the exit code for ``sys.exit``."""
    ddpwatch.attach()
    me = int(os.environ.get("RANK", 0))
    init(args, me)
    mode, faulty = args.mode, me == args.rank
    torch.manual_seed(0)
    batchnorm = args.batchnorm or mode in ("ddp-eval-alone", "healthy-ddp-eval")
    model = Net(args.width, batchnorm=batchnorm)
    # every rank calls new_group, members or not
    pair = dist.new_group([0, 2]) if mode in ("subgroup-cascade", "healthy-subgroup") else None
    p2p_pair = dist.new_group([0, 1]) if args.p2p_subgroup else None
    ddp = DistributedDataParallel(model)
    ddpwatch.attach(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    workers = 1 if mode.startswith("dataloader") else 0
    bad = args.at * args.batch if faulty and mode.startswith("dataloader") else -1
    twice = 2 if mode == "accumulate-uneven" else 1  # its faulty rank draws two a step
    data = Samples(args.steps * args.batch * twice, args.width, me, bad, mode)
    if faulty and mode == "slow-input":
        data.slow_from, data.batch = (args.at - 1) * args.batch, args.batch
    loader = DataLoader(data, batch_size=args.batch, num_workers=workers)
    batches = iter(loader) if not args.own_data else synthetic(args, me)
    kept: list[torch.Tensor] = []  # host-leak: "for logging", never emptied
    # healthy-join: fewer batches on one rank, DDP's join() shadows its all-reduces after
    steps = args.steps - 5 if faulty and mode == "healthy-join" else args.steps
    uneven = ddp.join() if mode == "healthy-join" else contextlib.nullcontext()
    with uneven:
        for step in range(1, steps + 1):
            x = next(batches)
            at_fault = faulty and step == args.at
            leaves = ("exit-early", "exit-zero", "os-exit", "raise", "skipped-batch")
            if at_fault and mode in leaves:
                fault_line(me)
                if mode == "exit-early":
                    sys.exit(3)  # "should stop" decided on this rank alone
                if mode == "exit-zero":
                    return 0  # leaves the loop and skips the final barrier
                if mode == "os-exit":
                    os._exit(3)
                if mode == "raise":
                    raise RuntimeError(f"injected failure on rank {me} at step {step}")
                try:
                    raise ValueError(f"corrupt sample in batch {step}")
                except ValueError as exc:  # the rank skips this batch: one collective behind
                    print(f"rank {me}: skipping batch {step}: {exc}", flush=True)
                    continue
            accumulating = faulty and mode == "accumulate-uneven" and step >= args.at
            if accumulating:
                if at_fault:
                    fault_line(me)
                optimizer.zero_grad(set_to_none=True)
                with ddp.no_sync():
                    ddp(x).pow(2).mean().backward()  # a first micro-batch, kept local
                x = next(batches)  # and a second, reduced with the others' only one
            if at_fault and mode == "unused-params":
                fault_line(me)
            if at_fault and mode == "nan-grad":
                fault_line(me)
                x = torch.cat([x[:1], x[:1], x[2:]])  # the same sample twice in one batch
            out = ddp(x, use_aux=not (at_fault and mode == "unused-params"))
            if faulty and mode == "slow-backward" and step >= args.at:
                if at_fault:
                    fault_line(me)
                out.register_hook(slow_backward)
            loss = out.pow(2).mean()
            if mode == "nan-grad":  # a distance between two samples' outputs, as metric losses have
                loss = loss + 0.01 * (out[0] - out[1]).pow(2).sum().sqrt()
            if at_fault and mode == "nan":
                fault_line(me)
                loss = loss * float("nan")
            metric = loss.detach().clone()
            if not args.no_metric and mode != "healthy-join":  # join shadows DDP's only
                all_reduce_metric(args, faulty, step, metric)
            if mode in ("broadcast-src", "healthy-broadcast"):
                broadcast_decision(args, me, faulty, step, metric)
            if mode.startswith("p2p-") or mode == "healthy-p2p":
                hand_off(args, me, faulty and step == args.at, metric, p2p_pair)
            if not accumulating:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if faulty and mode == "skipped-step" and step == args.at:
                fault_line(me)
                optimizer.zero_grad(set_to_none=True)  # "a loss spike: skip this update"
                continue
            optimizer.step()
            ddpwatch.step(loss)
            if mode == "ddp-eval-alone" and faulty and step == args.at:
                fault_line(me)
                validate_through_ddp(args, ddp)
            if mode == "healthy-ddp-eval" and step % 20 == 0:
                validate_through_ddp(args, ddp)
            if step == args.at:
                special(args, me, faulty, model, metric)
            if step == args.at and pair is not None and me in (0, 2):
                if faulty:
                    fault_line(me)
                    with ddpwatch.phase("data"):
                        time.sleep(args.sleep)  # a slow read of its next shard
                dist.all_reduce(metric, group=pair)  # e.g. a tensor-parallel pair's reduction
            if mode == "healthy-subgroup" and me in (0, 2):
                dist.all_reduce(metric, group=pair)  # the pair's own reduction, every step
            if mode == "healthy-busy" and faulty and step % 50 == 0:
                solo_work(model, args.sleep)  # its logs, written to disk
            if mode == "host-leak" and faulty and step >= args.at:
                keep_for_logging(args, me, step, kept)
            if mode == "rank0-eval-epochs" and step in (args.at, args.at + 10, args.at + 20):
                evaluate_alone(args, me, faulty, step, model)
            time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def validate_through_ddp(args: argparse.Namespace, ddp: nn.Module) -> None:
    """A quick validation on this rank alone, through the DDP wrapper (as a script calls its
    model): 5 batches in eval mode, no gradients."""
    ddp.eval()
    with torch.no_grad():
        for _ in range(5):
            ddp(torch.randn(args.batch, args.width))
    ddp.train()


def synthetic(args: argparse.Namespace, me: int) -> Iterator[torch.Tensor]:
    """Batches a loop makes itself (synthetic data, a hand-written loader): no DataLoader for
    the agent to count."""
    generator = torch.Generator().manual_seed(me)
    while True:
        yield torch.randn(args.batch, args.width, generator=generator)


def hand_off(
    args: argparse.Namespace, me: int, skip: bool, metric: torch.Tensor, pair: Any = None
) -> None:
    """A pipeline's hand-off each step: rank 0 sends its targets to rank 1 with ``dist.send``
    (``p2p-skip-send``), or every rank passes its metric on round a ring with
    ``batch_isend_irecv`` (``p2p-batch-skip``) or ``isend``/``irecv`` (``p2p-isend-skip``);
    ``healthy-p2p`` does all three. ``pair``: ``p2p-isend-skip`` on a group of ranks 0 and 1
    alone, peers given by their rank in it (``--p2p-subgroup``). ``skip``: this rank
    does not make its half this step (the send, or in ``p2p-skip-recv`` the receive)."""
    mode = args.mode
    if skip:
        fault_line(me)
        if mode == "p2p-slow-send":
            with ddpwatch.phase("data"):
                time.sleep(args.sleep)  # slow, not skipped: it sends after this
            skip = False
    one_way = ("p2p-skip-send", "p2p-skip-recv", "p2p-slow-send", "healthy-p2p")
    if mode in one_way and me in (0, 1) and not skip:
        if me == 0:  # ``p2p-skip-recv``: the receiver skips its half, rank 0 blocks in its send
            dist.send(metric.clone(), dst=1)
        else:
            dist.recv(torch.empty_like(metric), src=0)
    if mode in ("p2p-batch-skip", "healthy-p2p") and not skip:
        world = dist.get_world_size()
        got = torch.empty_like(metric)
        ops = [
            dist.P2POp(dist.isend, metric.clone(), (me + 1) % world),
            dist.P2POp(dist.irecv, got, (me - 1) % world),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    if mode == "p2p-isend-skip" and pair is not None:
        if me in (0, 1) and not skip:
            got = torch.empty_like(metric)
            requests = [
                dist.isend(metric.clone(), group=pair, group_dst=1 - me),
                dist.irecv(got, group=pair, group_src=1 - me),
            ]
            for request in requests:
                request.wait()
    elif mode in ("p2p-isend-skip", "healthy-p2p") and not skip:
        world = dist.get_world_size()
        got = torch.empty_like(metric)
        requests = [
            dist.isend(metric.clone(), dst=(me + 1) % world),
            dist.irecv(got, src=(me - 1) % world),
        ]
        for request in requests:
            request.wait()


def all_reduce_metric(
    args: argparse.Namespace, faulty: bool, step: int, metric: torch.Tensor
) -> None:
    """The logged loss, summed over ranks, as logs do; ``reduce-op``'s faulty rank takes the
    maximum instead from ``--at`` on, ``metric-dtype``'s sums it in float64."""
    if faulty and args.mode == "reduce-op" and step >= args.at:
        if step == args.at:
            fault_line(dist.get_rank())
        dist.all_reduce(metric, op=dist.ReduceOp.MAX)
    elif faulty and args.mode == "metric-dtype" and step >= args.at:
        fault_line(dist.get_rank())
        dist.all_reduce(metric.to(getattr(torch, args.odd_dtype)))
    else:
        dist.all_reduce(metric)


def broadcast_decision(
    args: argparse.Namespace, me: int, faulty: bool, step: int, metric: torch.Tensor
) -> None:
    """Every step, every rank takes one rank's decision (whether to stop, as early stopping
    shares it): ``broadcast-src``'s faulty rank names another root from ``--at`` on."""
    src = 1 if args.mode == "healthy-broadcast" else 0
    if faulty and args.mode == "broadcast-src" and step >= args.at:
        if step == args.at:
            fault_line(me)
        src = me  # a root computed from the rank: the classic slip
    decision = (metric > 1e9).float()  # "stop now?": 0 or 1
    dist.broadcast(decision, src=src)


def keep_for_logging(
    args: argparse.Namespace, me: int, step: int, kept: list[torch.Tensor]
) -> None:
    """The leak of PyTorch #13246's shape: host memory that grows every step. Here the step's
    outputs, ``--leak-mib`` MiB of them, kept in a list "for logging" (the fix: keep
    ``loss.item()`` or a few numbers, not tensors). At ``--oom-mib`` MiB the rank is killed
    with SIGKILL, as the kernel's OOM killer does at a cgroup's limit: no exception, no exit
    handler, the others hang in their next collective."""
    if step == args.at:
        fault_line(me)
    kept.append(torch.full((args.leak_mib << 18,), float(step)))  # float32: every page touched
    if len(kept) * args.leak_mib >= args.oom_mib:
        print(f"rank {me}: out of memory at step {step}: SIGKILL (the OOM killer)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def slow_backward(grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook on the model's output: this rank's backward takes ``SLOW_BACKWARD_S``
    longer, before any of its parameters' gradients is ready (a slower GPU, a heavier
    batch)."""
    time.sleep(SLOW_BACKWARD_S)
    return grad


def evaluate_alone(
    args: argparse.Namespace, me: int, faulty: bool, step: int, model: nn.Module
) -> None:
    """After "epoch" ``step`` (three of 10 steps), the faulty rank alone evaluates (forward
    passes, no gradients) while the others wait in a barrier: working all along, never
    stuck."""
    if faulty:
        if step == args.at:
            fault_line(me)
        deadline = time.monotonic() + args.sleep
        model.eval()
        with torch.no_grad():
            while time.monotonic() < deadline:
                for _ in range(20):
                    model(torch.randn(args.batch, args.width))
        model.train()
    dist.barrier()  # "everyone waits for the validation to finish"


def special(
    args: argparse.Namespace, me: int, faulty: bool, model: nn.Module, metric: torch.Tensor
) -> None:
    """The faults that happen between steps, at step ``--at``."""
    mode = args.mode
    if mode == "barrier-sleep":
        if faulty:
            fault_line(me)
            time.sleep(args.sleep)
        dist.barrier()  # e.g. "wait until everyone finished the epoch"
    elif mode in ("rank0-checkpoint", "rank0-checkpoint-timeout"):
        if faulty:
            fault_line(me)
            with ddpwatch.phase("checkpoint"):
                solo_work(model, args.sleep)
        if not args.no_barrier:
            dist.barrier()  # the others wait for the checkpoint, as wait_for_everyone() does
    elif mode == "allgather-size":
        values = torch.arange(5.0 if faulty else 4.0)
        if faulty:
            fault_line(me)
        gathered = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, values)
    elif mode == "rank0-only-collective" and faulty:
        fault_line(me)
        dist.all_reduce(metric)  # e.g. self.log(..., sync_dist=True) under `if rank == 0`


def main() -> None:
    sys.exit(train(parse()))


if __name__ == "__main__":
    main()
