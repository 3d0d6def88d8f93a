"""Only a rank's last words (a crash, an exit) move its record's step: any other event's step
is context. Taken as the record's, a phase event's step paired a newer step with the last
heartbeat's loss ("step 5, loss 0.0", the loss of step 1, seen under load) and hid the next
heartbeat's progress."""

from __future__ import annotations

from ddpwatch.core.protocol import Event, Sample
from ddpwatch.state.state import ServerState


def beat(step: int, loss: float) -> Sample:
    return Sample(v=1, rank=0, t=0.0, step=step, loss=loss, phase="train")


def test_a_phase_event_leaves_the_step_its_loss_belongs_to() -> None:
    state = ServerState(started=0.0)
    state.apply(beat(1, 0.0), 1.0)
    state.apply(Event(v=1, rank=0, t=0.0, event="phase", phase="eval", step=5), 1.2)
    record = state.ranks[0]
    assert (record.step, record.loss, record.phase) == (1, 0.0, "eval")
    state.apply(beat(5, 4.0), 1.5)
    assert (record.step, record.loss) == (5, 4.0)
    assert record.last_progress == 1.5  # the beat that brought step 5 is progress


def test_a_crash_or_an_exit_carries_the_last_step_reached() -> None:
    state = ServerState(started=0.0)
    state.apply(beat(1, 0.0), 1.0)
    state.apply(Event(v=1, rank=0, t=0.0, event="exit", exit_code=0, step=7), 2.0)
    assert state.ranks[0].step == 7
