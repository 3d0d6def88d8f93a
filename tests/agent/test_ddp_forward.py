"""An attached DDP model's forwards, watched through ``DistributedDataParallel.forward``
(``agent/hooks.py``, ``DDPForward``) rather than forward hooks, which would send every call
through ``torch.nn.Module``'s slow path: the same phases and counts, torch's forward back
after ``detach``, other DDP models untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import free_port_pair, rank_zero_of_one
from torch.nn.parallel import DistributedDataParallel

import ddpwatch
from ddpwatch.core.vocabulary import Phase

TORCH_FORWARD = DistributedDataParallel.forward


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Any:
    rank_zero_of_one(monkeypatch)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port_pair()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        ddpwatch.detach()
        dist.destroy_process_group()


def _attach(model: Any) -> Any:
    return ddpwatch.attach(model, addr=f"127.0.0.1:{free_port_pair()}", interval=60.0)


def test_an_attached_ddp_model_keeps_the_fast_call_path_and_its_phases(group: Any) -> None:
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    watcher = _attach(ddp)
    assert not ddp._forward_pre_hooks and not ddp._forward_hooks  # no slow path
    assert DistributedDataParallel.forward is not TORCH_FORWARD
    progress = watcher.progress
    seen = []
    ddp.module.register_forward_hook(lambda *_: seen.append(progress.phase))
    for _ in range(3):
        loss = ddp(torch.ones(2, 4)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert seen == [Phase.FORWARD] * 3  # DDP's own forward runs inside the wrapper
    assert progress.forwards == 3 and progress.step == 3  # steps from the optimizer
    assert progress.phase == Phase.DATA
    with torch.no_grad():
        ddp(torch.ones(2, 4))
    assert progress.phase == Phase.EVALUATION and progress.forwards == 4
    assert progress.step == 3  # an evaluation forward ends no step
    ddpwatch.detach()
    assert DistributedDataParallel.forward is TORCH_FORWARD
    ddp(torch.ones(2, 4))  # torch's own again
    assert progress.forwards == 4


def test_a_ddp_model_not_attached_passes_through_uncounted(group: Any) -> None:
    attached = DistributedDataParallel(torch.nn.Linear(4, 1))
    other = DistributedDataParallel(torch.nn.Linear(4, 1))
    watcher = _attach(attached)
    with torch.no_grad():
        other(torch.ones(2, 4))
        assert watcher.progress.forwards == 0
        attached(torch.ones(2, 4))
    assert watcher.progress.forwards == 1


def test_inference_through_ddp_counts_a_step_a_forward(group: Any) -> None:
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1)).eval()
    watcher = _attach(ddp)
    with torch.no_grad():
        for _ in range(5):
            ddp(torch.ones(2, 4))
    assert watcher.progress.step == 5 and watcher.progress.step_mode == "forward"


class OwnForward(DistributedDataParallel):
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return super().forward(*inputs, **kwargs) * 2


def test_a_ddp_subclass_with_its_own_forward_is_watched_by_hooks(group: Any) -> None:
    ddp = OwnForward(torch.nn.Linear(4, 1))
    watcher = _attach(ddp)
    assert ddp._forward_pre_hooks and ddp._forward_hooks
    with torch.no_grad():
        ddp(torch.ones(2, 4))
    assert watcher.progress.forwards == 1  # once: the hooks, not also torch's forward inside


def test_an_attached_ddp_model_compiled_after_trains_and_counts_its_steps(group: Any) -> None:
    """Compiled, the wrapper's compile check folds to True: a compiled forward marks no phase,
    as the hooks' did (``compiling_check``), and the optimizer still ends the steps."""
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    watcher = _attach(ddp)
    compiled = torch.compile(ddp, backend="eager")
    for _ in range(3):
        compiled(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert watcher.progress.step == 3
    ddpwatch.detach()
    assert DistributedDataParallel.forward is TORCH_FORWARD
