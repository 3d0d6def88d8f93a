"""Agent overhead on a real gloo DDP loop: attached vs. bare, each part's cost, and the peer.

    python benchmarks/agent_overhead.py [--ranks 2] [--trials 40] [--block-s 0.5]
                                        [--sizes small,medium] [--arms ...] [--peer auto|off]

Two launches of the same training loop (a DDP MLP on gloo, OMP_NUM_THREADS=1, each step's
batch drawn from a ``DataLoader``, so the agent's DataLoader probes run as in a real job):

* ``torchrun`` job, ddpwatch: every trial times one block of steps per arm, the arms in a
  rotated order (trial t starts with arm t mod n): ``bare`` (no agent; ``ddpwatch.step``
  still called, a no-op), ``bare-again`` (a second bare arm: the run's noise floor),
  ``ddpwatch`` (``ddpwatch.attach(model)``, reporting to a real server in this process),
  and one ``ddpwatch-<part>`` arm per part of ``agent/switches.py`` (the whole agent with that
  part switched off, ``DDPWATCH_PROBES=-<part>``): a part's cost is, trial by trial, the CPU
  time of ``ddpwatch`` minus that of ``ddpwatch-<part>``. ``--arms`` picks the arms.
  The agent is attached before its block and detached after;
  0.25 s of untimed steps after attaching hold the attach-time heartbeat and the hooks'
  learning steps, so a 0.5 s block holds one heartbeat, as the steady state does.
* ``traceml run`` job, the peer (skipped with a line saying so when ``traceml-ai`` is not
  installed): ``traceml_ai.init(mode="auto")`` at start, then ``bare``/``bare-again``
  blocks vs. ``traceml`` blocks with each step inside ``traceml_ai.trace_step(model)``.
  TraceML's runtime (samplers, telemetry sender, global patches) runs in all its arms, so
  its ratio is a lower bound of what TraceML costs.

Before timing, each job runs 2100 one-element all-reduces so the c10d flight-recorder ring
(2000 entries) is full, as it is in any job that has run for a few minutes.

Per size and arm it prints the bare step time, the median of the per-trial ratios arm/bare
with their interquartile range, the pooled ratio (sum of arm times over sum of bare times)
and the median ratio of CPU time summed over the ranks (process CPU time: every thread,
the publisher's included). Then, per size, each part's cost in CPU microseconds per step and
rank (median of the per-trial differences, with their IQR) and as a share of the bare step's
CPU time, beside the whole agent's and the A/A difference (the noise). Ratios and paired
differences, not absolute times: the machines here are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ddpwatch.agent.switches import PARTS
from ddpwatch.core.ports import free_port_pair

SIZES = {  # width, hidden layers, batch: ~2-4 ms and ~15 ms steps with 2 gloo ranks on 2 cores
    "tiny": (16, 1, 8),
    "small": (64, 2, 32),
    "medium": (384, 3, 128),
}
TARGETS = {"small": 1.02, "medium": 1.005}
FR_FILL = 2100
SETTLE_S = 0.25  # untimed steps after attach: the attach-time heartbeat falls here
FULL = "ddpwatch"
DEFAULT_ARMS = ",".join(["bare", "bare-again", FULL, *(f"{FULL}-{part}" for part in PARTS)])
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------ worker


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    traceml: Any = None
    if args.job == "traceml":
        import traceml_ai as traceml

        traceml.init(mode="auto")
    dist.init_process_group("gloo")
    one = torch.zeros(1)
    for _ in range(FR_FILL):  # fill the flight-recorder ring, as in a long job
        dist.all_reduce(one)
    results = {name: measure_size(name, args, traceml) for name in args.sizes.split(",")}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"job": args.job, "sizes": results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def measure_size(name: str, args: argparse.Namespace, traceml: Any) -> dict[str, Any]:
    """Interleaved trials of every arm on one model size (runs on every rank)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader

    import ddpwatch

    width, layers, batch = SIZES[name]
    torch.manual_seed(0)
    body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*body, nn.Linear(width, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)
    batches = iter(DataLoader(_Repeat(x), batch_size=None))

    def plain_step() -> Any:
        loss = model(next(batches)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    def run(steps: int, traced: bool) -> None:
        for _ in range(steps):
            if traced:
                with traceml.trace_step(model):
                    loss = plain_step()
            else:
                loss = plain_step()
            ddpwatch.step(loss)  # a no-op when detached: the call is in every arm

    def block(arm: str, steps: int, settle_steps: int) -> tuple[float, float]:
        if arm.startswith(FULL):
            os.environ["DDPWATCH_PROBES"] = _probes(arm)  # "ddpwatch-grads": all but grads
            ddpwatch.attach(model)
        traced = arm == "traceml"  # "bare-again" is a second bare arm: the noise floor
        run(settle_steps, traced)
        dist.barrier()
        cpu = time.process_time()
        started = time.perf_counter()
        run(steps, traced)
        dist.barrier()
        elapsed = time.perf_counter() - started
        cpu_s = torch.tensor([time.process_time() - cpu])
        if arm.startswith(FULL):
            ddpwatch.detach()
        dist.all_reduce(cpu_s)  # every rank's process CPU time (all its threads)
        return elapsed, float(cpu_s)

    run(20, False)  # warm up, then size the blocks from rank 0's step time
    dist.barrier()
    started = time.perf_counter()
    run(30, False)
    dist.barrier()
    step_s = torch.tensor([(time.perf_counter() - started) / 30])
    dist.broadcast(step_s, 0)
    steps = max(5, round(args.block_s / float(step_s)))
    settle_steps = max(2, round(SETTLE_S / float(step_s)))
    arms = args.arms.split(",")
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    for trial in range(args.trials):
        order = arms[trial % len(arms) :] + arms[: trial % len(arms)]
        for arm in order:
            elapsed, cpu_s = block(arm, steps, settle_steps)
            times[arm].append(elapsed)
            cpu[arm].append(cpu_s)
    return {"steps": steps, "ranks": dist.get_world_size(), "times": times, "cpu": cpu}


class _Repeat:
    """A map-style dataset whose every item is the same batch: the DataLoader's own cost
    (sampler, fetch) stays small and equal in every arm."""

    def __init__(self, batch: Any) -> None:
        self._batch = batch

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, index: int) -> Any:
        return self._batch


def _probes(arm: str) -> str:
    """``DDPWATCH_PROBES`` for an arm: ``ddpwatch`` runs every part, ``ddpwatch-<part>`` all
    but that one."""
    part = arm.removeprefix(FULL).removeprefix("-")
    if part and part not in PARTS:
        raise SystemExit(f"unknown arm {arm!r}: parts are {', '.join(PARTS)}")
    return f"-{part}" if part else ""


# ------------------------------------------------------------------------------------ parent


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _low(values: list[float]) -> float:
    """The 10th percentile: other tenants only ever add time, so the least disturbed blocks
    are closest to each arm's own cost (every block holds one heartbeat, so it is counted)."""
    if len(values) < 3:
        return min(values)
    return statistics.quantiles(values, n=10, method="inclusive")[0]


def summarise(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows per size and non-bare arm: bare step time, per-trial ratio quartiles, pooled ratio."""
    rows = []
    for size, data in result["sizes"].items():
        times, steps, cpu = data["times"], data["steps"], data["cpu"]
        bare = times["bare"]
        for arm, arm_times in times.items():
            if arm == "bare":
                continue
            ratios = [a / b for a, b in zip(arm_times, bare, strict=True)]
            cpu_ratio = statistics.median(a / b for a, b in zip(cpu[arm], cpu["bare"], strict=True))
            low = _low(arm_times) / _low(bare)
            q1, median, q3 = _quartiles(ratios)
            if arm == "bare-again":
                arm = f"A/A {result['job']} job"
            rows.append(
                {
                    "size": size,
                    "arm": arm,
                    "bare_ms": statistics.median(bare) / steps * 1e3,
                    "steps": steps,
                    "trials": len(ratios),
                    "median": median,
                    "q1": q1,
                    "q3": q3,
                    "pooled": sum(arm_times) / sum(bare),
                    "cpu": cpu_ratio,
                    "low": low,
                }
            )
    return rows


def part_costs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size: CPU microseconds per step and rank of the whole agent (``ddpwatch`` - bare),
    of the A/A pair (``bare-again`` - bare: the noise) and of each part (``ddpwatch`` -
    ``ddpwatch-<part>``), as medians of the per-trial differences with their IQR, and as a
    share of the bare arm's CPU time per step and rank."""
    rows = []
    for size, data in result["sizes"].items():
        cpu, steps, ranks = data["cpu"], data["steps"], data.get("ranks", 2)
        per_step = 1e6 / (steps * ranks)
        bare_us = statistics.median(cpu["bare"]) * per_step
        pairs = [("whole agent", FULL, "bare"), ("A/A (noise)", "bare-again", "bare")]
        pairs += [(part, FULL, f"{FULL}-{part}") for part in PARTS]
        for label, arm, minus in pairs:
            if arm not in cpu or minus not in cpu:
                continue
            diffs = [(a - b) * per_step for a, b in zip(cpu[arm], cpu[minus], strict=True)]
            q1, median, q3 = _quartiles(diffs)
            rows.append(
                {
                    "size": size,
                    "part": label,
                    "bare_cpu_us": bare_us,
                    "us": median,
                    "q1": q1,
                    "q3": q3,
                    "share": median / bare_us,
                }
            )
    return rows


def print_part_costs(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print(
        f"\n{'size':<7} {'part':<12} {'CPU/step':>9} {'cost us/step/rank':>18} "
        f"{'IQR':>15} {'% of step':>9}"
    )
    for r in rows:
        print(
            f"{r['size']:<7} {r['part']:<12} {r['bare_cpu_us']:>7.0f}us {r['us']:>+18.1f} "
            f"{r['q1']:>+7.1f}..{r['q3']:<+7.1f} {100 * r['share']:>+8.2f}%"
        )
    for r in rows:
        print(
            f"PART {r['part'].split(' ')[0]} {r['size']} ({r['bare_cpu_us']:.0f} us CPU/step) "
            f"us={r['us']:+.1f} iqr={r['q1']:+.1f}..{r['q3']:+.1f} share={r['share']:+.4f}"
        )


def _traceml_command() -> list[str] | None:
    try:
        import traceml_ai  # noqa: F401
    except ImportError:
        return None
    exe = Path(sys.executable).with_name("traceml")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("traceml")
    return [found] if found else None


def _worker_args(args: argparse.Namespace, job: str, arms: str) -> list[str]:
    return [
        "--worker", "--job", job, "--arms", arms, "--trials", str(args.trials),
        "--block-s", str(args.block_s), "--sizes", args.sizes,
    ]  # fmt: skip


def _run_job(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    try:
        out = subprocess.run(
            cmd, env=env, capture_output=True, text=True, check=False, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        sys.exit(f"benchmark job timed out after {timeout:.0f} s: {' '.join(cmd)}\n{exc.stdout}")
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(
            f"benchmark job failed ({' '.join(cmd)}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        )
    return dict(json.loads(line[len("RESULT ") :]))


def run_ddpwatch_job(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from ddpwatch.server.service import Server

    port = free_port_pair()
    server = Server("127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    env = {**os.environ, "DDPWATCH_ADDR": f"127.0.0.1:{port}", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}",
        "--master-addr=127.0.0.1", f"--master-port={free_port_pair()}", __file__,
        *_worker_args(args, "ddpwatch", args.arms),
    ]  # fmt: skip
    try:
        result = _run_job(cmd, env, args.timeout)
    finally:
        server.stop()
        thread.join(5)
    return result, server.state.received


def run_traceml_job(args: argparse.Namespace, traceml: list[str]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="traceml-bench-") as logs:
        cmd = [
            *traceml, "run", __file__, f"--nproc-per-node={args.ranks}",
            "--master-addr=127.0.0.1", f"--master-port={free_port_pair()}",
            f"--aggregator-port={free_port_pair()}", "--logs-dir", logs,
            "--no-save-training-output", "--finalize-timeout-sec", "60",
            "--args", *_worker_args(args, "traceml", "bare,bare-again,traceml"),
        ]  # fmt: skip
        return _run_job(cmd, env, args.timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--trials", type=int, default=40, help="interleaved trials per size")
    parser.add_argument(
        "--block-s",
        type=float,
        default=0.5,
        help="timed seconds per block (0.5 = one heartbeat interval: one beat per block)",
    )
    parser.add_argument("--sizes", default="small,medium", help=f"of {', '.join(SIZES)}")
    parser.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help="arms of the ddpwatch job (bare must be one; ddpwatch-<part> needs ddpwatch)",
    )
    parser.add_argument("--peer", choices=("auto", "off"), default="auto")
    parser.add_argument("--json", metavar="PATH", help="also write every block time here")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per job, seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", default="ddpwatch", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    arms = args.arms.split(",")
    if "bare" not in arms:
        parser.error("--arms must include bare")
    if any(arm.startswith(f"{FULL}-") for arm in arms) and FULL not in arms:
        parser.error(f"--arms: a {FULL}-<part> arm needs the {FULL} arm")

    print(
        f"agent overhead: {args.ranks} gloo ranks, DDP MLP, {args.trials} interleaved trials "
        f"per size, ~{args.block_s:g} s per block, {os.cpu_count()} cores"
    )
    started = time.monotonic()
    ours, received = run_ddpwatch_job(args)
    raw = [ours]
    rows = summarise(ours)
    print(
        f"ddpwatch job done in {time.monotonic() - started:.0f} s; "
        f"server received {received} messages"
    )
    traceml = _traceml_command() if args.peer == "auto" else None
    if args.peer == "off":
        print("peer TraceML: skipped (--peer off)")
    elif traceml is None:
        print("peer TraceML: skipped, traceml-ai is not installed (pip install traceml-ai)")
    else:
        started = time.monotonic()
        theirs = run_traceml_job(args, traceml)
        raw.append(theirs)
        rows += summarise(theirs)
        print(f"traceml job done in {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(raw))
    rows.sort(key=lambda r: (list(SIZES).index(r["size"]), r["arm"]))
    print(
        f"{'size':<7} {'arm':<19} {'bare step':>9} {'steps/blk':>9} {'median':>7} "
        f"{'IQR':>13} {'pooled':>7} {'cpu':>7} {'p10':>7}  target"
    )
    for r in rows:
        target = TARGETS.get(r["size"]) if r["arm"].startswith("ddpwatch") else None
        mark = ""
        if target is not None:
            mark = f"<={target:g} " + ("ok" if r["median"] <= target else "MISS")
        print(
            f"{r['size']:<7} {r['arm']:<19} {r['bare_ms']:>7.2f}ms {r['steps']:>9} "
            f"{r['median']:>7.4f} {r['q1']:>6.3f}-{r['q3']:<6.3f} {r['pooled']:>7.4f} "
            f"{r['cpu']:>7.4f} {r['low']:>7.4f}  {mark}"
        )
    for r in rows:
        if r["arm"].startswith("A/A"):
            print(
                f"noise floor, {r['arm']} {r['size']}: per-trial ratios "
                f"{r['q1']:.3f}..{r['q3']:.3f} (IQR); medians closer to 1 than that are not "
                "resolved by this run"
            )
    print_part_costs(part_costs(ours))
    for r in rows:
        print(
            f"RATIO {r['arm']}/bare {r['size']} ({r['bare_ms']:.1f} ms steps) "
            f"median={r['median']:.4f} iqr={r['q1']:.4f}..{r['q3']:.4f} pooled={r['pooled']:.4f} "
            f"cpu={r['cpu']:.4f} p10={r['low']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
