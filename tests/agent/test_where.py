"""Where a rank is, from what it is doing (issue #33): a validation loop is not ``backward``, and
a rank that works without a step sends its stack, with ``attach`` as with ``ddpwatch run``."""

from __future__ import annotations

import sys
import time
from types import FrameType
from typing import Any

import pytest
import torch
from conftest import SCRIPTS, LiveServer, rank_zero_of_one

import ddpwatch
from ddpwatch.agent.where import named_phase, stack_phase, torch_phase
from ddpwatch.core.vocabulary import Phase


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    rank_zero_of_one(monkeypatch)
    yield
    ddpwatch.detach()


def validate_here() -> FrameType:
    return sys._getframe()


def run_eval_loop() -> FrameType:
    return sys._getframe()


def save_checkpoint_here() -> FrameType:
    return sys._getframe()


def test_a_function_named_for_validation_or_evaluation_names_the_phase() -> None:
    assert named_phase(validate_here()) == Phase.VALIDATION
    assert named_phase(run_eval_loop()) == Phase.EVALUATION
    assert named_phase(save_checkpoint_here()) is None
    assert named_phase(sys._getframe()) is None  # "retrieval" or a test's name is not one


def test_the_stack_inside_torch_says_backward_optimizer_or_forward() -> None:
    seen: dict[str, FrameType] = {}

    def note(name: str) -> None:
        seen.setdefault(name, sys._getframe(1))

    weight = torch.ones(2, requires_grad=True)
    weight.register_hook(lambda grad: note("backward"))
    (weight * 2).sum().backward()
    model = torch.nn.Linear(2, 1)
    model.register_forward_hook(lambda *_: note("forward"))
    model(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    optimizer.register_step_pre_hook(lambda *_: note("optimizer"))
    optimizer.step()
    assert {name: torch_phase(frame) for name, frame in seen.items()} == {
        "backward": Phase.BACKWARD,
        "forward": Phase.FORWARD,
        "optimizer": Phase.OPTIMIZER,
    }


def test_an_old_hook_phase_becomes_what_the_stack_shows() -> None:
    here = save_checkpoint_here()
    assert stack_phase(Phase.BACKWARD, here) == Phase.TRAIN  # not backward any more
    assert stack_phase(Phase.FORWARD, here) == Phase.TRAIN
    assert stack_phase(Phase.DATA, here) == Phase.DATA  # the user's own input code
    assert stack_phase(Phase.BACKWARD, validate_here()) == Phase.VALIDATION
    assert stack_phase(Phase.EVALUATION, here) == Phase.EVALUATION


def test_forwards_without_gradients_are_an_evaluation_not_a_backward(rank_env: Any) -> None:
    """The newcomer's rank 0, validating alone with ``attach(model)``: its last hook set
    ``backward`` after each evaluation forward, and it said so for the whole validation."""
    model = torch.nn.Linear(3, 1)
    watcher = ddpwatch.attach(model, addr="127.0.0.1:1", interval=0.1)
    assert watcher is not None
    progress = watcher.progress
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(2, 3)).pow(2).mean()
        assert progress.phase == Phase.FORWARD  # until its backward starts
        loss.backward()
        assert progress.phase == Phase.BACKWARD
        optimizer.step()
        assert progress.phase == Phase.DATA
    steps, forwards, data_wait = progress.step, progress.forwards, progress.data_wait_s
    model.eval()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(2, 3))
            assert progress.phase == Phase.EVALUATION
    model.train()
    with torch.no_grad():
        model(torch.randn(2, 3))  # no gradients, in train mode: an evaluation all the same
    assert progress.phase == Phase.EVALUATION
    assert progress.step == steps == 3  # evaluation forwards end no step
    assert progress.forwards == forwards + 5  # but they are progress
    assert progress.data_wait_s == data_wait


def test_a_job_without_training_counts_its_forwards_as_steps(rank_env: Any) -> None:
    model = torch.nn.Linear(3, 1).eval()
    watcher = ddpwatch.attach(model, addr="127.0.0.1:1", interval=0.1)
    assert watcher is not None
    with torch.inference_mode():
        for _ in range(3):
            model(torch.randn(2, 3))
    assert watcher.progress.step == 3 and watcher.progress.phase == Phase.EVALUATION


def test_a_backward_long_gone_is_not_reported(rank_env: Any) -> None:
    """The hooks said ``backward`` last; a second later the rank runs something else."""
    watcher = ddpwatch.attach(addr="127.0.0.1:1", interval=0.1)
    assert watcher is not None
    progress = watcher.progress
    progress.set_phase(Phase.BACKWARD)
    assert watcher._phase_now() == Phase.BACKWARD  # just set: the stack is not read
    progress.last_progress = progress.phase_changed = time.perf_counter() - 2.0

    def save_checkpoint() -> str:
        return watcher._phase_now()

    def validate() -> str:
        return watcher._phase_now()

    assert save_checkpoint() == Phase.TRAIN
    assert validate() == Phase.VALIDATION
    with ddpwatch.phase("my_eval"):  # a user's phase stands, however old
        progress.phase_changed = time.perf_counter() - 2.0
        assert watcher._phase_now() == "my_eval"


def test_a_rank_working_without_a_step_sends_its_stack(rank_env: Any) -> None:
    """Forwards count as progress, so the stack of a rank evaluating alone was never read: its
    waiting peers' alert sent people to a stack that never came."""
    model = torch.nn.Linear(3, 1)
    watcher = ddpwatch.attach(model, addr="127.0.0.1:1", interval=0.1)
    assert watcher is not None
    watcher.publisher.stop()  # this test calls what its beats would
    watcher.stack_after = 0.3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    stacks = []

    def validate() -> None:
        with torch.no_grad():
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                model(torch.randn(2, 3))
                stacks.append(watcher._stack_if_stuck())  # what each beat would send
                time.sleep(0.05)

    validate()
    sent = [stack for stack in stacks if stack is not None]
    assert sent and "in validate" in sent[0]
    assert len(sent) <= 2  # a moving rank: one now and then, not one a beat


@pytest.mark.e2e
def test_rank_0_validating_alone_is_named_with_its_place_and_stack(
    live_server: LiveServer, jobs: Any
) -> None:
    """The newcomer's job, for real: torchrun, gloo, ``attach(model)``, ``ddpwatch serve``."""
    job = jobs(str(SCRIPTS / "validates_alone.py"), 2, ["--at", "8", "--seconds", "8"],
               live_server.port)  # fmt: skip

    def validating(status: dict[str, Any]) -> dict[str, Any] | None:
        rank = next((r for r in status["ranks"] if r["rank"] == 0), None)
        if rank is None or rank["step"] != 8 or not rank["stack"]:
            return None
        return rank

    rank0 = live_server.wait_for(validating, timeout=90)
    assert rank0["phase"] == Phase.EVALUATION, rank0["phase"]
    assert "in validate" in rank0["stack"]
    assert "validates_alone.py" in rank0["stack"]
    code, out = job.wait(90)
    assert code == 0, out[-3000:]
    seen = {c.alert.kind: c.alert for c in live_server.changes if 0 in c.alert.ranks}
    for alert in seen.values():
        assert "'backward'" not in alert.message, alert.message
