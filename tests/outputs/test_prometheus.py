"""Prometheus exporter: a real HTTP scrape of the metrics of a real status document."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import free_port_pair
from prometheus_client.parser import text_string_to_metric_families

from ddpwatch.cli import main
from ddpwatch.core.protocol import ErrorInfo, Event, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.rules import diagnose
from ddpwatch.outputs.prometheus import RANK_GAUGES, STATES, serve_metrics, summary_from_query
from ddpwatch.server import engine
from ddpwatch.server.document import status_document
from ddpwatch.server.service import Server
from ddpwatch.state.state import ServerState
from ddpwatch.status.schema import StatusDocument

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample of a real HTTP scrape of ``/metrics``, by name and sorted labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def ranks_of(samples: Samples, name: str) -> list[int]:
    """The ranks with a sample of ``name``, each once, sorted."""
    return sorted({int(dict(labels)["rank"]) for n, labels in samples if n == name})


def test_scrape_shows_ranks_states_and_alerts() -> None:
    state = ServerState(started=0.0)
    for rank in range(3):
        state.apply(
            Sample(
                v=1,
                rank=rank,
                t=0,
                world_size=4,
                local_rank=rank,
                host="node-a",
                step=7,
                loss=0.5,
                step_time_s=0.1,
            ),
            100.0,
        )
    # ranks 0 and 1 report a finite loss at the step rank 2 went bad: it went first
    state.apply(Sample(v=1, rank=2, t=0, step=7, loss=float("nan")), 100.0)
    th = Thresholds(connect_after=1.0)

    def status():
        return status_document(state, diagnose(state, 101.0, th), 101.0, th)

    port = free_port_pair()
    server = serve_metrics(status, port)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert (
        samples[("ddpwatch_rank_step", (("host", "node-a"), ("local_rank", "0"), ("rank", "0")))]
        == 7
    )
    assert (
        samples[
            (
                "ddpwatch_rank_state",
                (("host", "node-a"), ("local_rank", "1"), ("rank", "1"), ("state", "running")),
            )
        ]
        == 1
    )
    assert (
        samples[
            (
                "ddpwatch_rank_state",
                (("host", ""), ("local_rank", ""), ("rank", "3"), ("state", "not_connected")),
            )
        ]
        == 1
    )
    assert (
        "ddpwatch_rank_loss",
        (("host", "node-a"), ("local_rank", "2"), ("rank", "2")),
    ) not in samples  # NaN is absent
    assert samples[("ddpwatch_alerts", (("kind", "nan_loss"), ("severity", "error")))] == 1
    assert samples[("ddpwatch_world_size", ())] == 4
    assert samples[("ddpwatch_messages_received_total", ())] == 4


def test_serve_exposes_metrics_on_the_prometheus_port() -> None:
    import json
    import signal
    import subprocess
    import sys
    import time

    port, metrics = free_port_pair(), free_port_pair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(port), "--prometheus-port", str(metrics), "--prometheus-max-ranks", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                text = (
                    urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=2)
                    .read()
                    .decode()
                )
                break
            except OSError:
                assert time.monotonic() < deadline, proc.stderr
                time.sleep(0.2)
        assert "ddpwatch_messages_received_total 0.0" in text
        assert "ddpwatch_ranks 0.0" in text and "ddpwatch_ranks_exported 0.0" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    assert proc.returncode == 0
    json.dumps(text)


# ------------------------------------------------------------------------------ large jobs

WORLD = 50  # ranks 0-47 report; 48 and 49 never do
CRASHED, SILENT, STALLED, MISSING = (5, 17), (3, 30, 41, 44), (8, 9, 22, 47), (48, 49)
WORST = sorted({*CRASHED, *SILENT, *STALLED})  # the ten worst: not_connected comes after stalled


class FrozenClock:
    """The server's clock, moved only by the test: ranks' states stay put while it looks."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def beat(rank: int, step: int) -> Sample:
    return Sample(
        v=1, rank=rank, t=0, world_size=WORLD, local_rank=rank % 8, host=f"node{rank // 8}",
        step=step, loss=0.5, step_time_s=0.1, mem_allocated_bytes=1000, mem_reserved_bytes=2000,
        gpu_mem_used_bytes=3000, gpu_mem_total_bytes=8000,
    )  # fmt: skip


@pytest.fixture
def large(port: int) -> Iterator[Server]:
    """A real ``Server`` (not running: its methods are called here) holding a job of 50 ranks:
    two crashed, four silent, four stalled, two never connected, 38 running; diagnosed once."""
    clock = FrozenClock(100.0)
    server = Server("127.0.0.1", port, Thresholds(silent_after=5.0, stall_after=20.0), clock=clock)
    try:
        for rank in range(48):
            server.state.apply(beat(rank, 7), 100.0)
        for rank in range(48):
            if rank not in SILENT:  # the stalled ones still report, at the same step
                server.state.apply(beat(rank, 7 if rank in STALLED else 8), 130.0)
        for rank in CRASHED:
            crash = Event(v=1, rank=rank, t=0, event="crash", error=ErrorInfo(type="E"))
            server.state.apply(crash, 130.0)
        clock.now = 131.0
        server.tick()
        yield server
    finally:
        server.collector.close()


def serve_and_scrape(server: Server, **options: Any) -> Samples:
    port = free_port_pair()
    metrics = serve_metrics(server.status, port, **options)
    try:
        return scrape(port)
    finally:
        metrics.shutdown()


@pytest.mark.parametrize("read", ["summary", "status"])
def test_a_large_job_exports_its_worst_ranks_and_counts_them_all(large: Server, read: str) -> None:
    summary = summary_from_query(large.query_json) if read == "summary" else None
    samples = serve_and_scrape(large, summary=summary, max_ranks=10)
    for name, _, _ in RANK_GAUGES:
        assert ranks_of(samples, name) == WORST, name
        assert sum(1 for n, _ in samples if n == name) == 10, name
    assert ranks_of(samples, "ddpwatch_rank_state") == WORST
    assert sum(1 for n, _ in samples if n == "ddpwatch_rank_state") == 10 * len(STATES)
    full = {entry.rank: entry for entry in large.status().ranks}
    for rank in WORST:
        entry = full[rank]
        labels = (
            ("host", entry.host or ""),
            ("local_rank", "" if entry.local_rank is None else str(entry.local_rank)),
            ("rank", str(rank)),
        )
        assert samples[("ddpwatch_rank_state", (*labels, ("state", entry.state)))] == 1
        if entry.step is not None:
            assert samples[("ddpwatch_rank_step", labels)] == entry.step
    assert samples[("ddpwatch_ranks", ())] == WORLD
    assert samples[("ddpwatch_ranks_exported", ())] == 10
    counts = {state: samples[("ddpwatch_ranks_by_state", (("state", state),))] for state in STATES}
    assert counts == {
        "running": 38, "waiting": 0, "stalled": 4, "busy": 0, "silent": 4, "crashed": 2,
        "stopped": 0, "exited": 0, "not_connected": 2,
    }  # fmt: skip
    assert samples[("ddpwatch_alerts", (("kind", "crashed"), ("severity", "error")))] >= 1
    assert samples[("ddpwatch_world_size", ())] == WORLD


def test_a_job_within_max_ranks_reads_the_whole_document_as_before(large: Server) -> None:
    with_summary = serve_and_scrape(large, summary=summary_from_query(large.query_json))
    assert with_summary == serve_and_scrape(large)  # every rank, from the same document
    assert ranks_of(with_summary, "ddpwatch_rank_step") == list(range(48))
    assert ranks_of(with_summary, "ddpwatch_rank_state") == list(range(WORLD))
    assert with_summary[("ddpwatch_ranks_exported", ())] == WORLD


def test_a_scrape_past_max_ranks_never_builds_the_whole_document(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []
    real = engine.status_document

    def counting(*args: Any, **kwargs: Any) -> dict[str, Any]:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "status_document", counting)
    clock = FrozenClock(1.0)
    server = Server("127.0.0.1", port, clock=clock)  # not running: its methods are called here
    try:
        for rank in range(5000):
            sample = Sample(v=1, rank=rank, t=0, host=f"node{rank // 8}", step=7, loss=0.5)
            server.state.apply(sample, 1.0)
        clock.now = 2.0
        status_calls: list[int] = []

        def status() -> StatusDocument:
            status_calls.append(1)
            return server.status()

        metrics_port = free_port_pair()
        metrics = serve_metrics(
            status, metrics_port, summary=summary_from_query(server.query_json), max_ranks=10
        )
        try:
            samples = scrape(metrics_port)
            assert scrape(metrics_port) == samples  # the summary is cached for the tick
        finally:
            metrics.shutdown()
        assert (status_calls, built) == ([], [])
        assert samples[("ddpwatch_ranks", ())] == 5000
        assert samples[("ddpwatch_ranks_exported", ())] == 10
        assert ranks_of(samples, "ddpwatch_rank_loss") == list(range(10))  # all run: by rank
        assert samples[("ddpwatch_ranks_by_state", (("state", "running"),))] == 5000
    finally:
        server.collector.close()


def test_max_ranks_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="from 0 to 1000"):
        serve_metrics(lambda: {}, free_port_pair(), summary=lambda n: {}, max_ranks=1001)
    for value in ("1001", "-1", "x"):
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--prometheus-port", "9101", "--prometheus-max-ranks", value])
        assert exited.value.code == 2
        assert "argument --prometheus-max-ranks:" in capsys.readouterr().err


@pytest.mark.parametrize("max_ranks", [0, 1, 8, 12])
def test_the_summary_and_the_whole_document_pick_the_same_worst_ranks(
    large: Server, max_ranks: int
) -> None:
    summary = summary_from_query(large.query_json)
    from_summary = serve_and_scrape(large, summary=summary, max_ranks=max_ranks)
    assert from_summary == serve_and_scrape(large, max_ranks=max_ranks)
    assert len(ranks_of(from_summary, "ddpwatch_rank_state")) == max_ranks
    assert from_summary[("ddpwatch_ranks_exported", ())] == max_ranks
    if max_ranks == 12:  # past the stalled ranks: the never connected ones are next
        assert ranks_of(from_summary, "ddpwatch_rank_state") == sorted([*WORST, *MISSING])
