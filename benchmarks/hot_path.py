"""What ddpwatch costs on the training thread per call and per step, and proof that it never syncs.

    python benchmarks/hot_path.py [--calls 100000] [--rounds 7] [--sync-steps 300]

Part 1, per-call cost. Every hot-path entry point is called in a tight loop timed with
``time.perf_counter_ns``; an identical loop calling an empty function of the same shape is
the baseline, and its time is subtracted. Rounds interleave every measurement with its
baseline and the median round is reported, so load from other processes hits both alike.
Measured: ``Progress.end_step``, ``ddpwatch.step`` attached and detached, the forward
pre/post hooks of ``ModelHooks`` (called directly, and as the extra cost of calling a
hooked module, which leaves ``nn.Module``'s no-hook fast path), the global optimizer step
hooks (the extra cost of ``optimizer.step()``), the collective wrapper around a no-op, and
the ``Tensor.backward`` wrapper's own work (zero-code mode hands the loss over there).
The publisher thread's heartbeat (flight-recorder read included) is timed too: it runs off
the training thread but takes the GIL at 2 Hz.

Part 2, no host-device synchronisation from the training thread.
* CPU (always): ``Tensor.item``, ``tolist``, ``cpu``, ``numpy``, ``__float__``, ``__int__`` and
  ``__bool__`` are wrapped with counters while an attached DDP loop calls
  ``ddpwatch.step(loss)`` every step with the heartbeat at 20 Hz, then while a loop that
  never calls it (zero-code: the loss is taken from ``loss.backward()``) runs. A call counts
  as ddpwatch's when a ddpwatch frame is on the calling stack. The script asserts zero such
  calls on the training thread, and more than zero on the publisher thread in each loop
  (which reads the losses: so the counters do see ddpwatch's reads).
* CUDA (only where ``torch.cuda.is_available()``): the same two loops on the GPU inside
  ``torch.cuda.set_sync_debug_mode("error")``, where any synchronising call raises.

Prints ``RATIO`` lines: the hot-path cost of one step as a fraction of a 2 ms step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PACKAGE_DIR = str(Path(__file__).resolve().parent.parent / "src" / "ddpwatch")
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
REFERENCE_STEP_S = 2e-3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _init_single_rank_group() -> None:
    """A one-rank gloo group, so DDP, the wrappers and the flight recorder are real."""
    import torch.distributed as dist

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )


def _loop_ns(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> int:
    started = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    return time.perf_counter_ns() - started


def per_call_ns(
    cases: dict[str, tuple[Callable[..., Any], Callable[..., Any], tuple[Any, ...], int]],
    rounds: int,
) -> dict[str, float]:
    """For each case (fn, baseline, args, calls): median over rounds of (fn - baseline) / calls."""
    deltas: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(rounds):
        for name, (fn, base, args, calls) in cases.items():
            first, second = (fn, base) if round_ % 2 == 0 else (base, fn)  # alternate the order
            t_first = _loop_ns(first, args, calls)
            t_second = _loop_ns(second, args, calls)
            t_fn, t_base = (t_first, t_second) if first is fn else (t_second, t_first)
            deltas[name].append((t_fn - t_base) / calls)
    return {name: statistics.median(values) for name, values in deltas.items()}


def _stdout_tee(stream: Any) -> Any:
    try:
        from ddpwatch.agent.logtail import LineBuffer, Tee
    except ImportError:
        return None
    return Tee(stream, LineBuffer())


def _noop(*args: Any) -> None:
    return None


def measure_calls(calls: int, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    import torch
    import torch.distributed as dist
    from torch import nn

    import ddpwatch
    from ddpwatch.agent.collectives import CollectiveWrappers
    from ddpwatch.agent.hooks import BackwardLoss, ModelHooks
    from ddpwatch.agent.progress import Progress

    loss = torch.tensor(1.0)
    graph_loss = (torch.ones(1, requires_grad=True) * 2).sum()  # detached when handed over

    progress = Progress()
    progress.on_step = None
    hooks = ModelHooks(progress)

    class Scalar(nn.Module):
        """A module whose forward costs almost nothing: what is left is the call machinery."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    bare_module, hooked_module = Scalar(), Scalar()
    hooks.add_model(hooked_module)

    param = nn.Parameter(torch.zeros(1))  # no grad: SGD skips it, the hook machinery remains
    optimizer = torch.optim.SGD([param], lr=0.1)

    wrappers = CollectiveWrappers(progress)
    wrapped_noop = wrappers._wrap("all_reduce", _noop)

    zero_code = Progress()
    zero_code.step_mode = "optimizer"  # no ddpwatch.step(): backward() hands the loss over
    backward_hook = BackwardLoss(zero_code)._before_backward

    def step_detached(value: Any) -> None:
        ddpwatch.step(value)

    def end_step(value: Any) -> None:
        progress.end_step(value)

    fast = max(1000, calls)
    slow = max(200, calls // 5)
    cases: dict[str, tuple[Callable[..., Any], Callable[..., Any], tuple[Any, ...], int]] = {
        "ddpwatch.step(loss), detached": (step_detached, _noop, (loss,), fast),
        "Progress.end_step(loss)": (end_step, _noop, (loss,), fast),
        "forward pre-hook (direct call)": (hooks._before_forward, _noop, (None, ()), fast),
        "forward post-hook (direct call)": (
            hooks._after_forward,
            _noop,
            (None, (), loss),
            fast,
        ),
        "hooked module call, extra": (hooked_module, bare_module, (loss,), slow),
        "collective wrapper around a no-op": (wrapped_noop, _noop, (loss,), fast),
        "Tensor.backward wrapper's hook (direct call)": (
            backward_hook,
            _noop,
            (graph_loss,),
            fast,
        ),
    }
    devnull = open(os.devnull, "w")  # noqa: SIM115 - closed below
    tee = _stdout_tee(devnull)
    if tee is not None:  # the agent's tee on sys.stdout (agent/logtail.py), when it has one
        line = "step 1200 loss 0.4321 lr 1e-3 (a typical training-loop print)\n"
        case = (tee.write, devnull.write, (line,), slow)
        cases["print line through the stdout tee, extra"] = case
    results = per_call_ns(cases, rounds)
    devnull.close()

    # optimizer hooks are global: measure with and without in separate interleaved loops
    opt_deltas = []
    for round_ in range(rounds):
        timed = {}
        for hooked in (round_ % 2 == 0, round_ % 2 == 1):  # alternate which goes first
            if hooked:
                hooks.add_optimizer_hook()
            timed[hooked] = _loop_ns(optimizer.step, (), slow)
            if hooked:
                hooks.remove()
                hooks.add_model(hooked_module)
        opt_deltas.append((timed[True] - timed[False]) / slow)
    results["optimizer.step() pre+post hooks, extra"] = statistics.median(opt_deltas)

    # the full public path, with a live watcher (publisher thread running, no server needed)
    _init_single_rank_group()
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    watcher = ddpwatch.attach(model, addr=f"127.0.0.1:{_free_port()}")
    try:
        case = (ddpwatch.step, _noop, (loss,), fast)
        results.update(per_call_ns({"ddpwatch.step(loss), attached": case}, rounds))
        beats = _heartbeat_costs(watcher, model, rounds)
    finally:
        ddpwatch.detach()
    del dist
    return results, beats


def _heartbeat_costs(watcher: Any, model: Any, rounds: int) -> dict[str, float]:
    """One heartbeat built and encoded (ns), with the flight-recorder ring full and without it.

    The ring keeps the last 2000 collectives; DDP adds one all-reduce per bucket per step,
    so a real job fills it within minutes. Also: the cheap status-only dump, and how much
    of its time the training thread can still run while a heartbeat is being built.
    """
    import torch
    from torch._C._distributed_c10d import _dump_fr_trace_json

    from ddpwatch.core.protocol import encode

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    for _ in range(2100):  # more collectives than the ring holds
        loss = model(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def beat() -> None:
        for message in watcher._heartbeat():
            encode(message)

    def timed(fn: Callable[[], Any], n: int) -> float:
        times = []
        for _ in range(n):
            started = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - started)
        return float(statistics.median(times))

    n = max(rounds, 9)
    dump = _dump_fr_trace_json(True, True)
    results = {
        "heartbeat, flight-recorder ring full": timed(beat, n),
        "  of which _dump_fr_trace_json(True, True)": timed(
            lambda: _dump_fr_trace_json(True, True), n
        ),
        "  of which json.loads of that dump": timed(lambda: json.loads(dump), n),
        "_dump_fr_trace_json(False, True): pg_status only": timed(
            lambda: _dump_fr_trace_json(False, True), n * 20
        ),
    }
    recorder, watcher._flight_recorder = watcher._flight_recorder, None
    try:
        results["heartbeat without the flight-recorder read"] = timed(beat, n * 4)
    finally:
        watcher._flight_recorder = recorder
    results["training thread speed while beats run"] = _gil_share(beat)
    return results


def _gil_share(work: Callable[[], Any], seconds: float = 0.4) -> float:
    """Main-thread loop speed while ``work`` runs back to back on another thread, over its
    speed alone: 1.0 means the work never holds the GIL (the machine has a second core)."""
    stop = threading.Event()

    def spin_for(duration: float) -> float:
        count, started = 0, time.perf_counter()
        deadline = started + duration
        while time.perf_counter() < deadline:
            count += 1
        return count / (time.perf_counter() - started)

    alone = spin_for(seconds / 2)

    def loop() -> None:
        while not stop.is_set():
            work()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    time.sleep(0.05)
    shared = spin_for(seconds)
    stop.set()
    thread.join()
    return shared / alone


# ------------------------------------------------------------------------------ sync proof


class SyncCounter:
    """Counts calls of host-syncing tensor methods per thread, and which came from ddpwatch."""

    def __init__(self) -> None:
        self.total: Counter[tuple[str, str]] = Counter()  # (thread, method)
        self.ours: Counter[tuple[str, str]] = Counter()
        self.where: dict[tuple[str, str], str] = {}
        self._originals: dict[str, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[SyncCounter]:
        import torch

        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        try:
            yield self
        finally:
            for name, original in self._originals.items():
                setattr(torch.Tensor, name, original)
            self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            main = threading.current_thread() is threading.main_thread()
            thread = "training" if main else "other"
            key = (thread, name)
            counter.total[key] += 1
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.startswith(PACKAGE_DIR):
                    counter.ours[key] += 1
                    counter.where.setdefault(key, f"{frame.f_code.co_filename}:{frame.f_lineno}")
                    break
                frame = frame.f_back
            return original(*args, **kwargs)

        return counted

    def ours_on(self, thread: str) -> int:
        return sum(n for (t, _), n in self.ours.items() if t == thread)


def _train(model: Any, x: Any, steps: int, step_fn: Callable[[Any], None]) -> None:
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step_fn(loss)


def _no_step(loss: Any) -> None:
    """Zero-code mode: the loop never calls ``ddpwatch.step``."""


def cpu_sync_proof(steps: int) -> dict[str, SyncCounter]:
    """One counter per loop: ``ddpwatch.step(loss)`` each step, then zero-code (no model
    hooks, no step call: the loss comes from the ``backward()`` wrapper)."""
    import torch
    from torch import nn

    import ddpwatch

    _init_single_rank_group()
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1)))
    x = torch.randn(32, 64)
    counters: dict[str, SyncCounter] = {}
    for name, hooked, step_fn in (
        ("ddpwatch.step(loss)", model, ddpwatch.step),
        ("zero-code, loss from backward()", None, _no_step),
    ):
        counter = counters[name] = SyncCounter()
        ddpwatch.attach(hooked, addr=f"127.0.0.1:{_free_port()}", interval=0.05)
        try:
            with counter.installed():
                deadline = time.monotonic() + 0.6  # at least a dozen heartbeats
                while time.monotonic() < deadline:
                    _train(model, x, max(10, steps // 10), step_fn)
                _train(model, x, steps, step_fn)
                time.sleep(0.15)  # let the publisher read the last loss
        finally:
            ddpwatch.detach()
    return counters


def cuda_sync_check(steps: int) -> str:
    """The training loop on the GPU with sync debug mode 'error'; returns a verdict line."""
    import torch
    from torch import nn

    import ddpwatch

    if not torch.cuda.is_available():
        return "CUDA sync check: skipped, no GPU here (needs torch.cuda.is_available())"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).to(device)
    x = torch.randn(64, 256, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(5):  # warm up outside the check: lazy init may synchronise once
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()
    torch.cuda.synchronize()
    seen: list[str] = []
    verdict = "ok"
    for name, hooked, step_fn in (
        ("ddpwatch.step(loss)", model, ddpwatch.step),
        ("zero-code", None, _no_step),
    ):
        watcher = ddpwatch.attach(hooked, addr=f"127.0.0.1:{_free_port()}", interval=0.05)
        try:
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(steps):
                    loss = model(x).pow(2).mean()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    step_fn(loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            time.sleep(0.3)  # a few heartbeats: the publisher copies and reads the losses
            loss_seen = watcher.progress.loss.value if watcher is not None else None
            faulted = bool(watcher is not None and watcher.publisher._faulted)
        finally:
            ddpwatch.detach()
        if loss_seen is None or faulted:
            verdict = "CHECK"
        seen.append(f"{name}: publisher read loss={loss_seen}, publisher fault={faulted}")
    return (
        f"CUDA sync check: {steps} steps twice on {torch.cuda.get_device_name(device)} under "
        f"set_sync_debug_mode('error'): no synchronising call on the training thread; "
        + "; ".join(seen)
        + f" ({verdict})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=100_000, help="calls per timed loop")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (median)")
    parser.add_argument("--sync-steps", type=int, default=300, help="steps in the sync proof")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

    results, beats = measure_calls(args.calls, args.rounds)
    print(f"training thread, per call (ns, minus an empty call), median of {args.rounds} rounds")
    for name, ns in results.items():
        print(f"  {name:<50} {ns:>9.0f} ns")
    per_step = (
        results["hooked module call, extra"]
        + results["optimizer.step() pre+post hooks, extra"]
        + results["ddpwatch.step(loss), attached"]
    )
    print(f"  {'one step: module call + optimizer.step() + step()':<50} {per_step:>9.0f} ns")
    print("publisher thread, per heartbeat (median)")
    for name, value in beats.items():
        if name.startswith("training thread"):
            continue
        print(f"  {name:<50} {value / 1e3:>9.1f} us")
    full = beats["heartbeat, flight-recorder ring full"]
    lean = beats["heartbeat without the flight-recorder read"]
    print(
        f"  at 2 Hz: {full * 2 / 1e9:.3f} of a core with the ring full, "
        f"{lean * 2 / 1e9:.5f} without the flight-recorder read"
    )
    print(
        "  training thread runs at "
        f"{beats['training thread speed while beats run']:.2f}x its speed alone while beats "
        "run back to back (1.0 = the beat never holds the GIL)"
    )
    print(f"RATIO hot path per step / 2 ms step = {per_step / (REFERENCE_STEP_S * 1e9):.5f}")
    print(f"RATIO heartbeat GIL time per second / 1 s = {full * 2 / 1e9:.4f}")

    ok = True
    on_training = 0
    for name, counter in cpu_sync_proof(args.sync_steps).items():
        training = counter.ours_on("training")
        on_publisher = counter.ours_on("other")
        on_training += training
        ok = ok and training == 0 and on_publisher > 0
        print(
            f"CPU sync proof, {name}: ddpwatch's calls of "
            + "/".join(SYNC_METHODS)
            + f" on the training thread: {training}; on the publisher thread: {on_publisher}"
        )
        for (thread, method), n in sorted(counter.ours.items()):
            where = counter.where[(thread, method)]
            print(f"  {thread:<8} {method:<10} {n:>5}  first at {where}")
        user_calls = sum(n for (t, _), n in counter.total.items() if t == "training") - training
        print(f"  (calls from the training loop itself and torch, not ddpwatch: {user_calls})")
    print(cuda_sync_check(args.sync_steps))

    print(f"RATIO training-thread syncs by ddpwatch = {on_training} ({'ok' if ok else 'FAILED'})")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
