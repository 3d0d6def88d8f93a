"""``ddpwatch run``: zero-code attach in every rank of real jobs, and only in ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, LiveServer, as_json, ddpwatch_run, free_port_pair

from ddpwatch.agent.auto import bootstrap, runs_a_launcher, script_missing, started_by_launcher
from ddpwatch.jobs.launch import BOOT_DIR, job_environment
from ddpwatch.jobs.stop import stop_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_launchers_are_recognised_from_the_parent_command() -> None:
    assert started_by_launcher(
        "/usr/bin/python3 -m torch.distributed.run --nproc-per-node 2 train.py"
    )
    assert started_by_launcher("/opt/venv/bin/python /opt/venv/bin/torchrun train.py")
    assert started_by_launcher("slurmstepd: [1234.0]")
    assert started_by_launcher("prted --leave-session-attached")
    assert not started_by_launcher("python train.py --fast")
    assert not started_by_launcher("")


def test_a_launcher_process_is_never_taken_for_a_rank() -> None:
    python = "/venv/bin/python3"
    assert runs_a_launcher([python, "/venv/bin/torchrun", "--nproc-per-node=2", "train.py"])
    assert runs_a_launcher([python, "-u", "-m", "torch.distributed.run", "train.py"])
    assert runs_a_launcher([python, "-X", "utf8", "-m", "deepspeed.launcher.launch", "x.py"])
    assert runs_a_launcher([python, "/venv/bin/deepspeed", "--num_gpus", "2", "train.py"])
    assert runs_a_launcher([python, "/venv/bin/accelerate", "launch", "train.py"])
    assert not runs_a_launcher([python, "train.py", "--launcher", "torchrun"])
    assert not runs_a_launcher([python, "-m", "my_project.train"])
    assert not runs_a_launcher([python, "-c", "import torchrun"])
    assert not runs_a_launcher([python])


def test_bootstrap_decides_now_deferred_or_off(monkeypatch) -> None:
    hooked: list[str] = []
    monkeypatch.setattr("ddpwatch.agent.auto.after_import", lambda name, _: hooked.append(name))
    monkeypatch.setattr("ddpwatch.agent.auto._install_integrations", lambda: None)
    attached: list[str] = []

    def attach() -> None:
        attached.append("attach")

    assert bootstrap({}, parent="torchrun x", attach=attach) == "off"
    # a rank started by torchrun would attach "now"; here the parent is not a launcher
    assert (
        bootstrap(
            {"DDPWATCH_AUTO": "1", "RANK": "0", "WORLD_SIZE": "2"},
            parent="python x.py",
            attach=attach,
        )
        == "deferred"
    )
    assert bootstrap({"DDPWATCH_AUTO": "1"}, parent="torchrun x", attach=attach) == "deferred"
    assert hooked == ["torch.distributed", "torch.distributed"]
    assert attached == []  # deferred: attached by init_process_group, not now


def test_a_process_whose_script_is_missing_is_no_rank(tmp_path: Path) -> None:
    """Python says "can't open file" only after the boot hook ran: attached, such a process
    was a rank that reported and "exited 0", and ``ddpwatch run`` no longer saw a job that
    did not start (``tests/jobs/test_not_started.py``)."""
    python = sys.executable
    assert script_missing([python, str(tmp_path / "missing.py")])
    assert script_missing([python, "-u", "-X", "utf8", str(tmp_path / "missing.py"), "--x"])
    assert not script_missing([python, __file__])
    assert not script_missing([python, "-m", "no.such.module"])
    assert not script_missing([python, "-c", "pass"])
    assert not script_missing([python, "-"]) and not script_missing([python])
    env = {"DDPWATCH_AUTO": "1", "RANK": "0", "WORLD_SIZE": "2"}
    argv = [python, str(tmp_path / "missing.py")]
    assert bootstrap(env, parent="torchrun x", argv=argv, attach=lambda: None) == "off"


def test_job_environment_prepends_the_boot_hook() -> None:
    env = job_environment("10.0.0.1:5599", {"PYTHONPATH": "/mine", "PATH": "/bin"})
    assert env["PYTHONPATH"].split(":") == [str(BOOT_DIR), "/mine"]
    assert env["DDPWATCH_ADDR"] == "10.0.0.1:5599" and env["DDPWATCH_AUTO"] == "1"
    assert (BOOT_DIR / "sitecustomize.py").is_file()


@pytest.mark.e2e
def test_run_torchrun_on_an_unmodified_script_reports_every_rank_and_only_ranks(
    live_server: LiveServer,
) -> None:
    master = free_port_pair()
    result = ddpwatch_run(
        live_server, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={master}", str(SCRIPTS / "unmodified.py"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    status = as_json(live_server.server.status())
    ranks = {r["rank"]: r for r in status["ranks"]}
    assert set(ranks) == {0, 1}, status["ranks"]
    for rank in ranks.values():
        assert rank["step"] == 48  # 16 batches x 3 epochs, counted from optimizer.step()
        assert rank["world_size"] == 2 and rank["launcher"] == "torchrun"
        assert rank["state"] == "exited"
    # rendezvous was watched: the phases went started -> rendezvous -> first_step -> ...
    record = live_server.server.state.ranks[0]
    phases = [name for name, _ in record.phases]
    assert phases.index("rendezvous") < phases.index("model_wrap") < phases.index("first_step"), (
        phases
    )
    assert status["alerts"] == []


@pytest.mark.e2e
def test_run_attaches_ranks_spawned_without_a_launcher(live_server: LiveServer) -> None:
    result = ddpwatch_run(
        live_server, sys.executable, str(SCRIPTS / "spawned.py"), str(free_port_pair())
    )
    assert result.returncode == 0, result.stdout + result.stderr
    status = as_json(live_server.server.status())
    assert {r["rank"] for r in status["ranks"]} == {0, 1}
    assert all(r["world_size"] == 2 for r in status["ranks"])
    lines = result.stderr.splitlines()
    assert lines[0].startswith("ddpwatch run: watching `")  # run's banner; the ranks say nothing
    assert not [
        line for line in lines if "ddpwatch" in line and not line.startswith("ddpwatch run: ")
    ]


def test_run_without_a_command_says_how(capsys) -> None:
    from ddpwatch.cli import main

    assert main(["run"]) == 2
    assert "after --" in capsys.readouterr().err


def test_after_import_runs_once_the_module_is_imported(tmp_path, monkeypatch) -> None:
    from ddpwatch.agent.auto import after_import

    (tmp_path / "late_module_for_ddpwatch.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    after_import("late_module_for_ddpwatch", lambda module: seen.append(module.VALUE + 1))
    assert seen == []
    import late_module_for_ddpwatch  # noqa: F401

    assert seen == [42]
    after_import("late_module_for_ddpwatch", lambda module: seen.append(module.VALUE))
    assert seen == [42, 41]  # already imported: called at once


@pytest.mark.e2e
def test_a_job_torchrun_restarted_is_told_as_two_attempts(tmp_path: Path) -> None:
    """torchrun --max-restarts 1: rank 1 fails as it starts in the first attempt, while rank 0
    waits for it in the rendezvous; torchrun stops rank 0 and restarts both, and the second
    attempt trains to the end. The live stream says the crash ended with its attempt (not that
    it cleared); the summary tells both attempts, each with its verdict. Rank 0, stopped
    while blocked in the rendezvous store's C++ wait, is reported stopped, at once: the
    agent's signal handler does not keep it alive until torchrun's kill 30 s later."""
    proc, err = run_restarted(tmp_path, "restart_once.py")
    assert proc.returncode == 0, err[-4000:]
    assert not _collector_failed(err), err[-4000:]
    assert "attempt 2 began: crashed (rank 1) ends with attempt 1" in err, err[-4000:]
    assert "cleared crashed" not in err, err[-4000:]
    summary = err[err.index("── summary") :].splitlines()
    assert "2 attempts (the launcher restarted it)" in summary[1], summary
    verdicts = [line.removeprefix("ddpwatch: ") for line in summary if "verdict:" in line]
    assert verdicts[0] == (
        "verdict: attempt 1 of 2: rank 1 crashed with RuntimeError (config file not found: "
        "/data/run.yaml), which ended the job; rank 0 was stopped because of it"
    ), verdicts
    assert "forcefully exiting via 9" not in err, err[-4000:]  # torchrun's kill after 30 s
    assert verdicts[1].startswith(  # then "no problems seen", or a slow start's warning
        "verdict: attempt 2 of 2: the job finished: every rank exited 0; "
    ), verdicts


@pytest.mark.e2e
def test_a_job_that_fails_again_after_its_restart_is_judged_on_both_attempts(
    tmp_path: Path,
) -> None:
    """Issue #33: torchrun --max-restarts 1, rank 1 raising at step 30 in both attempts, so
    torchrun exits 1. The collector took every report in (its thread once died on rank 1's
    late exit report after attempt 2 began: live alerts stopped, and the verdict said the job
    was still running); the last verdict names rank 1's crash, the summary sees problems."""
    proc, err = run_restarted(tmp_path, "restart_fails_twice.py")
    assert proc.returncode == 1, err[-4000:]
    assert not _collector_failed(err), err[-4000:]
    summary = err[err.index("── summary") :].splitlines()
    assert "2 attempts (the launcher restarted it)" in summary[1], summary
    verdicts = [line.removeprefix("ddpwatch: ") for line in summary if "verdict:" in line]
    assert len(verdicts) == 2, summary
    for attempt, verdict in enumerate(verdicts, 1):
        assert verdict.startswith(
            f"verdict: attempt {attempt} of 2: rank 1 crashed with RuntimeError (bad batch at "
            f"step 30 (attempt {attempt}))"
        ), verdicts
    assert "still running" not in "\n".join(summary), summary


@pytest.mark.e2e
def test_a_rank_gloo_aborts_is_told_with_the_backends_own_words(tmp_path: Path) -> None:
    """Issue #34: under ``ddpwatch run``, rank 1 all-reduces a float64 metric where the
    others use float32 (pytorch/pytorch#150248's family) and gloo aborts a receiver from C++.
    Its black box gives its call and its death; the job's stderr, the backend's message
    ("Received data size doesn't match expected size"), which the summary tells as its crash:
    a victim of rank 1's mismatch, which the verdict names."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "run", "--no-record", "--",
         sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3",
         "--master-addr=127.0.0.1", f"--master-port={free_port_pair()}",
         str(EXAMPLES / "failures.py"), "--mode", "metric-dtype"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DDPWATCH_BOX_DIR": str(tmp_path)},
        start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=150)
    finally:
        stop_job(proc, grace=1.0)
    assert proc.returncode == 1, err[-4000:]
    summary = err[err.index("── summary") :].splitlines()
    ranks = next(line for line in summary if "ranks:" in line)
    assert "crashed (gloo::EnforceNotMet), SIGABRT" in ranks, summary
    verdict = next(line for line in summary if "verdict:" in line)
    assert "verdict: rank 1 made collective calls that did not match the others'" in verdict
    assert "failed because of it" in verdict, summary
    left = sorted(p.name for p in tmp_path.glob("*.box"))
    assert not left, ("boxes left behind", left, summary)


def _collector_failed(err: str) -> bool:
    """Whether ``ddpwatch run``'s output tells of a collector that raised or stopped."""
    return any(
        text in err
        for text in ("Exception in thread", "collector stopped", "could not be taken in")
    )


def test_run_records_in_one_folder_keeps_the_last_20_and_says_where_at_the_end(
    tmp_path: Path,
) -> None:
    """A newcomer's afternoon left nine recordings beside their script (#33): they go to
    ./ddpwatch-runs, the oldest beyond 20 removed, and the end of the run says which file."""
    runs = tmp_path / "ddpwatch-runs"
    runs.mkdir()
    for n in range(25):
        old = runs / f"ddpwatch-old-{n:02}.ddpw"
        old.write_bytes(b"")
        os.utime(old, (1_000_000 + n, 1_000_000 + n))
    (runs / "notes.txt").write_text("mine")  # not a recording: never touched
    env = {k: v for k, v in os.environ.items() if k != "DDPWATCH_RECORD_DIR"}
    done = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "run", "--", sys.executable, "-c", "print('hi')"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    kept = sorted(p.name for p in runs.glob("ddpwatch-*.ddpw"))
    (new,) = [name for name in kept if not name.startswith("ddpwatch-old-")]
    assert len(kept) == 20 and kept[:19] == [f"ddpwatch-old-{n:02}.ddpw" for n in range(6, 25)]
    assert (runs / "notes.txt").exists()
    assert not list(tmp_path.glob("*.ddpw"))  # nothing beside the user's files
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last
        == f"ddpwatch run: recorded in ddpwatch-runs/{new}: ddpwatch report ddpwatch-runs/{new}"
    )


def test_run_usage_names_every_option() -> None:
    from ddpwatch.cli import build_parser

    parser = build_parser()
    (run,) = [
        p for a in parser._subparsers._group_actions for n, p in a.choices.items() if n == "run"
    ]
    usage = run.format_usage()
    options = [a.option_strings for a in run._actions if a.option_strings]
    assert len(options) > 5
    assert [o for o in options if not any(f"[{s}" in usage or f" {s}" in usage for s in o)] == []


def run_restarted(tmp_path: Path, script: str) -> tuple[subprocess.Popen[str], str]:
    """``ddpwatch run -- torchrun --max-restarts=1`` on two ranks of ``script``: the process
    (ended) and its stderr; its ranks never left behind, reporting to the next test."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "run", "--no-record", "--",
         sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--max-restarts=1", "--master-addr=127.0.0.1", f"--master-port={free_port_pair()}",
         str(SCRIPTS / script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=150)
    finally:
        stop_job(proc, grace=1.0)
    return proc, err


def test_a_port_taken_between_its_pick_and_the_bind_is_tried_again_on_another(
    monkeypatch, capsys
) -> None:
    """Two ``ddpwatch run`` started at once on one node: the pair one picked free is bound by
    the other before its own bind. The collector binds another pair, never a traceback; a
    port never free is one line."""
    import socket

    from ddpwatch.jobs import launch

    taken = free_port_pair()
    holder = socket.socket()
    holder.bind(("127.0.0.1", taken))
    holder.listen()
    picks = iter([taken])
    monkeypatch.setattr(launch, "pick_port", lambda preferred: next(picks))
    try:
        bound = launch._bound_local_server(taken, None, None)
        assert bound is not None
        port, server = bound
        server.collector.close()
        assert port != taken
        monkeypatch.setattr(launch, "free_port_pair", lambda: taken)
        monkeypatch.setattr(launch, "pick_port", lambda preferred: taken)
        assert launch._bound_local_server(taken, None, None) is None
    finally:
        holder.close()
    said = capsys.readouterr().err
    assert said.startswith("ddpwatch run: no port for its collector: ") and "Traceback" not in said
