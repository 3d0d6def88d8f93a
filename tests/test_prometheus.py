"""Prometheus exporter: a real HTTP scrape of the metrics of a real status document."""

from __future__ import annotations

import urllib.request

from conftest import free_port_pair
from prometheus_client.parser import text_string_to_metric_families

from ddpwatch.protocol import Sample
from ddpwatch.server.alerts import Thresholds
from ddpwatch.server.prometheus import serve_metrics
from ddpwatch.server.rules import diagnose
from ddpwatch.server.state import ServerState
from ddpwatch.server.status import status_document


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
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(port), "--prometheus-port", str(metrics)],
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
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    assert proc.returncode == 0
    json.dumps(text)
