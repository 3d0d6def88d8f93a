"""The Watcher: one per process, tying progress, hooks and the publisher together."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from ddpwatch.agent import early, hostmem, registry, switches
from ddpwatch.agent.auto import after_import
from ddpwatch.agent.blackbox import BlackBox
from ddpwatch.agent.calls import CallDigests
from ddpwatch.agent.collectives import (
    CollectiveWrappers,
    FlightRecorder,
    ensure_flight_recorder,
    pg_name,
)
from ddpwatch.agent.compiling import CompileWatch, in_compile_stack
from ddpwatch.agent.hooks import BackwardLoss, ModelHooks, ProcessHooks
from ddpwatch.agent.identity import (
    RankIdentity,
    identity_from_env,
    init_method_of,
    read_rendezvous_env,
    refresh_from_torch,
)
from ddpwatch.agent.logtail import LogTail
from ddpwatch.agent.patches import Patches
from ddpwatch.agent.probes import device_info, memory_info, note_current_device
from ddpwatch.agent.progress import Progress, SplitReader
from ddpwatch.agent.publisher import Publisher
from ddpwatch.agent.split import GradReady, InputTimer
from ddpwatch.agent.where import HOOK_PHASES, LOOK_AFTER_S, stack_phase
from ddpwatch.core.ports import resolve_endpoint
from ddpwatch.core.protocol import (
    PROTOCOL_VERSION,
    AnyMessage,
    Collective,
    CollectiveCounts,
    ErrorInfo,
    Event,
    Hello,
    Sample,
)
from ddpwatch.core.vocabulary import EventKind, Phase

log = logging.getLogger("ddpwatch")

RANK_WAIT_S = 10.0
LOG_EVERY_S = 2.0  # new output lines ship at most this often
IDENTITY_EVERY = 10
"""Heartbeats carry the identity when it changed, after each new connection, and at least
every this many beats (a safety net); the server keeps the last one it was told."""
STACK_AFTER_S = 5.0  # half the server's default stall threshold
MOVING_STACK_EVERY_S = 2.0  # a rank working without a step: its stack at most this often
COMPILE_LOOK_AFTER_S = 1.0
"""Without torch's compile callbacks: how long a rank idles before its stack is read for a
compilation (a cold compile takes seconds; a healthy step is not read at all)."""
CRASH_FLUSH_S = 1.0  # the most a crash or an exit waits for its report to leave
FINAL_SAMPLE_WAIT_S = 0.1  # for a heartbeat being built on the publisher thread
_BEFORE_TRAINING = (Phase.STARTED, Phase.SETUP, Phase.FIRST_STEP)  # "train" once a step ends


class Watcher:
    """Watches one training process. Create it with ``ddpwatch.attach``."""

    def __init__(self, addr: str | None = None, interval: float = 0.5) -> None:
        self.endpoint = resolve_endpoint(addr)
        self.interval = interval
        self.progress = Progress()
        self.progress.on_step = note_current_device  # CUDA's current device is per thread
        self.identity: RankIdentity = identity_from_env()
        self.stack_after = float(os.environ.get("DDPWATCH_STACK_AFTER", STACK_AFTER_S))
        self._dist: Any = None
        self._dist_ready = False
        self._model_hooks = ModelHooks(self.progress)
        self._wrappers = CollectiveWrappers(self.progress)
        self._flight_recorder: FlightRecorder | None = None
        self._backward_loss = BackwardLoss(self.progress)
        self._grad_ready = GradReady(self.progress)  # where the step goes: ``agent/split.py``
        self.probes = switches.from_env()  # the parts switched off (``agent/switches.py``)
        self._split_on = self.probes.on("split")
        self.progress.grads.enabled = self.probes.on("grads")
        self._model_hooks.on_optimizer = self._grad_ready.backward_ended
        self._input_timer = InputTimer(
            self.progress, timing=self._split_on, counting=self.probes.on("batches")
        )
        self._split = SplitReader(self.progress, device_waits=self._grad_ready.collect)
        self._calls = CallDigests(self.progress)
        self._process_hooks = ProcessHooks(
            self._report_crash, self._report_exit, mark=lambda: self.progress.step
        )
        self._beat_lock = threading.Lock()  # one sample built at a time (heartbeat or exit)
        self._final_sent = False
        self.patches = Patches()  # undone by detach; integrations wrap through it too
        self._compile = CompileWatch(self.progress, self._enter_phase, self.patches)
        self._log_tail = LogTail()
        self._next_log = 0.0
        self._detached = False
        self._phase_before_device: str = Phase.STARTED
        self._main_thread = threading.main_thread().ident
        self._last_stack: str | None = None
        self._stack_step: int | None = None
        self._step_seen_at = time.monotonic()  # when this thread saw the step change
        self._stack_sent_at = 0.0
        self._exited = False
        self._pid = os.getpid()
        self._started = time.monotonic()
        self._sent_identity: dict[str, Any] | None = None
        self._identity_connections = 0
        self._beats_since_identity = 0
        self.publisher = Publisher(self.endpoint, interval, self._heartbeat)
        self.active = False

    # lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self._hook_torch()
        self._process_hooks.install(self.patches)
        if os.environ.get("DDPWATCH_LOG_TAIL", "1") != "0":
            self._log_tail.install()
        if self.probes.on("publisher"):
            self.publisher.start()
        early.hand_over()  # the early hello's sender (boot hook) stops: this one beats now
        self._open_box()
        if self.identity.rank is not None:
            self.publisher.publish(
                Hello(v=PROTOCOL_VERSION, rank=self.rank, t=time.time(), **self._identity_fields())
            )
        self.active = True

    def detach(self) -> None:
        """Remove every hook, restore wrapped functions and stop the publisher thread."""
        if not self.active:
            return
        self.active = False
        self._detached = True
        self._model_hooks.remove()
        self._grad_ready.remove()
        self._compile.remove()
        self._process_hooks.remove()
        self.patches.restore()
        self._log_tail.remove()
        if self._dist is not None:
            self._wrappers.restore(self._dist)
        if os.getpid() == self._pid:
            self.publisher.stop()
            self._close_box()

    def add_model(self, model: Any) -> None:
        """Hook a module (forward hooks), or a framework object an integration knows."""
        if not registry.adapt(self, model):
            self._model_hooks.add_model(model)
            if self._split_on:
                self._grad_ready.add_model(model)

    @property
    def rank(self) -> int:
        return self.identity.rank if self.identity.rank is not None else 0

    # training-thread API ---------------------------------------------------
    def step(self, loss: Any = None) -> None:
        """Mark the end of a training step; ``loss`` may be a tensor (read later, no sync)."""
        try:  # every step: no context manager
            self.progress.end_step(loss, mode="explicit")
        except Exception:
            pass

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label what the rank is doing, e.g. ``with watcher.phase("eval"):``."""
        previous = self.progress.phase
        self._enter_phase(name)
        self.progress.pinned += 1
        try:
            yield
        finally:
            self.progress.pinned -= 1
            self._enter_phase(previous)

    def set_phase(self, name: str) -> None:
        """Enter phase ``name`` until the next phase change (for integrations and startup)."""
        self._enter_phase(name)

    @property
    def in_startup(self) -> bool:
        """No step counted yet."""
        return self.progress.step is None

    def submit_loss(self, loss: Any) -> None:
        """Hand over the loss of the step in progress without ending the step."""
        try:  # every step: no context manager
            self.progress.loss.submit(loss)
        except Exception:
            pass

    def note_forward(self) -> None:
        """Count an evaluation batch as progress (no step)."""
        try:  # every step: no context manager
            self.progress.note_forward()
        except Exception:
            pass

    def count_steps_explicitly(self) -> None:
        """From now on steps come from ``step()`` alone (for integrations)."""
        self.progress.count_steps_explicitly()

    def claim_steps(self, owner: Any) -> bool:
        """Whether integration ``owner`` counts the steps: the first to ask does."""
        return self.progress.claim_steps(owner)

    def release_steps(self, owner: Any) -> None:
        self.progress.release_steps(owner)

    def checkpoint(self, path: str) -> None:
        """Report that this rank writes a checkpoint to ``path`` (checkpoint_conflict)."""
        with contextlib.suppress(Exception):
            if self.active:
                self.publisher.publish(
                    self._event(EventKind.CHECKPOINT, path=str(path), step=self.progress.step)
                )

    def _enter_phase(self, name: str) -> None:
        try:
            self.progress.set_phase(name)
            if self.active:
                self.publisher.publish(
                    self._event(EventKind.PHASE, phase=name, step=self.progress.step)
                )
        except Exception:
            pass

    # torch -------------------------------------------------------------------
    def _hook_torch(self) -> None:
        """Hook torch now if the program imported it, else the moment it does: a script that
        never imports torch does not pay its ~1.5 s import for being watched."""
        after_import("torch", self._on_torch)

    def _on_torch(self, torch: Any) -> None:
        if self._detached:
            return
        import torch.distributed as dist

        self._model_hooks.add_optimizer_hook()
        self._patch_startup(torch)
        self._compile.install()
        if not dist.is_available():
            return
        self._dist = dist
        if self.probes.on("collectives"):
            self._wrappers.install(dist)
        if dist.is_initialized():
            self._on_group_ready()
            note_current_device()
        else:
            ensure_flight_recorder(torch.__version__)
            self.patches.wrap(
                dist,
                "init_process_group",
                before=lambda *a, **k: self._before_init(dist.init_process_group, a, k),
                after=lambda *_, **__: self._after_init(),
            )

    def _patch_startup(self, torch: Any) -> None:
        """Startup phases (device, model_wrap) and checkpoint writes, from the calls themselves."""
        patches = self.patches
        patches.wrap(
            torch.cuda, "set_device", before=self._before_set_device, after=self._after_set_device
        )
        patches.wrap(torch, "save", before=self._before_save)
        # zero-code loss: what backward() is run on; the end of each backward: the step split
        ended = self._grad_ready.backward_ended if self._split_on else None
        self._backward_loss.install(patches, torch, ended)
        if self._split_on or self.probes.on("batches"):  # DataLoaders: time, batches drawn
            after_import("torch.utils.data.dataloader", self._time_data_loaders)
        self._wrap_model_class(torch.nn.parallel, "DistributedDataParallel")
        after_import(
            "torch.distributed.fsdp",
            lambda m: self._wrap_model_class(m, "FullyShardedDataParallel"),
        )
        try:
            registry.install(self)  # deepspeed.initialize phases, Lightning Trainers' callback
        except Exception as exc:
            log.debug("ddpwatch: no framework hooks: %r", exc)

    def _time_data_loaders(self, dataloader: Any) -> None:
        """Wrap every DataLoader iterator's ``__next__``: the rank's input wait, and the
        batches it drew (``InputTimer``)."""
        if not self._detached:
            self.patches.replace(dataloader._BaseDataLoaderIter, "__next__", self._input_timer.wrap)

    def _before_set_device(self, *args: Any, **kwargs: Any) -> None:
        self._phase_before_device = self.progress.phase
        self.set_phase(Phase.DEVICE)

    def _after_set_device(self, *args: Any, **kwargs: Any) -> None:
        """After the rendezvous, "device" lasts until the model is wrapped (the documented
        order); before it (torchtitan's order) the rank goes back to what it was doing."""
        note_current_device()
        if not self._dist_ready:
            self.set_phase(self._phase_before_device)

    def _wrap_model_class(self, module: Any, name: str) -> None:
        cls = getattr(module, name, None)
        if cls is None or self._detached:
            return
        self.patches.wrap(
            cls,
            "__init__",
            before=lambda *_, **__: self.set_phase(Phase.MODEL_WRAP),
            after=lambda _, model, *__, **___: self._after_model_wrap(model),
        )

    def _after_model_wrap(self, model: Any) -> None:
        if self._split_on:
            self._grad_ready.add_model(model)  # a DDP model: its gradient wait (zero-code too)
        self._model_hooks.watch_gradients(model)  # its own gradients' check (zero-code too)
        if self.in_startup:
            self.set_phase(Phase.FIRST_STEP)

    def _before_save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, (str, os.PathLike)):
            self.checkpoint(os.path.abspath(os.fspath(f)))

    def _before_init(self, init: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._learn_rank(init, args, kwargs)
        self.set_phase(Phase.RENDEZVOUS)

    def _after_init(self) -> None:
        self._on_group_ready()
        note_current_device()  # on the training thread: its set_device has happened

    def _learn_rank(self, init: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Rank and world size given to init_process_group are what the group will use: ranks
        started by ``mp.spawn`` learn them here, and a world size that differs from the
        launcher's (a rank the launcher never starts) is seen while the rendezvous waits."""
        try:
            bound = inspect.signature(init).bind_partial(*args, **kwargs).arguments
        except (TypeError, ValueError):
            return
        rank, world_size = bound.get("rank", -1), bound.get("world_size", -1)
        if isinstance(rank, int) and rank >= 0:
            self.identity.rank = rank
        if isinstance(world_size, int) and world_size > 0:
            self.identity.world_size = world_size
        self.identity.init_method = init_method_of(bound)
        backend = bound.get("backend")
        if isinstance(backend, str) and backend:
            self.identity.backend = backend
        read_rendezvous_env(os.environ, self.identity)  # what env:// reads, at this moment

    def _on_group_ready(self) -> None:
        try:
            self.identity = refresh_from_torch(self.identity)
            self._dist_ready = True
            self._open_box()
            self._flight_recorder = FlightRecorder()
            if self.in_startup:
                self._enter_phase(Phase.SETUP)
        except Exception as exc:
            log.debug("ddpwatch: could not read the process group: %s", exc)

    # publisher thread --------------------------------------------------------
    def _identity_fields(self) -> dict[str, Any]:
        fields = self.identity.as_fields()
        fields["pid"] = os.getpid()
        box = self.progress.box
        if box is not None:
            fields["box"] = box.name
        return fields

    def _open_box(self) -> None:
        """The black box, once this process knows its rank (``agent/blackbox.py``)."""
        if self.progress.box is not None or self.identity.rank is None:
            return
        if not self.probes.on("box") or os.getpid() != self._pid:
            return
        self.progress.box = BlackBox.open(self.identity.rank, self._calls.exact)

    def _close_box(self) -> None:
        box, self.progress.box = self.progress.box, None
        if box is not None:
            box.close()

    def _identity_due(self, identity: dict[str, Any]) -> bool:
        """Whether this beat repeats the identity (see ``IDENTITY_EVERY``)."""
        connections = self.publisher.connections
        due = (
            identity != self._sent_identity
            or connections != self._identity_connections
            or self._beats_since_identity + 1 >= IDENTITY_EVERY
        )
        if due:
            self._sent_identity = identity
            self._identity_connections = connections
            self._beats_since_identity = 0
        else:
            self._beats_since_identity += 1
        return due

    def _heartbeat(self) -> list[AnyMessage]:
        """Build this beat's sample, plus a stack event when the rank has not moved."""
        with self._beat_lock:
            sample = self._sample()
        if sample is None:
            return []
        self._process_hooks.find_main_frame()  # once found, a no-op
        progress = self.progress
        messages: list[AnyMessage] = [sample]
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + LOG_EVERY_S
            messages.extend(self._new_output())
        stack = self._stack_if_stuck()
        if stack is not None:
            messages.append(
                self._event(EventKind.STACK, stack=stack, phase=progress.phase, step=progress.step)
            )
        return messages

    def _p2p_counted(self) -> dict[str, int] | None:
        """The sends and receives this rank posted per group, where its backend numbers them
        with the group's collectives (gloo, measured; NCCL keeps them apart: none)."""
        backend = self.identity.backend or ""
        if not self.progress.p2p_ops or "gloo" not in backend or "nccl" in backend:
            return None
        return self.progress.p2p_counts(pg_name)

    def _in_flight(self, recorded: Collective | None) -> Collective | None:
        """The collective this rank is in: the flight recorder's (its number counts DDP's own
        all-reduces), with the Python-level call's arguments where the rank is inside one of
        the same op (the recorder keeps no root or reduce op); else the Python-level one.
        Either way with ``before``, the last Python-level call made before it."""
        python = self.progress.in_flight()
        if python is not None and python.peer is not None:
            return python  # blocked in a send or a receive now, whatever the recorder holds
        if recorded is None:
            if python is not None and python.seq is not None:
                python.before = self._calls.call(python.seq - 1)
            return python
        if python is None:
            recorded.before = self._calls.call(self.progress.collective_seq)
        elif _same_op(recorded.op, python.op):
            recorded.shape, recorded.dtype = python.shape, python.dtype
            recorded.reduce_op, recorded.root = python.reduce_op, python.root
            if python.seq is not None:
                recorded.py_seq = python.seq
                recorded.before = self._calls.call(python.seq - 1)
        return recorded

    def _sample(self) -> Sample | None:
        """The rank's measurements now; None while it does not know which rank it is."""
        if not self._dist_ready and self._dist is not None and self._dist.is_initialized():
            self._on_group_ready()
        if self.identity.rank is None and time.monotonic() - self._started < RANK_WAIT_S:
            return None  # which rank this is comes with init_process_group; lone: rank 0
        progress = self.progress
        if progress.step is not None and progress.phase in _BEFORE_TRAINING:
            progress.set_phase(Phase.TRAIN)
        device = device_info()
        recorder = self._flight_recorder
        collective, enqueued = recorder.read(self._p2p_counted()) if recorder else (None, None)
        collective = self._in_flight(collective)
        counts = None
        if self._dist_ready:
            digests, window, earlier = self._calls.read()
            counts = CollectiveCounts(
                py=progress.collective_seq,
                fr=enqueued,
                marks=list(progress.marks) or None,
                digests=digests,
                window=window,
                earlier=earlier,
            )
        identity = {**self._identity_fields(), **device.as_fields()}
        # the step before the loss: a step's loss is in the ring before its count moves
        # (``end_step``), so a sample never pairs step N with a loss read on the host from
        # an earlier step. Read the other way round, the training thread could end steps in
        # between (the memory reads below take that long under load): step 5, step 1's loss
        step = progress.step
        loss = progress.loss.poll()
        input_wait_s, compute_s, grad_wait_s = self._split.read()
        phase = self._phase_now()
        return Sample(
            v=PROTOCOL_VERSION,
            rank=self.rank,
            t=time.time(),
            **(identity if self._identity_due(identity) else {}),
            **memory_info(device).as_fields(),
            **self._host_memory().as_fields(),
            phase=phase,
            cpu_s=time.process_time(),
            compile_reason=progress.compile_reason if phase == Phase.COMPILING else None,
            step=step,
            loss=loss,
            nan_step=progress.loss.nan_step,
            grad_nan_step=progress.loss.grad_nan_step,
            step_time_s=progress.step_time_s,
            avg_step_time_s=progress.avg_step_time_s,
            data_wait_s=progress.data_wait_s,
            collective_time_s=progress.collective_time_s,
            input_wait_s=input_wait_s,
            compute_s=compute_s,
            grad_wait_s=grad_wait_s,
            collective=collective,
            collectives=counts,
            forwards=progress.forwards or None,
            batch_marks=list(progress.batch_marks) or None,
            backward_marks=list(progress.backward_marks) or None,
            eval_sync_marks=list(progress.eval_sync_marks) or None,
        )

    def _phase_now(self) -> str:
        """The phase to report: the training thread's; where the hooks set it and it is old,
        what the main thread's stack shows (``agent/where.py``); ``compiling`` where torch has
        no compile callbacks and the main thread, idle a while, is inside a compilation."""
        progress = self.progress
        phase = progress.phase
        if phase == Phase.COMPILING:
            return phase
        idle = progress.idle_for()
        compile_look = (
            not self._compile.hooked
            and "torch._dynamo" in sys.modules
            and idle >= COMPILE_LOOK_AFTER_S
        )
        hook_look = not progress.pinned and phase in HOOK_PHASES and idle >= LOOK_AFTER_S
        if not (compile_look or hook_look):
            return phase
        frame = sys._current_frames().get(self._main_thread) if self._main_thread else None
        if compile_look and in_compile_stack(frame):
            return Phase.COMPILING
        return stack_phase(phase, frame) if hook_look else phase

    def _host_memory(self) -> hostmem.HostMemoryInfo:
        """/proc and the cgroup (a few reads, some cached); none when switched off."""
        if self.probes.on("hostmem"):
            return hostmem.read()
        return hostmem.HostMemoryInfo()

    def _stack_if_stuck(self) -> str | None:
        """The main thread's stack once the rank has made no step for ``stack_after``: sent
        when it changed, every beat while nothing moves (stuck), at most every
        ``MOVING_STACK_EVERY_S`` while it works without a step (forwards of an evaluation on
        one rank, its own loop: what its waiting peers' alert names it for)."""
        progress = self.progress
        step = progress.step
        now = time.monotonic()
        if step != self._stack_step:
            self._stack_step, self._last_stack = step, None  # it moved: send again if it sticks
            self._step_seen_at = now
        if now - self._step_seen_at < self.stack_after:
            return None  # a step came lately (seen here: within a beat of it)
        moving = progress.idle_for() < self.stack_after
        if moving and now - self._stack_sent_at < max(self.stack_after, MOVING_STACK_EVERY_S):
            return None
        stack = main_thread_stack(self._main_thread)
        if stack is None or stack == self._last_stack:
            return None
        self._last_stack, self._stack_sent_at = stack, now
        return stack

    def _new_output(self) -> list[Event]:
        """The output lines printed since the last call, as a log event (none if no lines)."""
        lines = self._log_tail.buffer.take()
        return [self._event(EventKind.LOG, text="\n".join(lines))] if lines else []

    def _event(self, kind: str, **fields: Any) -> Event:
        return Event(v=PROTOCOL_VERSION, rank=self.rank, t=time.time(), event=kind, **fields)

    # process hooks -----------------------------------------------------------
    def _final_collective(self) -> Collective | None:
        """The collective the main thread failed in or is inside now, if any."""
        progress = self.progress
        return progress.failed_collective or progress.in_flight(dying=True)

    def _publish_final_sample(self) -> None:
        """One last sample before a crash or exit event (after one, it would revive a dead
        rank's collective timer): the loss that went NaN a step before the end is in it."""
        if self._final_sent:
            return
        self._final_sent = True
        try:
            if not self._beat_lock.acquire(timeout=FINAL_SAMPLE_WAIT_S):
                return
            try:
                sample = self._sample()
            finally:
                self._beat_lock.release()
            if sample is not None:
                self.publisher.publish(sample)
        except Exception as exc:
            log.debug("ddpwatch: no final sample: %r", exc)

    def _report_crash(self, error: ErrorInfo, thread_name: str | None) -> None:
        if not self.active or os.getpid() != self._pid:
            return
        for message in self._new_output():  # the last lines before the crash
            self.publisher.publish(message)
        if thread_name is None:
            self._publish_final_sample()
            self.publisher.publish(
                self._event(
                    EventKind.CRASH,
                    error=error,
                    phase=self.progress.phase,
                    step=self.progress.step,
                    collective=self._final_collective(),
                )
            )
        else:
            text = f"exception in thread {thread_name}: {error.type}: {error.message}"
            self.publisher.publish(self._event(EventKind.LOG, error=error, text=text))
        self.publisher.flush(CRASH_FLUSH_S)

    def _report_exit(self, signal_name: str | None, exit_code: int | None) -> None:
        """The exit event (once), sent within ``CRASH_FLUSH_S``: from atexit, a terminating
        signal, or ``os._exit`` (which runs no atexit handler)."""
        if self._exited or not self.active or os.getpid() != self._pid:
            return
        self._exited = True
        for message in self._new_output():  # lines printed since the last heartbeat
            self.publisher.publish(message)
        self._publish_final_sample()
        self.publisher.publish(
            self._event(
                EventKind.EXIT,
                signal=signal_name,
                exit_code=exit_code,
                step=self.progress.step,
                collective=self._final_collective(),
            )
        )
        self.publisher.stop(CRASH_FLUSH_S)
        self._close_box()  # it said how it ended: nothing for a reader to find


def main_thread_stack(thread_id: int | None) -> str | None:
    """Format another thread's current Python stack; works while it waits inside C++."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return None
    return "".join(traceback.format_stack(frame))


def _same_op(recorded: str, python: str) -> bool:
    """The flight recorder's name of a collective and the wrapped function's are one op:
    "allreduce" and "all_reduce", "broadcast[pg 1]" and "broadcast"."""
    return recorded.split("[", 1)[0].replace("_", "") == python.replace("_", "")
