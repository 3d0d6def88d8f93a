"""False alarms on healthy jobs: does ddpwatch name a rank when nothing is wrong? (#32 item 5)

    python benchmarks/false_alarms.py [--jobs a,b] [--reps N] [--load] [--thresholds tight,default]
        [--quick] [--show] [--record DIR] [--json F]

Each job of the corpus is healthy but unusual (``examples/healthy.py``, and
``examples/failures.py --mode healthy-join``): a real ``torchrun --nproc-per-node 3`` job on
gloo and CPU under a real server, run as ``benchmarks/diagnosis.py`` runs its failure modes
(its ``run_mode``). Every setting runs idle and, with ``--load``, again beside one busy-loop
process per core (``os.cpu_count()``), under two threshold sets: ``tight`` (``--stall-after 4
--silent-after 3 --startup-after 6``) and ``default`` (``ddpwatch serve``'s own).

A correct monitor names no rank on any of them. Per job and setting the table shows:

* false alarms: alert episodes of severity warning or error whose ``ranks`` are not empty
  (each is listed below the table with its kind, ranks and message);
* raises/ep: the most ``raised`` events of one episode (history.py numbers them);
* flaps: raises of a kind about the same ranks within ``FLAP_S`` of its clearing;
* rc: the job's exit code (a healthy job that failed is no measurement: ``!`` marks it).

Then ``RATIO false_alarms ...``. Exit status 0 always: the benchmark reports, a test judges.
``--quick``: two short jobs (a checkpoint on every rank, ranks that finish apart), tight
thresholds, idle (the e2e test's slice).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diagnosis import (
    BLAMING,
    ROOT,
    Mode,
    RunResult,
    Stamped,
    flaps,
    raises_per_episode,
    run_mode,
    stamp,
)

from ddpwatch.core.vocabulary import HistoryEvent
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.history import AlertChange
from ddpwatch.server.replay import ReplayServer

HEALTHY = ROOT / "examples" / "healthy.py"
FAILURES = ROOT / "examples" / "failures.py"
THRESHOLDS = {
    "tight": Thresholds(stall_after=4.0, silent_after=3.0, startup_after=6.0),
    "default": Thresholds(),
}
QUICK_JOBS = ("checkpoint", "finish-apart")
QUICK_ARGS = ("--steps", "80")


def _job(name: str, needs: str | None = None, watch_s: float = 90.0) -> tuple[str, Job]:
    return name, Job(
        Mode(name, frozenset(), frozenset(), "", script=HEALTHY, watch_s=watch_s), needs
    )


@dataclass(frozen=True)
class Job:
    """One healthy job: how it runs, and the module it needs (skipped without it)."""

    mode: Mode
    needs: str | None = None

    def missing(self) -> str | None:
        """Why the job cannot run here, or None."""
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return f"{self.needs} is not installed"
        return None


HEALTHY_JOIN = Mode(
    "healthy-join", frozenset(), frozenset(), "", args=("--steps", "400"), script=FAILURES
)
JOBS: dict[str, Job] = dict(
    [
        _job("compile"),
        _job("compile-inductor", watch_s=240.0),  # ~85 s of compiling on a shared 2-core host
        _job("lightning", needs="lightning"),
        _job("deepspeed", needs="deepspeed"),
        _job("workers"),
        _job("memory"),
        _job("checkpoint"),
        _job("eval"),
        _job("rank0-log"),
        _job("accumulate"),
        _job("batch-sizes"),
        # uneven inputs under DDP's join(): failures.py's mode, ~20 s of it
        ("join", Job(HEALTHY_JOIN)),
        _job("finish-apart"),
    ]
)


# ----------------------------------------------------------------------------------- load


@contextlib.contextmanager
def cpu_hog(processes: int) -> Iterator[None]:
    """``processes`` busy loops for the duration: every core taken, as a co-tenant's job or a
    data-preparation pool does. Each is killed by its own pid at the end."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(10)


# ----------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Score:
    """What one healthy run raised that it should not have."""

    false_alarms: tuple[Stamped, ...]  # the first change of each blaming episode
    raises_per_episode: int  # the most ``raised`` events of one episode
    flaps: int  # raised again about the same ranks within FLAP_S of clearing
    returncode: int | None


def false_alarms(changes: list[Stamped]) -> tuple[Stamped, ...]:
    """One change per episode that warned of or blamed a rank (raised or escalated into it):
    on a healthy job, every one is a false alarm."""
    first: dict[int, Stamped] = {}
    for c in changes:
        if c.event != HistoryEvent.CLEARED and c.severity in BLAMING and c.ranks:
            first.setdefault(c.episode, c)
    return tuple(first.values())


def score_changes(changes: list[Stamped], returncode: int | None = 0) -> Score:
    """Score a stream of alert changes (a live run's, or a replay's) of a healthy job."""
    return Score(false_alarms(changes), raises_per_episode(changes), flaps(changes), returncode)


def score(result: RunResult) -> Score:
    """Score one live run: the changes before the harness stopped the job, if it did."""
    limit = result.stopped_at if result.stopped_at is not None else float("inf")
    return score_changes([c for c in result.changes if c.at < limit], result.returncode)


def replayed(path: Path, thresholds: Thresholds) -> list[Stamped]:
    """The alert changes of a recording (``--record``) replayed in-process as fast as
    possible under ``thresholds``: the live server's stream again, without the job (what
    the default tests score)."""
    changes: list[AlertChange] = []
    ReplayServer(path, speed=None, on_change=changes.append, thresholds=thresholds).run()
    return [stamp(c, c.at) for c in changes]


# ----------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Setting:
    """Where a job ran: with or without the CPU hog, under which thresholds."""

    loaded: bool
    thresholds: str

    def label(self) -> str:
        return f"{'loaded' if self.loaded else 'idle'}/{self.thresholds}"


def run_job(
    name: str, setting: Setting, extra: tuple[str, ...] = (), record: Path | None = None
) -> RunResult:
    """One run of one job in one setting (recorded to ``record`` when given)."""
    job = JOBS[name]
    hog = cpu_hog(os.cpu_count() or 1) if setting.loaded else contextlib.nullcontext()
    with hog:
        return run_mode(
            job.mode, thresholds=THRESHOLDS[setting.thresholds], extra=extra, record=record
        )


def alarm_line(name: str, setting: Setting, c: Stamped) -> str:
    return (
        f"  {name} {setting.label()}: [{c.severity}] {c.kind} ranks={list(c.ranks)}: "
        f"{c.message[:200]}"
    )


def change_line(result: RunResult, c: Stamped) -> str:
    """One alert change of a run, from its launch (``--show``)."""
    return (
        f"    {c.at - result.started:+6.1f} s {c.event} ep{c.episode} [{c.severity}] {c.kind} "
        f"ranks={list(c.ranks)}: {c.message[:160]}"
    )


def row(name: str, setting: Setting, scores: list[Score]) -> str:
    alarms = sum(len(s.false_alarms) for s in scores)
    per_episode = max((s.raises_per_episode for s in scores), default=0)
    flapped = sum(s.flaps for s in scores)
    codes = ",".join(str(s.returncode) for s in scores)
    bad = "!" if any(s.returncode != 0 for s in scores) else " "
    return (
        f"  {name:<17} {'loaded' if setting.loaded else 'idle':<6} {setting.thresholds:<8}"
        f" {len(scores):>4} {alarms:>6} {per_episode:>9} {flapped:>5}  {bad}{codes}"
    )


def settings(args: argparse.Namespace) -> list[Setting]:
    loads = (False, True) if args.load else (False,)
    return [Setting(loaded, t) for loaded in loads for t in args.thresholds]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated jobs")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--load", action="store_true", help="also run beside a CPU hog")
    parser.add_argument("--thresholds", default="tight,default", help="tight, default or both")
    parser.add_argument("--quick", action="store_true", help="2 short jobs, tight, idle")
    parser.add_argument("--show", action="store_true", help="print every alert change")
    parser.add_argument("--record", metavar="DIR", help="keep each run's recording here")
    parser.add_argument("--json", metavar="FILE", help="write every run's results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.thresholds, args.load = ",".join(QUICK_JOBS), "tight", False
    args.jobs = [n.strip() for n in args.jobs.split(",") if n.strip()]
    args.thresholds = [t.strip() for t in args.thresholds.split(",") if t.strip()]
    unknown = [n for n in args.jobs if n not in JOBS] + [
        t for t in args.thresholds if t not in THRESHOLDS
    ]
    if unknown:
        parser.error(f"unknown {unknown}; jobs: {', '.join(JOBS)}; thresholds: tight, default")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    extra = QUICK_ARGS if args.quick else ()
    print(
        f"false alarms: {len(args.jobs)} healthy jobs x {args.reps} runs, real torchrun jobs "
        f"(3 ranks, gloo, CPU), settings {', '.join(s.label() for s in settings(args))}"
    )
    print(f"  {'job':<17} {'load':<6} {'thresh':<8} {'runs':>4} {'alarms':>6} {'raises/ep':>9}"
          f" {'flaps':>5}  rc")  # fmt: skip
    listed: list[str] = []
    everything: list[dict[str, Any]] = []
    total = runs = flapped = worst = failed = 0
    for name in args.jobs:
        missing = JOBS[name].missing()
        if missing:
            print(f"  {name:<17} skipped: {missing}")
            continue
        for setting in settings(args):
            results = []
            for rep in range(args.reps):
                record = None
                if args.record:
                    Path(args.record).mkdir(parents=True, exist_ok=True)
                    label = setting.label().replace("/", "-")
                    record = Path(args.record) / f"{name}-{label}-{rep}.ddpw"
                results.append(run_job(name, setting, extra, record))
            scores = [score(r) for r in results]
            print(row(name, setting, scores), flush=True)
            listed += [alarm_line(name, setting, c) for s in scores for c in s.false_alarms]
            runs += len(scores)
            total += sum(len(s.false_alarms) for s in scores)
            flapped += sum(s.flaps for s in scores)
            worst = max([worst, *(s.raises_per_episode for s in scores)])
            failed += sum(s.returncode != 0 for s in scores)
            for result in results if args.show else []:
                print("\n".join(change_line(result, c) for c in result.changes))
            everything += [
                {"job": name, "setting": setting.label(), "result": asdict(r), "score": asdict(s)}
                for r, s in zip(results, scores, strict=True)
            ]
    for line in listed:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1, default=str))
    print(
        f"RATIO false_alarms total={total} runs={runs} max_raises_per_episode={worst} "
        f"flaps={flapped} failed_jobs={failed} (jobs={len(args.jobs)}, reps={args.reps}"
        f"{', loaded too' if args.load else ''}, thresholds={'+'.join(args.thresholds)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
