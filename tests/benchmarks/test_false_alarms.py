"""False alarms on healthy jobs (``benchmarks/false_alarms.py``, #32 item 5): its scoring, and
a fast slice of its corpus in the default tests.

The slice replays recordings of real healthy jobs of the corpus (``recordings/``: ``--quick``
runs taken with ``--record``, gzipped) through the server's engine in-process, under the
tight thresholds: the same alerts the live server raised, in a second, without a job. The
same slice for real, torchrun jobs, is ``test_false_alarms_quick`` in the smoke tests (e2e).
``deepspeed-loaded`` is ``--jobs deepspeed --load`` (#32: a rank still working in
'deepspeed_init' while the others wait in 'backward', an error before the fix).
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import pytest
from conftest import BENCHMARKS

from ddpwatch.core.vocabulary import HistoryEvent

sys.path.insert(0, str(BENCHMARKS))
from diagnosis import Stamped
from false_alarms import (
    THRESHOLDS,
    false_alarms,
    flaps,
    raises_per_episode,
    replayed,
    score_changes,
)

RECORDINGS = Path(__file__).resolve().parent / "recordings"
KNOWN: dict[str, str] = {}
"""Recordings whose replay still names a rank on this commit, and why: strict expected
failures, so the fix that clears one fails here until its entry is removed. Emptied by the
start-up wording (every rank slow in 'model_wrap' names no culprit) and the host-memory
warm-up (a rank's first seconds are no leak)."""


def slice_of_recordings() -> list[object]:
    """The recordings, each expected to fail strictly while it is in ``KNOWN``."""
    return [
        pytest.param(
            path,
            id=path.name.split(".")[0],
            marks=[pytest.mark.xfail(strict=True, reason=KNOWN[name])] if name in KNOWN else [],
        )
        for path in sorted(RECORDINGS.glob("*.ddpw.gz"))
        for name in [path.name.split(".")[0]]
    ]


def change(
    at: float, event: str, kind: str = "straggler", ranks: tuple[int, ...] = (1,), **kw: object
) -> Stamped:
    fields: dict[str, object] = {
        "severity": "warning",
        "waiting": (),
        "message": f"{kind} on {ranks}",
        "hint": "",
        "episode": 1,
        **kw,
    }
    return Stamped(at, HistoryEvent(event), kind, ranks=ranks, **fields)  # type: ignore[arg-type]


def test_a_warning_or_error_naming_a_rank_is_a_false_alarm_once_per_episode() -> None:
    changes = [
        change(1.0, "raised", episode=1),
        change(2.0, "escalated", kind="stalled", severity="error", episode=1),
        change(3.0, "cleared", kind="stalled", severity="error", episode=1),
        change(4.0, "raised", kind="silent", ranks=(), severity="error", episode=2),  # nobody
        change(5.0, "raised", kind="slow_start", severity="info", episode=3),  # not a blame
        change(6.0, "raised", kind="host_memory", ranks=(0,), episode=4),
    ]
    assert [(c.kind, c.episode) for c in false_alarms(changes)] == [
        ("straggler", 1),
        ("host_memory", 4),
    ]


def test_raised_again_soon_after_clearing_is_a_flap_and_later_is_not() -> None:
    changes = [
        change(1.0, "raised", episode=1),
        change(2.0, "cleared", episode=1),
        change(4.0, "raised", episode=2),  # 2 s after: a flap
        change(5.0, "cleared", episode=2),
        change(30.0, "raised", episode=3),  # 25 s after: a new episode (a straggler each epoch)
        change(31.0, "raised", ranks=(2,), episode=4),  # other ranks: not the same alert
    ]
    assert flaps(changes) == 1
    assert raises_per_episode(changes) == 1
    assert raises_per_episode([*changes, change(32.0, "raised", episode=3)]) == 2


def test_a_quiet_stream_scores_clean() -> None:
    score = score_changes([])
    assert (score.false_alarms, score.raises_per_episode, score.flaps) == ((), 0, 0)


@pytest.mark.parametrize("recording", slice_of_recordings())
def test_replayed_healthy_job_names_no_rank(recording: Path, tmp_path: Path) -> None:
    plain = tmp_path / recording.stem
    plain.write_bytes(gzip.decompress(recording.read_bytes()))
    changes = replayed(plain, THRESHOLDS["tight"])
    score = score_changes(changes)
    assert not score.false_alarms, [(c.kind, c.ranks, c.message) for c in score.false_alarms]
    assert score.flaps == 0 and score.raises_per_episode <= 1


def test_the_slice_has_recordings() -> None:
    assert len(list(RECORDINGS.glob("*.ddpw.gz"))) >= 3
