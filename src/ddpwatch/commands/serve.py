"""``ddpwatch serve``: collect every rank and flag problems (dashboard, or ``--headless``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from ddpwatch.commands._args import (
    Subparsers,
    _port,
    _positive_int,
    add_address,
    add_bell,
    add_notify,
    add_otlp,
    add_thresholds,
    add_trackers,
    notifier,
    otlp_exporter,
    thresholds,
    trackers,
    trackers_refused,
    whole_number,
)

if TYPE_CHECKING:
    from ddpwatch.outputs.notify import Notifier
    from ddpwatch.outputs.otlp import OtlpExporter
    from ddpwatch.server.service import Server

NAME = "serve"

log = logging.getLogger("ddpwatch")


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    serve = subparsers.add_parser(NAME, help="collect every rank and flag problems")
    add_address(serve)
    serve.add_argument(
        "--prometheus-port",
        type=_port,
        default=None,
        metavar="P",
        help="serve Prometheus metrics on this port (docs/prometheus.md)",
    )
    serve.add_argument(
        "--prometheus-max-ranks",
        type=whole_number(0, 1000),
        default=1000,
        metavar="N",
        help="per-rank metrics for at most the N worst ranks, 0-1000 (default 1000)",
    )
    serve.add_argument(
        "--headless",
        action="store_true",
        help="no dashboard: one JSON line per alert raised or cleared",
    )
    add_thresholds(serve)
    serve.add_argument(
        "--record",
        metavar="FILE",
        default=None,
        help="append every accepted message to FILE, for ddpwatch replay (docs/recording.md)",
    )
    serve.add_argument(
        "--curve-secret-file",
        metavar="F",
        default=None,
        help="encrypt and authenticate with this CurveZMQ secret key (ddpwatch keygen); "
        "ranks and clients then need DDPWATCH_SERVER_KEY",
    )
    serve.add_argument(
        "--curve-clients",
        metavar="DIR",
        default=None,
        help="with --curve-secret-file: allow only the client public keys (*.key) in DIR",
    )
    serve.add_argument(
        "--max-ranks",
        type=_positive_int,
        default=None,
        metavar="N",
        help="track at most N ranks (default: world size + 64, or 1024 while unknown)",
    )
    add_otlp(serve)
    add_trackers(serve)
    add_notify(serve)
    add_bell(serve)
    return serve


def run(args: argparse.Namespace) -> int:
    from ddpwatch.commands._signals import stop_on_signals

    if args.curve_clients and not args.curve_secret_file:
        print("ddpwatch: --curve-clients needs --curve-secret-file", file=sys.stderr)
        return 2
    refused = trackers_refused(args)
    if refused is not None:
        print(f"ddpwatch: {refused}", file=sys.stderr)
        return 2
    try:
        otlp = otlp_exporter(args)
    except ValueError as exc:
        print(f"ddpwatch: {exc}", file=sys.stderr)
        return 2
    notify = notifier(args)  # its thread starts with the first alert it sends
    server = _make_server(args, notify, otlp)
    if server is None:
        return 1
    _announce(args, notify, otlp)
    if args.prometheus_port is not None and not _serve_metrics(args, server):
        return 1
    if otlp is not None:
        from ddpwatch.outputs.prometheus import summary_from_query

        otlp.bind(summary_from_query(server.query_json))
        otlp.start()
    if not args.headless:
        from ddpwatch.tui.app import run_dashboard

        try:
            return run_dashboard(server, bell=not args.no_bell)
        finally:
            _finish(server, args, notify, otlp)
    stop_on_signals(server)
    log.info(
        "listening for ranks on tcp://%s:%d, status on port %d", args.host, args.port, args.port + 1
    )
    try:
        server.run()
        log.info("stopped")
    finally:
        _finish(server, args, notify, otlp)
    return 0


def _finish(
    server: Server, args: argparse.Namespace, notify: Notifier | None, otlp: OtlpExporter | None
) -> None:
    """The last alerts and metrics out, then the summary and the trackers' hand-off."""
    if notify is not None:
        notify.close()
    if otlp is not None:
        otlp.close()
    _summarize(server, args)


def _make_server(
    args: argparse.Namespace, notify: Notifier | None, otlp: OtlpExporter | None
) -> Server | None:
    """The server the flags ask for, its sockets bound; None once told why there is none (a
    port in use, an unusable CURVE key, a recording that cannot be written)."""
    from ddpwatch.core.security import CurveKeyError, ServerCurve
    from ddpwatch.diagnosis.history import print_json_line
    from ddpwatch.outputs.notify import chain
    from ddpwatch.server.collector import BindError
    from ddpwatch.server.recording import RecordingError
    from ddpwatch.server.service import Server

    try:
        curve = (
            ServerCurve.from_files(args.curve_secret_file, args.curve_clients)
            if args.curve_secret_file
            else None
        )
        return Server(
            args.host,
            args.port,
            thresholds(args),
            on_change=chain(print_json_line, notify, otlp),
            record=args.record,
            curve=curve,
            max_ranks=args.max_ranks,
        )
    except (BindError, CurveKeyError, RecordingError) as exc:
        print(f"ddpwatch: {exc}", file=sys.stderr)
        return None


def _announce(
    args: argparse.Namespace, notify: Notifier | None, otlp: OtlpExporter | None
) -> None:
    """Say what the server does besides listening: warn when anyone who can reach it may
    use it (no CURVE key, not on loopback), name the recording and the notifications."""
    from ddpwatch.core.security import is_loopback

    if not args.curve_secret_file and not is_loopback(args.host):
        print(
            f"ddpwatch: warning: listening on {args.host} without authentication: anyone who "
            f"can reach ports {args.port}-{args.port + 1} can send data and read the status "
            "(see ddpwatch keygen and --curve-secret-file)",
            file=sys.stderr,
        )
    if args.record:
        log.info("recording to %s", args.record)
    if notify is not None:
        log.info("notifying of each raised alert of severity %s or worse", args.notify_level)
    if otlp is not None:
        log.info(
            "exporting OTLP metrics to %s every %g s, alert records to %s",
            otlp.config.metrics_url,
            otlp.config.interval_s,
            otlp.config.logs_url,
        )


def _serve_metrics(args: argparse.Namespace, server: Server) -> bool:
    """Serve ``--prometheus-port``; False (the server closed) when the port cannot be had."""
    from ddpwatch.outputs.prometheus import serve_metrics, summary_from_query

    try:
        serve_metrics(
            server.status,
            args.prometheus_port,
            args.host,
            summary=summary_from_query(server.query_json),
            max_ranks=args.prometheus_max_ranks,
        )
    except OSError as exc:
        print(
            f"ddpwatch: cannot serve metrics on port {args.prometheus_port}: {exc.strerror}",
            file=sys.stderr,
        )
        server.collector.close()
        return False
    log.info("Prometheus metrics on http://%s:%d/metrics", args.host, args.prometheus_port)
    return True


def _summarize(server: Server, args: argparse.Namespace) -> None:
    """What happened, once the server stops, and its account to the trackers asked for
    (``--mlflow``, ``--wandb``): only when some rank ever reported."""
    from ddpwatch.outputs.summary import print_summary

    if not server.state.ranks:
        return
    document = server.status(final=True)
    print_summary(document, sys.stderr)
    asked = trackers(args)
    if asked is not None:
        from ddpwatch.jobs.handoff import hand_off

        if server.recorder is not None:
            server.recorder.flush()
        hand_off(document, asked, recording=args.record)
