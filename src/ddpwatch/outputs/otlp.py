"""OpenTelemetry export (``serve --otlp ENDPOINT``, or the SDK's ``OTEL_EXPORTER_OTLP_*``).

Every ``interval_s`` one daemon thread reads the server's summary (the same cached reply
Prometheus reads: ``status?view=summary&worst=N``) and POSTs it as OTLP metrics; every alert
change (the ``on_change`` stream of ``serve --headless``) becomes a log record, sent with the
next export. Over OTLP/HTTP with protobuf bodies (``opentelemetry-proto`` encodes them,
``urllib`` sends them): the OpenTelemetry SDK's own exporters describe one process with one
resource, where this server speaks for thousands of ranks, each a resource of its own.

Never a stall of the server: ``on_change`` appends to a bounded queue under a lock; encoding
and sending are on the exporter's thread, with a timeout. An endpoint that is down is said in
one line when it first fails and one when it works again; metrics are not queued (the next
export sends the state as it is then), alert records are kept, at most ``LOGS_KEPT``, the
oldest dropped and counted, and sent once it is back.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from ddpwatch.status.schema import HistoryEntry, SummaryReply

log = logging.getLogger("ddpwatch.otlp")

DEFAULT_ENDPOINT = "http://localhost:4318"
"""OTLP/HTTP's default, as the SDK has it."""
DEFAULT_INTERVAL_S = 10.0
"""Between exports, unless ``OTEL_METRIC_EXPORT_INTERVAL`` says (the SDK's default, 60 s, is
long for a live culprit)."""
DEFAULT_TIMEOUT_S = 10.0
"""Per request, unless ``OTEL_EXPORTER_OTLP_TIMEOUT`` says (the SDK's default)."""
LOGS_KEPT = 10_000
"""Alert records kept while the endpoint is away; past it the oldest are dropped."""
LOGS_PER_REQUEST = 512
RETRYABLE = frozenset({429, 502, 503, 504})
"""HTTP answers after which a request is sent again (OTLP/HTTP's rule); any other failure
answer drops its alert records (counted), which would fail again."""
PROTOCOL = "http/protobuf"

Summary = Callable[[int], SummaryReply]
"""The server's summary listing the ``n`` worst ranks (``prometheus.summary_from_query``)."""


class Change(Protocol):
    """What the exporter reads of an alert change: its ``change`` document (and its server
    time ``at``, where it has one)."""

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class OtlpConfig:
    """Where and how to send, from the flag and the SDK's environment variables."""

    metrics_url: str
    logs_url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S
    interval_s: float = DEFAULT_INTERVAL_S
    gzip: bool = False
    resource: Mapping[str, str] = field(default_factory=dict)
    """Every resource's own attributes: ``service.name`` and ``OTEL_RESOURCE_ATTRIBUTES``."""


class OtlpConfigError(ValueError):
    """A flag or variable that cannot be used: its one-line reason."""


def _check_url(url: str, name: str) -> str:
    from ddpwatch.outputs.notify import check_webhook_url

    try:
        return check_webhook_url(url)
    except ValueError as exc:
        raise OtlpConfigError(f"{name}: {exc}") from None


def _signal_url(base: str, signal: str) -> str:
    """A base endpoint's URL for one signal, as the SDK builds it (``/v1/metrics``)."""
    return base.rstrip("/") + f"/v1/{signal}"


def _pairs(text: str, name: str) -> dict[str, str]:
    """``k=v,k2=v2`` with percent-encoded values (W3C baggage style, as the SDK reads
    ``OTEL_EXPORTER_OTLP_HEADERS`` and ``OTEL_RESOURCE_ATTRIBUTES``)."""
    pairs = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise OtlpConfigError(f"{name}: not key=value: {item.strip()!r}")
        pairs[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    return pairs


def _millis(env: Mapping[str, str], name: str, default_s: float) -> float:
    text = env.get(name)
    if not text:
        return default_s
    try:
        value = float(text) / 1000.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise OtlpConfigError(f"{name}: not a positive number of milliseconds: {text}")
    return value


def otlp_config(endpoint: str | None, env: Mapping[str, str]) -> OtlpConfig | None:
    """The export ``--otlp ENDPOINT`` or the environment asks for; None when neither does.

    ``endpoint`` is a base URL like ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/metrics`` and
    ``/v1/logs`` are added); ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` and ``..._LOGS_...``
    are used as they are. ``OTEL_SDK_DISABLED=true`` turns off an export only the
    environment asked for. Raises ``OtlpConfigError`` with the reason."""
    signals = {s: env.get(f"OTEL_EXPORTER_OTLP_{s.upper()}_ENDPOINT") for s in ("metrics", "logs")}
    base_env = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    asked_by_env = bool(base_env or any(signals.values()))
    if endpoint is None and (
        not asked_by_env or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    ):
        return None
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", *(f"OTEL_EXPORTER_OTLP_{s.upper()}_PROTOCOL"
                                                   for s in signals)):
        protocol = env.get(name)
        if protocol and protocol.strip() != PROTOCOL:
            raise OtlpConfigError(
                f"{name}={protocol}: ddpwatch sends OTLP as {PROTOCOL} only (a collector's "
                "port 4318)"
            )
    base = endpoint or base_env or DEFAULT_ENDPOINT
    _check_url(base, "--otlp" if endpoint else "OTEL_EXPORTER_OTLP_ENDPOINT")
    urls = {}
    for signal, own in signals.items():
        name = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
        urls[signal] = _check_url(own, name) if own and not endpoint else _signal_url(base, signal)
    headers = _pairs(env.get("OTEL_EXPORTER_OTLP_HEADERS", ""), "OTEL_EXPORTER_OTLP_HEADERS")
    compression = env.get("OTEL_EXPORTER_OTLP_COMPRESSION", "").strip().lower()
    if compression not in ("", "none", "gzip"):
        raise OtlpConfigError(f"OTEL_EXPORTER_OTLP_COMPRESSION: gzip or none, not {compression}")
    resource = _pairs(env.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES")
    resource["service.name"] = env.get("OTEL_SERVICE_NAME") or resource.get(
        "service.name", "ddpwatch"
    )
    return OtlpConfig(
        metrics_url=urls["metrics"],
        logs_url=urls["logs"],
        headers=headers,
        timeout_s=_millis(env, "OTEL_EXPORTER_OTLP_TIMEOUT", DEFAULT_TIMEOUT_S),
        interval_s=_millis(env, "OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_INTERVAL_S),
        gzip=compression == "gzip",
        resource=resource,
    )


class PostError(Exception):
    """A request that did not succeed: its reason, and whether to send it again."""

    def __init__(self, reason: str, retry: bool) -> None:
        super().__init__(reason)
        self.retry = retry


Post = Callable[[str, bytes], None]
"""Send one body to a URL; raise ``PostError`` when it did not succeed."""


def http_post(config: OtlpConfig) -> Post:
    """POST protobuf bodies the way OTLP/HTTP wants them (``application/x-protobuf``)."""
    from ddpwatch import __version__

    headers = {
        **config.headers,
        "Content-Type": "application/x-protobuf",
        "User-Agent": f"ddpwatch/{__version__}",
    }
    if config.gzip:
        headers["Content-Encoding"] = "gzip"

    def post(url: str, body: bytes) -> None:
        data = gzip.compress(body) if config.gzip else body
        request = urllib.request.Request(url, data=data, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=config.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise PostError(f"HTTP {exc.code} {exc.reason}", exc.code in RETRYABLE) from None
        except TimeoutError:
            raise PostError(f"no answer in {config.timeout_s:g} s", True) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            text = reason.strerror if isinstance(reason, OSError) and reason.strerror else reason
            raise PostError(str(text) or type(exc).__name__, True) from None

    return post


class OtlpExporter:
    """Sends the summary as metrics every ``interval_s`` and the alert changes as log
    records; ``__call__`` is the server's ``on_change``. ``post`` and ``clock`` (unix
    seconds) are the seams tests turn."""

    def __init__(
        self,
        config: OtlpConfig,
        summary: Summary | None = None,
        *,
        max_ranks: int = 1000,
        post: Post | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.max_ranks = max_ranks
        self._summary = summary
        self._post = post or http_post(config)
        self._clock = clock
        self._start_ns = int(clock() * 1e9)
        self._lock = threading.Lock()
        self._changes: deque[tuple[int, dict[str, Any], int]] = deque()  # (seq, change, ns)
        self._next_seq = 0
        self._stop = threading.Event()
        self._exporting = threading.Lock()  # the periodic export and the last one, one at once
        self._thread: threading.Thread | None = None
        self._job: str | None = None  # the job id the last summary gave
        self._down: dict[str, str] = {}  # url -> the reason it failed, while it fails
        self.exports = 0
        """Metric exports the endpoint took."""
        self.records = 0
        """Alert records the endpoint took."""
        self.failed = 0
        """Requests that did not succeed."""
        self.dropped = 0
        """Alert records never sent: over ``LOGS_KEPT`` or refused by the endpoint."""

    @property
    def queued(self) -> int:
        """Alert records waiting for the next export."""
        with self._lock:
            return len(self._changes)

    def bind(self, summary: Summary) -> None:
        """The summary to read, once the server exists (``ddpwatch run`` makes it later)."""
        self._summary = summary

    # the server's thread -------------------------------------------------
    def __call__(self, change: Change) -> None:
        """Queue an alert change for the next export: a lock and an append."""
        try:
            entry = change.to_dict()
        except Exception:
            self._add_dropped(1)
            return
        at = getattr(change, "at", None)  # the server's time of the change (a replay's too)
        now_ns = int((at if isinstance(at, float) and at > 0 else self._clock()) * 1e9)
        with self._lock:
            if len(self._changes) >= LOGS_KEPT:
                self._changes.popleft()
                self.dropped += 1
            self._changes.append((self._next_seq, entry, now_ns))
            self._next_seq += 1

    # the exporter's thread ------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ddpwatch-otlp", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self.export()

    def export(self) -> None:
        """One export: the metrics as they are now, then the alert records queued."""
        with self._exporting:
            try:
                self._export_metrics()
            except Exception as exc:  # a bug here must not end the thread
                log.warning("OTLP: could not build the metrics: %r", exc)
            try:
                self._export_logs()
            except Exception as exc:
                log.warning("OTLP: could not build the alert records: %r", exc)

    def _export_metrics(self) -> None:
        if self._summary is None:
            return
        from ddpwatch.outputs.otlp_encode import job_id, metrics_request

        reply = self._summary(self.max_ranks)
        self._job = job_id(reply.ranks) or self._job
        body = metrics_request(reply, self.config.resource, self._start_ns).SerializeToString()
        if self._send(self.config.metrics_url, body):
            self.exports += 1

    def _export_logs(self) -> None:
        from ddpwatch.outputs.otlp_encode import logs_request

        while True:
            with self._lock:
                batch = [self._changes[i] for i in range(min(LOGS_PER_REQUEST, len(self._changes)))]
            if not batch:
                return
            changes = []
            for _seq, entry, at_ns in batch:
                try:
                    changes.append((msgspec.convert(entry, HistoryEntry), at_ns))
                except msgspec.ValidationError:
                    self._add_dropped(1)
            body = logs_request(changes, self.config.resource, self._job).SerializeToString()
            sent = self._send(self.config.logs_url, body, records=len(changes))
            if sent is False:
                return  # kept for the next export
            self._forget(batch[-1][0])
            if sent:
                self.records += len(changes)
            else:
                self._add_dropped(len(changes))

    def _add_dropped(self, count: int) -> None:
        with self._lock:
            self.dropped += count

    def _forget(self, last_seq: int) -> None:
        with self._lock:
            while self._changes and self._changes[0][0] <= last_seq:
                self._changes.popleft()

    def _send(self, url: str, body: bytes, records: int = 0) -> bool | None:
        """True when taken; False when worth sending again; None when refused for good."""
        try:
            self._post(url, body)
        except PostError as exc:
            self.failed += 1
            if url not in self._down:
                self._down[url] = str(exc)
                kept = f"; {records} alert records kept" if exc.retry and records else ""
                log.warning(
                    "OTLP export to %s failed: %s (sent again every %g s%s)",
                    url, exc, self.config.interval_s, kept,
                )
            if not exc.retry:
                return None
            return False
        if self._down.pop(url, None) is not None:
            log.warning("OTLP export to %s works again", url)
        return True

    def close(self, drain_s: float = 5.0) -> None:
        """Stop; one last export (the verdict's last alerts), bounded by ``drain_s``. Once."""
        if self._stop.is_set():
            return
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(drain_s)
            if thread.is_alive():  # stuck on an endpoint that does not answer: no second wait
                log.warning("OTLP: the last export was not sent: %s does not answer",
                            self.config.metrics_url)
                return
        last = threading.Thread(target=self.export, name="ddpwatch-otlp-last", daemon=True)
        last.start()
        last.join(drain_s)
        if self.failed or self.dropped:
            log.warning(
                "OTLP: %d exports and %d alert records sent, %d requests failed, "
                "%d alert records dropped",
                self.exports, self.records, self.failed, self.dropped,
            )
