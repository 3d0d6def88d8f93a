"""A recording turned into what a post-mortem needs (``ddpwatch report``): the final status
document, per-rank time series, per-rank numbers and the culprits.

The final document comes from replaying the file, so its alerts and timeline are exactly the
live server's. The series come from a second pass over the frames: the server keeps only
each rank's latest values, and a post-mortem wants the whole curve.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ddpwatch.core.protocol import ProtocolError, Sample, decode
from ddpwatch.core.vocabulary import HistoryEvent, Severity
from ddpwatch.outputs.summary import summary_lines, told
from ddpwatch.server.recording import RecordingError, RecordingReader
from ddpwatch.status.fmt import event_label, hint_pointing_at, step_seconds
from ddpwatch.status.order import median_steps
from ddpwatch.status.schema import (
    UNSET,
    AlertEntry,
    HistoryEntry,
    RankEntry,
    RankError,
    StatusDocument,
    Verdict,
)

RAISING = (HistoryEvent.RAISED, HistoryEvent.ESCALATED)
"""The events that count as an alert raised (an update moves one to other ranks)."""
SERIES_POINTS = 400  # per rank and metric: enough for a chart, small in JSON
_COMPACT_AT = 8 * SERIES_POINTS  # series are thinned while read, so memory stays bounded
METRICS = ("step", "step_time_s", "loss", "mem_allocated_bytes", "gpu_mem_used_bytes")
ALERTING = (Severity.ERROR, Severity.WARNING)

Point = tuple[float, float]
TIMES = "\N{MULTIPLICATION SIGN}"


def downsample(points: list[Point], limit: int = SERIES_POINTS) -> list[Point]:
    """At most ``limit`` points of a time-ordered series: per time bucket its lowest and
    highest point, plus the last one, so a spike survives where plain striding skips it."""
    if len(points) <= limit:
        return list(points)
    buckets = max(1, (limit - 1) // 2)
    t0 = points[0][0]
    span = (points[-1][0] - t0) or 1.0
    out: list[Point] = []
    current, low, high = -1, points[0], points[0]
    for point in points:
        bucket = min(buckets - 1, max(0, int((point[0] - t0) / span * buckets)))
        if bucket != current:
            if current >= 0:
                out.extend(_pair(low, high))
            current, low, high = bucket, point, point
            continue
        if point[1] < low[1]:
            low = point
        if point[1] > high[1]:
            high = point
    out.extend(_pair(low, high))
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out[:limit]


def _pair(low: Point, high: Point) -> list[Point]:
    if low is high:
        return [low]
    return [low, high] if low[0] <= high[0] else [high, low]


@dataclass
class RankSeries:
    """One rank over time: ``points[metric]`` is ``(seconds since t0, value)``, at most
    ``SERIES_POINTS`` each; step time and loss get one point per new step."""

    rank: int
    points: dict[str, list[Point]] = field(default_factory=lambda: {m: [] for m in METRICS})
    samples: int = 0
    max_step: int | None = None
    peak_allocated_bytes: int | None = None
    peak_gpu_used_bytes: int | None = None
    _last_step: int | None = None

    @property
    def peak_mem_bytes(self) -> int | None:
        """The allocator's peak where the rank reported it, else the GPU's (NVML)."""
        return (
            self.peak_allocated_bytes
            if self.peak_allocated_bytes is not None
            else self.peak_gpu_used_bytes
        )

    def take(self, elapsed: float, sample: Sample) -> None:
        """Fold one heartbeat in."""
        self.samples += 1
        if sample.step is not None and sample.step != self._last_step:
            self._last_step = sample.step
            self.max_step = max(sample.step, self.max_step or 0)
            self._add("step", elapsed, sample.step)
            step_time, loss = sample.step_time_s, sample.loss
            if step_time is not None and math.isfinite(step_time):
                self._add("step_time_s", elapsed, step_time)
            if loss is not None and math.isfinite(loss):
                self._add("loss", elapsed, loss)
        allocated = max(
            (v for v in (sample.mem_allocated_bytes, sample.mem_peak_bytes) if v is not None),
            default=None,
        )
        if allocated is not None:
            self.peak_allocated_bytes = max(self.peak_allocated_bytes or 0, allocated)
        if sample.mem_allocated_bytes is not None:
            self._add("mem_allocated_bytes", elapsed, sample.mem_allocated_bytes)
        if sample.gpu_mem_used_bytes is not None:
            self.peak_gpu_used_bytes = max(self.peak_gpu_used_bytes or 0, sample.gpu_mem_used_bytes)
            self._add("gpu_mem_used_bytes", elapsed, sample.gpu_mem_used_bytes)

    def _add(self, metric: str, elapsed: float, value: float) -> None:
        points = self.points[metric]
        points.append((elapsed, float(value)))
        if len(points) >= _COMPACT_AT:
            self.points[metric] = downsample(points, 4 * SERIES_POINTS)

    def finish(self) -> None:
        """Cut every series to ``SERIES_POINTS``."""
        self.points = {m: downsample(p) for m, p in self.points.items()}


@dataclass(frozen=True)
class RankStats:
    """One rank's numbers for the tables and the comparison."""

    rank: int
    host: str | None
    state: str | None
    steps: int | None
    median_step_time_s: float | None  # the server's, every step one vote (``figures``)
    peak_mem_bytes: int | None
    alerts: tuple[str, ...]  # kinds of the raised alerts naming this rank, in order


@dataclass(frozen=True)
class Culprit:
    """A rank named by an error or warning: what was said about it and what it left behind."""

    rank: int
    alerts: tuple[AlertEntry, ...]  # as each last stood
    state: str | None
    step: int | None
    stack: str | None
    error: RankError | None
    log_tail: tuple[str, ...]


@dataclass
class RunReport:
    """Everything the renderers need from one recording; they are pure functions of it."""

    path: str
    document: StatusDocument
    series: dict[int, RankSeries]
    ranks: list[RankStats]
    culprits: list[Culprit]
    t0: float | None  # unix time the series count from: the file's first report
    frames: int = 0
    undecodable: int = 0
    tail_bytes: int = 0
    sessions: int = 0

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def history(self) -> list[HistoryEntry]:
        return self.document.history

    @property
    def duration_s(self) -> float | None:
        """How long the job ran: the summary's figure (the verdict's ``run_s``), not how
        long the recording went on after it."""
        return self.run.run_s

    @property
    def run(self) -> Verdict:
        """The run as the replay judged it (the document's ``verdict``): episodes, time lost,
        each attempt's verdict."""
        return told(self.document)

    @property
    def verdict(self) -> str:
        return self.run.text

    @property
    def summary(self) -> list[str]:
        return summary_lines(self.document)

    @property
    def alerts_raised(self) -> int:
        return sum(1 for e in self.history if e.event in RAISING)

    @property
    def median_step_time_s(self) -> float | None:
        """The job's median step: its ranks' medians' median, as the summary says it."""
        return self.run.median_step_s

    @property
    def slowest_step_time_s(self) -> float | None:
        """The slowest rank's median step time: in synchronous training, the job's pace."""
        medians = [r.median_step_time_s for r in self.ranks if r.median_step_time_s is not None]
        return max(medians) if medians else None

    @property
    def peak_mem_bytes(self) -> int | None:
        peaks = [r.peak_mem_bytes for r in self.ranks if r.peak_mem_bytes is not None]
        return max(peaks) if peaks else None

    def worst_ranks(self, limit: int) -> list[int]:
        """Up to ``limit`` ranks, the most telling first: culprits, other ranks alerts named,
        then the slowest, then the most memory (charts and tables cannot show 8,192)."""
        chosen = dict.fromkeys(c.rank for c in self.culprits)
        chosen.update(dict.fromkeys(r.rank for r in self.ranks if r.alerts))
        rest = sorted(
            (r for r in self.ranks if r.rank not in chosen),
            key=lambda r: (-(r.median_step_time_s or 0.0), -(r.peak_mem_bytes or 0), r.rank),
        )
        chosen.update(dict.fromkeys(r.rank for r in rest))
        return list(chosen)[:limit]

    def hints(self) -> list[tuple[str, str]]:
        """(kind, hint) of every alert episode, once each, in the order they came up: each
        fix as the live alert last gave it (``episodes``), the one the dashboard showed, not
        the first guess it was raised with (#33: a slow rank's generic "compare its GPU"
        where it said "give its DataLoader more workers" live); sending the reader to this
        report for a rank's stack, not to a server (``in_report``)."""
        seen: dict[tuple[str, str], None] = {}
        for episode in self.run.episodes:
            if episode.hint:
                seen.setdefault((episode.kind, in_report(episode.hint)), None)
        return list(seen)

    def notes(self) -> list[str]:
        """What the reader should know about the file itself."""
        notes = []
        if self.tail_bytes:
            notes.append(
                f"the file ends in a partial record: its last {self.tail_bytes} bytes were not "
                "read (the server stopped mid-write)"
            )
        if self.undecodable:
            notes.append(f"{self.undecodable} recorded frames no longer decode and were skipped")
        if self.sessions > 1:
            notes.append(
                f"the file holds {self.sessions} server runs: the ranks are the last run's; "
                "the timeline and the plots cover all of them"
            )
        return notes


def load_run(
    path: str | os.PathLike[str], document: StatusDocument, sessions: int = 1
) -> RunReport:
    """The report of the recording ``path``: ``document``, its last status document as a
    replay judged it (``server.replay.replay_to_end``, which also counts its ``sessions``),
    and its frames read again for the series. Raises ``RecordingError`` for a file that
    holds no whole record."""
    reader = RecordingReader(path)
    series: dict[int, RankSeries] = {}
    frames = undecodable = 0
    t0: float | None = None
    for record in reader:
        if record.kind != "frame":
            continue
        frames += 1
        try:
            message = decode(record.data)
        except ProtocolError:
            undecodable += 1
            continue
        if t0 is None:
            t0 = record.t
        if isinstance(message, Sample):
            if message.rank not in series:
                series[message.rank] = RankSeries(message.rank)
            series[message.rank].take(record.t - t0, message)
    if reader.records_read == 0 and reader.tail_bytes:
        raise RecordingError(
            f"{path} holds no readable record: its {reader.tail_bytes} bytes after the header "
            "are corrupt"
        )
    for rank in series.values():
        rank.finish()
    return RunReport(
        path=str(path),
        document=document,
        series=series,
        ranks=_rank_stats(document, series),
        culprits=_culprits(document),
        t0=t0,
        frames=frames,
        undecodable=undecodable,
        tail_bytes=reader.tail_bytes,
        sessions=sessions,
    )


IN_REPORT = "this report's Culprits section"
"""Where a report sends the reader for a rank's stack and traceback: it holds them itself,
and the server a live hint named (``ddpwatch status --json``) is gone."""


def in_report(hint: str) -> str:
    """A live hint as a report writes it (``status.fmt.hint_pointing_at``)."""
    return hint_pointing_at(hint, IN_REPORT)


def _raised(history: Iterable[HistoryEntry]) -> Iterable[AlertEntry]:
    return (e.alert for e in history if e.event != HistoryEvent.CLEARED)


def _rank_stats(document: StatusDocument, series: dict[int, RankSeries]) -> list[RankStats]:
    entries = {r.rank: r for r in document.ranks}
    named: dict[int, list[str]] = {}
    for alert in _raised(document.history):
        for rank in alert.ranks:
            kinds = named.setdefault(rank, [])
            if alert.kind not in kinds:
                kinds.append(alert.kind)
    medians = median_steps(document.ranks)
    stats = []
    for rank in sorted(set(entries) | set(series)):
        entry, seen = entries.get(rank), series.get(rank)
        steps = seen.max_step if seen is not None else None
        if steps is None and entry is not None:
            steps = entry.step
        stats.append(
            RankStats(
                rank=rank,
                host=None if entry is None else entry.host,
                state=None if entry is None else entry.state,
                steps=steps,
                median_step_time_s=medians.get(rank),
                peak_mem_bytes=seen.peak_mem_bytes if seen is not None else None,
                alerts=tuple(named.get(rank, ())),
            )
        )
    return stats


def _culprits(document: StatusDocument) -> list[Culprit]:
    """Ranks named by error or warning alerts, errors' culprits first, each alert as it last
    stood (a cleared entry holds its final numbers; an active alert its current ones)."""
    latest: dict[tuple[str, tuple[int, ...]], AlertEntry] = {}
    for alert in [*(entry.alert for entry in document.history), *document.alerts]:
        latest[(alert.kind, tuple(alert.ranks))] = msgspec.structs.replace(
            alert, hint=in_report(alert.hint)
        )
    order: dict[int, list[AlertEntry]] = {}
    for severity in ALERTING:
        for alert in latest.values():
            if alert.severity != severity:
                continue
            for rank in alert.ranks:
                order.setdefault(rank, []).append(alert)
    entries = {r.rank: r for r in document.ranks}
    culprits = []
    for rank, alerts in order.items():
        entry = entries.get(rank) or RankEntry(rank=rank, state="")
        culprits.append(
            Culprit(
                rank=rank,
                alerts=tuple(alerts),
                state=entry.state or None,
                step=entry.step,
                stack=entry.stack,
                error=entry.error,
                log_tail=tuple(entry.log_tail or ()),
            )
        )
    return culprits


# ------------------------------------------------------------------ two runs


@dataclass(frozen=True)
class RankPair:
    """One rank in both runs (None where a run never saw it)."""

    rank: int
    before: RankStats | None
    after: RankStats | None


def pair_ranks(before: RunReport, after: RunReport) -> list[RankPair]:
    a = {r.rank: r for r in before.ranks}
    b = {r.rank: r for r in after.ranks}
    return [RankPair(rank, a.get(rank), b.get(rank)) for rank in sorted(set(a) | set(b))]


def ratio(before: float | None, after: float | None) -> float | None:
    """``after / before``, or None where either is unknown or ``before`` is 0."""
    if before is None or after is None or before == 0:
        return None
    return after / before


# ------------------------------------------------------------------ formatting


def event_text(entry: HistoryEntry) -> str:
    """A timeline entry's event (``history.event_label``) and, once its episode ended, how
    long it was up: "cleared #2 after 28.3 s"."""
    event = event_label(entry)
    if entry.event == HistoryEvent.CLEARED and entry.duration_s is not UNSET:
        event += f" after {step_seconds(entry.duration_s)}"
    return event


def fmt_change(before: float | None, after: float | None) -> str:
    """``-75.0% (x0.25)`` with a multiplication sign; ``—`` where there is nothing to compare."""
    r = ratio(before, after)
    if r is None:
        return "—"
    return f"{(r - 1) * 100:+.1f}% ({TIMES}{r:.2f})"
