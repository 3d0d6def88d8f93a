"""Command line: ``ddpwatch serve``, ``ddpwatch status``, ..."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
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
        type=int,
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
        type=int,
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

    web = commands.add_parser(
        "web", help="serve the read-only dashboard to browsers (textual-serve)"
    )
    _add_address(web)
    web.add_argument(
        "--web-host", default="127.0.0.1", help="address to serve the page on (default 127.0.0.1)"
    )
    web.add_argument("--web-port", type=int, default=8000, help="port of the page (default 8000)")

    run = commands.add_parser(
        "run",
        help="run a launch command with ddpwatch in every rank, no code change",
        usage="ddpwatch run [--addr HOST:PORT] [--tui] -- COMMAND ...",
    )
    run.add_argument(
        "--addr",
        default=None,
        help="a running ddpwatch serve (default: collect here and print alerts)",
    )
    run.add_argument(
        "--tui",
        action="store_true",
        help="show the dashboard here; the job's output goes to a file",
    )
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
        "--port", type=int, default=None, help="collector port (default 5599 if free)"
    )
    _add_keygen_and_replay(commands)
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

        return run_client(args.host, args.port, timeout=args.timeout)
    if args.command == "keygen":
        from ddpwatch.security import keygen_main

        return keygen_main(args)
    if args.command == "replay":
        from ddpwatch.server.replay import replay_main

        return replay_main(args)
    if args.command == "run":
        from ddpwatch.launch import run_command

        job = args.job[1:] if args.job[:1] == ["--"] else args.job
        return run_command(job, args.addr, args.tui)
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
    from ddpwatch.server.recording import RecordingError

    if args.curve_clients and not args.curve_secret_file:
        print("ddpwatch: --curve-clients needs --curve-secret-file", file=sys.stderr)
        return 2
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
            on_change=print_change,
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

        return run_dashboard(server)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    log.info(
        "listening for ranks on tcp://%s:%d, status on port %d", args.host, args.port, args.port + 1
    )
    server.run()
    log.info("stopped")
    return 0


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
    )
    return run_demo(options)


def fetch_status(host: str, port: int, timeout: float) -> dict[str, Any] | None:
    """Ask a running server for its status document; None if none answered in time."""
    import zmq

    from ddpwatch.security import apply_client_curve

    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        apply_client_curve(sock)  # DDPWATCH_SERVER_KEY set: CurveZMQ (a bad key: ValueError)
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
