"""Where a rank is, from its main thread's stack, once the hooks' phase is old (issue #33).

The step hooks mark where a phase starts (a forward, a backward, an optimizer step, the next
batch) but not what runs after it: a rank whose last hook was a backward and that has since
gone into its own validation loop, a checkpoint or a barrier still says ``backward``. So once
a hook phase has not changed for ``LOOK_AFTER_S`` (a healthy step changes it many times a
second: its stack is never read), the publisher thread reads the main thread's stack
(``sys._current_frames``, cheap, and the GIL makes it consistent) and reports what the stack
shows instead:

* a frame of the user's own code named like ``validat*`` or ``eval*`` (``validate``,
  ``run_validation``, ``evaluate``, ``do_eval``; the innermost): ``validation`` or
  ``evaluation``, whatever runs inside it (its forwards and batches are the evaluation's);
* otherwise the innermost frame of torch's autograd, optimizers, data loading or a module's
  ``__call__``: ``backward``, ``optimizer``, ``data``, ``forward``;
* an evaluation the hooks saw (forwards without gradients) stays one through its forwards
  and batches;
* none of these: ``data`` stays ``data`` (between steps, the user's own input code), any other
  hook phase becomes ``train`` (in the training loop, outside what the hooks mark: its
  location says where).

A phase a user's ``phase()`` block or an integration set is never replaced.
"""

from __future__ import annotations

import re
from types import FrameType
from typing import Final

from ddpwatch.core.vocabulary import Phase

LOOK_AFTER_S: Final = 1.0
"""How long a hook phase stands before the stack is read to confirm it."""

HOOK_PHASES: Final = frozenset(
    {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.DATA, Phase.EVALUATION}
)
"""The phases the step hooks set (``agent/hooks.py``): what the stack may correct."""

_NAMED: Final = re.compile(r"^_*(?:run_|do_)?(validat|eval)", re.IGNORECASE)
"""A function of the user's that validates or evaluates: ``validate``, ``evaluation_loop``,
``run_eval``, ``do_validation`` (not ``train_and_evaluate``: the whole of a run)."""

_TORCH_PARTS: Final = (
    # (path fragment, phase): the innermost match wins
    ("torch/autograd/", Phase.BACKWARD),  # Tensor.backward calls into it
    ("torch/optim/", Phase.OPTIMIZER),
    ("torch/utils/data/", Phase.DATA),
    ("torch/nn/modules/module.py", Phase.FORWARD),
)
_NOT_USERS: Final = ("/torch/", "/ddpwatch/", "/site-packages/", "/dist-packages/")


def _path(frame: FrameType) -> str:
    return frame.f_code.co_filename.replace("\\", "/")


def named_phase(frame: FrameType | None) -> str | None:
    """``validation`` or ``evaluation`` when a frame of the user's code on the stack is named
    for it (the innermost such frame); None otherwise."""
    while frame is not None:
        match = _NAMED.match(frame.f_code.co_name)
        if match is not None and not any(part in _path(frame) for part in _NOT_USERS):
            return Phase.VALIDATION if match.group(1).lower() == "validat" else Phase.EVALUATION
        frame = frame.f_back
    return None


def torch_phase(frame: FrameType | None) -> str | None:
    """The phase of the innermost frame of torch's autograd, optimizers, data loading or a
    module's call; None when the stack is in none of them."""
    while frame is not None:
        path = _path(frame)
        for part, phase in _TORCH_PARTS:
            if part in path:
                return phase
        frame = frame.f_back
    return None


def stack_phase(hooked: str, frame: FrameType | None) -> str:
    """What to report for a rank whose hook phase ``hooked`` is old and whose main thread's
    innermost frame is ``frame`` (see the module's docstring)."""
    named = named_phase(frame)
    if named is not None:
        return named
    found = torch_phase(frame)
    if hooked == Phase.EVALUATION and found in (Phase.FORWARD, Phase.DATA, None):
        return hooked  # an evaluation's own forwards and batches (or its metrics)
    if found is not None:
        return found
    return Phase.DATA if hooked == Phase.DATA else Phase.TRAIN
