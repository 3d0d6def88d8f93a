"""Argument types and flag groups shared by several subcommands.

The types keep their ``_`` names: argparse shows a type's name when it raises
``ValueError`` (``invalid _positive value: 'x'``)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from ddpwatch.core.ports import named_port
from ddpwatch.core.protocol import DEFAULT_PORT
from ddpwatch.core.vocabulary import SEVERITIES, Severity
from ddpwatch.diagnosis.alerts import Thresholds

if TYPE_CHECKING:
    from ddpwatch.jobs.handoff import Trackers
    from ddpwatch.outputs.notify import Notifier
    from ddpwatch.outputs.otlp import OtlpExporter

# what ``ArgumentParser.add_subparsers`` returns; a string, as the class is generic only in typeshed
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

# ---------------------------------------------------------------------------- argument types


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argument type: an integer from ``low`` to ``high`` (no upper bound: None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text}") from None
        if value < low or (high is not None and value > high):
            bounds = f"{low}-{high}" if high is not None else f"{low} or more"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse


_positive_int = whole_number(1)


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
    (``core/ports.py``: a bare host, IPv6 ones included, means port 5599)."""
    named = named_port(text.removeprefix("tcp://"))
    if named is not None:
        try:
            _rank_port(named[1])
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text}: the port {exc}") from None
    return text


def _webhook_url(text: str) -> str:
    from ddpwatch.outputs.notify import check_webhook_url

    try:
        return check_webhook_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---------------------------------------------------------------------------- flag groups


def add_address(parser: argparse.ArgumentParser) -> None:
    """``--host`` and ``--port`` of a server: ``serve`` binds them, the clients ask them."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address of the server (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port",
        type=_rank_port,
        default=DEFAULT_PORT,
        help=f"rank port (default {DEFAULT_PORT}); queries use port+1",
    )


def add_wait(parser: argparse.ArgumentParser) -> None:
    """``--wait``: a dashboard client opens even when no server answers yet."""
    parser.add_argument(
        "--wait",
        action="store_true",
        help="open even when no server answers yet, and wait for one (default: say that none "
        "answered, and how to start one, and exit 1)",
    )


def refuse_without_server(name: str, args: argparse.Namespace, timeout: float = 2.0) -> int | None:
    """Before a dashboard client opens (``top``, ``web``): unless ``--wait``, ask the server
    once and, when none answers, print ``client.no_server``'s line (as ``status`` does) and
    give the exit code 1; None when the client may go on."""
    import sys

    from ddpwatch.core.security import CurveKeyError
    from ddpwatch.status.client import unanswered

    if args.wait:
        return None
    try:
        refusal = unanswered(args.host, args.port, timeout)
    except CurveKeyError as exc:
        print(f"ddpwatch {name}: {exc}", file=sys.stderr)
        return 1
    if refusal is None:
        return None
    print(f"ddpwatch {name}: {refusal}", file=sys.stderr)
    return 1


# The ``Thresholds`` fields that are flags: what each is, and how ``serve`` shows its
# default (``{}``: the field's default). ``connect_after`` is not a flag.
THRESHOLD_FLAGS: dict[str, tuple[str, str]] = {
    "interval": ("the ranks' heartbeat interval", "{:g} s"),
    "stall_after": ("seconds without progress", "{:g}, or 5x the median step time"),
    "silent_after": ("seconds without a heartbeat", "3 x interval + 1"),
    "startup_after": ("seconds in one startup phase", "{:g}"),
}


def add_thresholds(parser: argparse.ArgumentParser, *, recorded: bool = False) -> None:
    """``--interval``, ``--stall-after``, ``--silent-after``, ``--startup-after``, with the
    defaults of ``Thresholds``; ``recorded``: default None, "the recording's" (``replay``)."""
    for field in dataclasses.fields(Thresholds):
        if field.name not in THRESHOLD_FLAGS:
            continue
        what, shown = THRESHOLD_FLAGS[field.name]
        flag = "--" + field.name.replace("_", "-")
        if recorded:
            parser.add_argument(
                flag, type=_positive, default=None, help=f"{what} (default: recorded)"
            )
        else:
            parser.add_argument(
                flag,
                type=_positive,
                default=field.default,
                help=f"{what} (default {shown.format(field.default)})",
            )


def threshold_values(args: argparse.Namespace) -> dict[str, Any]:
    """The threshold flags' values by ``Thresholds`` field name (None where not given)."""
    return {name: getattr(args, name, None) for name in THRESHOLD_FLAGS}


def thresholds(args: argparse.Namespace) -> Thresholds:
    """The ``Thresholds`` the threshold flags ask for (``serve``)."""
    return Thresholds(**threshold_values(args))


def add_notify(parser: argparse.ArgumentParser) -> None:
    """Alert notifications (``outputs/notify.py``): ``serve`` and ``run``."""
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
        choices=SEVERITIES,
        default=Severity.WARNING,
        help="notify of alerts this severe or worse (default warning)",
    )
    parser.add_argument(
        "--notify-interval",
        type=_positive,
        default=60.0,
        metavar="S",
        help="notify of the same alert at most once per S seconds (default 60)",
    )


def notifier(args: argparse.Namespace) -> Notifier | None:
    """The ``Notifier`` the notify flags ask for, or None."""
    if args.notify_cmd is None and args.webhook is None:
        return None
    from ddpwatch.outputs.notify import Notifier

    return Notifier(
        args.notify_cmd, args.webhook, level=args.notify_level, interval=args.notify_interval
    )


def add_otlp(parser: argparse.ArgumentParser) -> None:
    """OpenTelemetry export (``outputs/otlp.py``): ``serve`` and ``run``."""
    parser.add_argument(
        "--otlp",
        metavar="URL",
        default=None,
        help="export metrics and alert records over OTLP/HTTP to this collector, e.g. "
        "http://localhost:4318 (also: OTEL_EXPORTER_OTLP_ENDPOINT; docs/otlp.md)",
    )
    parser.add_argument(
        "--otlp-max-ranks",
        type=whole_number(0, 1000),
        default=1000,
        metavar="N",
        help="OTLP: per-rank metrics for at most the N worst ranks, 0-1000 (default 1000)",
    )


def otlp_exporter(args: argparse.Namespace) -> OtlpExporter | None:
    """The ``OtlpExporter`` the flag or the environment asks for, or None; ValueError (its
    one-line reason) for an endpoint or a variable that cannot be used. Needs
    ``opentelemetry-proto`` (``pip install 'ddpwatch[otlp]'``) only when asked for."""
    import os

    from ddpwatch.outputs.otlp import OtlpExporter, otlp_config

    config = otlp_config(args.otlp, os.environ)
    if config is None:
        return None
    try:
        import opentelemetry.proto.metrics.v1.metrics_pb2  # noqa: F401
    except ImportError:
        raise ValueError(
            "OTLP export needs opentelemetry-proto: pip install 'ddpwatch[otlp]'"
        ) from None
    return OtlpExporter(config, max_ranks=args.otlp_max_ranks)


def add_trackers(parser: argparse.ArgumentParser) -> None:
    """The run's account to MLflow and W&B at its end (``jobs/handoff.py``): ``run``,
    ``serve``, ``report``."""
    parser.add_argument(
        "--mlflow",
        action="store_true",
        help="at the end, log the verdict, alert timeline, time lost and per-rank summary to "
        "MLflow (MLFLOW_TRACKING_URI; the script's run if MLFLOW_RUN_ID is set, else a new one)",
    )
    parser.add_argument(
        "--mlflow-run-id",
        metavar="ID",
        default=None,
        help="with --mlflow: log to this MLflow run",
    )
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="at the end, log the same to Weights & Biases (WANDB_PROJECT; the script's run if "
        "WANDB_RUN_ID is set, else a new one)",
    )
    parser.add_argument(
        "--wandb-alert",
        action="store_true",
        help="with --wandb: also send a W&B alert when the verdict names a culprit",
    )


def trackers_refused(args: argparse.Namespace) -> str | None:
    """Why the tracker flags cannot work here (a library not installed, an option without its
    flag), or None: said before the job starts, not after it ran."""
    if args.mlflow_run_id and not args.mlflow:
        return "--mlflow-run-id needs --mlflow"
    if args.wandb_alert and not args.wandb:
        return "--wandb-alert needs --wandb"
    from ddpwatch.outputs import mlflow_handoff, wandb_handoff

    if args.mlflow and (why := mlflow_handoff.available()) is not None:
        return why
    if args.wandb and (why := wandb_handoff.available()) is not None:
        return why
    return None


def trackers(args: argparse.Namespace) -> Trackers | None:
    """The trackers the flags ask for, or None."""
    if not (args.mlflow or args.wandb):
        return None
    from ddpwatch.jobs.handoff import Trackers

    return Trackers(args.mlflow, args.mlflow_run_id, args.wandb, args.wandb_alert)


def add_bell(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-bell", action="store_true", help="dashboard: no terminal bell on a new error"
    )
