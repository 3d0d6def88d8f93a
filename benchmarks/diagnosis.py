"""Diagnosis accuracy on real failure modes: does ddpwatch blame the rank that caused it?

    python benchmarks/diagnosis.py [--reps 3] [--modes exit-zero,nan] [--show] [--json F]
        [--relay [--pace 2]]

Each mode of ``examples/failures.py`` (a bug from a public issue, cited there) runs ``--reps``
times as a real ``torchrun --nproc-per-node 3`` job (4 for allgather-size; gloo, CPU,
``OMP_NUM_THREADS=1``) reporting to a real ``Server`` on a thread here, whose ``on_change``
stamps every raised and cleared alert with ``time.time()``. The faulty rank prints
``DDPWATCH_FAULT rank=r t=...`` just before its fault. A run ends when the job ends (plus a
few seconds for the ranks' last messages) or ``watch_s`` after the fault, when the job is
stopped; alerts raised after the harness began stopping it are kept but not scored (the
harness's own SIGTERM is not part of the failure).

Per mode the table shows:

* culprit accuracy: runs whose first error-or-warning alert naming anyone names exactly the
  expected culprits, with a kind the mode allows (for ``healthy``: runs with no alert);
* wrong blames: alerts raised at any time of the run whose ``ranks`` include a rank that is
  not an expected culprit (a few examples are printed);
* detection latency: median seconds from the fault line to the first alert that names
  exactly the culprits with an allowed kind;
* false alerts on the healthy run: every alert it raised;
* verdict: runs whose end-of-run verdict (``diagnosis/verdict.py``, what ``run``'s summary and
  ``report`` print) blames exactly the expected culprits (for ``healthy``: nobody), judged on
  the ranks it names (``Account.named``);
* raises per episode and flaps (#32 item 3): the most ``raised`` changes one alert episode
  had (1: it was raised once, then updated in place), and the raises of a kind about the same
  ranks within ``FLAP_S`` of its clearing (0: no alert cleared and came back).

Then one ``RATIO diagnosis right_culprit=x/n wrong_blames=k ...`` line. ``--show`` prints
every alert of every run (time from the fault, kind, ranks, waiting, message) and the job's
tracebacks, exit codes and torchrun's root cause; ``--json`` writes all of it.
``--relay``: each run's ranks report through a per-node relay (``ddpwatch.relay.Relay`` on a
thread here, on its own ``ipc://`` socket), as ``ddpwatch run --addr`` sets them up;
``--pace 2`` has the server ask it for one batch every second beat all run, as a server
behind its queue does (``server/pace.py``), so that every mode is judged at that pace.
The functions here (``MODES``, ``run_mode``, ``score``, ``describe``) are what
``tests/e2e/test_failure_modes.py`` uses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from ddpwatch.core.ports import free_port_pair
from ddpwatch.core.vocabulary import HistoryEvent
from ddpwatch.demo.runner import stop_job
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.history import AlertChange
from ddpwatch.diagnosis.verdict import read_run
from ddpwatch.relay import Relay
from ddpwatch.server.service import Server

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "failures.py"
# the thresholds of the e2e tests: stalls show after 4 s, a slow start only after 20 s
THRESHOLDS = Thresholds(interval=0.5, stall_after=4.0, startup_after=20.0)
SETTLE_S = 3.0  # after the job ends: its ranks' last messages, as `ddpwatch run` waits
START_S = 60.0  # from launch to the fault line at most
FAULT = re.compile(r"DDPWATCH_FAULT rank=(\d+) t=([0-9.]+)")
BLAMING = ("error", "warning")


@dataclass(frozen=True)
class Mode:
    """One failure mode: who is to blame, with which kinds, and how long to watch it."""

    name: str
    culprits: frozenset[int]
    kinds: frozenset[str]
    report: str
    nproc: int = 3
    args: tuple[str, ...] = ()  # script arguments for every run of the mode
    watch_s: float = 15.0  # after the fault line, stop a job that has not ended
    script: Path = SCRIPT  # the job script (benchmarks/false_alarms.py runs examples/healthy.py)


def _mode(name: str, culprits: set[int], kinds: set[str], report: str, **kw: Any) -> Mode:
    return Mode(name, frozenset(culprits), frozenset(kinds), report, **kw)


_GH = "https://github.com/"
MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        _mode("healthy", set(), set(), "", watch_s=60.0),
        _mode("healthy-busy", set(), set(), "", watch_s=60.0),
        _mode("healthy-join", set(), set(), _GH + "pytorch/pytorch/issues/38174", watch_s=60.0),
        _mode("healthy-subgroup", set(), set(), "", watch_s=60.0),
        _mode(
            "exit-early",
            {1},
            {"exited", "crashed"},
            _GH + "Lightning-AI/pytorch-lightning/issues/379",
        ),
        _mode("exit-zero", {1}, {"exited"}, _GH + "pytorch/pytorch/issues/138322"),
        _mode("os-exit", {1}, {"exited", "silent"}, _GH + "pytorch/pytorch/issues/41067"),
        _mode("nan", {1}, {"nan_loss"}, _GH + "Lightning-AI/pytorch-lightning/issues/5243"),
        _mode("nan-grad", {1}, {"nan_loss"}, _GH + "pytorch/pytorch/issues/2421"),
        _mode(
            "barrier-sleep",
            {1},
            {"straggler", "stalled"},
            _GH + "deepspeedai/DeepSpeed/issues/4488",
            watch_s=30.0,
        ),
        _mode(
            "allgather-size",
            {2},
            {"collective_mismatch", "crashed"},
            _GH + "Lightning-AI/pytorch-lightning/issues/7773",
            # gloo's ring aborts the odd rank's neighbour (SIGABRT, no report): with 3 ranks
            # the two calls left tie, so 4 ranks, where the majority still shows the odd one
            nproc=4,
        ),
        _mode(
            "rank0-only-collective",
            {0},
            # gloo aborts rank 0 itself from C++ (SIGABRT): killed inside its all_reduce, as
            # its black box says (it falls silent where the box cannot be read)
            {"collective_mismatch", "crashed", "straggler", "silent", "exited"},
            _GH + "Lightning-AI/pytorch-lightning/pull/19056",
        ),
        _mode(
            "rank0-checkpoint",
            {0},
            {"straggler", "stalled"},
            _GH + "huggingface/accelerate/issues/1359",
            watch_s=35.0,
        ),
        _mode(
            "rank0-checkpoint-timeout",
            {0},
            # the others' timeout is its consequence: the alert stays on rank 0
            {"straggler", "stalled"},
            _GH + "hiyouga/LLaMA-Factory/issues/2424",
            watch_s=30.0,
        ),
        _mode(
            "subgroup-cascade",
            {2},
            {"straggler", "stalled"},  # rank 0 waits for it in the subgroup: a victim
            _GH + "pytorch/pytorch/issues/130102",
            watch_s=25.0,
        ),
        _mode(
            "rank0-eval-epochs",
            {0},
            {"straggler"},  # working (its stack moves): never ``stalled``
            _GH + "rwth-i6/returnn/issues/1621",
            watch_s=40.0,
        ),
        _mode(
            "dataloader-hang",
            {1},
            {"straggler", "stalled"},
            _GH + "pytorch/pytorch/issues/87995",
        ),
        _mode("dataloader-killed", {1}, {"crashed"}, _GH + "pytorch/pytorch/issues/8976"),
        _mode(
            "unused-params",
            {1},
            {"crashed", "collective_mismatch"},
            _GH + "pytorch/pytorch/issues/43259",
        ),
        _mode(
            "skipped-batch",
            {1},
            {"collective_mismatch", "step_skew", "straggler", "crashed"},
            _GH + "pytorch/pytorch/issues/44353",
        ),
        _mode(
            "reduce-op",
            {2},
            {"collective_mismatch"},  # same count, another reduce op: its calls' digest differs
            _GH + "pytorch/pytorch/issues/39708",
        ),
        _mode(
            "broadcast-src",
            {2},
            {"collective_mismatch"},  # a tie in flight, broken by the rank that got past it
            _GH + "pytorch/pytorch/issues/39706",
        ),
        _mode(
            "metric-dtype",
            {1},
            {"collective_mismatch"},  # gloo aborts a rank it reaches: a victim
            _GH + "pytorch/pytorch/issues/150248",
        ),
        _mode("healthy-broadcast", set(), set(), "", watch_s=60.0),
        _mode(
            "accumulate-uneven",
            {1},
            {"step_skew"},  # its batches per step differ; nothing else does
            _GH + "modelscope/FunASR/pull/3472",
        ),
        _mode(
            "skipped-step",
            {1},
            # one backward more than optimizer steps (and, with the metric all-reduce, one
            # collective more by the same step): nothing else differs
            {"step_skew", "collective_mismatch"},
            _GH + "NVIDIA-NeMo/Automodel/pull/2468",
            args=("--own-data",),  # no DataLoader to count
        ),
        _mode(
            "ddp-eval-alone",
            {0},
            # run on: its evaluation forwards, counted at the marks; hung: the mismatch in
            # flight, or the straggler the others wait for in its broadcast
            {"collective_mismatch", "straggler", "stalled"},
            _GH + "pytorch/pytorch/issues/175024",
        ),
        _mode("healthy-ddp-eval", set(), set(), "", watch_s=60.0),
        _mode("raise", {1}, {"crashed"}, _GH + "Lightning-AI/pytorch-lightning/issues/8130"),
        # the slow rank runs on: the others wait for it inside DDP's all-reduce every step
        _mode(
            "slow-backward",
            {1},
            {"slow_rank"},
            _GH + "traceopt-ai/traceml/issues/252",
            watch_s=25.0,  # the job ends ~13 s after the fault
        ),
        _mode(
            "slow-input",
            {2},
            {"slow_rank"},
            _GH + "traceopt-ai/traceml/issues/252",
            watch_s=25.0,  # the job ends ~13 s after the fault
        ),
        _mode(
            "host-leak",
            {1},
            # warned of while it grows (~13 s after the fault); then the OOM kill at 1 GiB
            # (SIGKILL: it falls silent, the others hang) ends the job
            {"host_memory"},
            _GH + "pytorch/pytorch/issues/13246",
            watch_s=90.0,
        ),
        # point-to-point: the rank that did not make its half of a send/recv is named, never
        # the rank blocked in it; the others wait in DDP's all-reduce, which the blocked rank
        # must enter (a deadlock)
        _mode(
            "p2p-skip-send",
            {0},
            {"send_recv_deadlock"},
            _GH + "tdrussell/diffusion-pipe/issues/409",
        ),
        _mode(
            "p2p-skip-recv",
            {1},
            {"send_recv_deadlock"},
            _GH + "tdrussell/diffusion-pipe/issues/409",
        ),
        _mode("p2p-batch-skip", {0}, {"send_recv_deadlock"}, _GH + "pytorch/PiPPy/issues/969"),
        _mode(
            "p2p-isend-skip", {0}, {"send_recv_deadlock"}, _GH + "pytorch/pytorch/issues/109401"
        ),
        _mode(
            "p2p-slow-send",
            {0},
            {"straggler", "stalled"},  # the receiver waits for it: a victim on the way
            _GH + "tdrussell/diffusion-pipe/issues/409",
        ),
        _mode("healthy-p2p", set(), set(), "", watch_s=60.0),
        _mode(
            "missing-rank",
            {2},
            {"not_connected", "startup_hang"},
            _GH + "pytorch/pytorch/issues/52848",
            nproc=2,
            watch_s=40.0,
        ),
        # one rank sets its own MASTER_PORT before init_process_group: named while the others
        # wait, never the ranks that time out waiting for it; rank 0 too (the store's host
        # in a static rendezvous)
        _mode(
            "port-of-its-own",
            {2},
            {"config_mismatch"},
            _GH + "pytorch/pytorch/issues/53395",
            watch_s=45.0,
        ),
        _mode(
            "port-of-its-own-rank0",
            {0},
            {"config_mismatch"},
            _GH + "pytorch/pytorch/issues/76069",
            watch_s=45.0,
        ),
    )
}


# ----------------------------------------------------------------------------------- running


FLAP_S = 5.0  # raised again this soon after its clearing: one problem shown twice

@dataclass(frozen=True)
class Stamped:
    """One raised or cleared alert with the time the server raised or cleared it."""

    at: float
    event: str
    kind: str
    severity: str
    ranks: tuple[int, ...]
    waiting: tuple[int, ...]
    message: str
    hint: str
    episode: int = 0  # the alert's episode (history.py): its raise, escalations and clearing


def raises_per_episode(changes: list[Stamped]) -> int:
    """The most ``raised`` events one episode had (1 when each raise is its own episode)."""
    counts = Counter(c.episode for c in changes if c.event == HistoryEvent.RAISED)
    return max(counts.values(), default=0)


def flaps(changes: list[Stamped], within: float = FLAP_S) -> int:
    """Raises of the same kind about the same ranks within ``within`` s of its clearing."""
    cleared: dict[tuple[str, tuple[int, ...]], float] = {}
    count = 0
    for c in changes:
        key = (c.kind, c.ranks)
        if c.event == HistoryEvent.CLEARED:
            cleared[key] = c.at
        elif c.event == HistoryEvent.RAISED and key in cleared and c.at - cleared[key] <= within:
            count += 1
    return count


def stamp(change: AlertChange, at: float) -> Stamped:
    """One change as kept here: the fields of its ``serve --headless`` JSON line, at ``at``."""
    a = change.alert
    return Stamped(
        at, change.event, a.kind, a.severity, a.ranks, a.waiting, a.message, a.hint, change.episode
    )


@dataclass
class RunResult:
    """Everything one run showed: the alerts, the job's output, how it ended."""

    mode: str
    started: float
    fault_at: float | None = None
    fault_rank: int | None = None
    changes: list[Stamped] = field(default_factory=list)
    output: list[tuple[float, str]] = field(default_factory=list)
    returncode: int | None = None
    stopped_at: float | None = None  # when the harness began stopping the job, if it did
    ended_at: float = 0.0
    ranks: list[dict[str, Any]] = field(default_factory=list)  # the last status, per rank
    verdict: str = ""  # the end-of-run verdict on the last status
    verdict_named: list[int] = field(default_factory=list)  # the ranks it blames
    relayed: int = 0  # frames the server took inside relays' batches (``--relay``)

    def scored(self) -> list[Stamped]:
        """The raised alerts that count: those before the harness stopped the job."""
        limit = self.stopped_at if self.stopped_at is not None else float("inf")
        return [c for c in self.changes if c.event != HistoryEvent.CLEARED and c.at < limit]


class _Recorder:
    """The server's ``on_change``: stamps each change as it happens, for the latency."""

    def __init__(self) -> None:
        self.changes: list[Stamped] = []

    def __call__(self, change: AlertChange) -> None:
        self.changes.append(stamp(change, time.time()))


def job_command(mode: Mode, master_port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The torchrun command line of one run (``extra`` goes to the script)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={mode.nproc}", "--master-addr=127.0.0.1",
        f"--master-port={master_port}",
        str(mode.script), "--mode", mode.name, *mode.args, *extra,
    ]  # fmt: skip


def job_environment(addr: str | None, relay: str | None = None) -> dict[str, str]:
    """The job's environment: one thread per rank, unbuffered output, stacks after 1 s; the
    ranks report through ``relay`` when given, else straight to the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPWATCH_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DDPWATCH_STACK_AFTER="1.0")
    if addr is not None:
        env["DDPWATCH_ADDR"] = addr
    if relay is not None:
        env["DDPWATCH_RELAY"] = relay
    return env


def run_mode(
    mode: Mode | str,
    *,
    thresholds: Thresholds = THRESHOLDS,
    extra: tuple[str, ...] = (),
    watch_s: float | None = None,
    relay: bool = False,
    record: Path | None = None,
    pace: int = 1,
) -> RunResult:
    """Run one mode once under a live server (its ranks through a per-node relay when
    ``relay``, as ``ddpwatch run --addr`` sets it up, the server asking it for one batch
    every ``pace`` beats as it does when behind; recording to ``record`` when given, as
    ``serve --record`` does); the job is always stopped before returning."""
    mode = MODES[mode] if isinstance(mode, str) else mode
    watch = mode.watch_s if watch_s is None else watch_s
    port = free_port_pair()
    recorder = _Recorder()
    server = Server("127.0.0.1", port, thresholds, on_change=recorder, record=record)
    if pace > 1:
        server.collector.pace.hold(pace)
    thread = threading.Thread(target=server.run, name="diagnosis-server", daemon=True)
    thread.start()
    result = RunResult(mode.name, started=time.time())
    proc: subprocess.Popen[str] | None = None
    node = tempfile.TemporaryDirectory(prefix="ddpwatch-relay-") if relay else None
    forwarder = (
        Relay(f"tcp://127.0.0.1:{port}", f"ipc://{node.name}/relay.sock").start() if node else None
    )
    try:
        proc = subprocess.Popen(
            job_command(mode, free_port_pair(), extra),
            env=job_environment(f"127.0.0.1:{port}", forwarder.listen if forwarder else None),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        reader = threading.Thread(target=_read, args=(proc, result), daemon=True)
        reader.start()
        _watch(proc, result, watch)
        if proc.poll() is None:
            result.stopped_at = time.time()
            stop_job(proc, grace=3.0)
        else:
            time.sleep(SETTLE_S)
        result.returncode = proc.poll()
        reader.join(5)
        status = server.status()
        result.ranks = [_rank_summary(msgspec.to_builtins(r)) for r in status.ranks]
        judged = read_run(status)
        result.verdict = judged.text
        result.verdict_named = sorted(judged.accounts[-1].named)
        result.relayed = sum(relay.frames for relay in status.relays)
    finally:
        if proc is not None:
            stop_job(proc, grace=1.0)
        if forwarder is not None:
            forwarder.stop()
        if node is not None:
            node.cleanup()
        server.stop()
        thread.join(5)
        result.ended_at = time.time()
        result.changes = list(recorder.changes)
    return result


def _read(proc: subprocess.Popen[str], result: RunResult) -> None:
    """Keep the job's output, stamped, and catch the fault line as it is printed."""
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        result.output.append((time.time(), line))
        found = FAULT.search(line)
        if found and result.fault_at is None:
            result.fault_rank, result.fault_at = int(found[1]), float(found[2])


def _watch(proc: subprocess.Popen[str], result: RunResult, watch: float) -> None:
    """Wait for the job to end, at most START_S to the fault and ``watch`` after it."""
    while proc.poll() is None:
        now = time.time()
        if result.fault_at is None and now - result.started > START_S + watch:
            return
        if result.fault_at is not None and now - result.fault_at > watch:
            return
        time.sleep(0.1)


def _rank_summary(rank: dict[str, Any]) -> dict[str, Any]:
    """How a rank ended as the server saw it, short enough to print per run."""
    error = rank.get("error") or {}
    keys = (
        "rank",
        "state",
        "phase",
        "step",
        "exit_code",
        "exit_signal",
        "nan_step",
        "nan_exact",
        "grad_nan_step",
    )
    summary = {key: rank.get(key) for key in keys}
    summary["error"] = f"{error.get('type')}: {error.get('message')}" if error else None
    return summary


# ----------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Score:
    """How one run was diagnosed, against its mode's expectation."""

    right: bool  # the first blaming alert named exactly the culprits with an allowed kind
    first: Stamped | None  # that first error-or-warning alert naming anyone
    wrong: tuple[Stamped, ...]  # alerts naming a rank that is not a culprit
    latency: float | None  # fault line -> first right alert
    alerts: int  # alerts raised (scored ones)
    verdict_right: bool = False  # the verdict blames exactly the culprits (healthy: nobody)


def score(result: RunResult, mode: Mode | str | None = None) -> Score:
    """Score one run: the first blame, every wrong blame, and the detection latency."""
    mode = MODES[result.mode if mode is None else mode] if not isinstance(mode, Mode) else mode
    raised = result.scored()
    first = next((c for c in raised if c.severity in BLAMING and c.ranks), None)
    wrong = tuple(c for c in raised if set(c.ranks) - mode.culprits)

    def names_culprits(c: Stamped) -> bool:
        return c.severity in BLAMING and set(c.ranks) == mode.culprits and c.kind in mode.kinds

    # healthy: right when nothing at all was raised
    right = not raised if not mode.culprits else first is not None and names_culprits(first)
    found = next((c for c in raised if mode.culprits and names_culprits(c)), None)
    latency = None
    if found is not None and result.fault_at is not None:
        latency = found.at - result.fault_at
    verdict_right = set(result.verdict_named) == set(mode.culprits)
    return Score(right, first, wrong, latency, len(raised), verdict_right)


# --------------------------------------------------------------------------------- reporting

_JOB_LINES = re.compile(
    r"Error|Exception|Traceback \(most|Root Cause|exitcode|rank\s+:|Signal|SIGTERM|"
    r"killed|terminate|DDPWATCH_FAULT|skipping|Timed out|timeout|Socket|Connection"
)


def describe(result: RunResult, lines: int = 40) -> str:
    """A readable account of one run: every alert from the fault, how each rank ended, and
    the job's notable output (exceptions, exit codes, torchrun's root cause)."""
    zero = result.fault_at if result.fault_at is not None else result.started
    origin = "fault" if result.fault_at is not None else "launch"
    when = "-" if result.fault_at is None else f"{result.fault_at - result.started:.1f} s"
    stop = (
        f", stopped by the harness at {result.stopped_at - zero:+.1f} s"
        if result.stopped_at
        else ""
    )
    out = [
        f"mode {result.mode}: fault on rank {result.fault_rank} at {when} after launch; "
        f"job returncode {result.returncode}{stop}"
    ]
    for c in result.changes:
        late = " (after stop, unscored)" if result.stopped_at and c.at >= result.stopped_at else ""
        out.append(
            f"  {c.at - zero:+6.1f} s from {origin}: {c.event} [{c.severity}] {c.kind} "
            f"ranks={list(c.ranks)} waiting={list(c.waiting)}{late}: {c.message}"
        )
    if not result.changes:
        out.append("  (no alert)")
    for rank in result.ranks:
        out.append(f"  rank {rank['rank']}: {rank}")
    out.append(f"  verdict (names {result.verdict_named}): {result.verdict}")
    notable = [(t, line) for t, line in result.output if _JOB_LINES.search(line)]
    for t, line in notable[-lines:]:
        out.append(f"  | {t - zero:+6.1f} s {line[:240]}")
    return "\n".join(out)


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s" if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--show", action="store_true", help="print every run's alerts and output")
    parser.add_argument("--json", metavar="FILE", help="write every run's results here")
    parser.add_argument(
        "--relay", action="store_true", help="ranks report through a per-node relay"
    )
    parser.add_argument(
        "--pace",
        type=int,
        default=1,
        choices=(1, 2, 4),
        help="with --relay: the server asks for one batch every this many beats all run, as "
        "it does while behind (server/pace.py)",
    )
    parser.add_argument(
        "--nproc", type=int, help="ranks per job instead of each mode's own (a variation)"
    )
    parser.add_argument(
        "--extra",
        default="",
        help="flags for every job's script, e.g. '--pg-timeout 6' (a timeout instead of a hang)",
    )
    args = parser.parse_args(argv)
    if args.pace > 1 and not args.relay:
        parser.error("--pace needs --relay: only relays take the server's pace")
    extra = tuple(shlex.split(args.extra))
    names = [n.strip() for n in args.modes.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")

    print(
        f"diagnosis: {len(names)} modes x {args.reps} runs, real torchrun jobs (gloo, CPU), "
        f"stall_after {THRESHOLDS.stall_after} s, heartbeat {THRESHOLDS.interval} s"
        + (", ranks through a per-node relay" if args.relay else "")
        + (f" at pace {args.pace}" if args.pace > 1 else "")
        + (f", {args.nproc} ranks" if args.nproc else "")
        + (f", script flags {args.extra!r}" if extra else "")
    )
    header = (
        f"  {'mode':<22} {'runs':>4} {'right':>6} {'wrong':>6} {'latency':>9} {'alerts':>7} "
        f"{'verdict':>7}"
    )
    print(header)
    everything: list[dict[str, Any]] = []
    right = runs = wrong = healthy_alerts = verdicts = flapped = most_raises = 0
    latencies: list[float] = []
    examples: list[str] = []
    misses: list[str] = []
    for name in names:
        mode = MODES[name] if not args.nproc else replace(MODES[name], nproc=args.nproc)
        results = [
            run_mode(mode, relay=args.relay, extra=extra, pace=args.pace) for _ in range(args.reps)
        ]
        scores = [score(r, mode) for r in results]
        mode_right = sum(s.right for s in scores)
        mode_verdicts = sum(s.verdict_right for s in scores)
        verdicts += mode_verdicts
        mode_wrong = sum(len(s.wrong) for s in scores)
        flapped += sum(flaps(r.changes) for r in results)
        most_raises = max([most_raises, *(raises_per_episode(r.changes) for r in results)])
        mode_lat = [s.latency for s in scores if s.latency is not None]
        alerts = sum(s.alerts for s in scores)
        runs += len(results)
        right += mode_right
        wrong += mode_wrong
        latencies += mode_lat
        if not mode.culprits:
            healthy_alerts += alerts
        examples += [f"{name}: {c.kind} ranks={list(c.ranks)}" for s in scores for c in s.wrong]
        print(
            f"  {name:<22} {len(results):>4} {mode_right:>3}/{len(results):<2} {mode_wrong:>6} "
            f"{_median(mode_lat):>9} {alerts:>7} {mode_verdicts:>4}/{len(results):<2}"
        )
        bad = [r for r, s in zip(results, scores, strict=True) if not s.verdict_right]
        misses += [f"{name} (names {r.verdict_named}): {r.verdict}" for r in bad]
        for result in results if args.show else []:
            print(describe(result))
        everything += [
            {"result": asdict(r), "score": asdict(s)} for r, s in zip(results, scores, strict=True)
        ]
    if examples:
        print("  wrong blames, e.g.: " + "; ".join(list(dict.fromkeys(examples))[:6]))
    for miss in misses:
        print(f"  verdict missed: {miss}")
    if args.relay:
        relayed = [e["result"]["relayed"] for e in everything]
        print(f"  frames taken through relays: {sum(relayed)}, at least {min(relayed)} a run")
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1, default=str))
    print(
        f"RATIO diagnosis right_culprit={right}/{runs} wrong_blames={wrong} "
        f"right_verdict={verdicts}/{runs} "
        f"median_latency={_median(latencies)} healthy_false_alerts={healthy_alerts} "
        f"max_raises_per_episode={most_raises} flaps={flapped} "
        f"(modes={len(names)}, reps={args.reps}{', relay' if args.relay else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
