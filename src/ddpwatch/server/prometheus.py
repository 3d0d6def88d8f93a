"""Prometheus metrics (``serve --prometheus-port P``), read from the status document at scrape time.

A custom collector, so nothing is computed between scrapes and the numbers are
exactly what ``ddpwatch status --json`` shows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric

from ddpwatch.vocabulary import RankState

RANK_LABELS = ["rank", "local_rank", "host"]
STATES = (
    RankState.RUNNING,
    RankState.WAITING,
    RankState.STALLED,
    RankState.SILENT,
    RankState.CRASHED,
    RankState.STOPPED,
    RankState.EXITED,
    RankState.NOT_CONNECTED,
)
"""Every ``RankState``, in the order ``docs/prometheus.md`` shows them (a label per state)."""
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


def _labels(rank: dict[str, Any]) -> list[str]:
    return [
        str(rank["rank"]),
        "" if rank["local_rank"] is None else str(rank["local_rank"]),
        rank["host"] or "",
    ]


class StatusCollector:
    """Turns one status document into metric families on every scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        document = self._status()
        ranks = document["ranks"]
        for name, key, doc in RANK_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=RANK_LABELS)
            for rank in ranks:
                value = rank.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    family.add_metric(_labels(rank), float(value))
            yield family
        state = GaugeMetricFamily(
            "ddpwatch_rank_state", "1 for the rank's current state.", labels=[*RANK_LABELS, "state"]
        )
        for rank in ranks:
            for name in STATES:
                state.add_metric([*_labels(rank), name], 1.0 if rank["state"] == name else 0.0)
        yield state
        alerts = GaugeMetricFamily("ddpwatch_alerts", "Active alerts.", labels=["kind", "severity"])
        for (kind, severity), count in sorted(
            Counter((a["kind"], a["severity"]) for a in document["alerts"]).items()
        ):
            alerts.add_metric([kind, severity], float(count))
        yield alerts
        world = document["world_size"]
        if world is not None:
            yield GaugeMetricFamily("ddpwatch_world_size", "Known world size.", value=float(world))
        stats = document["stats"]
        yield CounterMetricFamily(
            "ddpwatch_messages_received", "Valid messages taken in.", value=stats["received"]
        )
        yield CounterMetricFamily(
            "ddpwatch_messages_rejected", "Frames dropped as invalid.", value=stats["rejected"]
        )


def serve_metrics(status: Callable[[], dict[str, Any]], port: int, host: str = "127.0.0.1") -> Any:
    """Start the ``/metrics`` HTTP endpoint on a daemon thread; returns the HTTP server."""
    registry = CollectorRegistry()
    registry.register(StatusCollector(status))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
