"""Where a NaN came from: the agent's check of this rank's own gradients, before DDP's
all-reduce averages them (``agent/grads.py``), on a plain model and in a real gloo job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpwatch.agent.grads import LEARN_STEPS, GradCheck, _stride
from ddpwatch.agent.hooks import ModelHooks
from ddpwatch.agent.progress import Progress
from ddpwatch.core.ports import free_port_pair

INF = float("inf")


def train_step(model: nn.Module, progress: Progress, bad: bool = False) -> None:
    """One step as a script runs it: forward, backward (an infinite gradient from a finite loss
    when ``bad``), ``ddpwatch.step(loss)``."""
    out = model(torch.ones(4, 8))
    if bad:
        out.register_hook(lambda g: g * INF)
    loss = out.pow(2).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    progress.end_step(loss.detach())


def test_the_first_step_with_non_finite_own_gradients_is_exact() -> None:
    progress = Progress()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    assert len(progress.grads.watch(model)) == 4
    assert progress.grads.watch(model) == []  # each parameter once
    for step in range(1, 13):
        train_step(model, progress, bad=step in (7, 8, 9, 11, 12))
    progress.loss.poll()  # one heartbeat for all twelve steps: the run began at 11
    assert progress.loss.grad_nan_step == 11 and progress.loss.nan_step is None
    for step in range(13, 20):
        train_step(model, progress, bad=step >= 17)
        if step in (14, 19):
            progress.loss.poll()
            assert progress.loss.grad_nan_step == (None if step == 14 else 17)
    assert progress.grads.faults == 0


def test_after_learning_only_the_last_gradients_to_arrive_stay_checked() -> None:
    """A deep model's every parameter hooked cost a third of a 7 ms step: after its first
    steps only a gradient of the first layer (the last to arrive, and where a bad gradient
    anywhere above flows) stay checked, and a bad step is still found."""
    progress = Progress()
    layers = [nn.Linear(8, 8) for _ in range(20)]
    model = nn.Sequential(*layers, nn.Linear(8, 1))
    assert len(progress.grads.watch(model)) == 42
    for _ in range(LEARN_STEPS + 1):
        train_step(model, progress)
    kept = {id(p) for p in layers[0].parameters()}
    assert len(progress.grads._handles) == 1 and set(progress.grads._handles) <= kept
    train_step(model, progress, bad=True)
    progress.loss.poll()
    assert progress.loss.grad_nan_step == LEARN_STEPS + 2
    assert progress.grads.faults == 0


def test_a_hook_that_takes_the_gradient_away_first_does_not_hide_it() -> None:
    """DeepSpeed's ZeRO 1-3 (``deepspeed.utils.torch.register_grad_hook``, 0.19) and
    optimizer-in-backward code hook each parameter's accumulation before ddpwatch is attached,
    and set ``.grad`` to None once they have taken it: the check runs before them."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    taken: list[torch.Tensor] = []

    def take(param: torch.Tensor) -> None:
        taken.append(param.grad.clone())
        param.grad = None

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(take)
    progress = Progress()
    progress.grads.watch(model)
    for step in range(1, LEARN_STEPS + 4):
        train_step(model, progress, bad=step >= LEARN_STEPS + 2)  # bad from then on
    progress.loss.poll()
    assert progress.loss.grad_nan_step == LEARN_STEPS + 2
    assert len(taken) == 4 * (LEARN_STEPS + 3)  # theirs still ran, every parameter, every step
    assert progress.grads.faults == 0


def test_gradient_accumulation_checks_every_backward_of_the_step() -> None:
    progress = Progress()
    model = nn.Linear(8, 1)
    progress.grads.watch(model)
    for micro in range(4):
        out = model(torch.ones(2, 8))
        if micro == 2:
            out.register_hook(lambda g: g * INF)
        out.sum().backward()  # .grad accumulates: no zero_grad between micro-batches
    progress.end_step(mode="optimizer")
    progress.loss.poll()
    assert progress.loss.grad_nan_step == 1


def test_a_large_gradient_is_sampled_but_every_row_is_read() -> None:
    weight = nn.Parameter(torch.zeros(4096, 512))
    stride = _stride(weight)
    assert 1 < stride <= 512  # at least one element of every row
    assert _stride(nn.Parameter(torch.zeros(64, 16))) == 1  # small: read whole
    progress = Progress()
    progress.grads.watch(nn.ParameterList([weight]))
    grad = torch.zeros(4096, 512)
    grad[3001] = INF  # one row: what a bad value in one output unit's gradient gives
    weight.backward(grad)
    progress.end_step(mode="optimizer")
    progress.loss.poll()
    assert progress.loss.grad_nan_step == 1


def test_frozen_integer_and_subclass_parameters_are_not_hooked(monkeypatch) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    check = GradCheck(Progress().loss)
    assert len(check.watch(model)) == 3
    monkeypatch.setenv("DDPWATCH_GRAD_CHECK", "0")
    assert GradCheck(Progress().loss).watch(nn.Linear(2, 2)) == []


def test_the_hooks_go_with_the_model_hooks() -> None:
    progress = Progress()
    hooks = ModelHooks(progress)
    model = nn.Linear(8, 1)
    hooks.add_model(model)
    hooks.remove()
    train_step(model, progress, bad=True)
    progress.loss.poll()
    assert progress.loss.grad_nan_step is None  # removed: nothing checked
    hooks.add_model(model)  # watched again: hooked again
    train_step(model, progress, bad=True)
    progress.loss.poll()
    assert progress.loss.grad_nan_step == 2
    hooks.remove()


RANK_SCRIPT = """\
import json, os, sys, torch, torch.distributed as dist
from torch import nn
import ddpwatch

watcher = ddpwatch.attach()  # zero-code: the DDP model below is hooked as it is built
dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(os.environ["RANK"]),
                        world_size=2)
me = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=sys.argv[2] == "1")
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
averaged = {}
for step in range(1, 7):
    out = ddp(torch.ones(4, 8) * (me + 1))
    if me == 1 and step == 3:
        out.register_hook(lambda g: g * float("inf"))  # rank 1's own gradient, loss finite
    loss = out.pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    averaged[step] = bool(torch.isfinite(model[0].weight.grad).all())
    optimizer.step()
    ddpwatch.step(loss)
reader = watcher.progress.loss
reader.poll()
print(json.dumps({"rank": me, "grad_nan_step": reader.grad_nan_step,
                  "nan_step": reader.nan_step, "finite_after_all_reduce": averaged[3]}))
dist.destroy_process_group()
ddpwatch.detach()
"""


@pytest.mark.e2e
@pytest.mark.parametrize("bucket_view", [False, True], ids=["grad-copied", "bucket-view"])
def test_ddp_ranks_see_their_own_gradients_not_the_averaged_ones(
    tmp_path: Path, bucket_view: bool
) -> None:
    """Under gloo, rank 1's infinite gradient at step 3 reaches rank 0's ``.grad`` through the
    all-reduce in the same step; rank 0's own gradients are finite until its parameters are
    NaN (step 4). So rank 1 reports step 3 and rank 0 step 4, as the rule needs: also where
    ``.grad`` is a view of DDP's bucket, which the all-reduce writes in place."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    method = f"tcp://127.0.0.1:{free_port_pair()}"
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "DDPWATCH_ADDR": f"127.0.0.1:{free_port_pair()}",  # no server: nothing listens
            "DDPWATCH_LOG_TAIL": "0",
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), method, "1" if bucket_view else "0"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err[-3000:]
            found = json.loads(out.strip().splitlines()[-1])
            results[found.pop("rank")] = found
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert results[0] == {"grad_nan_step": 4, "nan_step": 4, "finite_after_all_reduce": False}
    assert results[1] == {"grad_nan_step": 3, "nan_step": 4, "finite_after_all_reduce": False}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_sum_of_finite_values_does_not_overflow(dtype: torch.dtype) -> None:
    weight = nn.Parameter(torch.zeros(64, 64, dtype=dtype))
    progress = Progress()
    progress.grads.watch(nn.ParameterList([weight]))
    weight.backward(torch.full((64, 64), 60000.0, dtype=dtype))  # sums past fp16's 65504
    progress.end_step(mode="optimizer")
    progress.loss.poll()
    assert progress.loss.grad_nan_step is None
