"""Integrations: Lightning, DeepSpeed, Hugging Face (each skipped where it is not installed).

Real jobs: a Lightning ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` fit that
Lightning launches itself, and a two-rank DeepSpeed engine on gloo (no compiled ops).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS, LiveServer, alert_of, as_json, free_port_pair

import ddpwatch
from ddpwatch.agent.api import WatcherSurface
from ddpwatch.agent.patches import Patches
from ddpwatch.agent.progress import Progress
from ddpwatch.demo.runner import stop_job
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.integrations import adapt, framework_of
from ddpwatch.integrations.shared import PhaseStack
from ddpwatch.jobs.launch import job_environment

torch = pytest.importorskip("torch")

LIGHTNING_FIT = SCRIPTS / "lightning_fit.py"


# --------------------------------------------------------------------------- helpers


def fake_class(module: str, name: str, base: type = object) -> type:
    return type(name, (base,), {"__module__": module})


class RecordingWatcher:
    """The Watcher API the integrations use (``WatcherSurface``), recording calls (no
    threads, no sockets); step counting and losses are the agent's own ``Progress``."""

    def __init__(self) -> None:
        self.progress = Progress()
        self.active = True
        self.phases: list[str] = []
        self.checkpoints: list[str] = []
        self.models: list[Any] = []
        self.patches = Patches()

    @property
    def in_startup(self) -> bool:
        return self.progress.step is None

    def step(self, loss: Any = None) -> None:
        self.progress.end_step(loss, mode="explicit")

    def submit_loss(self, loss: Any) -> None:
        self.progress.loss.submit(loss)

    def note_forward(self) -> None:
        self.progress.note_forward()

    def count_steps_explicitly(self) -> None:
        self.progress.count_steps_explicitly()

    def claim_steps(self, owner: Any) -> bool:
        return self.progress.claim_steps(owner)

    def release_steps(self, owner: Any) -> None:
        self.progress.release_steps(owner)

    def set_phase(self, name: str) -> None:
        self.phases.append(name)
        self.progress.set_phase(name)

    def phase(self, name: str) -> Any:
        import contextlib

        @contextlib.contextmanager
        def block() -> Any:
            previous = self.progress.phase
            self.set_phase(name)
            self.progress.pinned += 1
            try:
                yield
            finally:
                self.progress.pinned -= 1
                self.set_phase(previous)

        return block()

    def checkpoint(self, path: str) -> None:
        self.checkpoints.append(path)

    def add_model(self, model: Any) -> None:
        self.models.append(model)
        adapt(self, model)


@pytest.fixture
def rank_env(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("DDPWATCH_LOG_TAIL", "0")
    yield
    ddpwatch.detach()


@pytest.fixture
def phase_trace(monkeypatch) -> list[str]:
    """Every phase a Progress enters, in order (consecutive repeats folded)."""
    seen: list[str] = []
    original = Progress.set_phase

    def set_phase(self: Progress, name: str) -> None:
        if not seen or seen[-1] != name:
            seen.append(name)
        original(self, name)

    monkeypatch.setattr(Progress, "set_phase", set_phase)
    return seen


def in_order(seen: list[str], expected: list[str]) -> bool:
    """``expected`` is a subsequence of ``seen``."""
    remaining = iter(seen)
    return all(name in remaining for name in expected)


def finish(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_job(proc, grace=2.0)
        out, _ = proc.communicate()
        raise AssertionError(f"job did not finish in {timeout} s:\n{out[-4000:]}") from None
    return out


def base_env(port: int) -> dict[str, str]:
    return {
        **os.environ,
        "DDPWATCH_ADDR": f"127.0.0.1:{port}",
        "DDPWATCH_STACK_AFTER": "1.0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port_pair()),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def start(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def traces(folder: Path) -> dict[int, dict[str, Any]]:
    return {
        int(path.stem.removeprefix("rank")): json.loads(path.read_text())
        for path in folder.glob("rank*.json")
    }


# --------------------------------------------------------------------------- plumbing


def test_framework_objects_are_recognised_by_class_name_without_imports() -> None:
    engine_cls = fake_class("deepspeed.runtime.engine", "DeepSpeedEngine")
    pipe_cls = fake_class("deepspeed.runtime.pipe.engine", "PipelineEngine", engine_cls)
    assert framework_of(engine_cls()) == "deepspeed"
    assert framework_of(pipe_cls()) == "deepspeed"
    assert framework_of(fake_class("lightning.pytorch.trainer.trainer", "Trainer")()) == (
        "lightning_trainer"
    )
    assert framework_of(fake_class("pytorch_lightning.core.module", "LightningModule")()) == (
        "lightning_module"
    )
    assert framework_of(fake_class("transformers.trainer", "Trainer")()) == "hf_trainer"
    assert framework_of(fake_class("accelerate.accelerator", "Accelerator")()) == "accelerator"
    assert framework_of(fake_class("mylib", "DeepSpeedEngine")()) is None
    assert framework_of(torch.nn.Linear(2, 2)) is None
    watcher = RecordingWatcher()
    assert adapt(watcher, torch.nn.Linear(2, 2)) is False  # plain modules get forward hooks


def test_method_patches_wrap_instances_and_classes_and_restore_them() -> None:
    class Thing:
        def work(self, x: int) -> int:
            return x * 2

    calls: list[Any] = []
    thing = Thing()
    patches = Patches()
    assert patches.wrap(
        thing,
        "work",
        before=lambda x: calls.append(("before", x)),
        after=lambda result, x: calls.append(("after", result)),
    )
    assert not patches.wrap(thing, "work")  # never twice
    assert thing.work(3) == 6
    assert calls == [("before", 3), ("after", 6)]
    patches.wrap(Thing, "work", before=lambda *_: 1 / 0)  # a fault in ddpwatch is swallowed
    assert Thing().work(4) == 8
    patches.restore()
    assert "work" not in vars(thing)
    assert Thing.work.__name__ == "work" and not getattr(Thing.work, "__ddpwatch__", False)


def test_method_patches_hold_a_phase_around_a_call_even_when_it_raises() -> None:
    watcher = RecordingWatcher()
    watcher.set_phase("train")

    class Saver:
        def save(self, fail: bool) -> None:
            assert watcher.progress.phase == "checkpoint"
            if fail:
                raise OSError("disk full")

    saver = Saver()
    Patches().wrap(saver, "save", around=lambda *_: watcher.phase("checkpoint"))
    saver.save(False)
    with pytest.raises(OSError):
        saver.save(True)
    assert watcher.progress.phase == "train" and watcher.progress.pinned == 0


def test_phase_stack_closes_what_it_opened() -> None:
    watcher = RecordingWatcher()
    watcher.set_phase("data")
    phases = PhaseStack()
    phases.push(watcher, "validation")
    assert watcher.progress.phase == "validation" and watcher.progress.pinned == 1
    phases.pop("test")  # not open: nothing happens
    phases.pop("validation")
    assert watcher.progress.phase == "data" and watcher.progress.pinned == 0
    phases.push(watcher, "sanity_check")
    phases.close_all()
    assert watcher.progress.pinned == 0


def test_only_one_integration_counts_the_steps_of_a_watcher() -> None:
    watcher = RecordingWatcher()

    class Owner:
        pass

    first, second = Owner(), Owner()
    assert watcher.claim_steps(first)
    assert not watcher.claim_steps(second)
    assert watcher.claim_steps(first)
    watcher.release_steps(first)
    assert watcher.claim_steps(second)
    del second
    assert watcher.claim_steps(first)  # the owner is gone


def test_watcher_and_its_test_double_offer_the_integration_surface() -> None:
    from ddpwatch.agent.watcher import Watcher

    assert isinstance(RecordingWatcher(), WatcherSurface)
    watcher = Watcher(addr=f"127.0.0.1:{free_port_pair()}")  # not started: no threads
    assert isinstance(watcher, WatcherSurface)


# --------------------------------------------------------------------------- DeepSpeed, duck-typed


class FakeEngine:
    """DeepSpeed's documented engine interface: backward(loss), step(), global_steps,
    gradient accumulation boundaries every ``gas`` micro-batches."""

    def __init__(self, gas: int) -> None:
        self.gas = gas
        self.micro_steps = 0
        self.global_steps = 0

    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        return loss

    def step(self, lr_kwargs: Any = None) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.gas == 0:
            self.global_steps += 1


FakeEngine.__name__ = "DeepSpeedEngine"
FakeEngine.__module__ = "deepspeed.runtime.engine"


def test_deepspeed_engine_interface_counts_optimizer_steps_and_reads_backward_loss() -> None:
    watcher = RecordingWatcher()
    engine = FakeEngine(gas=2)
    assert adapt(watcher, engine) is False  # counted by the engine, forward hooks as well
    assert watcher.progress.step_mode == "explicit"
    for i in range(6):
        engine.backward(torch.tensor(float(i)))
        engine.step()
    assert watcher.progress.step == 3 == engine.global_steps
    assert watcher.progress.loss.poll() == 5.0
    # the global optimizer hook does not count on top
    watcher.progress.end_step(mode="optimizer")
    assert watcher.progress.step == 3
    adapt(watcher, engine)  # attaching twice wraps once
    engine.backward(torch.tensor(1.0))
    engine.step()
    engine.step()
    assert watcher.progress.step == 4


def test_deepspeed_initialize_gets_startup_phases_and_attaches_its_engine() -> None:
    from ddpwatch.integrations.deepspeed import hook_initialize

    watcher = RecordingWatcher()

    class Engine(FakeEngine):
        def __init__(self) -> None:
            super().__init__(gas=1)
            self._configure_zero_optimizer(None)

        def _configure_zero_optimizer(self, optimizer: Any) -> None:
            assert watcher.progress.phase == "zero_partition"

    Engine.__module__ = "deepspeed.runtime.engine"
    module = types.ModuleType("deepspeed")

    def initialize(**kwargs: Any) -> tuple[Any, ...]:
        assert watcher.progress.phase == "deepspeed_init"
        return Engine(), None, None, None

    module.initialize = initialize  # type: ignore[attr-defined]
    module.DeepSpeedEngine = Engine  # type: ignore[attr-defined]
    hook_initialize(watcher, module)
    engine, *_ = module.initialize(model=None)
    assert watcher.phases == ["deepspeed_init", "zero_partition", "first_step"]
    assert watcher.models == [engine]
    engine.backward(torch.tensor(2.0))
    engine.step()
    assert watcher.progress.step == 1
    watcher.patches.restore()
    assert module.initialize is initialize


# --------------------------------------------------------------------------- Lightning


@pytest.fixture
def pl() -> Any:
    return pytest.importorskip("lightning.pytorch")


def tiny_lightning_module(pl: Any) -> Any:
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.mse_loss(self.layer(x), y)
            self.losses.append(float(loss.detach()))
            return {"loss": loss}

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def loader(self) -> Any:
            x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    return Tiny()


def test_lightning_callback_in_process_counts_optimizer_steps_once(
    pl: Any, rank_env, tmp_path: Path, phase_trace: list[str]
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ddpwatch.integrations.lightning import DDPWatchCallback

    watcher = ddpwatch.attach(addr=f"127.0.0.1:{free_port_pair()}")
    assert watcher is not None
    reported: list[str] = []
    watcher.checkpoint = reported.append  # type: ignore[method-assign]
    model = tiny_lightning_module(pl)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        accumulate_grad_batches=2,
        limit_val_batches=2,
        val_check_interval=4,
        num_sanity_val_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1),
            DDPWatchCallback(),
        ],
    )
    assert sum(isinstance(c, DDPWatchCallback) for c in trainer.callbacks) == 1
    trainer.fit(model, model.loader(), model.loader())
    assert trainer.global_step == 6
    assert watcher.progress.step == 6  # optimizer steps, not the 12 batches; hooks don't add
    # the step's loss is the batch's own (Lightning hands over loss / accumulate_grad_batches)
    assert watcher.progress.loss.poll() == pytest.approx(model.losses[-1], rel=1e-5)
    assert in_order(
        phase_trace,
        [
            "setup",
            "configure_model",
            "strategy_setup",
            "fit_start",
            "sanity_check",
            "fit_start",
            "first_step",
            "validation",
            "checkpoint",
        ],
    ), phase_trace
    assert sorted(reported) == sorted(str(p) for p in tmp_path.glob("*.ckpt"))
    assert len(reported) == 2
    assert watcher.progress.pinned == 0
    # teardown put Lightning's own methods back
    assert "save_checkpoint" not in vars(trainer) and "setup" not in vars(model)


def test_install_auto_callback_gives_every_trainer_one_callback(pl: Any) -> None:
    from ddpwatch.integrations import lightning as integration

    integration.install_auto_callback()
    integration.install_auto_callback()  # idempotent
    callback_class = integration.DDPWatchCallback
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(trainer.callbacks[0], callback_class)
    assert trainer.callbacks[0].attach is False  # reports only to a watcher that exists
    mine = callback_class()
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, callbacks=[mine])
    assert [c for c in trainer.callbacks if isinstance(c, callback_class)] == [mine]
    # a trainer that lost it (or predates the hook) gets it back at fit/validate/test/predict
    trainer.callbacks.remove(mine)
    model = tiny_lightning_module(pl)
    trainer.validate(model, model.loader(), verbose=False)
    assert sum(isinstance(c, callback_class) for c in trainer.callbacks) == 1
    # attach(trainer) and attach(module) go through adapt
    watcher = RecordingWatcher()
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    trainer.callbacks.clear()
    assert adapt(watcher, trainer) is True
    assert sum(isinstance(c, callback_class) for c in trainer.callbacks) == 1
    assert adapt(watcher, model) is True


def test_lightning_callback_is_picklable_for_ddp_spawn(pl: Any) -> None:
    import pickle

    from ddpwatch.integrations.lightning import DDPWatchCallback

    callback = DDPWatchCallback(watcher=RecordingWatcher())
    copy = pickle.loads(pickle.dumps(callback))
    assert type(copy) is DDPWatchCallback and copy.attach is True and copy._watcher is None


@pytest.mark.e2e
def test_lightning_ddp_fit_reports_both_ranks(
    pl: Any, live_server: LiveServer, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {
        **base_env(live_server.port),
        "LIGHTNING_FIT_MODE": "callback",
        "LIGHTNING_FIT_TRACE": str(trace),
    }
    cmd = [sys.executable, str(LIGHTNING_FIT), "--steps", "16", "--ckpt-dir", str(tmp_path / "ck")]
    proc = start(cmd, env, tmp_path)
    out = finish(proc, 120)
    assert proc.returncode == 0, out[-4000:]
    time.sleep(1.0)
    status = as_json(live_server.server.status())
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    for rank in status["ranks"]:
        assert rank["step"] == 16, rank
        assert rank["loss"] is not None and rank["state"] == "exited"
    assert [c.alert.to_dict() for c in live_server.changes] == []
    reports = traces(trace)
    for rank in (0, 1):
        report = reports[rank]
        assert report["step"] == report["global_step"] == 16
        assert report["callbacks"].count("DDPWatchCallback") == 1
        assert in_order(
            report["phases"],
            [
                *("setup", "configure_model", "strategy_setup", "model_wrap", "fit_start"),
                *("sanity_check", "first_step", "validation", "checkpoint"),
            ],
        ), report["phases"]
    # only rank 0 writes Lightning's checkpoints: no conflict, and their paths are known
    written = sorted(str(p) for p in (tmp_path / "ck").glob("*.ckpt"))
    assert sorted(live_server.server.state.ranks[0].checkpoint_paths) == written
    assert live_server.server.state.ranks[1].checkpoint_paths == []


@pytest.mark.e2e
def test_lightning_setup_hang_on_one_rank_is_a_startup_hang(pl: Any, tmp_path: Path) -> None:
    """Under ``ddpwatch run`` (the ranks attach at init_process_group, the Trainer gets the
    callback from the post-import hook) rank 1 sleeps in ``LightningModule.setup``."""
    live = LiveServer(free_port_pair(), Thresholds(startup_after=3.0))
    env = job_environment(f"127.0.0.1:{live.port}", base_env(live.port))
    env.update(
        {
            "LIGHTNING_FIT_MODE": "auto",
            "LIGHTNING_FIT_SLEEP_RANK": "1",
            "LIGHTNING_FIT_SLEEP_S": "60",
        }
    )
    cmd = [sys.executable, str(LIGHTNING_FIT), "--ckpt-dir", str(tmp_path / "ck")]
    proc = start(cmd, env, tmp_path)
    try:

        def setup_hang(status: dict[str, Any]) -> Any:
            # the first ~2.5 s of its sleep, its CPU time is still seen growing (a note that
            # it works); then it is flat, and the rank hung
            alert = alert_of("startup_hang")(status)
            named = alert and alert["ranks"] == [1] and "'setup'" in alert["message"]
            return alert if named and "not hung" not in alert["message"] else None

        alert = live.wait_for(setup_hang, timeout=50)
        assert alert["ranks"] == [1], alert
        assert alert["waiting"] == [0], alert
        assert "rank 1 is still in 'setup'" in alert["message"]
        assert "rank 0 waits in 'configure_model'" in alert["message"]
        status = as_json(live.server.status())
        assert status["ranks"][1]["phase"] == "setup"
        assert status["ranks"][0]["phase"] == "configure_model"
        assert status["ranks"][0]["step"] is None
    finally:
        stop_job(proc, grace=2.0)
        proc.communicate()
        live.stop()


# --------------------------------------------------------------------------- DeepSpeed, for real

DEEPSPEED_JOB = textwrap.dedent(
    """
    import json, os, sys, time

    PHASES = []
    from ddpwatch.agent.progress import Progress
    _set_phase = Progress.set_phase

    def set_phase(self, name):
        if not PHASES or PHASES[-1] != name:
            PHASES.append(name)
        _set_phase(self, name)

    Progress.set_phase = set_phase

    import ddpwatch
    import torch

    watcher = ddpwatch.attach()
    # both ways in one job: rank 0 attaches its engine itself, rank 1 leaves it to the hook
    mode = "explicit" if os.environ["RANK"] == "0" else "auto"
    if mode == "auto":  # what Watcher.start is to do: hook deepspeed.initialize
        from ddpwatch.integrations import install
        install(watcher)

    import deepspeed
    import deepspeed.ops

    # CPU: skip the shared-memory all-reduce op, which DeepSpeed would compile here (JIT)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    if mode == "explicit":
        ddpwatch.attach(engine)
    losses = []
    for i in range(24):  # 12 optimizer steps of 2 micro-batches
        x = torch.randn(2, 8)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(1, keepdim=True))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        time.sleep(0.05)
    time.sleep(1.0)
    report = {
        "mode": mode,
        "phases": PHASES,
        "global_steps": engine.global_steps,
        "step": watcher.progress.step,
        "loss": watcher.progress.loss.value,
        "last_loss": losses[-1],
        "forwards": watcher.progress.forwards,
    }
    with open(os.path.join(os.environ["TRACE"], f"rank{engine.global_rank}.json"), "w") as f:
        json.dump(report, f)
    """
)


@pytest.mark.e2e
def test_deepspeed_engine_on_cpu_reports_steps_loss_and_phases(
    live_server: LiveServer, tmp_path: Path
) -> None:
    """Rank 0 attaches its engine (``ddpwatch.attach(engine)``), rank 1 leaves it to the hook
    on ``deepspeed.initialize`` (what the zero-code agent installs): one job, both ways."""
    pytest.importorskip("deepspeed")
    script = tmp_path / "ds_job.py"
    script.write_text(DEEPSPEED_JOB)
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {**base_env(live_server.port), "TRACE": str(trace), "DS_ACCELERATOR": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={env['MASTER_PORT']}",
        str(script),
    ]
    proc = start(cmd, env, tmp_path)
    out = finish(proc, 150)
    assert proc.returncode == 0, out[-4000:]
    reports = traces(trace)
    assert sorted(reports) == [0, 1], out[-4000:]
    for rank, report in reports.items():
        assert report["global_steps"] == 12
        assert report["step"] == 12, report  # optimizer steps, not the 24 micro-batches
        assert report["loss"] == pytest.approx(report["last_loss"], rel=1e-5)
        assert report["forwards"] == 24
        assert report["mode"] == ("explicit" if rank == 0 else "auto")
        if report["mode"] == "auto":
            assert in_order(
                report["phases"], ["rendezvous", "setup", "deepspeed_init", "zero_partition"]
            ), report["phases"]
        status_rank = live_server.wait_for(
            lambda s, rank=rank: next(
                (r for r in s["ranks"] if r["rank"] == rank and r["step"] == 12), None
            ),
            timeout=10,
        )
        assert status_rank["loss"] is not None
    assert [c.alert.to_dict() for c in live_server.changes] == []


# --------------------------------------------------------------------------- Hugging Face


class StandIn:
    """TrainingArguments / TrainerState / TrainerControl: the fields the callback reads."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def test_trainer_callback_logic_against_the_documented_signatures(tmp_path: Path) -> None:
    from ddpwatch.integrations.huggingface import TrainerCallbackLogic

    watcher = RecordingWatcher()
    callback = TrainerCallbackLogic(watcher=watcher, attach=False)
    args = StandIn(output_dir=str(tmp_path), should_save=True)
    state = StandIn(global_step=0)
    control = StandIn()
    callback.on_train_begin(args, state, control, model=None, optimizer=None)
    assert watcher.progress.step_mode == "explicit" and watcher.phases == ["first_step"]
    for step in range(1, 4):
        for _micro in range(2):  # gradient accumulation: on_substep_end, then on_step_end
            callback.add_loss(torch.tensor(0.5 * step))
        state.global_step = step
        callback.on_step_end(args, state, control)
    assert watcher.progress.step == 3
    assert watcher.progress.loss.poll() == pytest.approx(3.0)
    callback.on_log(args, state, control, logs={"loss": 1.25})
    assert watcher.progress.loss.poll() == 1.25
    callback.on_prediction_step(args, state, control)
    callback.on_prediction_step(args, state, control)
    assert watcher.progress.phase == "evaluation" and watcher.progress.forwards == 2
    callback.on_evaluate(args, state, control, metrics={})
    assert watcher.progress.pinned == 0
    callback.on_save(args, state, control)
    assert watcher.checkpoints == [str(tmp_path / "checkpoint-3")]
    callback.on_save(StandIn(output_dir=str(tmp_path), should_save=False), state, control)
    assert len(watcher.checkpoints) == 1  # only ranks that write report the directory
    callback.on_train_end(args, state, control)


def test_transformers_trainer_real_fit(rank_env, tmp_path: Path, phase_trace: list[str]) -> None:
    transformers = pytest.importorskip("transformers")
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
            out = self.layer(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    generator = torch.Generator().manual_seed(0)
    data = [
        {"x": v, "labels": v.sum(0, keepdim=True)} for v in torch.randn(32, 4, generator=generator)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=Tiny(), args=args, train_dataset=data, eval_dataset=data[:8]
    )
    watcher = ddpwatch.attach(trainer, addr=f"127.0.0.1:{free_port_pair()}")
    assert watcher is not None
    reported: list[str] = []
    watcher.checkpoint = reported.append  # type: ignore[method-assign]
    trainer.train()
    assert trainer.state.global_step == 4
    assert watcher.progress.step == 4  # optimizer steps; the optimizer hook adds nothing
    assert watcher.progress.loss.poll() is not None
    assert in_order(phase_trace, ["first_step", "evaluation"]), phase_trace
    folders = [p for p in reported if Path(p).is_dir()]  # the files come from torch.save
    assert folders == [str(tmp_path / "checkpoint-2"), str(tmp_path / "checkpoint-4")]


def test_accelerator_backward_hands_over_the_loss(rank_env) -> None:
    accelerate = pytest.importorskip("accelerate")
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{free_port_pair()}")
    assert watcher is not None
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    ddpwatch.attach(accelerator)
    for _ in range(3):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert watcher.progress.step == 3  # the optimizer hook counts
    assert watcher.progress.loss.poll() == pytest.approx(float(loss.detach()))
