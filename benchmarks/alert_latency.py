"""Stall -> alert latency: from the moment a rank stops to the alert, minus the rule's threshold.

    python benchmarks/alert_latency.py [--reps 4] [--ranks 3] [--stall-after 2.0]
                                       [--scenarios stalled,silent,straggler]

A real ``Server`` runs on a thread here with ``Thresholds(interval=0.5,
stall_after=--stall-after)``; its ``on_change`` callback stamps every raised alert. For
each repetition ``--ranks`` plain processes run the real agent (``ddpwatch.attach()``,
``RANK``/``WORLD_SIZE`` in the environment, ``ddpwatch.step(loss)`` every ~20 ms step),
and once all of them are stepping, rank 1 is stopped:

* ``stalled``: rank 1 gets SIGUSR1 and stops stepping (alive, heartbeats continue, no
  collectives in this job); onset = the end of its last step, as it reports it.
* ``silent``: rank 1 is SIGSTOPped (its agent thread freezes too); onset = the SIGSTOP.
* ``straggler``: the ranks form a gloo group and all-reduce every step; rank 1 gets
  SIGUSR1 and stops before its next all-reduce, so the others wait in it; onset = the end
  of rank 1's last step.

Latency = alert time - onset - threshold, where the threshold is the one diagnosis used
(``stall_after`` for stalled, ``Thresholds.silent`` = 3 x interval + 1 s for silent, the
collective limit for straggler). What bounds it: up to one heartbeat interval (the server
learns of the last step, or the last beat, only from a heartbeat) plus up to one
diagnosis tick (0.25 s). For ``silent`` the onset can fall after the last heartbeat, so
the latency can be negative by up to one interval; it is also shown measured from the
last heartbeat the server received. Prints ``RATIO`` lines with the median latency.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ddpwatch.core.ports import free_port_pair
from ddpwatch.core.vocabulary import HistoryEvent

INTERVAL = 0.5
STEP_S = 0.02
VICTIM = 1


# ------------------------------------------------------------------------------------- agent


def agent(scenario: str) -> None:
    """One rank: attach, step every STEP_S; on SIGUSR1 report the last step end and stop."""
    import ddpwatch

    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda signum, frame: stop.set())
    dist: Any = None
    if scenario == "straggler":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        one = torch.ones(1)
    ddpwatch.attach(interval=INTERVAL)
    step = 0
    last_end = time.time()
    print("READY", flush=True)
    while True:
        if stop.is_set():
            print(f"ONSET {last_end!r}", flush=True)
            while True:
                time.sleep(3600)  # hangs outside any collective, heartbeats go on
        time.sleep(STEP_S)
        if dist is not None:
            dist.all_reduce(one)
        step += 1
        ddpwatch.step(1.0 / step)
        last_end = time.time()


# ------------------------------------------------------------------------------------ parent


@dataclass
class Raised:
    at: float
    kind: str
    ranks: tuple[int, ...]
    threshold: float
    last_seen: float | None
    last_progress: float | None


@dataclass
class Recorder:
    server: Any = None
    raised: list[Raised] = field(default_factory=list)
    event: threading.Event = field(default_factory=threading.Event)

    def on_change(self, change: Any) -> None:
        if change.event == HistoryEvent.CLEARED:
            return  # raised, or escalated (a step_skew warning that became stalled)
        from ddpwatch.diagnosis.facts import Facts

        now = time.time()
        server = self.server
        with server.lock:
            facts = Facts(server.state, now, server.thresholds)
            thresholds = {
                "stalled": facts.stall_after,
                "silent": server.thresholds.silent,
                "straggler": facts.collective_limit,
            }
            record = server.state.ranks.get(VICTIM)
            last_seen = record.last_seen if record else None
            last_progress = record.last_progress if record else None
        alert = change.alert
        self.raised.append(
            Raised(
                now,
                alert.kind,
                alert.ranks,
                thresholds.get(alert.kind, float("nan")),
                last_seen,
                last_progress,
            )
        )
        self.event.set()


class Job:
    """``ranks`` agent processes reporting to ``port``."""

    def __init__(self, scenario: str, ranks: int, port: int) -> None:
        master_port = free_port_pair()
        self.procs: list[subprocess.Popen[str]] = []
        self.onset: float | None = None
        self._onset_seen = threading.Event()
        self.output: list[str] = []
        for rank in range(ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
                "DDPWATCH_ADDR": f"127.0.0.1:{port}",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
            proc = subprocess.Popen(
                [sys.executable, __file__, "--agent", scenario],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            self.procs.append(proc)
        threading.Thread(target=self._read, args=(self.procs[VICTIM],), daemon=True).start()
        for proc in self.procs[:VICTIM] + self.procs[VICTIM + 1 :]:
            threading.Thread(target=self._drain, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.output.append(line)
            if line.startswith("ONSET "):
                self.onset = float(line.split()[1])
                self._onset_seen.set()

    @staticmethod
    def _drain(proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for _ in proc.stdout:
            pass

    def wait_onset(self, timeout: float) -> float:
        if not self._onset_seen.wait(timeout) or self.onset is None:
            raise RuntimeError("the stopped rank did not report its last step")
        return self.onset

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(10)


def all_stepping(server: Any, ranks: int, min_step: int = 5) -> bool:
    with server.lock:
        records = list(server.state.ranks.values())
    return len(records) == ranks and all((r.step or 0) >= min_step for r in records)


def one_rep(scenario: str, ranks: int, stall_after: float, timeout: float) -> dict[str, float]:
    from ddpwatch.diagnosis.alerts import Thresholds
    from ddpwatch.server.service import Server

    port = free_port_pair()
    recorder = Recorder()
    server = Server(
        "127.0.0.1",
        port,
        Thresholds(interval=INTERVAL, stall_after=stall_after),
        on_change=recorder.on_change,
    )
    recorder.server = server
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    job = Job(scenario, ranks, port)
    try:
        deadline = time.monotonic() + timeout
        while not all_stepping(server, ranks):
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks did not start stepping: {''.join(job.output)[-2000:]}")
            time.sleep(0.1)
        time.sleep(1.0)  # a few heartbeats of healthy stepping
        recorder.raised.clear()
        victim = job.procs[VICTIM]
        if scenario == "silent":
            onset = time.time()
            os.kill(victim.pid, signal.SIGSTOP)
        else:
            os.kill(victim.pid, signal.SIGUSR1)
            onset = job.wait_onset(10)
        while True:
            found = next(
                (r for r in recorder.raised if r.kind == scenario and VICTIM in r.ranks), None
            )
            if found is not None:
                break
            if time.monotonic() > deadline + 30:
                kinds = [(r.kind, r.ranks) for r in recorder.raised]
                raise RuntimeError(f"no {scenario} alert for rank {VICTIM}; raised: {kinds}")
            recorder.event.wait(0.5)
            recorder.event.clear()
        others = sorted({r.kind for r in recorder.raised if r.at <= found.at} - {scenario})
        result = {
            "latency": found.at - onset - found.threshold,
            "threshold": found.threshold,
            "since_onset": found.at - onset,
            "others": others,
        }
        if scenario == "silent" and found.last_seen is not None:
            result["from_server_view"] = found.at - found.last_seen - found.threshold
        if scenario == "stalled" and found.last_progress is not None:
            result["from_server_view"] = found.at - found.last_progress - found.threshold
        return result
    finally:
        job.stop()
        server.stop()
        thread.join(5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--stall-after", type=float, default=2.0)
    parser.add_argument("--scenarios", default="stalled,silent,straggler")
    parser.add_argument("--timeout", type=float, default=60.0, help="per repetition start-up")
    parser.add_argument("--agent", metavar="SCENARIO", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.agent:
        agent(args.agent)
        return 0
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")

    print(
        f"alert latency: {args.ranks} agent processes, heartbeat {INTERVAL} s, diagnosis tick "
        f"0.25 s, stall_after {args.stall_after} s, {args.reps} repetitions per scenario"
    )
    summary = []
    for scenario in args.scenarios.split(","):
        reps = [
            one_rep(scenario, args.ranks, args.stall_after, args.timeout) for _ in range(args.reps)
        ]
        latencies = [r["latency"] for r in reps]
        server_view = [r["from_server_view"] for r in reps if "from_server_view" in r]
        others = sorted({kind for r in reps for kind in r["others"]})
        line = (
            f"  {scenario:<10} threshold {reps[0]['threshold']:.2f} s, alert after onset "
            f"{statistics.median(r['since_onset'] for r in reps):.2f} s; latency beyond "
            f"threshold: median {statistics.median(latencies):+.2f} s "
            f"(min {min(latencies):+.2f}, max {max(latencies):+.2f})"
        )
        if server_view:
            line += f"; from the server's last view {statistics.median(server_view):+.2f} s"
        if others:
            line += f"; also raised before it: {', '.join(others)}"
        print(line)
        summary.append((scenario, latencies))
    for scenario, latencies in summary:
        print(
            f"RATIO {scenario} latency beyond threshold = {statistics.median(latencies):+.3f} s "
            f"(n={len(latencies)}, bound: heartbeat {INTERVAL} s + tick 0.25 s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
