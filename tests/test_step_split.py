"""Where a rank's step goes (``agent/split.py``): input wait, compute, and the wait in DDP's
gradient all-reduce, timed on the training thread without a device sync."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import free_port_pair
from torch.utils.data import DataLoader, Dataset

import ddpwatch
from ddpwatch.agent.progress import Progress, SplitReader
from ddpwatch.agent.split import KEEP_LAST, LEARN_BACKWARDS, GradReady

INPUT_S = 0.02  # the dataset's extra time per batch
WAIT_S = 0.03  # a hook after this rank's last gradient: the reducer's wait, as a peer causes it


class SlowSamples(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(INPUT_S)
        return torch.ones(4)


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{free_port_pair()}", interval=60.0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port_pair()}", rank=0, world_size=1
    )
    try:
        yield watcher
    finally:
        dist.destroy_process_group()
        ddpwatch.detach()


def _wait_after_own_gradients(param: torch.Tensor) -> None:
    time.sleep(WAIT_S)


def test_the_split_of_a_ddp_step_without_handing_the_model_over(group: Any) -> None:
    """Zero-code: the DDP model is found by its construction; the gradient wait is the time
    from the last own gradient to the end of backward; after learning, hooks stay only on the
    parameters whose gradients come last; detach removes them."""
    watcher = group
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    grad_ready: GradReady = watcher._grad_ready
    params = list(model.parameters())
    assert len(grad_ready._handles) == len(params)
    for param in params[:2]:  # the first layer's gradients come last in backward
        param.register_post_accumulate_grad_hook(_wait_after_own_gradients)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    reader = SplitReader(watcher.progress)
    for i, x in enumerate(DataLoader(SlowSamples(), batch_size=1)):
        if i == LEARN_BACKWARDS + 1:
            reader.read()  # from here on: steps past learning
        ddp(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == LEARN_BACKWARDS + 8:
            break
    input_wait, compute, grad_wait = reader.read()
    assert grad_ready.faults == 0
    assert 0 < len(grad_ready._handles) <= KEEP_LAST < len(params)
    assert input_wait is not None and INPUT_S <= input_wait < INPUT_S + 0.1
    assert grad_wait is not None and WAIT_S <= grad_wait < WAIT_S + 0.1
    assert compute is not None and WAIT_S <= compute < WAIT_S + 0.2  # the other hook's sleep
    ddpwatch.detach()
    assert grad_ready._handles == {}


class BrokenProgress(Progress):
    """A progress whose gradient fields cannot be written: every hook fails."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("grad_") and hasattr(self, "split"):
            raise RuntimeError("a bug in ddpwatch")
        super().__setattr__(name, value)


def test_a_fault_in_a_hook_never_reaches_training_and_is_counted(group: Any) -> None:
    progress = BrokenProgress()
    grad_ready = GradReady(progress)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    grad_ready.add_model(ddp)
    for _ in range(3):
        ddp(torch.ones(2, 4)).sum().backward()
        grad_ready.backward_ended()
    assert grad_ready.faults >= 3
    grad_ready.remove()


def test_the_reader_averages_the_steps_since_its_last_read() -> None:
    progress = Progress()
    reader = SplitReader(progress)
    assert reader.read() == (None, None, None)  # no step yet
    progress.input_seen = progress.grad_hooked = True
    progress.split = (4, 1.0, 0.2, 0.4, 0.1)  # 4 steps: 0.25 s each
    assert reader.read() == pytest.approx((0.05, 0.075, 0.1))
    assert reader.read() == pytest.approx((0.05, 0.075, 0.1))  # no new step: the last again
    progress.split = (6, 1.2, 0.2, 0.4, 0.1)  # two 0.1 s steps of pure compute
    assert reader.read() == pytest.approx((0.0, 0.1, 0.0))
    progress.grad_hooked = False  # no DDP model timed: the compute would hold the wait
    progress.split = (7, 1.3, 0.2, 0.4, 0.1)
    assert reader.read() == (0.0, None, None)


def test_each_step_adds_its_parts_to_the_totals() -> None:
    progress = Progress()
    progress.end_step()
    progress.input_time_step, progress.grad_wait_step = 0.01, 0.02
    progress.collective_time_step = 0.005
    time.sleep(0.05)
    progress.end_step()
    steps, total, inputs, grads, waits = progress.split
    assert (steps, inputs, grads, waits) == (1, 0.01, 0.02, 0.005)
    assert 0.05 <= total < 0.5
    assert progress.input_time_step == progress.grad_wait_step == 0.0


class Samples(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.ones(4)


def test_batches_drawn_are_marked_per_training_loader_not_evaluation(group: Any) -> None:
    """The evidence of a silent desync (PyTorch #44353): at every 8th step, how many batches
    the rank drew from the loader its last batch came from. An evaluation loader read between
    steps (on one rank only, as rank-zero validation does) does not count; a skipped batch
    does, from then on."""
    watcher = group
    train = iter(DataLoader(Samples(), batch_size=2))
    evaluation = DataLoader(Samples(), batch_size=4)
    for step in range(1, 25):
        next(train)
        if step == 11:
            next(train)  # a corrupt batch caught and skipped: one more drawn by this step
        if step == 5:
            for _ in evaluation:  # 16 evaluation batches, between two steps
                pass
        ddpwatch.step()
    assert list(watcher.progress.batch_marks) == [(8, 8), (16, 17), (24, 25)]
    assert watcher._input_timer.faults == 0
