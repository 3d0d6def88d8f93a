"""Prometheus metrics (``serve --prometheus-port P``), read from the status document at scrape time.

A custom collector, so nothing is computed between scrapes and the numbers are
exactly what ``ddpwatch status --json`` shows.

Bounded at any job size (docs/prometheus.md, "Large jobs"): per-rank series for at most
``max_ranks`` ranks, the worst ones, and all-rank counts by state. Past ``max_ranks`` ranks a
scrape reads the server's per-tick summary (``status?view=summary&worst=N``, see
``server/pages.py``) instead of building the whole document.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric

from ddpwatch.core.vocabulary import RankState
from ddpwatch.status.order import worst_ranks
from ddpwatch.status.query import MAX_WORST, Query
from ddpwatch.status.schema import RankEntry, StatusDocument, SummaryReply

RANK_LABELS = ["rank", "local_rank", "host"]
STATES = (
    RankState.RUNNING,
    RankState.WAITING,
    RankState.STALLED,
    RankState.BUSY,
    RankState.SILENT,
    RankState.CRASHED,
    RankState.STOPPED,
    RankState.EXITED,
    RankState.NOT_CONNECTED,
)
"""Every ``RankState``, in the order ``docs/prometheus.md`` shows them (a label per state)."""
DEFAULT_MAX_RANKS = MAX_WORST
"""Ranks with per-rank series by default, and at most when read from the summary (which
lists at most ``MAX_WORST`` worst ranks): 1000 ranks are about 16,000 series."""
# (metric name, status field, help)
RANK_GAUGES = (
    ("ddpwatch_rank_step", "step", "Last training step reached."),
    ("ddpwatch_rank_step_time_seconds", "step_time_s", "Duration of the last step."),
    ("ddpwatch_rank_loss", "loss", "Last loss (absent when unknown or not finite)."),
    ("ddpwatch_rank_memory_allocated_bytes", "mem_allocated_bytes", "Torch allocator: allocated."),
    ("ddpwatch_rank_memory_reserved_bytes", "mem_reserved_bytes", "Torch allocator: reserved."),
    ("ddpwatch_rank_gpu_memory_used_bytes", "gpu_mem_used_bytes", "NVML: used on the rank's GPU."),
    (
        "ddpwatch_rank_gpu_memory_total_bytes",
        "gpu_mem_total_bytes",
        "NVML: total on the rank's GPU.",
    ),
    ("ddpwatch_rank_last_seen_seconds", "last_seen_s", "Seconds since the rank's last message."),
)

Summary = Callable[[int], SummaryReply]
"""The server's summary document listing the ``n`` worst ranks (``status?view=summary``)."""


def _labels(rank: RankEntry) -> list[str]:
    local = "" if rank.local_rank is None else str(rank.local_rank)
    return [str(rank.rank), local, rank.host or ""]


def worst(document: StatusDocument, ranks: list[RankEntry], n: int) -> list[RankEntry]:
    """The ``n`` worst of ``ranks``, by rank: the summary's order (worst state first, then the
    culprits of the document's alerts, then by rank) picks them."""
    culprits = {r for alert in document.alerts for r in alert.ranks}
    by_rank = {e.rank: e for e in ranks}
    states = {rank: e.state for rank, e in by_rank.items()}
    return [by_rank[r] for r in sorted(worst_ranks(by_rank, states, culprits, n))]


class StatusCollector:
    """Turns one status document into metric families on every scrape.

    ``status``: the whole document. ``summary``: when given, read first; past ``max_ranks``
    ranks its document (the ``max_ranks`` worst ranks, counts by state) is read instead of
    the whole one. Either way per-rank series go to at most ``max_ranks`` ranks, the worst.
    """

    def __init__(
        self,
        status: Callable[[], StatusDocument],
        summary: Summary | None = None,
        max_ranks: int = DEFAULT_MAX_RANKS,
    ) -> None:
        if max_ranks < 0 or (summary is not None and max_ranks > MAX_WORST):
            top = MAX_WORST if summary is not None else "any"
            raise ValueError(f"max_ranks must be from 0 to {top}, not {max_ranks}")
        self._status = status
        self._summary = summary
        self.max_ranks = max_ranks

    def read(self) -> tuple[StatusDocument, list[RankEntry], int, dict[str, int]]:
        """The document to read, the ranks to export (by rank), how many ranks the whole
        document lists, and how many of them are in each state."""
        if self._summary is not None:
            reply = self._summary(self.max_ranks)
            total = reply.summary.ranks
            if total > self.max_ranks:  # never the whole document
                ranks = sorted(reply.ranks, key=lambda e: e.rank)
                return reply, ranks, total, dict(reply.summary.states)
        document = self._status()
        ranks = document.ranks
        counts = Counter(rank.state for rank in ranks)
        if len(ranks) > self.max_ranks:
            ranks = worst(document, ranks, self.max_ranks)
        return document, ranks, len(document.ranks), dict(counts)

    def collect(self) -> Iterator[Metric]:
        document, ranks, total, counts = self.read()
        for name, key, doc in RANK_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=RANK_LABELS)
            for rank in ranks:
                value = getattr(rank, key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    family.add_metric(_labels(rank), float(value))
            yield family
        state = GaugeMetricFamily(
            "ddpwatch_rank_state", "1 for the rank's current state.", labels=[*RANK_LABELS, "state"]
        )
        for rank in ranks:
            for name in STATES:
                state.add_metric([*_labels(rank), name], 1.0 if rank.state == name else 0.0)
        yield state
        yield GaugeMetricFamily(
            "ddpwatch_ranks", "Ranks in the status document (not_connected too).", value=total
        )
        yield GaugeMetricFamily(
            "ddpwatch_ranks_exported",
            "Ranks with per-rank series: all of them, or the worst max_ranks.",
            value=len(ranks),
        )
        by_state = GaugeMetricFamily(
            "ddpwatch_ranks_by_state", "Ranks in each state, all ranks.", labels=["state"]
        )
        for name in STATES:
            by_state.add_metric([name], float(counts.get(name, 0)))
        yield by_state
        alerts = GaugeMetricFamily("ddpwatch_alerts", "Active alerts.", labels=["kind", "severity"])
        for (kind, severity), count in sorted(
            Counter((a.kind, a.severity) for a in document.alerts).items()
        ):
            alerts.add_metric([kind, severity], float(count))
        yield alerts
        world = document.world_size
        if world is not None:
            yield GaugeMetricFamily("ddpwatch_world_size", "Known world size.", value=float(world))
        stats = document.stats
        yield CounterMetricFamily(
            "ddpwatch_messages_received", "Valid messages taken in.", value=stats.received
        )
        yield CounterMetricFamily(
            "ddpwatch_messages_rejected", "Frames dropped as invalid.", value=stats.rejected
        )
        yield CounterMetricFamily(
            "ddpwatch_messages_shed",
            "Heartbeats counted unread while the server was far behind (newer ones followed).",
            value=stats.shed,
        )
        yield CounterMetricFamily(
            "ddpwatch_messages_failed",
            "Valid frames dropped because taking them in raised (a ddpwatch bug; logged).",
            value=stats.failed,
        )


def summary_from_query(query_json: Callable[[bytes], bytes]) -> Summary:
    """A ``Summary`` asking ``Server.query_json``: cached by the server for the tick."""

    def summary(worst: int) -> SummaryReply:
        reply = query_json(Query(view="summary", worst=worst).request())
        try:
            return msgspec.json.decode(reply, type=SummaryReply)
        except msgspec.ValidationError:
            error = msgspec.json.decode(reply).get("error")
            raise RuntimeError(f"the status summary failed: {error}") from None

    return summary


def serve_metrics(
    status: Callable[[], StatusDocument],
    port: int,
    host: str = "127.0.0.1",
    *,
    summary: Summary | None = None,
    max_ranks: int = DEFAULT_MAX_RANKS,
) -> Any:
    """Start the ``/metrics`` HTTP endpoint on a daemon thread; returns the HTTP server."""
    registry = CollectorRegistry()
    registry.register(StatusCollector(status, summary, max_ranks))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
