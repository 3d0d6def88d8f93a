"""What was said live stays said (#33 item 5): how a job ``ddpwatch run`` launched ended (why it
never started, who stopped it) is in its recording, so ``ddpwatch report`` repeats it; a job
stopped by Ctrl-C or from the dashboard is "stopped by you"; ``ddpwatch status`` on a finished
job tells its alerts and verdict; and once ``run`` has ended its hints name the recording, not
the server that went with it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, LiveServer, Recording, free_port_pair, push_frames
from terminal import Terminal

from ddpwatch.cli import main
from ddpwatch.core.protocol import ErrorInfo, Event, Sample, encode
from ddpwatch.core.vocabulary import HistoryEvent, JobStop
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.history import AlertChange
from ddpwatch.jobs.ending import ChangePrinter, Stops, job_end
from ddpwatch.jobs.launch import latest_recording

RECORDED = re.compile(r"ddpwatch run: recorded in (\S+\.ddpw)")


def _verdict(stderr: str) -> str:
    verdicts = [line for line in stderr.splitlines() if line.startswith("ddpwatch: verdict: ")]
    assert len(verdicts) == 1, stderr[-4000:]
    return verdicts[0].removeprefix("ddpwatch: verdict: ")


def _recording(stderr: str) -> str:
    found = RECORDED.search(stderr)
    assert found, stderr[-4000:]
    return found.group(1)


def _report(path: str) -> str:
    """``ddpwatch report FILE`` as a user runs it once ``ddpwatch run`` has ended."""
    done = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "report", path],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", *args]  # fmt: skip


# ------------------------------------------------------------------ a job that never started


def test_the_report_of_a_job_that_never_started_says_why_as_the_run_did(tmp_path: Path) -> None:
    """The newcomer's report said only "no rank reported": the reason the live verdict gave
    (a missing script) is in the recording, and the report's verdict repeats it."""
    script = tmp_path / "train.py"
    done = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "run", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    said = f"the job did not start: the script {script} was not found: check its path"
    assert _verdict(done.stderr) == said
    report = _report(_recording(done.stderr))
    assert f"**Verdict:** {said}" in report, report
    assert f"verdict: {said}" in report  # the report's summary too
    assert "no rank reported" not in report


@pytest.mark.e2e
def test_the_report_of_torchrun_on_a_held_port_names_the_port_and_its_holder(
    http_server: tuple[subprocess.Popen[bytes], int],
) -> None:
    holder, port = http_server
    done = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "run", "--",
         *_torchrun(f"--master-port={port}", str(SCRIPTS / "progress_bar.py"))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    report = _report(_recording(done.stderr))
    said = _verdict(done.stderr)
    assert said.startswith(f"the job did not start: port {port} is already in use"), said
    assert f"pid {holder.pid}" in said
    assert f"**Verdict:** {said}" in report, report


def test_how_the_launcher_ended_in_job_end() -> None:
    stops = Stops(lambda: 100.0)
    killed = job_end(-9, True, ["x"], stops, 101.0)
    assert (killed.exit_code, killed.exit_signal, killed.stopped_by, killed.not_started) == (
        None, "SIGKILL", None, None,
    )  # fmt: skip
    assert job_end(0, False, [], stops, 101.0).not_started is None  # ended well, no ranks
    stops.ask(JobStop.CTRL_C)
    stopped = job_end(1, False, ["Traceback ..."], stops, 101.0)
    assert (stopped.stopped_by, stopped.stopped_at) == ("ctrl_c", 100.0)
    assert stopped.not_started == "it was stopped by you (Ctrl-C) before any rank reported"


# ------------------------------------------------------------------ stopped by you


def _as_in_a_terminal() -> None:
    """Ctrl-C as a terminal's foreground job takes it: a suite started in the background by a
    shell without job control (``tests &``) hands its children SIGINT ignored, and a Python
    that starts with SIGINT ignored keeps it so (no KeyboardInterrupt ever comes)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.e2e
def test_ctrl_c_of_ddpwatch_run_is_a_stop_by_you_in_the_summary_and_the_report() -> None:
    """Ctrl-C reaches the terminal's foreground group, ``ddpwatch run``, torchrun and the
    ranks alike. It was told as "stopped from outside", the ranks' SIGINT exits and the
    warning they raised judged as if something had gone wrong."""
    job = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "run", "--",
         *_torchrun(f"--master-port={free_port_pair()}", str(SCRIPTS / "trains_until_stopped.py"))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=_as_in_a_terminal,
    )  # fmt: skip
    try:
        assert job.stdout is not None and job.stdout.readline() == "training\n"
        os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in its terminal does
        _, err = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    verdict = _verdict(err)
    assert re.fullmatch(r"the job was stopped by you \(Ctrl-C\) at \+\d+\.\d s; .*", verdict), err
    assert "from outside" not in verdict and "crashed" not in verdict, verdict
    assert f"**Verdict:** {verdict}" in _report(_recording(err))


@pytest.mark.e2e
def test_stop_the_job_in_run_tui_is_a_stop_by_you(tmp_path: Path) -> None:
    """After "Stop the job" the verdict said the job "was still running when the watch
    ended": the server had gone before the job was stopped, and never heard its end."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["TMPDIR"] = str(tmp_path)  # where run --tui writes the job's output
    command = [
        sys.executable, "-m", "ddpwatch", "run", "--tui", "--",
        *_torchrun(f"--master-port={free_port_pair()}", str(SCRIPTS / "trains_until_stopped.py")),
    ]  # fmt: skip
    terminal = Terminal(command, env)
    try:
        terminal.wait_for("ranks 2/2", timeout=90)
        deadline = time.monotonic() + 90
        while "training" not in "".join(p.read_text() for p in tmp_path.glob("ddpwatch-run-*")):
            assert time.monotonic() < deadline, terminal.text
            terminal.pump(0.2)
        terminal.press("q")
        terminal.wait_for("Stop the job")
        terminal.press("s")
        assert terminal.wait_exit(timeout=60) != 0
        err = bytes(terminal.raw).decode(errors="replace").replace("\r\n", "\n")
    finally:
        terminal.close()
    verdict = _verdict(err[err.index("── summary") :])
    assert verdict.startswith("the job was stopped by you from the dashboard (Stop the job) at +")
    assert "still running" not in verdict, verdict
    assert f"**Verdict:** {verdict}" in _report(_recording(err))


# ------------------------------------------------------------------ status on a finished job


def _beat(rank: int, step: int) -> bytes:
    return encode(Sample(v=1, rank=rank, t=time.time(), step=step, world_size=2, pid=100 + rank))


def test_status_on_a_finished_job_tells_its_alerts_and_verdict(
    port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ddpwatch serve`` serves on after the job; its ``status`` said "no alerts" once the
    crash alert had cleared, without what happened or the verdict."""
    live = LiveServer(port, Thresholds())
    try:
        push_frames(port, [_beat(r, s) for s in range(1, 4) for r in (0, 1)])
        exited = Event(v=1, rank=1, t=time.time(), event="exit", exit_code=3)
        push_frames(port, [_beat(0, 4), encode(exited)])
        live.wait_for(lambda s: any(a["kind"] == "exited" for a in s["alerts"]), 10)
        stopped = Event(v=1, rank=0, t=time.time(), event="exit", signal="SIGTERM")
        push_frames(port, [encode(stopped)])
        live.wait_for(lambda s: all(r["state"] != "running" for r in s["ranks"]), 10)
        time.sleep(0.5)  # a tick or two
        assert main(["status", "--port", str(port)]) == 0
    finally:
        live.stop()
    out = capsys.readouterr().out
    ended = out[out.index("the job has ended:") :]
    assert "  alerts, in order:" in ended and "[error] exited" in ended, out
    assert "  verdict: rank 1 exited with code 3 at step 3, which ended the job" in ended, out


def test_status_with_no_server_left_points_at_the_last_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After ``ddpwatch run`` has ended no server answers: status says where the run's story
    is, its recording and the command that reads it."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for name, age in (("ddpwatch-old-1.ddpw", 600), ("ddpwatch-train-2.ddpw", 120)):
        (runs / name).write_bytes(b"")
        os.utime(runs / name, (time.time() - age, time.time() - age))
    monkeypatch.setenv("DDPWATCH_RECORD_DIR", str(runs))
    assert latest_recording() == runs / "ddpwatch-train-2.ddpw"
    assert main(["status", "--port", str(free_port_pair()), "--timeout", "0.3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "ddpwatch: the last ddpwatch run here ended 2 min 0 s ago (its server ended with it); "
        f"what it said is in its recording: ddpwatch report {runs / 'ddpwatch-train-2.ddpw'}"
    ), err
    monkeypatch.setenv("DDPWATCH_RECORD_DIR", str(tmp_path / "none"))
    assert main(["status", "--port", str(free_port_pair()), "--timeout", "0.3"]) == 1
    assert "last ddpwatch run" not in capsys.readouterr().err


# ------------------------------------------------------------------ hints once run has ended


def _crash_change() -> AlertChange:
    hint = "read the traceback of rank 1 (ddpwatch status --port 5601 --json shows it)"
    alert = Alert("crashed", "error", (1,), (0,), "rank 1 crashed with RuntimeError", hint)
    return AlertChange(HistoryEvent.RAISED, alert, at=time.time(), elapsed_s=12.0)


def test_hints_printed_after_the_job_ended_name_the_recording(
    capsys: pytest.CaptureFixture[str],
) -> None:
    printer = ChangePrinter("ddpwatch-runs/ddpwatch-my train-1.ddpw")
    printer(_crash_change())  # the job runs: its server answers
    assert "(ddpwatch status --port 5601 --json shows it)" in capsys.readouterr().err
    printer.job_over()  # from here on the server is about to go
    printer(_crash_change())
    err = capsys.readouterr().err
    assert "(ddpwatch report 'ddpwatch-runs/ddpwatch-my train-1.ddpw' shows it)" in err, err
    assert "ddpwatch status" not in err
    unrecorded = ChangePrinter(None)
    unrecorded.job_over()
    unrecorded(_crash_change())
    assert "ddpwatch status" not in capsys.readouterr().err


def test_a_report_sends_the_reader_to_its_culprits_not_to_a_server(tmp_path: Path) -> None:
    """A crash's live hint named ``ddpwatch status --json`` for the traceback; the report
    holds the traceback itself, under Culprits, and says so."""
    path = tmp_path / "crash.ddpw"
    live = Recording(path)
    try:
        live.send(*(_beat(r, s) for s in range(1, 4) for r in (0, 1)))
        error = ErrorInfo(type="RuntimeError", message="boom", traceback="Traceback: boom")
        live.send(encode(Event(v=1, rank=1, t=time.time(), event="crash", error=error)))
        status = live.wait_for(lambda s: any(a["kind"] == "crashed" for a in s["alerts"]), 10)
        (crashed,) = [a for a in status["alerts"] if a["kind"] == "crashed"]
        assert "ddpwatch status" in crashed["hint"], crashed  # live, the server answers
    finally:
        live.stop()
    report = _report(str(path))
    assert "ddpwatch status" not in report, report
    assert "this report's Culprits section" in report and "Traceback: boom" in report
