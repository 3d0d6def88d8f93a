"""Where a rank's step goes (``agent/split.py``): input wait, compute, and the wait in DDP's
gradient all-reduce, timed on the training thread without a device sync."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import free_port_pair, rank_zero_of_one
from torch.utils.data import DataLoader, Dataset

import ddpwatch
from ddpwatch.agent.progress import Progress, SplitReader
from ddpwatch.agent.split import (
    KEEP_LAST,
    LEARN_BACKWARDS,
    PAIRS_KEPT,
    CudaClock,
    GradReady,
    cuda_clock,
)

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
    rank_zero_of_one(monkeypatch)
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


def test_backward_passes_are_marked_at_every_eighth_step(group: Any) -> None:
    """The evidence of a desync without a DataLoader: at every 8th step, the backward passes
    run so far (a micro-batch more under no_sync, or a step skipped after its backward)."""
    watcher = group
    model = torch.nn.Linear(4, 1)
    for step in range(1, 25):
        for _ in range(3 if step > 16 else 1):  # from step 17, 3 micro-batches a step
            model(torch.ones(2, 4)).sum().backward()
        ddpwatch.step()
    assert list(watcher.progress.backward_marks) == [(8, 8), (16, 16), (24, 40)]


def test_evaluation_forwards_through_a_buffer_broadcasting_ddp_model_are_marked(group: Any) -> None:
    """DDP broadcasts a BatchNorm model's buffers before a forward, also under no_grad (then
    not again until a forward with gradients): each such evaluation forward is a collective
    every rank must make, counted at the marks; one through the wrapped module is not."""
    from torch.nn.parallel import DistributedDataParallel

    watcher = group
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ddp = DistributedDataParallel(inner)
    ddpwatch.attach(ddp)
    for step in range(1, 17):
        ddp(torch.ones(2, 4)).sum().backward()
        ddpwatch.step()
        if step == 4:
            with torch.no_grad():
                ddp(torch.ones(2, 4))  # broadcasts
                ddp(torch.ones(2, 4))  # DDP does not again, under no_grad
                inner(torch.ones(2, 4))  # the wrapped module: no collective
    assert list(watcher.progress.eval_sync_marks) == [(8, 1), (16, 1)]


# The CUDA path, on the CPU: a fake device clock ------------------------------------------


class FakeClock:
    """An ``EventClock`` whose marks complete only when told: a stream at ``now`` seconds of
    device time. Nothing on it waits for the device; asking for the time between marks it has
    not passed is asking to wait, and fails the test."""

    def __init__(self) -> None:
        self.now = 0.0
        self.at: dict[int, float] = {}  # mark -> device time it was recorded at
        self.passed: set[int] = set()
        self.released: list[int] = []
        self.fail: str | None = None  # "record", "done" or "seconds" raises

    def record(self) -> int:
        if self.fail == "record":
            raise RuntimeError("no CUDA here")
        mark = len(self.at)
        self.at[mark] = self.now
        return mark

    def done(self, mark: int) -> bool:
        if self.fail == "done":
            raise RuntimeError("an API change")
        return mark in self.passed

    def seconds(self, start: int, end: int) -> float:
        assert start in self.passed and end in self.passed, "asked to wait for the device"
        if self.fail == "seconds":
            raise RuntimeError("an API change")
        return self.at[end] - self.at[start]

    def release(self, mark: int) -> None:
        assert mark not in self.released, "a mark released twice"
        self.released.append(mark)

    def complete(self, *marks: int) -> None:
        """The device passes these marks (all recorded so far when none are named)."""
        self.passed.update(marks or self.at)

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the device clock was asked for {name!r}: only marks, no waits")


def _device_timed(clock: FakeClock) -> tuple[Progress, GradReady, Any]:
    """A DDP model (on the CPU) timed as on a GPU: by the fake device clock."""
    progress = Progress()
    grad_ready = GradReady(progress, clock=lambda device: clock)
    ddp = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    )
    grad_ready.add_model(ddp)
    assert progress.grad_hooked
    return progress, grad_ready, ddp


def _step(progress: Progress, grad_ready: GradReady, ddp: Any, clock: FakeClock, wait: float):
    """One step: compute (1 s of device time), backward, then ``wait`` s on the device before
    backward's end mark; the marks of the pair it queued, if any."""
    clock.now += 1.0
    queued = len(grad_ready._pairs)
    ddp(torch.ones(2, 4)).sum().backward()  # the own-gradient marks, recorded at ``now``
    clock.now += wait
    grad_ready.backward_ended()  # the end mark, at ``now``
    progress.end_step()
    pairs = grad_ready._pairs
    return pairs[-1] if len(pairs) > queued or len(pairs) == PAIRS_KEPT else None


def test_device_waits_are_reported_once_the_device_has_passed_the_end_mark(group: Any) -> None:
    """On a GPU: marks on the stream at the last own gradient and at the end of backward; the
    publisher reads a pair's wait only once the device has passed both, in order, and adds it
    to the gradient wait of the steps since its last read."""
    clock = FakeClock()
    progress, grad_ready, ddp = _device_timed(clock)
    reader = SplitReader(progress, device_waits=grad_ready.collect)
    assert _step(progress, grad_ready, ddp, clock, 0.5) is None  # the first step: not timed
    pairs = [_step(progress, grad_ready, ddp, clock, wait) for wait in (0.01, 0.02, 0.03)]
    assert None not in pairs and len(grad_ready._pairs) == 3
    assert progress.grad_ready_at == 0.0 and progress.split[3] == 0.0  # no CPU timing here

    assert grad_ready.collect() == 0.0  # the device is behind: nothing passed yet
    clock.complete(*pairs[1])  # another stream passed the second pair: still in order
    assert grad_ready.collect() == 0.0
    clock.complete(pairs[0][1])  # the first one's end, but not its start
    assert grad_ready.collect() == 0.0
    clock.complete(pairs[0][0])
    assert grad_ready.collect() == pytest.approx(0.01 + 0.02)  # the first two, in order
    assert len(grad_ready._pairs) == 1

    _input_wait, compute, grad_wait = reader.read()  # the third pair still on the device
    assert grad_wait == pytest.approx(0.0)  # the first two were collected above, not here
    assert compute is not None and compute > 0.0
    clock.complete()
    _step(progress, grad_ready, ddp, clock, 0.04)
    _input_wait, compute, grad_wait = reader.read()  # one step: its pair is not passed yet
    assert grad_wait == pytest.approx(0.03)  # the last heartbeat's step, a heartbeat late
    assert compute is not None
    assert reader.read()[2] == pytest.approx(0.03)  # no new step: the last values again
    clock.complete()
    _step(progress, grad_ready, ddp, clock, 0.0)
    assert reader.read()[2] == pytest.approx(0.04)
    assert grad_ready.faults == 0
    grad_ready.remove()
    assert grad_ready._handles == {} and not progress.grad_hooked


def test_device_marks_are_bounded_and_reused(group: Any) -> None:
    """A publisher that falls behind: the oldest pairs are dropped (their marks released for
    reuse), never more than ``PAIRS_KEPT`` wait, and the waits of those dropped are counted at
    the mean of those read. Every mark recorded is released once, and only once."""
    clock = FakeClock()
    progress, grad_ready, ddp = _device_timed(clock)
    _step(progress, grad_ready, ddp, clock, 0.0)
    for _ in range(PAIRS_KEPT + 5):
        _step(progress, grad_ready, ddp, clock, 0.02)
        assert len(grad_ready._pairs) <= PAIRS_KEPT
    assert len(grad_ready._pairs) == PAIRS_KEPT and grad_ready.dropped == 5
    clock.complete()
    assert grad_ready.collect() == pytest.approx(0.02 * (PAIRS_KEPT + 5))
    assert grad_ready.collect() == 0.0  # each pair read once
    assert sorted(clock.released) == sorted(clock.at)  # every mark back in the pool
    assert grad_ready.faults == 0
    grad_ready.remove()


@pytest.mark.parametrize("fails", ["record", "done", "seconds"])
def test_a_fault_of_the_device_clock_turns_it_off_and_is_counted(group: Any, fails: str) -> None:
    """No CUDA, an API change: the device path turns off, the fault is counted, training goes
    on, and the rank reports no gradient wait and no compute rather than wrong ones."""
    clock = FakeClock()
    progress, grad_ready, ddp = _device_timed(clock)
    reader = SplitReader(progress, device_waits=grad_ready.collect)
    _step(progress, grad_ready, ddp, clock, 0.0)
    _step(progress, grad_ready, ddp, clock, 0.01)
    clock.complete()
    clock.fail = fails
    for _ in range(3):
        _step(progress, grad_ready, ddp, clock, 0.01)  # never raises into training
        reader.read()
    assert grad_ready.faults == 1
    assert not progress.grad_hooked and grad_ready._handles == {}  # unhooked: no cost left
    assert reader.read()[1:] == (None, None)
    grad_ready.remove()


def test_a_device_without_a_clock_is_counted_and_not_timed(group: Any) -> None:
    def no_cuda(device: Any) -> Any:
        raise RuntimeError("Torch not compiled with CUDA enabled")

    progress = Progress()
    grad_ready = GradReady(progress, clock=no_cuda)
    grad_ready.add_model(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1)))
    assert grad_ready.faults == 1 and not progress.grad_hooked and grad_ready._handles == {}
    assert grad_ready.collect() == 0.0
    assert cuda_clock(torch.device("cpu")) is None  # the CPU is timed by ``perf_counter``


def test_the_reader_adds_device_waits_to_the_steps_since_its_last_read() -> None:
    progress = Progress()
    collected = [0.4, 0.2, 0.0]
    reader = SplitReader(progress, device_waits=lambda: collected.pop(0))
    progress.input_seen = progress.grad_hooked = True
    progress.split = (4, 1.0, 0.2, 0.0, 0.0)
    assert reader.read() == pytest.approx((0.05, 0.1, 0.1))  # 0.4 s over 4 steps
    assert reader.read() == pytest.approx((0.05, 0.1, 0.1))  # no step: kept for the next
    progress.split = (6, 1.6, 0.2, 0.0, 0.0)
    assert reader.read() == pytest.approx((0.0, 0.2, 0.1))  # the 0.2 s waited for a step


class FakeEvent:
    """A ``torch.cuda.Event`` as ``CudaClock`` may use it: no synchronize, no wait."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.streams: list[str] = []
        self.passed = False

    def record(self, stream: str) -> None:
        self.streams.append(stream)
        self.passed = False

    def query(self) -> bool:
        return self.passed

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.passed and end.passed, "elapsed_time on an event not passed: it would wait"
        return 25.0  # milliseconds


class FakeCuda:
    """The few ``torch.cuda`` calls ``CudaClock`` makes."""

    Event = FakeEvent

    def __init__(self) -> None:
        self.capturing = False
        self.guarded: list[Any] = []

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    def current_stream(self, device: Any) -> str:
        return f"stream of {device}"

    def device(self, device: Any) -> Any:
        import contextlib

        self.guarded.append(device)
        return contextlib.nullcontext()


def test_the_cuda_clock_records_on_the_devices_stream_and_reuses_its_events() -> None:
    cuda = FakeCuda()
    clock = CudaClock("cuda:3", cuda=cuda)
    start, end = clock.record(), clock.record()
    assert start is not end and start.streams == ["stream of cuda:3"]
    assert not clock.done(end)
    start.passed = end.passed = True
    assert clock.done(start) and clock.done(end)
    assert clock.seconds(start, end) == pytest.approx(0.025)
    assert cuda.guarded == ["cuda:3"] * 4  # read with the model's device current
    clock.release(start)
    clock.release(end)
    assert {id(clock.record()), id(clock.record())} == {id(start), id(end)}  # reused
    assert type(clock.record()) is FakeEvent  # the pool empty: a new one
    cuda.capturing = True  # a CUDA graph being captured: no event recorded into it
    with pytest.raises(RuntimeError):
        clock.record()


@pytest.mark.parametrize("probes", ["-split", "-batches", "-hostmem,-collectives"])
def test_each_part_switched_off_alone(monkeypatch: pytest.MonkeyPatch, probes: str) -> None:
    """``DDPWATCH_PROBES``: a part switched off leaves the others whole (the split and the
    batch marks share the DataLoader wrapper, but not each other's work)."""
    monkeypatch.setenv("DDPWATCH_PROBES", probes)
    off = set(probes.replace("-", "").split(","))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{free_port_pair()}", interval=60.0)
    try:
        assert watcher is not None
        batches = iter(DataLoader(Samples(), batch_size=2))
        for _ in range(16):
            next(batches)
            ddpwatch.step()
        progress = watcher.progress
        assert bool(progress.batch_marks) == ("batches" not in off)
        assert progress.input_seen == ("split" not in off)
        assert getattr(dist.all_reduce, "__ddpwatch__", False) == ("collectives" not in off)
        sample = watcher._sample()
        assert sample is not None
        assert (sample.host_rss_bytes is None) == ("hostmem" in off)
    finally:
        ddpwatch.detach()
