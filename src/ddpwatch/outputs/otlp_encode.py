"""The status summary and the alert changes as OTLP protobuf requests (``serve --otlp``).

Pure functions over the published status contract (``status/schema.py``): a summary reply
(``status?view=summary&worst=N``) becomes one ``ExportMetricsServiceRequest`` and a list of
alert changes (the ``change`` documents of ``serve --headless``) one
``ExportLogsServiceRequest``, both as the OpenTelemetry protocol defines them
(``opentelemetry-proto``'s generated classes, the bytes a collector decodes).

Each rank is a resource of its own (``host.name``, ``process.pid``, ``ddpwatch.rank``,
``ddpwatch.local_rank``, ``ddpwatch.device``, ``ddpwatch.job.id``), as the process it is
would describe itself, so a collector can aggregate by host, job or device; each host of the
summary is a resource with its ranks' aggregates; the job is one more, with the counts by
state, the alerts and the server's message counters. What goes out is bounded at any job
size: per-rank series only for the summary's worst ranks (``max_ranks``), per-host rows only
as the summary holds them (``Summary.hosts``, itself capped), the rest counts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
)
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AggregationTemporality,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from ddpwatch.core.vocabulary import HistoryEvent, RankState, Severity
from ddpwatch.status.schema import HistoryEntry, HostRow, RankEntry, SummaryReply

Value = str | bool | int | float | Sequence[int]

STATES = tuple(RankState)
"""Every rank state: a state gauge has a point for each (1 for the rank's, 0 the others), so a
backend that keeps series by attribute sees the old state's series go to 0, not linger."""
RANK_GAUGES: tuple[tuple[str, str, str, str], ...] = (
    # (metric, RankEntry field, unit, description)
    ("ddpwatch.rank.step", "step", "{step}", "Last training step reached."),
    ("ddpwatch.rank.step_time", "step_time_s", "s", "Duration of the last step."),
    ("ddpwatch.rank.step_time.median", "median_step_s", "s", "Median step over the run."),
    ("ddpwatch.rank.input_wait", "input_wait_s", "s", "Step split: waiting for input."),
    ("ddpwatch.rank.compute", "compute_s", "s", "Step split: computing."),
    ("ddpwatch.rank.grad_wait", "grad_wait_s", "s", "Step split: in DDP's gradient all-reduce."),
    ("ddpwatch.rank.loss", "loss", "1", "Last loss (absent when unknown or not finite)."),
    ("ddpwatch.rank.memory.allocated", "mem_allocated_bytes", "By", "Torch allocator: allocated."),
    ("ddpwatch.rank.memory.reserved", "mem_reserved_bytes", "By", "Torch allocator: reserved."),
    ("ddpwatch.rank.gpu_memory.used", "gpu_mem_used_bytes", "By", "NVML: used on its GPU."),
    ("ddpwatch.rank.host_memory.rss", "host_rss_bytes", "By", "The rank's resident host memory."),
    ("ddpwatch.rank.last_seen", "last_seen_s", "s", "Seconds since the rank's last message."),
)
HOST_GAUGES: tuple[tuple[str, str, str, str], ...] = (
    ("ddpwatch.host.ranks", "ranks", "{rank}", "Ranks on the host."),
    ("ddpwatch.host.ranks.flagged", "flagged", "{rank}", "Of them, named in an alert."),
    ("ddpwatch.host.step.min", "step_min", "{step}", "The host's lowest step."),
    ("ddpwatch.host.step.max", "step_max", "{step}", "The host's highest step."),
    ("ddpwatch.host.step_time.max", "step_time_max_s", "s", "The host's slowest last step."),
    (
        "ddpwatch.host.memory.allocated",
        "mem_allocated_sum_bytes",
        "By",
        "Torch allocator: allocated, summed over the host's ranks.",
    ),
    (
        "ddpwatch.host.gpu_memory.used.max",
        "gpu_mem_used_max_bytes",
        "By",
        "NVML: the most used on one of the host's GPUs.",
    ),
)
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("ddpwatch.messages.received", "received", "Valid messages taken in."),
    ("ddpwatch.messages.rejected", "rejected", "Frames dropped as invalid."),
    ("ddpwatch.messages.shed", "shed", "Heartbeats counted unread while far behind."),
    ("ddpwatch.messages.failed", "failed", "Valid frames whose handling raised (logged)."),
)
SEVERITY_NUMBERS: Mapping[str, int] = {
    Severity.INFO: 9,  # SEVERITY_NUMBER_INFO
    Severity.WARNING: 13,  # SEVERITY_NUMBER_WARN
    Severity.ERROR: 17,  # SEVERITY_NUMBER_ERROR
}
"""An alert's severity as OTLP's ``SeverityNumber``; a cleared alert is INFO."""
CLEARED_SEVERITY = 9


def _value(value: Value) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    return AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=v) for v in value]))


def attributes(pairs: Mapping[str, Value | None]) -> list[KeyValue]:
    """OTLP attributes of the pairs whose value is known."""
    return [KeyValue(key=k, value=_value(v)) for k, v in pairs.items() if v is not None]


def rank_attributes(rank: RankEntry, base: Mapping[str, str]) -> list[KeyValue]:
    """A rank's resource attributes: as its own process would describe itself."""
    return attributes(
        {
            **base,
            "ddpwatch.job.id": rank.job_id,
            "host.name": rank.host,
            "process.pid": rank.pid,
            "ddpwatch.rank": rank.rank,
            "ddpwatch.local_rank": rank.local_rank,
            "ddpwatch.node_rank": rank.node_rank,
            "ddpwatch.device": rank.device,
            "ddpwatch.device.uuid": rank.device_uuid,
        }
    )


Points = Iterable[tuple[float | int, dict[str, Any]]]
Metrics = Any
"""A ``ScopeMetrics.metrics`` to add to: every message is built in place, as a message handed
to a constructor or ``extend`` is copied (it was most of an export's time)."""


def _set(point: Any, value: float | int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        point.as_double = float(value)
    else:
        point.as_int = value


def _gauge(
    into: Metrics, name: str, unit: str, description: str, points: Points, now_ns: int
) -> None:
    data = into.add(name=name, unit=unit, description=description).gauge.data_points
    for value, labels in points:
        point = data.add(time_unix_nano=now_ns)
        if labels:
            point.attributes.extend(attributes(labels))
        _set(point, value)


def _one(
    into: Metrics, name: str, unit: str, description: str, value: float | int, now_ns: int
) -> None:
    """A gauge of one point without attributes: most of a rank's and a host's."""
    metric = into.add(name=name, unit=unit, description=description)
    _set(metric.gauge.data_points.add(time_unix_nano=now_ns), value)


def _known(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_STATE_ATTRIBUTES = {state: attributes({"ddpwatch.state": str(state)}) for state in STATES}


def _states(
    into: Metrics, counts: Mapping[str, int], now_ns: int, name: str, unit: str, doc: str
) -> None:
    data = into.add(name=name, unit=unit, description=doc).gauge.data_points
    for state in STATES:
        point = data.add(time_unix_nano=now_ns, as_int=counts.get(state, 0))
        point.attributes.extend(_STATE_ATTRIBUTES[state])


def rank_metrics(into: Metrics, rank: RankEntry, now_ns: int) -> None:
    """A rank's gauges: what it reported, its state and its current collective wait."""
    for name, key, unit, doc in RANK_GAUGES:
        value = getattr(rank, key)
        if _known(value):
            _one(into, name, unit, doc, value, now_ns)
    if rank.collective is not None:
        wait = {"ddpwatch.collective": rank.collective.op}
        doc = "Time in the collective the rank is in."
        points = [(rank.collective.since_s, wait)]
        _gauge(into, "ddpwatch.rank.collective_wait", "s", doc, points, now_ns)
    _states(into, {rank.state: 1}, now_ns, "ddpwatch.rank.state", "1", "1 for its state.")


def host_metrics(into: Metrics, host: HostRow, now_ns: int) -> None:
    """A host's aggregates over its ranks, as the summary counts them."""
    for name, key, unit, doc in HOST_GAUGES:
        value = getattr(host, key)
        if _known(value):
            _one(into, name, unit, doc, value, now_ns)
    doc = "Ranks by state."
    _states(into, host.states, now_ns, "ddpwatch.host.ranks.by_state", "{rank}", doc)


def job_metrics(
    into: Metrics, reply: SummaryReply, exported: int, start_ns: int, now_ns: int
) -> None:
    """The job's counts, its active alerts and the server's message counters."""
    summary = reply.summary
    _one(into, "ddpwatch.ranks", "{rank}", "Ranks the server knows of.", summary.ranks, now_ns)
    doc = "Ranks with per-rank series: all, or the worst max_ranks."
    _one(into, "ddpwatch.ranks.exported", "{rank}", doc, exported, now_ns)
    doc = "Hosts past the summary's, in no host series."
    _one(into, "ddpwatch.hosts.omitted", "{host}", doc, summary.hosts_omitted, now_ns)
    if reply.world_size is not None:
        _one(into, "ddpwatch.world_size", "{rank}", "Known world size.", reply.world_size, now_ns)
    alerts = Counter((a.kind, a.severity) for a in reply.alerts)
    by_kind: list[tuple[float | int, dict[str, Any]]] = [
        (n, {"ddpwatch.alert.kind": kind, "ddpwatch.alert.severity": severity})
        for (kind, severity), n in sorted(alerts.items())
    ]
    _gauge(into, "ddpwatch.alerts", "{alert}", "Active alerts.", by_kind or [(0, {})], now_ns)
    _states(into, summary.states, now_ns, "ddpwatch.ranks.by_state", "{rank}", "Ranks by state.")
    cumulative = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    for name, key, doc in COUNTERS:
        total = into.add(name=name, unit="{message}", description=doc).sum
        total.is_monotonic = True
        total.aggregation_temporality = cumulative
        count = int(getattr(reply.stats, key))
        total.data_points.add(start_time_unix_nano=start_ns, time_unix_nano=now_ns, as_int=count)


def _scope() -> InstrumentationScope:
    from ddpwatch import __version__

    return InstrumentationScope(name="ddpwatch", version=__version__)


def job_id(ranks: Sequence[RankEntry]) -> str | None:
    """The job's id as its ranks tell it (``SLURM_JOB_ID``, torchrun's run id), when they
    agree."""
    ids = {rank.job_id for rank in ranks if rank.job_id is not None}
    return ids.pop() if len(ids) == 1 else None


def job_resource(base: Mapping[str, str], job: str | None) -> Resource:
    return Resource(attributes=attributes({**base, "ddpwatch.job.id": job}))


def metrics_request(
    reply: SummaryReply, base: Mapping[str, str], start_ns: int
) -> ExportMetricsServiceRequest:
    """One export of the summary: the job, each of its hosts, each of its worst ranks."""
    now_ns = int(reply.server_time * 1e9)
    scope = _scope()
    job = job_id(reply.ranks)

    request = ExportMetricsServiceRequest()

    def scoped(resource: list[KeyValue]) -> Metrics:
        out = request.resource_metrics.add()
        out.resource.attributes.extend(resource)
        scope_metrics = out.scope_metrics.add()
        scope_metrics.scope.CopyFrom(scope)
        return scope_metrics.metrics

    job_resource = attributes({**base, "ddpwatch.job.id": job})
    job_metrics(scoped(job_resource), reply, len(reply.ranks), start_ns, now_ns)
    for host in reply.summary.hosts:
        resource = attributes({**base, "ddpwatch.job.id": job, "host.name": host.host})
        host_metrics(scoped(resource), host, now_ns)
    for rank in reply.ranks:
        rank_metrics(scoped(rank_attributes(rank, base)), rank, now_ns)
    return request


def log_record(change: HistoryEntry, at_ns: int) -> LogRecord:
    """An alert change as a log record: its message the body, its kind, event, culprits and
    fix attributes; a cleared alert at INFO."""
    alert = change.alert
    cleared = change.event == HistoryEvent.CLEARED
    severity = CLEARED_SEVERITY if cleared else SEVERITY_NUMBERS.get(alert.severity, 9)
    pairs: dict[str, Value | None] = {
        "ddpwatch.alert.event": change.event,
        "ddpwatch.alert.kind": alert.kind,
        "ddpwatch.alert.severity": alert.severity,
        "ddpwatch.alert.ranks": alert.ranks,
        "ddpwatch.alert.waiting": alert.waiting,
        "ddpwatch.alert.hint": alert.hint,
        "ddpwatch.alert.episode": change.episode,
        "ddpwatch.attempt": change.attempt,
        "ddpwatch.elapsed_s": change.elapsed_s,
    }
    if alert.phase is not None:
        pairs["ddpwatch.alert.phase"] = alert.phase
    if alert.waited_s is not None:
        pairs["ddpwatch.alert.waited_s"] = alert.waited_s
    return LogRecord(
        time_unix_nano=at_ns,
        observed_time_unix_nano=at_ns,
        severity_number=severity,  # type: ignore[arg-type]
        severity_text=("INFO" if cleared else alert.severity.upper()),
        body=AnyValue(string_value=alert.message),
        attributes=attributes(pairs),
        event_name="ddpwatch.alert",
    )


def logs_request(
    changes: Sequence[tuple[HistoryEntry, int]], base: Mapping[str, str], job: str | None
) -> ExportLogsServiceRequest:
    """Alert changes (each with its time in ns) as one export, on the job's resource."""
    records = [log_record(change, at_ns) for change, at_ns in changes]
    return ExportLogsServiceRequest(
        resource_logs=[
            ResourceLogs(
                resource=job_resource(base, job),
                scope_logs=[ScopeLogs(scope=_scope(), log_records=records)],
            )
        ]
    )
