"""How a rank ended (exit code, signal, the collective it was in) and the exact first step
whose loss was not finite: real processes against a real server, and the loss buffer alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SCRIPTS, LiveServer, as_json, ddpwatch_run, free_port_pair

import ddpwatch
from ddpwatch.agent.hooks import BackwardLoss, ModelHooks, exit_status
from ddpwatch.agent.loss import LossReader
from ddpwatch.agent.patches import Patches
from ddpwatch.agent.progress import Progress

NAN = float("nan")

# ---------------------------------------------------------------------------------- exits

PRELUDE = """\
import os, signal, sys, time
import ddpwatch
watcher = ddpwatch.attach()
for _ in range(3):
    ddpwatch.step(0.5)
time.sleep(0.6)  # a heartbeat: the server knows the rank before it ends
"""


def run_rank(
    server: LiveServer, tmp_path: Path, body: str, before: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run ``before + PRELUDE + body`` as rank 1 of 2, as a script, reporting to ``server``."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(before) + PRELUDE + textwrap.dedent(body))
    env = {
        **os.environ,
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "DDPWATCH_ADDR": f"127.0.0.1:{server.port}",
    }
    return subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        # SIGINT as a terminal gives it: a suite started from `pytest &` hands it ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def ended(server: LiveServer) -> dict[str, Any]:
    """Rank 1's status entry once its exit event has arrived."""

    def find(status: dict[str, Any]) -> dict[str, Any] | None:
        # judged on the document itself: the live state can take the exit after the document
        # was made, which then still shows the rank running (seen once in a loaded full run)
        entry = next((r for r in status["ranks"] if r["rank"] == 1), None)
        return entry if entry is not None and entry.get("ended_at") is not None else None

    return server.wait_for(find, timeout=10)


EXITS = {
    "sys.exit(3)": ("sys.exit(3)", 3, None, "exited", 3),
    "sys.exit(message)": ("sys.exit('fatal: no data in /shards')", 1, None, "exited", 1),
    "sys.exit()": ("sys.exit()", 0, None, "exited", 0),
    "sys.exit(-1)": ("sys.exit(-1)", 255, None, "exited", 255),
    "exit(5)": ("exit(5)", 5, None, "exited", 5),
    "return": ("x = 1", 0, None, "exited", 0),
    # SystemExit raised directly: the process ends with 4, the agent cannot see the code
    "raise SystemExit(4)": ("raise SystemExit(4)", None, None, "exited", 4),
    "caught, went on": (
        """
        try:
            sys.exit(3)
        except SystemExit:
            pass
        ddpwatch.step(0.4)  # training went on after it
        """,
        0, None, "exited", 0,
    ),
    "uncaught exception": ("raise RuntimeError('CUDA error: an illegal memory access')",
                           1, None, "crashed", 1),
    "SIGTERM": ("os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)",
                -15, "SIGTERM", "stopped", -15),
    "SIGINT": ("os.kill(os.getpid(), signal.SIGINT); time.sleep(5)",
               -2, "SIGINT", "stopped", -2),
    "os._exit(7)": ("os._exit(7)", 7, None, "exited", 7),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EXITS))
def test_the_exit_event_carries_the_real_outcome(
    case: str, live_server: LiveServer, tmp_path: Path
) -> None:
    body, code, signal_name, state, returncode = EXITS[case]
    result = run_rank(live_server, tmp_path, body)
    assert result.returncode == returncode, result.stderr  # ddpwatch changes nothing here
    entry = ended(live_server)
    assert (entry["exit_code"], entry["exit_signal"]) == (code, signal_name)
    assert entry["state"] == state
    assert entry["step"] == (4 if case == "caught, went on" else 3)
    if case == "sys.exit(message)":
        assert "fatal: no data in /shards" in result.stderr  # Python still prints it


def test_a_signal_the_program_handles_itself_keeps_its_exit_code(
    live_server: LiveServer, tmp_path: Path
) -> None:
    before = """
    import signal, sys
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a graceful shutdown, set up first
    """
    body = "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(5)\n"
    result = run_rank(live_server, tmp_path, body, before)
    assert result.returncode == 0, result.stderr
    entry = ended(live_server)
    assert (entry["exit_code"], entry["exit_signal"], entry["state"]) == (0, "SIGTERM", "stopped")


def os_exit_takes(server_port: int, tmp_path: Path) -> tuple[float, int, str]:
    """Seconds from ``os._exit(9)`` to the process being gone, its status and its stdout."""
    script = tmp_path / "rank.py"
    body = (
        "print('exiting', flush=True)\ntry:\n    os._exit(9)\nfinally:\n    print('not reached')\n"
    )
    script.write_text(PRELUDE + body)
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2",
           "DDPWATCH_ADDR": f"127.0.0.1:{server_port}"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "exiting\n"
    started = time.monotonic()
    rest = proc.stdout.read()
    returncode = proc.wait(30)
    return time.monotonic() - started, returncode, rest


def test_os_exit_reports_within_a_second_and_still_exits(
    live_server: LiveServer, tmp_path: Path
) -> None:
    took, returncode, rest = os_exit_takes(live_server.port, tmp_path)
    assert returncode == 9 and "not reached" not in rest
    assert took < 1.2
    assert ended(live_server)["exit_code"] == 9


def test_os_exit_without_a_server_does_not_wait(port: int, tmp_path: Path) -> None:
    took, returncode, _ = os_exit_takes(port, tmp_path)  # nobody listens on this port
    assert returncode == 9 and took < 1.2


def test_a_forked_child_exiting_is_not_the_rank_exiting(
    live_server: LiveServer, tmp_path: Path
) -> None:
    body = """
    pid = os.fork()
    if pid == 0:
        os._exit(9)  # a worker process ending: not rank 1
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    ddpwatch.step(0.4)
    sys.exit(2)
    """
    result = run_rank(live_server, tmp_path, body)
    assert result.returncode == 2, result.stderr
    entry = ended(live_server)
    assert entry["exit_code"] == 2 and entry["step"] == 4


def test_crash_and_exit_name_the_collective_that_raised(
    live_server: LiveServer, tmp_path: Path
) -> None:
    body = """
    import torch, torch.distributed as dist
    dist.all_reduce(torch.ones(3))  # no process group: raises inside the wrapper
    """
    result = run_rank(live_server, tmp_path, body)
    assert result.returncode == 1
    entry = ended(live_server)
    assert entry["state"] == "crashed" and entry["exit_code"] == 1
    assert entry["error"]["type"] == "ValueError"
    final = entry["final_collective"]
    assert final is not None and final["op"] == "all_reduce" and final["shape"] == [3]


def test_a_signal_names_the_collective_the_rank_was_in(
    live_server: LiveServer, tmp_path: Path
) -> None:
    body = """
    watcher.progress.enter_collective("barrier")  # as the barrier wrapper does on entry
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    """
    result = run_rank(live_server, tmp_path, body)
    assert result.returncode == -15
    entry = ended(live_server)
    assert entry["exit_signal"] == "SIGTERM" and entry["final_collective"]["op"] == "barrier"


def test_exit_status_follows_python() -> None:
    assert [exit_status(c) for c in (None, 0, 3, True, "boom", 3.5)] == [0, 0, 3, 1, 1, 1]
    assert exit_status(256) == 0 and exit_status(-1) == 255  # what the parent process sees


def test_exit_wrappers_are_restored_by_detach(rank_env_port: int) -> None:
    originals = (sys.exit, os._exit, type(exit).__call__, torch.autograd.backward)
    ddpwatch.attach(addr=f"127.0.0.1:{rank_env_port}")
    assert sys.exit is not originals[0] and os._exit is not originals[1]
    assert torch.autograd.backward is not originals[3]
    ddpwatch.detach()
    assert (sys.exit, os._exit, type(exit).__call__, torch.autograd.backward) == originals


@pytest.fixture
def rank_env_port(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield free_port_pair()
    ddpwatch.detach()


# ------------------------------------------------------------------------- the loss buffer


def read(reader: LossReader, losses: list[tuple[int, Any]]) -> tuple[float | None, int | None]:
    """Submit (step, loss) pairs as the training thread does, then one heartbeat's read."""
    for step, loss in losses:
        reader.submit(loss, step)
    return reader.poll(), reader.nan_step


def steps(first: int, last: int, bad: set[int], value: float = NAN) -> list[tuple[int, Any]]:
    return [(s, torch.tensor(value if s in bad else 1.0 / s)) for s in range(first, last + 1)]


def test_a_nan_between_two_heartbeats_is_found_at_its_step() -> None:
    reader = LossReader()
    assert read(reader, steps(1, 10, set())) == (pytest.approx(0.1), None)
    loss, nan_step = read(reader, steps(11, 40, set(range(17, 41))))
    assert nan_step == 17 and loss != loss  # the latest value is reported too: NaN
    assert read(reader, steps(41, 50, set(range(41, 51))))[1] == 17  # the same run goes on


def test_inf_counts_and_a_finite_loss_ends_the_run() -> None:
    reader = LossReader()
    assert read(reader, steps(1, 9, {5, 6, 7}, float("inf")))[1] is None  # ended within the beat
    assert read(reader, steps(10, 12, {11, 12}, float("-inf")))[1] == 11
    assert read(reader, [(13, 2.0)]) == (2.0, None)
    assert read(reader, [(14, NAN), (14, 1.0)])[1] is None  # the step's last loss was finite
    assert read(reader, [(15, 1.0), (15, float("nan"))])[1] == 15


def test_python_numbers_non_scalars_and_unknown_steps() -> None:
    reader = LossReader()
    assert read(reader, [(1, 3), (2, torch.ones(3))]) == (3.0, None)  # non-scalar: ignored
    assert read(reader, [(3, torch.tensor(NAN, dtype=torch.bfloat16))])[1] == 3
    reader = LossReader()  # no progress: losses submitted without a step
    reader.submit(torch.tensor(NAN))
    value = reader.poll()
    assert value != value and reader.nan_step is None  # NaN, at no step anyone can name


def test_overflow_keeps_the_newest_and_never_names_a_step_it_cannot_know() -> None:
    reader = LossReader(size=8)
    # 20 losses in one beat: the 12 oldest go; the run starts inside what is kept: exact
    assert read(reader, steps(1, 20, set(range(16, 21))))[1] == 16
    assert reader.dropped == 12
    assert read(reader, steps(21, 22, set()))[1] is None
    # the run began among the dropped losses: unknown, not the first step that was kept
    assert read(reader, steps(23, 40, set(range(25, 41))))[1] is None
    assert read(reader, steps(41, 42, {41, 42}))[1] is None  # still that run: still unknown
    assert read(reader, steps(43, 45, {45}))[1] == 45  # a new run after a finite loss: exact
    # a known run that overflows again is assumed to have gone on
    assert read(reader, steps(46, 70, set(range(46, 71))))[1] == 45


def test_steps_follow_how_the_rank_counts() -> None:
    progress = Progress()
    progress.loss.submit(torch.tensor(NAN))  # before any step ends: step 1 is in progress
    assert (progress.loss.poll(), progress.loss.nan_step)[1] == 1
    progress = Progress()
    for _ in range(16):
        progress.end_step(torch.tensor(1.0))  # ddpwatch.step(loss): steps 1..16
    progress.end_step(torch.tensor(NAN))  # ends step 17 with this loss
    progress.loss.poll()
    assert progress.step == 17 and progress.loss.nan_step == 17
    progress = Progress()
    progress.end_step(None, mode="forward")  # forward counting: step 1 ended at the forward
    progress.loss.submit(torch.tensor(NAN))  # its backward: still step 1
    progress.loss.poll()
    assert progress.loss.nan_step == 1


def test_a_loss_with_a_graph_is_held_detached() -> None:
    weight = torch.ones(2, requires_grad=True)
    reader = LossReader()
    reader.submit((weight * 2).sum(), 1)
    ((_, held),) = reader._pending
    assert not held.requires_grad and held.grad_fn is None


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeCudaLoss:
    """What the reader asks of a CUDA tensor: metadata only, never its value."""

    is_cuda = True
    requires_grad = False
    device = "cuda:0"

    def __init__(self, value: float) -> None:
        self.value = value

    def numel(self) -> int:
        return 1

    def is_floating_point(self) -> bool:
        return True

    def __float__(self) -> float:
        raise AssertionError("read on the host: a device sync")


def test_cuda_losses_are_read_only_once_their_copy_has_completed(monkeypatch) -> None:
    events: list[FakeEvent] = []

    def start_copy(device: Any, tensors: list[FakeCudaLoss], indices: list[int]) -> Any:
        events.append(FakeEvent())
        return indices, torch.tensor([t.value for t in tensors]), events[-1]

    monkeypatch.setattr("ddpwatch.agent.loss._start_copy", start_copy)
    reader = LossReader()
    for step in range(1, 6):
        reader.submit(FakeCudaLoss(NAN if step >= 4 else 1.0), step)
    assert reader.poll() is None and reader.nan_step is None  # copy started, not complete
    reader.submit(FakeCudaLoss(2.0), 6)  # waits for the copy before it: order is kept
    assert reader.poll() is None and len(events) == 1
    events[0].done = True
    loss, nan_step = reader.poll(), reader.nan_step
    assert nan_step == 4 and loss != loss and len(events) == 2  # step 6's copy started
    events[1].done = True
    assert reader.poll() == 2.0 and reader.nan_step is None


# ---------------------------------------------------------------------- the backward wrapper


def test_backward_hands_over_the_loss_only_without_explicit_steps() -> None:
    progress = Progress()
    patches = Patches()
    original = torch.autograd.backward
    BackwardLoss(progress).install(patches, torch)
    try:
        weight = torch.ones(3, requires_grad=True)
        loss = (weight * NAN).sum()
        loss.backward()
        assert weight.grad is not None  # backward itself ran as always
        progress.end_step(mode="optimizer")
        progress.loss.poll()
        assert progress.loss.nan_step == 1
        (weight * 2).backward(torch.ones(3))  # not a scalar: not a loss
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.tensor(1.0).backward()  # the same error as without ddpwatch
        with pytest.raises(RuntimeError, match="second time"):
            loss.backward()
        progress.end_step(torch.tensor(1.0), mode="explicit")  # the user hands losses over
        (weight.sum() * NAN).backward()  # no longer read from backward
        progress.loss.poll()
        assert progress.loss.nan_step is None and progress.loss.value == 1.0
    finally:
        patches.restore()
    assert torch.autograd.backward is original


def test_backward_is_only_a_fallback_for_the_loss_a_model_returned() -> None:
    """HF-style models return their loss; scripts then divide it for gradient accumulation."""

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.weight * x).sum()}

    progress = Progress()
    hooks = ModelHooks(progress)
    patches = Patches()
    model = WithLoss()
    hooks.add_model(model)
    hooks.add_optimizer_hook()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    BackwardLoss(progress).install(patches, torch)
    try:
        (model(torch.tensor([1.0, 2.0]))["loss"] / 4).backward()
        assert progress.loss.poll() == 3.0  # the model's loss, not the divided one
        optimizer.step()
        (model.weight.sum() * 0.5).backward()  # step 2 had no model output: backward's loss
        assert progress.loss.poll() == 1.0
    finally:
        patches.restore()
        hooks.remove()


def test_backward_through_a_grad_scaler_reports_the_unscaled_loss() -> None:
    progress = Progress()
    patches = Patches()
    BackwardLoss(progress).install(patches, torch)
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        weight = torch.ones(2, requires_grad=True)
        scaler.scale((weight * 1.5).sum()).backward()
        assert progress.loss.poll() == 3.0  # not 3072
    finally:
        patches.restore()


# -------------------------------------------------------------------------------- real jobs


def rank_entries(server: LiveServer) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for r in as_json(server.server.status())["ranks"]}


@pytest.mark.e2e
def test_zero_code_nan_is_found_from_backward(live_server: LiveServer) -> None:
    result = ddpwatch_run(
        live_server, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={free_port_pair()}",
        str(SCRIPTS / "nan_unmodified.py"), "--rank", "1", "--at", "12",
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    entries = live_server.wait_for(
        lambda s: rank_entries(live_server) if len(s["ranks"]) == 2 and all(
            r["state"] == "exited" for r in s["ranks"]) else None, timeout=10,
    )  # fmt: skip
    assert (entries[1]["nan_step"], entries[1]["nan_exact"]) == (12, True)
    assert (entries[0]["nan_step"], entries[0]["nan_exact"]) == (13, True)
    assert entries[1]["step"] == 40  # counted from optimizer.step(), no ddpwatch.step() call
