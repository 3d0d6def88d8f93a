"""``ddpwatch run -- COMMAND``: any launch command, with ddpwatch attached in every rank.

The ranks load ``ddpwatch/boot/sitecustomize.py`` through ``PYTHONPATH`` (see
``agent/auto.py`` for which processes count as ranks). Without ``--addr`` a
collector runs here and prints each alert as it is raised and cleared. With ``--addr`` (a
server elsewhere, one ``run`` per node) a relay runs here and batches this node's ranks
(``relay.py``), unless the node already has one.

The job's stderr passes through ``StderrTee`` (``jobs/output.py``) unchanged, which keeps its
first and last lines: a launcher that ends with an error before any rank reported is a job
that did not start, and the summary (or, with ``--addr``, one line) says why in its own words
(``jobs/failure.py``).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from ddpwatch.agent.auto import AUTO_ENV
from ddpwatch.core.port_holder import holder_of
from ddpwatch.core.ports import free_port_pair, pick_port
from ddpwatch.core.protocol import DEFAULT_PORT
from ddpwatch.core.vocabulary import JobStop
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.jobs.aborts import AbortLines
from ddpwatch.jobs.emphasis import mark_for
from ddpwatch.jobs.ending import ChangePrinter, Stops, job_end
from ddpwatch.jobs.failure import not_started_reason, why_not_started
from ddpwatch.jobs.output import LogFollower, OutputTail, StderrTee, tail_of_file
from ddpwatch.jobs.stop import stop_job
from ddpwatch.outputs.notify import Notifier, chain
from ddpwatch.outputs.otlp import OtlpExporter
from ddpwatch.outputs.summary import print_summary
from ddpwatch.relay import RELAY_ENV, Relay, RelayError, find_relay
from ddpwatch.server.recording import RecordingError
from ddpwatch.server.service import Server
from ddpwatch.status.provider import in_background
from ddpwatch.status.schema import StatusDocument

BOOT_DIR = Path(__file__).resolve().parent.parent / "boot"
RECORD_DIR_ENV = "DDPWATCH_RECORD_DIR"  # where run's default recordings go
RUNS_DIR = "ddpwatch-runs"
"""...when it is not set: one folder in the working directory, not a file per run beside the
user's own."""
Tracker = Callable[[StatusDocument, str | None], object]
"""What ``--mlflow`` does at the end of a run: given the final document and the recording."""
RUNS_KEPT = 20
"""Default recordings kept in that folder: the oldest beyond these go as a new run starts."""


def job_environment(addr: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes every Python process of the job load the boot hook."""
    env = dict(os.environ if environ is None else environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(BOOT_DIR) + (os.pathsep + path if path else "")
    env[AUTO_ENV] = "1"
    env["DDPWATCH_ADDR"] = addr
    return env


def run_command(
    command: Sequence[str],
    addr: str | None = None,
    tui: bool = False,
    *,
    notify: Notifier | None = None,
    otlp: OtlpExporter | None = None,
    tracker: Tracker | None = None,
    bell: bool = True,
    preferred_port: int = DEFAULT_PORT,
    record: str | None = None,
    relay: bool = True,
) -> int:
    """Run ``command`` watched; returns its exit code. ``notify`` gets the local collector's
    alerts (closed at the end, after the final diagnosis), ``otlp`` its alerts and metrics,
    ``tracker`` the final document and the recording (``--mlflow``, ``jobs/handoff.py``);
    ``bell``: the dashboard's, on errors.
    ``preferred_port``: the local collector's, when it and the next are free. ``record``: the
    local collector records the run there (``ddpwatch report`` reads it). ``relay``: with
    ``addr``, batch this node's ranks through a relay (``relay.py``)."""
    if not command:
        print(
            "ddpwatch run: give the command after --, e.g. ddpwatch run -- torchrun train.py",
            file=sys.stderr,
        )
        return 2
    if addr is not None:
        if not tui:
            print(_banner(command, addr, False, preferred_port), file=sys.stderr)
        return _run_with_remote_server(command, addr, relay)
    printer = None if tui else ChangePrinter(record)
    bound = _bound_local_server(preferred_port, chain(printer, notify, otlp), record)
    if bound is None:
        return 1
    port, server = bound
    addr = f"127.0.0.1:{port}"
    _start_otlp(otlp, server)
    if not tui:
        print(_banner(command, addr, True, preferred_port), file=sys.stderr)
    if tui:
        output, log_path = _job_log()
        job = _start(command, job_environment(addr), output)
        output.close()  # the job holds its own copy
        if job is None:
            return 127
        aborts = AbortLines(server.boxes.note_abort)
        follower = LogFollower(log_path, OutputTail(on_line=aborts.feed))
        try:
            return _with_dashboard(server, job, log_path, bell, record, follower, tracker)
        finally:
            follower.stop()
            _close_outputs(notify, otlp)
    tee = StderrTee(tail=OutputTail(on_line=AbortLines(server.boxes.note_abort).feed))
    job = _start(command, job_environment(addr), None, tee.child_fd)
    tee.started()
    if job is None:
        tee.finish()
        return 127
    stops = Stops(server.clock)
    try:
        with in_background(server, name="ddpwatch-collector"):
            try:
                return _wait(job, stops)
            finally:
                if printer is not None:
                    printer.job_over()  # from here on its hints name the recording
                lines = tee.finish()  # the launcher's last words, before the summary
                _settle(server)
                _tell_the_end(server, job.returncode, lines, stops)
                server.tick()  # report what the job's last messages say
    finally:
        _end_of_run(server, record, notify, otlp, tracker)


def _tell_the_end(
    server: Server, returncode: int | None, lines: Sequence[str], stops: Stops
) -> None:
    """Tell the server how the job ended (``jobs/ending.py``): the next tick's document and
    the recording carry it, so the summary and ``ddpwatch report`` say it alike."""
    started = server.state.first_report is not None
    server.end_job(job_end(returncode, started, lines, stops, server.clock()))


def _end_of_run(
    server: Server,
    record: str | None,
    notify: Notifier | None,
    otlp: OtlpExporter | None,
    tracker: Tracker | None = None,
) -> None:
    """The summary, then where the run was recorded (what reads it once this server is gone)
    and the tracker's hand-off; the notifier and the OTLP export close last (their final alerts
    and the last metrics still go out, a few seconds at most)."""
    recorded = record if server.recorder is not None else None
    document = server.status(final=True)
    print_summary(document, sys.stderr, recording=recorded)
    if recorded is not None:
        print(
            f"ddpwatch run: recorded in {recorded}: ddpwatch report {shlex.quote(recorded)}",
            file=sys.stderr,
        )
    if tracker is not None:
        tracker(document, recorded)
    _close_outputs(notify, otlp)


def _close_outputs(notify: Notifier | None, otlp: OtlpExporter | None) -> None:
    if notify is not None:
        notify.close()
    if otlp is not None:
        otlp.close()


def _run_with_remote_server(command: Sequence[str], addr: str, relay: bool) -> int:
    """The job's ranks report to the server at ``addr``, through this node's relay."""
    env = job_environment(addr)
    node_relay = _start_relay(addr, env) if relay else None
    aborts = AbortLines(node_relay.boxes.note_abort).feed if node_relay is not None else None
    tee = StderrTee(tail=OutputTail(on_line=aborts))
    job = _start(command, env, None, tee.child_fd)
    tee.started()
    stops = Stops()
    try:
        code = 127 if job is None else _wait(job, stops)
    finally:
        lines = tee.finish()
        if node_relay is not None:
            node_relay.stop()  # what the ranks sent last still goes out
    if job is None:
        return code  # said in one line already
    line = _remote_not_started(code, lines, stops, node_relay)
    if line is not None:
        print(line, file=sys.stderr)
    return code


def _remote_not_started(
    code: int, lines: list[str], stops: Stops, node_relay: Relay | None
) -> str | None:
    """With ``--addr`` the summary is the server's; this node can tell when its launcher
    failed, and, through the relay it ran, whether any rank of this node reported. Without
    that relay (the node's own, or ``--no-relay``) it cannot: it says what the launcher's
    output says, not that the job did not start."""
    if code == 0 or stops.asked:
        return None
    if node_relay is not None:
        if node_relay.stats.received:
            return None  # ranks reported: the server tells the story
        why = not_started_reason(lines, code, holder_of=holder_of)
        return f"ddpwatch run: the job did not start on this node: {why}"
    why_found = why_not_started(lines, holder_of)
    if why_found is None:
        return None
    return f"ddpwatch run: the launcher exited with code {code}; its output says: {why_found}"


def _start(
    command: Sequence[str],
    env: dict[str, str],
    output: IO[bytes] | None,
    stderr: int | None = None,
) -> subprocess.Popen[bytes] | None:
    """The job's process, or None (said in one line) when it cannot start. ``output``: its
    stdout and stderr both (the dashboard's log); ``stderr``: its stderr alone."""
    try:
        return subprocess.Popen(
            list(command),
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT if output else stderr,
        )
    except OSError as exc:
        print(f"ddpwatch run: cannot start {command[0]}: {exc.strerror}", file=sys.stderr)
        return None


def default_recording(command: Sequence[str], now: float | None = None) -> str:
    """Where ``ddpwatch run`` records when not told: ``$DDPWATCH_RECORD_DIR`` or
    ``./ddpwatch-runs``, named after the job's script (or program) and the time, e.g.
    ``ddpwatch-runs/ddpwatch-train-20261123-192600.ddpw``."""
    scripts = [Path(arg).stem for arg in command if arg.endswith(".py")]
    name = scripts[0] if scripts else Path(command[0]).name if command else "job"
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40] or "job"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    folder = os.environ.get(RECORD_DIR_ENV) or RUNS_DIR
    return str(Path(folder) / f"ddpwatch-{name}-{stamp}.ddpw")


def prune_recordings(folder: str | os.PathLike[str], keep: int = RUNS_KEPT - 1) -> list[Path]:
    """Remove the oldest default recordings (``ddpwatch-*.ddpw``) in ``folder`` beyond the
    newest ``keep``, room for the one a run is about to make; the paths removed. A file that
    cannot be removed stays: housekeeping never stops a run."""
    try:
        found = sorted(Path(folder).glob("ddpwatch-*.ddpw"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return []
    removed = []
    for old in found[: max(0, len(found) - keep)]:
        try:
            old.unlink()
        except OSError:
            continue
        removed.append(old)
    return removed


def latest_recording(folder: str | os.PathLike[str] | None = None) -> Path | None:
    """The newest default recording in ``folder`` (``$DDPWATCH_RECORD_DIR`` or
    ``./ddpwatch-runs``): what ``ddpwatch status`` points at once ``run``'s server is gone."""
    where = Path(folder if folder is not None else os.environ.get(RECORD_DIR_ENV) or RUNS_DIR)
    try:
        found = [(p.stat().st_mtime, p) for p in where.glob("ddpwatch-*.ddpw")]
    except OSError:
        return None
    return max(found)[1] if found else None


def _start_otlp(otlp: OtlpExporter | None, server: Server) -> None:
    """The OTLP export, asked for, reads the local collector's summary every interval."""
    if otlp is not None:
        from ddpwatch.outputs.prometheus import summary_from_query

        otlp.bind(summary_from_query(server.query_json))
        otlp.start()


BIND_TRIES = 3
"""Ports tried for the local collector: a free pair can be taken by another process between
``pick_port`` and the bind (two ``ddpwatch run`` started at once on one node)."""


def _bound_local_server(
    preferred_port: int, on_change: Any, record: str | None
) -> tuple[int, Server] | None:
    """The local collector on the preferred port pair when it is free, else on another free
    pair, a taken one tried again on a new pair; None, said in one line, when none binds."""
    from ddpwatch.server.collector import BindError

    problem = ""
    for attempt in range(BIND_TRIES):
        port = pick_port(preferred_port) if attempt == 0 else free_port_pair()
        try:
            return port, _local_server(port, on_change, record)
        except BindError as exc:
            problem = str(exc)
    print(f"ddpwatch run: no port for its collector: {problem}", file=sys.stderr)
    return None


def _local_server(port: int, on_change: Any, record: str | None) -> Server:
    """The collector here, recording to ``record`` when it can: a recording that cannot be
    written is announced and skipped, never a reason not to run the job."""
    if record is not None:
        try:
            Path(record).parent.mkdir(parents=True, exist_ok=True)
            server = Server("127.0.0.1", port, Thresholds(), on_change=on_change, record=record)
        except (RecordingError, OSError) as exc:
            print(f"ddpwatch run: not recording: {exc}", file=sys.stderr)
        else:
            print(
                f"ddpwatch run: recording to {record} (post-mortem: ddpwatch report {record})",
                file=sys.stderr,
            )
            return server
    return Server("127.0.0.1", port, Thresholds(), on_change=on_change)


def _settle(
    server: Server, quiet_s: float = 0.5, limit_s: float = 3.0, behind_limit_s: float = 15.0
) -> None:
    """Let the ranks' last messages in before the final diagnosis: a rank's exit or crash
    report is sent as it dies, and may still be on its way when the launcher returns. A
    collector still working through its queue (a loaded machine) is waited for up to
    ``behind_limit_s``: until then its ranks look alive, and the verdict would say so. One
    that stopped (``state.collector_stopped``) takes nothing more in: not waited for."""
    ended = server.clock()
    start = time.monotonic()
    seen, since = server.state.received, start
    while server.state.collector_stopped is None:  # stopped: nothing more will come in
        now = time.monotonic()
        heard = server.state.heard_until
        caught_up = heard is not None and heard >= ended
        if now - start >= (limit_s if caught_up else behind_limit_s):
            return
        if caught_up and now - since >= quiet_s:
            return
        time.sleep(0.05)
        if server.state.received != seen:
            seen, since = server.state.received, time.monotonic()


def _banner(command: Sequence[str], addr: str, local: bool, preferred_port: int) -> str:
    """What ``run`` watches and where, before the job's first line: a healthy run prints
    nothing else, and a collector moved off a busy port must say where it went."""
    shown = " ".join(shlex.join(command).split())  # one line, even for python -c "..."
    shown = shown if len(shown) <= 60 else shown[:59] + "…"
    if not local:
        return f"ddpwatch run: watching `{shown}`; its ranks report to {addr}"
    busy = "" if addr.endswith(f":{preferred_port}") else f" ({preferred_port} was busy)"
    return (
        f"ddpwatch run: watching `{shown}` on {addr}{busy}; "
        f"alerts appear here, marked {mark_for(sys.stderr)}"
    )


def _start_relay(addr: str, env: dict[str, str]) -> Relay | None:
    """This node's relay to the server at ``addr``, on a thread, unless the node already has
    one (the job's ranks find that one) or ``$DDPWATCH_RELAY`` says otherwise. A relay that
    cannot start is one line: the ranks then send to the server directly."""
    from ddpwatch.core.ports import resolve_endpoint

    if env.get(RELAY_ENV):
        return None  # the user chose: a relay of their own, or "off"
    upstream = resolve_endpoint(addr)
    if find_relay(upstream, env) is not None:
        return None
    try:
        node_relay = Relay(upstream).start()
    except RelayError as exc:
        print(f"ddpwatch run: no relay ({exc}); ranks send to {addr} directly", file=sys.stderr)
        return None
    env[RELAY_ENV] = node_relay.listen
    return node_relay


def _wait(job: subprocess.Popen[bytes], stops: Stops | None = None) -> int:
    """Wait for the job, passing SIGTERM on (Ctrl-C reaches it through the terminal: the
    job decides when to end). ``stops`` gets what asked the job to stop (Ctrl-C, SIGTERM),
    in order, dated as the signal came: ``Popen.wait`` lets a KeyboardInterrupt through only
    0.25 s later, after the ranks it stopped had ended."""
    said = stops if stops is not None else Stops()

    def terminate(*_: object) -> None:
        said.ask(JobStop.SIGTERM)
        job.send_signal(signal.SIGTERM)

    def interrupted(*_: object) -> None:
        said.ask(JobStop.CTRL_C)

    previous = signal.signal(signal.SIGTERM, terminate)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int != signal.SIG_IGN:  # ignored (a background job): no Ctrl-C comes
        signal.signal(signal.SIGINT, interrupted)
    try:
        while True:
            try:
                return job.wait()
            except KeyboardInterrupt:  # one that came before the handler above
                said.ask(JobStop.CTRL_C)
                continue  # the job got the same Ctrl-C: let it decide when to end
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int or signal.default_int_handler)


def _job_log() -> tuple[IO[bytes], str]:
    fd, path = tempfile.mkstemp(prefix="ddpwatch-run-", suffix=".log")
    return os.fdopen(fd, "wb"), path


def _with_dashboard(
    server: Server,
    job: subprocess.Popen[bytes],
    log_path: str,
    bell: bool = True,
    record: str | None = None,
    follower: LogFollower | None = None,
    tracker: Tracker | None = None,
) -> int:
    """The dashboard owns the terminal; the job's output goes to a file, which ``o`` follows
    (each rank's own tail also reaches its detail pane through its agent) and ``follower``
    reads for the backends' C++ aborts. The header shows whether the job still runs;
    quitting the dashboard stops it, unless the user detaches. The server runs on until the
    job stopped that way has said how it ended: a job the user stopped is told as stopped by
    them, not as one still running when the watch ended."""
    from ddpwatch.tui.app import show_dashboard
    from ddpwatch.tui.data.sources import JobSource
    from ddpwatch.tui.screens.quit import detached_message

    source = JobSource(server, job, log_path)
    stops = Stops(server.clock)
    with in_background(server, name="ddpwatch-collector"):
        try:
            show_dashboard(source, bell=bell)
        finally:
            if not source.detached:
                if job.poll() is None:  # "Stop the job": it did not end by itself
                    stops.ask(JobStop.DASHBOARD)
                stop_job(job)
                if follower is not None:
                    follower.stop()  # the job's last lines read, before its end is told
                _settle(server)
                _tell_the_end(server, job.returncode, tail_of_file(log_path), stops)
                server.tick()
    if source.detached:  # the job runs on, unwatched: say where it is and how to stop it
        print_summary(server.status(final=True), sys.stderr)
        print(detached_message(job.pid, log_path), file=sys.stderr)
        return 0
    print(f"ddpwatch run: the job's output is in {log_path}", file=sys.stderr)
    _end_of_run(server, record, None, None, tracker)  # run_command closes the outputs
    return job.returncode if job.returncode is not None else 1
