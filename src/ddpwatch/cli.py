"""Command line: ``ddpwatch serve``, ``ddpwatch status``, ..."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddpwatch import __version__
from ddpwatch.protocol import DEFAULT_PORT

log = logging.getLogger("ddpwatch")


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address of the server (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port",
        type=_rank_port,
        default=DEFAULT_PORT,
        help=f"rank port (default {DEFAULT_PORT}); queries use port+1",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _port(text: str, highest: int = 65535, why: str = "") -> int:
    """A TCP port, checked here: the OS would take 99999 modulo 65536, and 0 as "any"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 1 <= value <= highest:
        raise argparse.ArgumentTypeError(f"must be 1-{highest}{why}, got {text}")
    return value


def _rank_port(text: str) -> int:
    """The ranks' port: the status queries use the next one, which must exist too."""
    return _port(text, 65534, " (queries use port+1)")


def _addr(text: str) -> str:
    """``run --addr``: HOST, HOST:PORT or tcp://HOST:PORT, read as the ranks will read it
    (``agent/watcher.py``: a bare host, IPv6 ones included, means port 5599)."""
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if sep and not host.endswith(":") and "]" not in port:
        try:
            _rank_port(port)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text}: the port {exc}") from None
    return text


def _webhook_url(text: str) -> str:
    from ddpwatch.server.notify import check_webhook_url

    try:
        return check_webhook_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_notify(parser: argparse.ArgumentParser) -> None:
    """Alert notifications (``server/notify.py``): ``serve`` and ``run``."""
    parser.add_argument(
        "--notify-cmd",
        metavar="CMD",
        default=None,
        help="run this shell command for each raised alert, its JSON on stdin",
    )
    parser.add_argument(
        "--webhook",
        metavar="URL",
        type=_webhook_url,
        default=None,
        help="POST each raised alert's JSON here (with a Slack-compatible text field)",
    )
    parser.add_argument(
        "--notify-level",
        choices=("error", "warning", "info"),
        default="warning",
        help="notify of alerts this severe or worse (default warning)",
    )
    parser.add_argument(
        "--notify-interval",
        type=_positive,
        default=60.0,
        metavar="S",
        help="notify of the same alert at most once per S seconds (default 60)",
    )


def _notifier(args: argparse.Namespace) -> Any:
    """The ``Notifier`` the notify flags ask for, or None."""
    if args.notify_cmd is None and args.webhook is None:
        return None
    from ddpwatch.server.notify import Notifier

    return Notifier(
        args.notify_cmd, args.webhook, level=args.notify_level, interval=args.notify_interval
    )


def _add_bell(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-bell", action="store_true", help="dashboard: no terminal bell on a new error"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpwatch", description="Live monitor for distributed PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"ddpwatch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="collect every rank and flag problems")
    _add_address(serve)
    serve.add_argument(
        "--prometheus-port",
        type=_port,
        default=None,
        metavar="P",
        help="serve Prometheus metrics on this port (docs/prometheus.md)",
    )
    serve.add_argument(
        "--headless",
        action="store_true",
        help="no dashboard: one JSON line per alert raised or cleared",
    )
    serve.add_argument(
        "--interval",
        type=_positive,
        default=0.5,
        help="the ranks' heartbeat interval (default 0.5 s)",
    )
    serve.add_argument(
        "--stall-after",
        type=_positive,
        default=10.0,
        help="seconds without progress (default 10, or 5x the median step time)",
    )
    serve.add_argument(
        "--silent-after",
        type=_positive,
        default=None,
        help="seconds without a heartbeat (default 3 x interval + 1)",
    )
    serve.add_argument(
        "--startup-after",
        type=_positive,
        default=60.0,
        help="seconds in one startup phase (default 60)",
    )
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
    _add_notify(serve)
    _add_bell(serve)

    status = commands.add_parser("status", help="print one snapshot from a running server")
    _add_address(status)
    status.add_argument("--json", action="store_true", help="the status JSON document")
    status.add_argument(
        "--timeout", type=_positive, default=2.0, help="seconds to wait for an answer (default 2)"
    )
    top = commands.add_parser(
        "top", help="open the dashboard on a running ddpwatch serve (read-only)"
    )
    _add_address(top)
    top.add_argument(
        "--timeout", type=_positive, default=1.0, help="seconds to wait per poll (default 1)"
    )
    _add_bell(top)

    web = commands.add_parser(
        "web", help="serve the read-only dashboard to browsers (textual-serve)"
    )
    _add_address(web)
    web.add_argument(
        "--web-host", default="127.0.0.1", help="address to serve the page on (default 127.0.0.1)"
    )
    web.add_argument("--web-port", type=_port, default=8000, help="port of the page (default 8000)")

    run = commands.add_parser(
        "run",
        help="run a launch command with ddpwatch in every rank, no code change",
        usage="ddpwatch run [--addr HOST:PORT] [--tui] [--notify-cmd CMD] [--webhook URL] "
        "-- COMMAND ...",
    )
    run.add_argument(
        "--addr",
        type=_addr,
        default=None,
        help="a running ddpwatch serve (default: collect here and print alerts)",
    )
    run.add_argument(
        "--tui",
        action="store_true",
        help="show the dashboard here; the job's output goes to a file",
    )
    recording = run.add_mutually_exclusive_group()
    recording.add_argument(
        "--record",
        metavar="FILE",
        default=None,
        help="record the run here (default: ddpwatch-<script>-<time>.ddpw in the working "
        "directory; ddpwatch report FILE reads it)",
    )
    recording.add_argument("--no-record", action="store_true", help="do not record the run")
    _add_notify(run)
    _add_bell(run)
    run.add_argument("job", nargs=argparse.REMAINDER, help="the launch command, after --")

    demo = commands.add_parser("demo", help="watch a real CPU DDP job that misbehaves on cue")
    demo.add_argument(
        "--ranks", type=int, default=4, help="ranks of the real job (default 4; 0: none)"
    )
    demo.add_argument("--no-faults", action="store_true", help="run the job healthy")
    demo.add_argument(
        "--simulate",
        type=int,
        default=0,
        metavar="N",
        help="add N simulated GPU ranks (no torch needed)",
    )
    demo.add_argument(
        "--headless", action="store_true", help="print the alert stream instead of the dashboard"
    )
    demo.add_argument(
        "--duration", type=_positive, default=None, help="headless: stop after this many seconds"
    )
    demo.add_argument(
        "--port", type=_rank_port, default=None, help="collector port (default 5599 if free)"
    )
    _add_bell(demo)
    _add_keygen_and_replay(commands)
    _add_report(commands)
    _add_doctor(commands)
    return parser


def _speed(text: str) -> float | None:
    from ddpwatch.server.replay import parse_speed

    return parse_speed(text)


def _add_keygen_and_replay(commands: Any) -> None:
    keygen = commands.add_parser("keygen", help="create a CurveZMQ key pair (docs/security.md)")
    keygen.add_argument("dir", nargs="?", default=".", help="where to write (default .)")
    keygen.add_argument(
        "--name", default="ddpwatch", help="file name stem (default ddpwatch; e.g. a client name)"
    )
    keygen.add_argument("--force", action="store_true", help="replace existing key files")

    replay = commands.add_parser(
        "replay", help="feed a serve --record file through diagnosis and the views again"
    )
    replay.add_argument("file", help="a recording made by ddpwatch serve --record")
    replay.add_argument(
        "--speed",
        type=_speed,
        default=1.0,
        help="times real time (default 1; 0 or max: as fast as possible)",
    )
    replay.add_argument(
        "--headless", action="store_true", help="print the alert stream instead of the dashboard"
    )
    for flag, what in (
        ("--interval", "the ranks' heartbeat interval"),
        ("--stall-after", "seconds without progress"),
        ("--silent-after", "seconds without a heartbeat"),
        ("--startup-after", "seconds in one startup phase"),
    ):
        replay.add_argument(flag, type=_positive, default=None, help=f"{what} (default: recorded)")
    _add_bell(replay)


def _add_report(commands: Any) -> None:
    report = commands.add_parser(
        "report", help="a post-mortem of a serve --record file; two files: compare them"
    )
    report.add_argument("file", help="a recording made by ddpwatch serve --record")
    report.add_argument(
        "other", nargs="?", default=None, help="a second recording: the two runs side by side"
    )
    report.add_argument(
        "--format", choices=("md", "html", "json"), default="md", help="output format (default md)"
    )
    report.add_argument(
        "-o", "--output", metavar="PATH", default=None, help="write here (default: stdout)"
    )


def _add_doctor(commands: Any) -> None:
    doctor = commands.add_parser(
        "doctor", help="pre-flight checks to run before a launch; exit 1 if one fails"
    )
    doctor.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=_positive_int,
        default=None,
        metavar="N",
        help="ranks per node, as given to torchrun (default: $LOCAL_WORLD_SIZE)",
    )
    doctor.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="the job's backend (default: nccl when CUDA is available, else gloo)",
    )
    doctor.add_argument(
        "--addr",
        type=_addr,
        default=None,
        metavar="HOST:PORT",
        help="the ddpwatch serve to probe (default: where the ranks report: $DDPWATCH_ADDR, "
        "else $MASTER_ADDR:5599)",
    )
    doctor.add_argument(
        "--curve-server-key",
        default=None,
        metavar="KEY|FILE",
        help="the server's CurveZMQ public key, or its .key file (default: $DDPWATCH_SERVER_KEY)",
    )
    doctor.add_argument(
        "--curve-client-key-file",
        default=None,
        metavar="FILE",
        help="this client's .key_secret file (default: $DDPWATCH_CLIENT_KEY_FILE)",
    )
    doctor.add_argument(
        "--timeout", type=_positive, default=2.0, help="seconds to wait for the server (default 2)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="ddpwatch: %(message)s", stream=sys.stderr)
    if args.command == "serve":
        return serve(args)
    if args.command == "status":
        return status(args)
    if args.command == "demo":
        return demo(args)
    if args.command == "web":
        from ddpwatch.web import run_web

        return run_web(args.host, args.port, args.web_host, args.web_port)
    if args.command == "top":
        from ddpwatch.tui.app import run_client

        return run_client(args.host, args.port, timeout=args.timeout, bell=not args.no_bell)
    if args.command == "keygen":
        from ddpwatch.security import keygen_main

        return keygen_main(args)
    if args.command == "replay":
        from ddpwatch.server.replay import replay_main

        return replay_main(args)
    if args.command == "run":
        from ddpwatch.launch import run_command

        job = args.job[1:] if args.job[:1] == ["--"] else args.job
        if args.addr is not None and (args.notify_cmd or args.webhook):
            print(
                "ddpwatch run: with --addr the alerts are that serve's: give it "
                "--notify-cmd/--webhook",
                file=sys.stderr,
            )
            return 2
        if args.addr is not None and args.record:
            print(
                "ddpwatch run: with --addr the run is that serve's: give it --record",
                file=sys.stderr,
            )
            return 2
        record = None
        if args.addr is None and not args.no_record:
            from ddpwatch.launch import default_recording

            record = args.record or default_recording(job)
        return run_command(
            job, args.addr, args.tui, notify=_notifier(args), bell=not args.no_bell, record=record
        )
    if args.command == "doctor":
        from ddpwatch.doctor import doctor_main

        return doctor_main(args)
    if args.command == "report":
        from ddpwatch.server.report import report_main

        return report_main(args)
    return 2


def serve(args: argparse.Namespace) -> int:
    from ddpwatch.server.alerts import Thresholds
    from ddpwatch.server.collector import BindError
    from ddpwatch.server.service import AlertChange, Server

    thresholds = Thresholds(
        interval=args.interval,
        stall_after=args.stall_after,
        silent_after=args.silent_after,
        startup_after=args.startup_after,
    )

    def print_change(change: AlertChange) -> None:
        sys.stdout.write(json.dumps(change.to_dict()) + "\n")
        sys.stdout.flush()

    from ddpwatch.security import CurveKeyError, ServerCurve, is_loopback
    from ddpwatch.server.notify import chain
    from ddpwatch.server.recording import RecordingError

    if args.curve_clients and not args.curve_secret_file:
        print("ddpwatch: --curve-clients needs --curve-secret-file", file=sys.stderr)
        return 2
    notifier = _notifier(args)  # its thread starts with the first alert it sends
    try:
        curve = (
            ServerCurve.from_files(args.curve_secret_file, args.curve_clients)
            if args.curve_secret_file
            else None
        )
        server = Server(
            args.host,
            args.port,
            thresholds,
            on_change=chain(print_change, notifier),
            record=args.record,
            curve=curve,
            max_ranks=args.max_ranks,
        )
    except (BindError, CurveKeyError, RecordingError) as exc:
        print(f"ddpwatch: {exc}", file=sys.stderr)
        return 1
    if curve is None and not is_loopback(args.host):
        print(
            f"ddpwatch: warning: listening on {args.host} without authentication: anyone who "
            f"can reach ports {args.port}-{args.port + 1} can send data and read the status "
            "(see ddpwatch keygen and --curve-secret-file)",
            file=sys.stderr,
        )
    if args.record:
        log.info("recording to %s", args.record)
    if notifier is not None:
        log.info("notifying of each raised alert of severity %s or worse", args.notify_level)
    if args.prometheus_port is not None:
        from ddpwatch.server.prometheus import serve_metrics

        try:
            serve_metrics(server.status, args.prometheus_port, args.host)
        except OSError as exc:
            print(
                f"ddpwatch: cannot serve metrics on port {args.prometheus_port}: {exc.strerror}",
                file=sys.stderr,
            )
            server.collector.close()
            return 1
        log.info("Prometheus metrics on http://%s:%d/metrics", args.host, args.prometheus_port)
    if not args.headless:
        from ddpwatch.tui.app import run_dashboard

        try:
            return run_dashboard(server, bell=not args.no_bell)
        finally:
            if notifier is not None:
                notifier.close()
            _summarize(server)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    log.info(
        "listening for ranks on tcp://%s:%d, status on port %d", args.host, args.port, args.port + 1
    )
    server.run()
    if notifier is not None:
        notifier.close()
    log.info("stopped")
    _summarize(server)
    return 0


def _summarize(server: Any) -> None:
    """What happened, once the server stops: only when some rank ever reported."""
    from ddpwatch.server.summary import print_summary

    if server.state.ranks:
        print_summary(server.status(), sys.stderr)


def demo(args: argparse.Namespace) -> int:
    from ddpwatch.demo.runner import DemoOptions, run_demo

    if args.ranks == 1 or args.ranks < 0:
        print("ddpwatch demo: --ranks must be 0 or at least 2", file=sys.stderr)
        return 2
    if args.ranks == 0 and not args.simulate:
        print("ddpwatch demo: with --ranks 0, give --simulate N", file=sys.stderr)
        return 2
    options = DemoOptions(
        ranks=args.ranks,
        faults=not args.no_faults,
        simulate=args.simulate,
        headless=args.headless,
        duration=args.duration,
        port=args.port,
        bell=not args.no_bell,
    )
    return run_demo(options)


def fetch_status(
    host: str, port: int, timeout: float, environ: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """Ask a running server for its status document; None if none answered in time.

    ``environ`` (default ``os.environ``) is where the CURVE keys are read from."""
    import zmq

    from ddpwatch.security import apply_client_curve

    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        # DDPWATCH_SERVER_KEY set: CurveZMQ (a bad key: ValueError)
        apply_client_curve(sock, environ)
        sock.connect(f"tcp://{host}:{port + 1}")
        sock.send(b"status")
        if not sock.poll(int(timeout * 1000)):
            return None
        return json.loads(sock.recv())
    except (zmq.ZMQError, ValueError):
        return None
    finally:
        sock.close()
        context.term()


def status(args: argparse.Namespace) -> int:
    from ddpwatch.security import SERVER_KEY_ENV, CurveKeyError, client_curve_keys

    try:
        curve = client_curve_keys() is not None
    except CurveKeyError as exc:
        print(f"ddpwatch: {exc}", file=sys.stderr)
        return 1
    document = fetch_status(args.host, args.port, args.timeout)
    if document is None:
        hint = (
            f" (with {SERVER_KEY_ENV} set: is it the key of a server started with "
            "--curve-secret-file?)"
            if curve
            else ""
        )
        print(
            f"ddpwatch: no server answered on {args.host}:{args.port + 1} "
            f"within {args.timeout:g} s{hint}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(format_status(document))
    return 0


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def _collective(rank: dict[str, Any]) -> str:
    coll = rank["collective"]
    return f"{coll['op']} #{_fmt(coll['seq'])} {coll['since_s']:.1f}s" if coll else "-"


# (title, width, right-aligned, cell)
COLUMNS: tuple[tuple[str, int, bool, Callable[[dict[str, Any]], str]], ...] = (
    ("rank", 5, True, lambda r: _fmt(r["rank"])),
    ("host", 16, False, lambda r: _fmt(r["host"])),
    ("pid", 7, True, lambda r: _fmt(r["pid"])),
    ("device", 8, False, lambda r: _fmt(r["device"])),
    ("state", 13, False, lambda r: r["state"]),
    ("phase", 11, False, lambda r: _fmt(r["phase"])),
    ("step", 7, True, lambda r: _fmt(r["step"])),
    ("loss", 9, True, lambda r: _fmt(r["loss"], ".4g")),
    ("step s", 7, True, lambda r: _fmt(r["step_time_s"], ".3f")),
    ("collective", 22, False, _collective),
    ("seen", 5, True, lambda r: _fmt(r["last_seen_s"], ".1f")),
)


def _row(cells: list[str]) -> str:
    parts = []
    for (_, width, right, _cell), text in zip(COLUMNS, cells, strict=True):
        text = text[:width]
        parts.append(text.rjust(width) if right else text.ljust(width))
    return " ".join(parts).rstrip()


def format_status(document: dict[str, Any]) -> str:
    """A plain-text table of the status document, for people."""
    lines = [_row([title for title, *_ in COLUMNS])]
    lines += [_row([cell(rank) for *_, cell in COLUMNS]) for rank in document["ranks"]]
    connected = sum(1 for r in document["ranks"] if r["state"] != "not_connected")
    stats = document["stats"]
    lines.append(
        f"\n{connected}/{_fmt(document['world_size'])} ranks, "
        f"{stats['received']} messages, {stats['rejected']} rejected"
        + (f", {stats['refused']} refused" if stats.get("refused") else "")
    )
    for alert in document["alerts"]:
        lines.append(f"[{alert['severity']}] {alert['kind']}: {alert['message']}")
        lines.append(f"    fix: {alert['hint']}")
    if not document["alerts"]:
        lines.append("no alerts")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
