"""OTLP export: a real HTTP receiver in the test decodes the real protobuf requests."""

from __future__ import annotations

import gzip
import http.server
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port_pair
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from ddpwatch.core.protocol import ErrorInfo, Event, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.outputs import otlp
from ddpwatch.outputs.otlp import OtlpConfig, OtlpConfigError, OtlpExporter, otlp_config
from ddpwatch.outputs.prometheus import summary_from_query
from ddpwatch.server.service import Server

# ------------------------------------------------------------------------------ the receiver


class Receiver:
    """An OTLP/HTTP endpoint on 127.0.0.1: keeps each request's path, headers and body;
    ``answer`` is the HTTP status it gives."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port_pair()
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.answer = 200
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver._lock:
                    receiver.requests.append((self.path, dict(self.headers), body))
                self.send_response(receiver.answer)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def bodies(self, path: str) -> list[bytes]:
        with self._lock:
            found = [(h, b) for p, h, b in self.requests if p == path]
        return [gzip.decompress(b) if h.get("Content-Encoding") == "gzip" else b for h, b in found]

    def metrics(self) -> list[ExportMetricsServiceRequest]:
        return [ExportMetricsServiceRequest.FromString(b) for b in self.bodies("/v1/metrics")]

    def logs(self) -> list[ExportLogsServiceRequest]:
        return [ExportLogsServiceRequest.FromString(b) for b in self.bodies("/v1/logs")]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    try:
        yield found
    finally:
        found.close()


def attrs(resource_or_point: Any) -> dict[str, Any]:
    """Attributes as plain values (ints, strings, lists of ints)."""
    out: dict[str, Any] = {}
    for kv in resource_or_point.attributes:
        which = kv.value.WhichOneof("value")
        if which == "array_value":
            out[kv.key] = [v.int_value for v in kv.value.array_value.values]
        else:
            out[kv.key] = getattr(kv.value, which)
    return out


def points(request: ExportMetricsServiceRequest) -> dict[tuple[str, tuple[Any, ...]], float]:
    """(metric, resource attributes + point attributes) -> value, over the whole request."""
    out = {}
    for rm in request.resource_metrics:
        res = attrs(rm.resource)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                data = metric.gauge if metric.HasField("gauge") else metric.sum
                for p in data.data_points:
                    key = {**res, **attrs(p)}
                    value = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
                    out[(metric.name, tuple(sorted(key.items())))] = value
    return out


def value(found: dict[tuple[str, tuple[Any, ...]], float], name: str, **labels: Any) -> float:
    """The one point of ``name`` whose attributes include ``labels``."""
    hits = [v for (n, key), v in found.items() if n == name and set(labels.items()) <= set(key)]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


# ------------------------------------------------------------------------------ a job


class FrozenClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def beat(rank: int, step: int, world: int = 4) -> Sample:
    return Sample(
        v=1, rank=rank, t=0, world_size=world, local_rank=rank % 2, host=f"node{rank // 2}",
        pid=1000 + rank, device=f"cuda:{rank % 2}", job_id="4242", step=step, loss=0.5,
        step_time_s=0.1, mem_allocated_bytes=1000 * (rank + 1), gpu_mem_used_bytes=3000,
    )  # fmt: skip


@pytest.fixture
def job(port: int) -> Iterator[tuple[Server, OtlpExporter, Receiver]]:
    """A real ``Server`` (its methods called here) of 4 ranks on two hosts, rank 3 crashed,
    with an exporter as its ``on_change`` sending to a receiver."""
    clock = FrozenClock(100.0)
    found = Receiver()
    config = otlp_config(found.url, {})
    assert config is not None
    exporter = OtlpExporter(config, clock=clock)
    server = Server("127.0.0.1", port, Thresholds(), clock=clock, on_change=exporter)
    exporter.bind(summary_from_query(server.query_json))
    try:
        for rank in range(4):
            server.state.apply(beat(rank, 7), 100.0)
        crash = Event(v=1, rank=3, t=0, event="crash", error=ErrorInfo(type="OSError"))
        server.state.apply(crash, 100.5)
        clock.now = 101.0
        server.tick()
        yield server, exporter, found
    finally:
        server.collector.close()
        found.close()


def test_the_summary_goes_out_as_metrics_with_a_resource_per_rank_and_host(
    job: tuple[Server, OtlpExporter, Receiver],
) -> None:
    server, exporter, found = job
    exporter.export()
    [request] = found.metrics()
    got = points(request)
    rank2 = {"ddpwatch.rank": 2, "host.name": "node1", "ddpwatch.local_rank": 0,
             "process.pid": 1002, "ddpwatch.device": "cuda:0", "ddpwatch.job.id": "4242",
             "service.name": "ddpwatch"}  # fmt: skip
    assert value(got, "ddpwatch.rank.step", **rank2) == 7
    assert value(got, "ddpwatch.rank.memory.allocated", **rank2) == 3000
    assert value(got, "ddpwatch.rank.loss", **{"ddpwatch.rank": 2}) == 0.5
    assert value(got, "ddpwatch.rank.state", **{"ddpwatch.rank": 3, "ddpwatch.state": "crashed"})
    assert not value(got, "ddpwatch.rank.state", **{"ddpwatch.rank": 3, "ddpwatch.state": "running"})
    # the hosts' aggregates, a resource each
    node1 = {"host.name": "node1"}
    assert value(got, "ddpwatch.host.ranks", **node1) == 2
    assert value(got, "ddpwatch.host.memory.allocated", **node1) == 7000
    assert value(got, "ddpwatch.host.ranks.by_state", **node1, **{"ddpwatch.state": "crashed"}) == 1
    # the job: counts, the alert, the server's counters
    assert value(got, "ddpwatch.ranks") == 4
    assert value(got, "ddpwatch.ranks.by_state", **{"ddpwatch.state": "running"}) == 3
    crashes = value(got, "ddpwatch.alerts", **{"ddpwatch.alert.kind": "crashed"})
    assert crashes == 1
    assert value(got, "ddpwatch.messages.received") == server.state.received
    # the point time is the summary's own
    gauge = request.resource_metrics[0].scope_metrics[0].metrics[0].gauge
    assert gauge.data_points[0].time_unix_nano == int(101.0 * 1e9)


def test_an_alert_change_goes_out_once_as_a_log_record(
    job: tuple[Server, OtlpExporter, Receiver],
) -> None:
    _server, exporter, found = job
    exporter.export()
    exporter.export()  # nothing new: no second record
    records = [r for req in found.logs() for rl in req.resource_logs
               for sl in rl.scope_logs for r in sl.log_records]  # fmt: skip
    crash = [r for r in records if attrs(r)["ddpwatch.alert.kind"] == "crashed"]
    assert len(crash) == 1
    [record] = crash
    assert record.severity_text == "ERROR" and record.severity_number == 17
    assert record.event_name == "ddpwatch.alert"
    assert "rank 3" in record.body.string_value
    assert attrs(record)["ddpwatch.alert.ranks"] == [3]
    assert attrs(record)["ddpwatch.alert.event"] == "raised"
    assert attrs(record)["ddpwatch.alert.hint"]
    assert exporter.records == len(records) and exporter.dropped == 0
    resource = attrs(found.logs()[0].resource_logs[0].resource)
    assert resource["ddpwatch.job.id"] == "4242" and resource["service.name"] == "ddpwatch"


def test_the_endpoint_going_away_is_said_once_and_the_records_wait_for_it(
    job: tuple[Server, OtlpExporter, Receiver], caplog: pytest.LogCaptureFixture
) -> None:
    _server, exporter, found = job
    port = found.port
    found.close()
    with caplog.at_level(logging.WARNING, "ddpwatch.otlp"):
        started = time.monotonic()
        exporter.export()
        exporter.export()
        assert time.monotonic() - started < 5  # refused at once: never a long stall
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 2, failed  # metrics and logs, each said once over two exports
    assert any("/v1/logs" in line and "alert records kept" in line for line in failed)
    assert exporter.records == 0 and exporter.failed == 4
    back = Receiver(port)
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, "ddpwatch.otlp"):
            exporter.export()
        assert any("works again" in r.getMessage() for r in caplog.records)
        kinds = [attrs(r)["ddpwatch.alert.kind"] for req in back.logs()
                 for rl in req.resource_logs for sl in rl.scope_logs for r in sl.log_records]  # fmt: skip
        assert "crashed" in kinds and exporter.dropped == 0
        assert len(back.metrics()) == 1
    finally:
        back.close()


def test_a_refused_request_drops_its_records_and_a_retryable_one_keeps_them(
    job: tuple[Server, OtlpExporter, Receiver],
) -> None:
    _server, exporter, found = job
    queued = exporter.queued
    assert queued >= 1
    found.answer = 503
    exporter.export()
    assert exporter.queued == queued and exporter.dropped == 0
    found.answer = 400  # would fail again: not kept
    exporter.export()
    assert exporter.queued == 0 and exporter.dropped == queued and exporter.records == 0


def test_records_kept_while_away_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otlp, "LOGS_KEPT", 5)

    class Change:
        def __init__(self, n: int) -> None:
            self.n = n

        def to_dict(self) -> dict[str, Any]:
            alert = {"kind": "stalled", "severity": "error", "ranks": [self.n], "waiting": [],
                     "message": f"rank {self.n}", "hint": "look"}  # fmt: skip
            return {"event": "raised", "alert": alert}

    sent: list[bytes] = []
    config = OtlpConfig(metrics_url="http://x/v1/metrics", logs_url="http://x/v1/logs")
    exporter = OtlpExporter(config, post=lambda url, body: sent.append(body))
    for n in range(8):
        exporter(Change(n))
    assert exporter.queued == 5 and exporter.dropped == 3
    exporter.export()
    [body] = sent
    records = ExportLogsServiceRequest.FromString(body).resource_logs[0].scope_logs[0].log_records
    assert [r.body.string_value for r in records] == [f"rank {n}" for n in range(3, 8)]


# ------------------------------------------------------------------------------ configuration


def test_the_flag_is_a_base_url_and_the_sdk_variables_are_read() -> None:
    config = otlp_config("http://collector:4318/", {})
    assert config is not None
    assert config.metrics_url == "http://collector:4318/v1/metrics"
    assert config.logs_url == "http://collector:4318/v1/logs"
    assert config.interval_s == otlp.DEFAULT_INTERVAL_S and not config.gzip
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel.example:4318",
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "https://logs.example/ingest",
        "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%3Dcret, x-team=ml",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_METRIC_EXPORT_INTERVAL": "30000",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,team=ml",
        "OTEL_SERVICE_NAME": "train-watch",
    }
    config = otlp_config(None, env)
    assert config is not None
    assert config.metrics_url == "https://otel.example:4318/v1/metrics"
    assert config.logs_url == "https://logs.example/ingest"  # a signal's own URL, as it is
    assert dict(config.headers) == {"api-key": "s=cret", "x-team": "ml"}
    assert config.timeout_s == 2.5 and config.interval_s == 30.0 and config.gzip
    assert dict(config.resource) == {
        "deployment.environment": "prod", "team": "ml", "service.name": "train-watch"
    }  # fmt: skip


def test_nothing_asked_is_no_export_and_the_sdk_switch_turns_the_environment_off() -> None:
    assert otlp_config(None, {}) is None
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    assert otlp_config(None, env) is None
    assert otlp_config("http://c:4318", env) is not None  # the flag is asked for by name
    only_metrics = otlp_config(None, {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m/x"})
    assert only_metrics is not None and only_metrics.metrics_url == "http://m/x"
    assert only_metrics.logs_url == "http://localhost:4318/v1/logs"  # the SDK's default


@pytest.mark.parametrize(
    ("endpoint", "env", "said"),
    [
        ("collector:4318", {}, "not an http:// or https:// URL"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://c"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ("http://c", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf only"),
        ("http://c", {"OTEL_METRIC_EXPORT_INTERVAL": "soon"}, "milliseconds"),
        ("http://c", {"OTEL_EXPORTER_OTLP_HEADERS": "novalue"}, "not key=value"),
        ("http://c", {"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "gzip or none"),
    ],
)
def test_a_setting_that_cannot_be_used_is_one_line(
    endpoint: str | None, env: dict[str, str], said: str
) -> None:
    with pytest.raises(OtlpConfigError, match=said):
        otlp_config(endpoint, env)


# ------------------------------------------------------------------------------ serve --otlp


def test_serve_exports_to_the_collector_the_flag_names(receiver: Receiver) -> None:
    port = free_port_pair()
    env = {**os.environ, "OTEL_METRIC_EXPORT_INTERVAL": "300", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(port),
         "--otlp", receiver.url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not receiver.metrics():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert value(points(receiver.metrics()[0]), "ddpwatch.ranks") == 0
    assert f"exporting OTLP metrics to {receiver.url}/v1/metrics" in err


def test_serve_refuses_a_protocol_it_does_not_speak_in_one_line() -> None:
    env = {**os.environ, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    done = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(free_port_pair()),
         "--otlp", "http://127.0.0.1:4318"],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "ddpwatch: OTEL_EXPORTER_OTLP_PROTOCOL=grpc: ddpwatch sends OTLP as http/protobuf only "
        "(a collector's port 4318)"
    ]


@pytest.mark.e2e
def test_run_exports_the_ranks_and_the_crash_of_a_real_job(
    receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ddpwatch run --otlp --mlflow`` on a real torchrun job (3 gloo ranks, rank 1 raising
    at step 20): each rank a resource with its host and pid, and the crash a log record naming
    rank 1, sent by the export that closes the run at the latest; the run's account in a new
    MLflow run of a local store, with the report of the run's recording (one job for both
    hand-offs: the suite's time)."""
    from conftest import EXAMPLES
    from mlflow.tracking import MlflowClient

    from ddpwatch.core.ports import free_port_pair as master

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPWATCH_", "OTEL_"))}
    store = (tmp_path / "mlruns").as_uri()
    env.update(
        OMP_NUM_THREADS="1", OTEL_METRIC_EXPORT_INTERVAL="500", MLFLOW_TRACKING_URI=store,
        MLFLOW_ALLOW_FILE_STORE="true",
    )  # fmt: skip
    env.pop("MLFLOW_RUN_ID", None)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this test's own client reads it
    command = [
        sys.executable, "-m", "ddpwatch", "run", "--otlp", receiver.url, "--mlflow", "--",
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3",
        "--master-addr=127.0.0.1", f"--master-port={master()}",
        str(EXAMPLES / "failures.py"), "--mode", "raise", "--steps", "40",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert done.returncode != 0, done.stderr[-3000:]
    ranks = {}
    for request in receiver.metrics():
        for rm in request.resource_metrics:
            res = attrs(rm.resource)
            if "ddpwatch.rank" in res:
                ranks[res["ddpwatch.rank"]] = res
    assert sorted(ranks) == [0, 1, 2], done.stderr[-3000:]
    assert all(r["host.name"] and r["process.pid"] > 0 for r in ranks.values())
    assert {r["ddpwatch.local_rank"] for r in ranks.values()} == {0, 1, 2}
    records = [r for req in receiver.logs() for rl in req.resource_logs
               for sl in rl.scope_logs for r in sl.log_records]  # fmt: skip
    crashed = [attrs(r) for r in records if attrs(r)["ddpwatch.alert.kind"] == "crashed"]
    assert crashed and crashed[0]["ddpwatch.alert.ranks"] == [1], done.stderr[-3000:]
    assert "OTLP export" not in done.stderr  # no failure said
    [run] = MlflowClient(tracking_uri=store).search_runs(["0"])
    assert f"ddpwatch run: logged to MLflow run {run.info.run_id}" in done.stderr
    assert run.data.tags["ddpwatch.culprits"] == "1" and run.info.status == "FAILED"
    assert run.info.run_name.startswith("ddpwatch-failures-")  # the recording's name
    listed = MlflowClient(tracking_uri=store).list_artifacts(run.info.run_id, "ddpwatch")
    files = {f.path for f in listed}
    assert "ddpwatch/report.html" in files and "ddpwatch/report.json" in files
