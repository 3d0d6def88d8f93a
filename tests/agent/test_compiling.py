"""Phase ``compiling`` from torch's own compile callbacks, on a real ``torch.compile``
(backend ``aot_eager``: dynamo and AOT autograd, as inductor, without its C++ build)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_agent import Receiver, rank_env, receiver  # noqa: F401 -- fixtures, by name

import ddpwatch
from ddpwatch.agent.compiling import clean_reason, in_compile_stack
from ddpwatch.agent.watcher import Watcher
from ddpwatch.core.protocol import Sample
from ddpwatch.core.vocabulary import Phase
from ddpwatch.state.state import ServerState


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles its function from scratch (a cache entry would skip the compile)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def spying_backend(
    watcher: Watcher, seen: list[tuple[str, str | None, Sample | None, bool]]
) -> Callable[..., Any]:
    """aot_eager, noting what the watcher says while dynamo compiles: the phase, the reason,
    the heartbeat it would send and whether the stack shows the compilation."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm: Any, inputs: Any) -> Any:
        progress = watcher.progress
        frame = sys._getframe()
        seen.append(
            (progress.phase, progress.compile_reason, watcher._sample(), in_compile_stack(frame))
        )
        return aot_eager(gm, inputs)

    return backend


@pytest.mark.usefixtures("rank_env", "fresh_dynamo")
def test_compiling_is_the_phase_during_a_compile_and_reverts_after(
    request: pytest.FixtureRequest,
) -> None:
    server: Receiver = request.getfixturevalue("receiver")
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{server.collector.port}", interval=0.1)
    assert watcher is not None
    seen: list[tuple[str, str | None, Sample | None, bool]] = []
    model = torch.nn.Linear(4, 1)
    loss_of = torch.compile(lambda x: model(x).pow(2).mean(), backend=spying_backend(watcher, seen))
    with ddpwatch.phase("eval"):
        loss_of(torch.randn(2, 4)).backward()  # a first compile: no reason
        assert watcher.progress.phase == "eval" and watcher.progress.pinned == 1
    loss_of(torch.randn(3, 4)).backward()  # another batch size: dynamo compiles again
    assert watcher.progress.phase == Phase.BACKWARD and watcher.progress.pinned == 0
    assert watcher.progress.compile_reason is None
    assert not in_compile_stack(sys._getframe())

    first, second = seen
    assert first[0] == Phase.COMPILING and first[1] is None and first[3]
    assert second[0] == Phase.COMPILING and second[3]
    assert second[1] == "tensor 'x' size mismatch at index 0. expected 2, actual 3"
    beat = second[2]
    assert beat is not None and beat.phase == Phase.COMPILING and beat.compile_reason == second[1]

    def back_from_compiling(state: ServerState) -> bool:
        record = state.ranks.get(0)
        names = [name for name, _ in record.phases] if record else []
        return Phase.COMPILING in names and names[-1] == Phase.BACKWARD

    server.wait_for(back_from_compiling)  # the phase events reached the server, in order
    names = [name for name, _ in server.state.ranks[0].phases]
    assert names[names.index(Phase.COMPILING) - 1 :][:3] == ["eval", Phase.COMPILING, "eval"]


@pytest.mark.usefixtures("rank_env", "fresh_dynamo")
def test_the_deferred_backward_compile_is_compiling_too() -> None:
    """AOT autograd compiles the backward at its first run (torch's ``LAZY_BACKWARD``)."""
    watcher = ddpwatch.attach(addr="127.0.0.1:1", interval=0.1)
    assert watcher is not None
    model = torch.nn.Linear(4, 1)
    loss_of = torch.compile(lambda x: model(x).pow(2).mean(), backend="aot_eager")
    loss = loss_of(torch.randn(2, 4))
    entered: list[str] = []
    enter = watcher._compile._enter_phase
    watcher._compile._enter_phase = lambda name: (entered.append(name), enter(name))
    loss.backward()  # the phase is backward's from its start (``BackwardLoss``)
    assert entered == [Phase.COMPILING, Phase.BACKWARD]
    loss_of(torch.randn(2, 4)).backward()  # compiled: no compile, no phase
    assert entered == [Phase.COMPILING, Phase.BACKWARD]


@pytest.mark.usefixtures("rank_env", "fresh_dynamo")
def test_detach_unregisters_the_callbacks_and_a_reset_does_not() -> None:
    from torch._dynamo.callback import callback_handler

    before = len(callback_handler.start_callbacks), len(callback_handler.end_callbacks)
    watcher = ddpwatch.attach(addr="127.0.0.1:1", interval=0.1)
    assert watcher is not None and watcher._compile.hooked
    assert len(callback_handler.start_callbacks) == before[0] + 1
    torch.compiler.reset()  # clears every callback: ours come back
    assert watcher._compile._started in callback_handler.start_callbacks
    assert watcher._compile._ended in callback_handler.end_callbacks
    ddpwatch.detach()
    assert (len(callback_handler.start_callbacks), len(callback_handler.end_callbacks)) == before


@pytest.mark.usefixtures("rank_env", "fresh_dynamo")
def test_without_torchs_callbacks_the_stack_tells() -> None:
    """The fallback: a rank idle a while whose main thread is in dynamo's convert_frame."""
    watcher = ddpwatch.attach(addr="127.0.0.1:1", interval=0.1)
    assert watcher is not None
    watcher._compile.remove()  # as on a torch without them
    progress = watcher.progress
    progress.set_phase(Phase.FORWARD)
    told: list[str] = []

    def backend(gm: Any, inputs: Any) -> Any:
        progress.last_progress = progress.phase_changed = time.perf_counter() - 5.0
        told.append(watcher._phase_now())
        return gm.forward

    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    assert told == [Phase.COMPILING]
    assert watcher._phase_now() == Phase.TRAIN  # idle, not compiling, no forward on its stack


def test_clean_reason_keeps_torchs_words_on_one_line() -> None:
    assert clean_reason("0/0: tensor 'x' size mismatch at index 0. expected 4, actual 8") == (
        "tensor 'x' size mismatch at index 0. expected 4, actual 8"
    )
    assert clean_reason("1/2: L['n'] == 3\nUser stack trace:\n  File ...") == "L['n'] == 3"
    assert clean_reason("   ") is None
    long = clean_reason("0/0: " + "x" * 1000)
    assert long is not None and len(long) == 240 and long.endswith("…")


@pytest.mark.usefixtures("rank_env", "fresh_dynamo")
def test_a_model_attached_then_compiled_keeps_its_graph_whole_and_its_steps() -> None:
    """``attach(model)`` then ``torch.compile(model)``: dynamo traces the forward hooks; their
    clock and ``suppress`` broke the graph (a warning and a split graph per compile)."""
    from torch._dynamo.utils import counters

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    watcher = ddpwatch.attach(model, addr="127.0.0.1:1", interval=0.1)
    assert watcher is not None
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counters.clear()
    for _ in range(4):
        compiled(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert dict(counters["graph_break"]) == {}
    assert watcher.progress.step == 4  # the optimizer hooks end the compiled steps
    model(torch.randn(4, 8))  # eager, the hooks run as before
    assert watcher.progress.phase == Phase.FORWARD  # until a backward starts


def test_importing_dynamo_is_not_compiling() -> None:
    """The body of ``convert_frame.py`` runs while ``torch._dynamo`` is imported (DDP's
    constructor imports it): seen under mpirun on a loaded machine as 'compiling' and
    'model_wrap' alternating 16 times, which pushed 'rendezvous' out of the rank's phases."""
    import importlib.util

    spec = importlib.util.find_spec("torch._dynamo.convert_frame")
    assert spec is not None and spec.origin is not None
    body = compile("import sys\nframe = sys._getframe()", spec.origin, "exec")
    scope: dict[str, Any] = {}
    exec(body, scope)  # a frame of convert_frame.py's module body, as an import runs it
    assert not in_compile_stack(scope["frame"])
    inner = compile("def _compile():\n    return sys._getframe()\n", spec.origin, "exec")
    exec(inner, scope)
    assert in_compile_stack(scope["_compile"]())
