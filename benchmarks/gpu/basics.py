"""Checks 1-3, 8 and 9 of issue #27: identity, no host synchronisation, NaN without a sync,
the agent's overhead on a real GPU step, and the step split on CUDA.

Each check starts its own ``ddpwatch serve --headless`` per job and torchrun jobs of
``jobs/train.py`` (one DDP rank of a small model) or ``jobs/overhead.py``, reads the server's
status document, and appends every job's output to one log, ``basics.log`` under ``ctx.out``
(the device tool brings back at most 8 files).

1. identity: rank 0 on ``cuda:0`` reports the name, UUID and PCI bus id that NVML (``pynvml``)
   and ``nvidia-smi`` give.
2. no sync: 200 steps with ``attach(model)`` and ``step(loss)`` under
   ``torch.cuda.set_sync_debug_mode("error")`` raise nothing, attached and under ``ddpwatch
   run``; a third run in ``"warn"`` mode counts the syncs of the agent's own thread (which
   swallows exceptions, so "error" cannot show them).
3. NaN: the loss turns NaN at step 37 on CUDA; ``nan_loss`` names step 37, exactly.
8. overhead: a small transformer's step at ~2 ms and ~15 ms, bare vs. attached, interleaved
   in one process, CUDA-event timed: the median ratio against the goals 1.02 and 1.01 (a
   measurement: FAIL only past 1.10).
9. step split: a one-rank NCCL DDP job on ``cuda:0`` reports ``grad_wait_s`` and
   ``compute_s`` (the agent's CUDA-event clock, ``agent/split.py``), with no sync.

With ``ctx.cpu`` (no GPU) each runs its job on the CPU with gloo where that means something
(identity reads ``cpu``, the steps and the NaN step are counted, the split is timed by
``perf_counter``, the overhead job runs a tiny size) and SKIPs the GPU part, saying why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import (
    JOBS,
    Context,
    Drained,
    Result,
    Served,
    alerts_of,
    append,
    launch,
    rank_of,
    served,
    skip,
    tail,
)

TRAIN = JOBS / "train.py"
OVERHEAD = JOBS / "overhead.py"
LOG = "basics"
STEPS = 200
WARMUP = 3  # steps before the sync debug mode is on: DDP itself syncs in its second step
NAN_AT = 37
OVERHEAD_GOALS = {"small": 1.02, "medium": 1.01}
OVERHEAD_FAIL = 1.10
NO_GPU = "no GPU: --cpu dry run"

Doc = dict[str, Any]


def _device_args(ctx: Context) -> list[str]:
    return ["--device", "cpu", "--backend", "gloo"] if ctx.cpu else ["--device", "cuda"]


def _job_line(text: str, tag: str) -> dict[str, Any] | None:
    """The JSON of the last ``TAG {json}`` line a job printed."""
    for line in reversed(text.splitlines()):
        _, found, rest = line.partition(tag + " ")
        if found:
            try:
                value = json.loads(rest)
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def _run(
    ctx: Context,
    title: str,
    script: Path,
    args: Sequence[str],
    *,
    timeout: float,
    zero_code: bool = False,
    watch: Any = None,
) -> tuple[int | None, str, Doc, Any]:
    """One job against a fresh server: (exit code or None when stopped, its output, the final
    status document, what ``watch(srv, job)`` returned while it ran)."""
    with tempfile.TemporaryDirectory(prefix="ddpw-gpu-") as tmp:
        serve_log = Path(tmp) / "serve.log"
        with served(ctx.python, log=serve_log) as srv:
            proc = launch(script, 1, srv.addr, args=args, zero_code=zero_code, python=ctx.python)
            job = Drained(proc)
            seen = None
            try:
                if watch is not None:
                    seen = watch(srv, job)
            finally:
                code = job.finish(timeout)
            doc = srv.status()
        append(ctx, LOG, f"{title}: job exit {code}", job.text())
        append(ctx, LOG, f"{title}: server", serve_log.read_text(errors="replace"))
    return code, job.text(), doc, seen


def _ran(code: int | None, text: str) -> str:
    if code is None:
        return f"stopped at the time limit; {tail(text)}"
    return f"exit {code}; {tail(text)}"


# 1. identity -------------------------------------------------------------------------------
def _norm_pci(value: Any) -> str | None:
    """``[domain:]bus:device.function`` as ``DDDDDDDD:BB:DD.F``, upper case, or None."""
    if not isinstance(value, str) or not value.strip():
        return None
    parts = value.strip().split(":")
    try:
        if len(parts) == 2:
            parts = ["0", *parts]
        domain, bus, rest = parts[-3:]
        device, _, function = rest.partition(".")
        return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{function or 0}"
    except ValueError:
        return value.strip().upper()


def nvml_truth() -> dict[str, str | None]:
    """Name, UUID and bus id of CUDA device 0 as NVML gives them (``pynvml``)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or "").split(",")[0].strip()
        if visible.startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)

        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        return {
            "name": text(pynvml.nvmlDeviceGetName(handle)),
            "uuid": text(pynvml.nvmlDeviceGetUUID(handle)),
            "pci_bus_id": text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
        }
    finally:
        pynvml.nvmlShutdown()


def smi_rows(text: str) -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu=name,uuid,pci.bus_id --format=csv,noheader`` as rows."""
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.rsplit(",", 2)]
        if len(parts) == 3:
            rows.append({"name": parts[0], "uuid": parts[1], "pci_bus_id": parts[2]})
    return rows


def nvidia_smi() -> list[dict[str, str]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    out = subprocess.run(
        [exe, "--query-gpu=name,uuid,pci.bus_id", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return smi_rows(out.stdout)


def compare_identity(
    rank: Doc, nvml: dict[str, str | None], smi: dict[str, str] | None
) -> list[Result]:
    """One Result per field: the rank's report against NVML's and nvidia-smi's."""
    results = []
    fields = (("name", "device_name"), ("uuid", "device_uuid"), ("pci_bus_id", "device_pci_bus_id"))
    for field, key in fields:
        name = f"1 identity {field}"
        if key not in rank:
            figure = f"the status document has no '{key}' for a rank"
            results.append(Result(name, False, figure, f"NVML's {nvml.get(field)!r}"))
            continue
        norm = _norm_pci if field == "pci_bus_id" else (lambda v: v)
        reported, want = norm(rank.get(key)), norm(nvml.get(field))
        smi_value = norm(smi.get(field)) if smi else None
        ok = reported is not None and reported == want and (smi is None or smi_value == want)
        figure = f"rank 0 {reported!r}, NVML {want!r}, nvidia-smi {smi_value!r}"
        results.append(Result(name, ok, figure, "all three equal"))
    return results


def check_identity(ctx: Context) -> list[Result]:
    args = [*_device_args(ctx), "--identity", "--steps", "50", "--step-sleep", "0.01"]
    args += ["--hold-s", "2"]
    code, text, doc, _ = _run(ctx, "1 identity", TRAIN, args, timeout=90)
    rank = rank_of(doc, 0)
    if rank is None:
        return [Result("1 identity", False, f"rank 0 never reported; {_ran(code, text)}", "rank 0")]
    if ctx.cpu:
        seen = {k: rank.get(k) for k in ("device", "device_name", "device_uuid")}
        ok = seen == {"device": "cpu", "device_name": None, "device_uuid": None}
        return [
            Result("1 identity (cpu dry run)", ok, f"rank 0 reports {seen}", "device cpu, nulls"),
            skip("1 identity vs NVML and nvidia-smi", NO_GPU),
        ]
    results = []
    device_ok = rank.get("device") == "cuda:0"
    results.append(Result("1 identity device", device_ok, f"{rank.get('device')!r}", "'cuda:0'"))
    try:
        nvml = nvml_truth()
    except Exception as exc:  # pynvml missing or failing: the comparison cannot be made
        return [*results, Result("1 identity", False, f"NVML failed: {exc!r}", "NVML answers")]
    rows = nvidia_smi()
    smi = next((r for r in rows if r["uuid"] == nvml["uuid"]), None)
    torch_view = _job_line(text, "IDENTITY")
    append(
        ctx, LOG, "1 identity: truth", json.dumps({"nvml": nvml, "smi": rows, "torch": torch_view})
    )
    results += compare_identity(rank, nvml, smi)
    if smi is None:
        results.append(
            Result("1 identity nvidia-smi", False, f"no row with NVML's UUID in {rows}", "one")
        )
    return results


# 2. no host synchronisation ----------------------------------------------------------------
def _steps_run(ctx: Context, title: str, extra: Sequence[str], zero_code: bool) -> Result:
    """One run of ``STEPS`` steps after ``WARMUP``: PASS when it ended cleanly and the server
    counted every step."""
    total = STEPS + WARMUP
    args = [*_device_args(ctx), "--steps", str(total), "--warmup", str(WARMUP), "--hold-s", "1.5"]
    if zero_code:
        args.append("--no-attach")
    code, text, doc, _ = _run(ctx, title, TRAIN, [*args, *extra], timeout=120, zero_code=zero_code)
    rank = rank_of(doc, 0) or {}
    step = rank.get("step")
    ok = code == 0 and step == total
    figure = f"exit {code}, server counted step {step}"
    if not ok:
        figure = f"{figure}; {tail(text)}"
    return Result(title, ok, figure, f"exit 0 and step {total}")


def _agent_syncs(ctx: Context) -> Result:
    """The agent's own thread under ``set_sync_debug_mode("warn")``: no sync warning."""
    title = "2 no sync: agent thread (warn mode)"
    args = [*_device_args(ctx), "--steps", str(STEPS + WARMUP), "--warmup", str(WARMUP)]
    args += ["--sync-debug", "warn", "--hold-s", "2"]
    code, text, _, _ = _run(ctx, title, TRAIN, args, timeout=120)
    report = _job_line(text, "SYNCWARN")
    if code != 0 or report is None:
        return Result(title, False, _ran(code, text), "a SYNCWARN report")
    ok = report.get("other") == 0
    figure = f"{report.get('other')} in other threads, {report.get('main')} in the training thread"
    if report.get("examples"):
        figure += f"; first: {report['examples'][0]}"
    return Result(title, ok, figure, "0 in other threads")


def check_no_sync(ctx: Context) -> list[Result]:
    if ctx.cpu:
        return [
            _steps_run(ctx, "2 steps counted, attached (cpu dry run)", [], zero_code=False),
            _steps_run(ctx, "2 steps counted, zero-code (cpu dry run)", [], zero_code=True),
            skip("2 no sync under set_sync_debug_mode", f"{NO_GPU}: the mode needs CUDA"),
        ]
    error = ["--sync-debug", "error"]
    return [
        _steps_run(ctx, "2 no sync: attached (error mode)", error, zero_code=False),
        _steps_run(ctx, "2 no sync: zero-code (error mode)", error, zero_code=True),
        _agent_syncs(ctx),
    ]


# 3. NaN without a sync ---------------------------------------------------------------------
def judge_nan(doc: Doc, at: int) -> tuple[bool, str]:
    """Whether ``nan_loss`` names step ``at`` exactly, and what was seen."""
    found = alerts_of(doc, "nan_loss")
    rank = rank_of(doc, 0) or {}
    exact = f"rank 0 nan_step {rank.get('nan_step')} exact {rank.get('nan_exact')}"
    if not found:
        return False, f"no nan_loss alert; {exact}"
    message = str(found[0].get("message", ""))
    steps = [int(s) for s in re.findall(r"step (\d+)", message)]
    ok = (
        bool(steps)
        and steps[0] == at
        and found[0].get("ranks") == [0]
        and rank.get("nan_step") == at
        and rank.get("nan_exact") is True
    )
    return ok, f"{message!r}; {exact}"


def check_nan(ctx: Context) -> list[Result]:
    args = [*_device_args(ctx), "--steps", str(STEPS), "--warmup", str(WARMUP)]
    args += ["--nan-at", str(NAN_AT), "--hold-s", "2"]
    if not ctx.cpu:
        args += ["--sync-debug", "error"]
    name = "3 nan_loss (cpu dry run)" if ctx.cpu else "3 nan_loss without a sync"
    code, text, doc, _ = _run(ctx, name, TRAIN, args, timeout=90)
    ok, figure = judge_nan(doc, NAN_AT)
    if code != 0:
        ok, figure = False, f"{figure}; {_ran(code, text)}"
    results = [Result(name, ok, figure, f"nan_loss names rank 0 and step {NAN_AT}, exact")]
    if ctx.cpu:
        results.append(skip("3 nan_loss on CUDA (async loss read)", NO_GPU))
    return results


# 8. overhead -------------------------------------------------------------------------------
def judge_overhead(size: str, data: dict[str, Any], goal: float | None) -> Result:
    name = f"8 overhead {size} step"
    arm, floor = data.get("ddpwatch") or {}, data.get("bare-again") or {}
    median = arm.get("median")
    figure = (
        f"bare {data.get('bare_ms', 0):.2f} ms/step (target {data.get('target_ms', 0):.0f} ms, "
        f"batch {data.get('batch')}), attached/bare median {median:.3f} "
        f"[IQR {arm.get('q1', 0):.3f}-{arm.get('q3', 0):.3f}], A/A {floor.get('median', 0):.3f}, "
        f"{data.get('trials')} trials of {data.get('steps')} steps"
        if isinstance(median, float)
        else f"no ratio in {data}"
    )
    if goal is None:  # the dry run: the figure is perf_counter on a shared CPU
        return Result(f"{name} (cpu dry run)", isinstance(median, float), figure, "a ratio")
    ok = isinstance(median, float) and median <= OVERHEAD_FAIL
    return Result(name, ok, figure, f"<= {goal} (goal; FAIL only past {OVERHEAD_FAIL})")


def check_overhead(ctx: Context) -> list[Result]:
    if ctx.cpu:
        args = ["--device", "cpu", "--sizes", "cpu", "--trials", "3", "--block-s", "0.2"]
    else:
        args = ["--device", "cuda", "--sizes", "small,medium", "--trials", "12"]
    code, text, _, _ = _run(ctx, "8 overhead", OVERHEAD, args, timeout=240)
    result = _job_line(text, "RESULT")
    if code != 0 or result is None:
        return [Result("8 overhead", False, _ran(code, text), "a RESULT line")]
    sizes = result.get("sizes") or {}
    results = [
        judge_overhead(size, data, None if ctx.cpu else OVERHEAD_GOALS.get(size))
        for size, data in sizes.items()
    ]
    if ctx.cpu:
        results.append(skip("8 overhead on a GPU step (CUDA events)", NO_GPU))
    return results


# 9. step split on CUDA ---------------------------------------------------------------------
def _split_seen(srv: Served, job: Drained) -> Doc | None:
    """The first status whose rank 0 has both ``grad_wait_s`` and ``compute_s``, while the
    job runs (after it, heartbeats carry no steps to average)."""

    def both(doc: Doc) -> bool:
        rank = rank_of(doc, 0) or {}
        return rank.get("grad_wait_s") is not None and rank.get("compute_s") is not None

    deadline = time.monotonic() + 60
    while job.running() and time.monotonic() < deadline:
        doc = srv.wait_for(both, timeout=1.0)
        if doc is not None:
            return doc
    return None


def check_split(ctx: Context) -> list[Result]:
    args = [*_device_args(ctx), "--steps", str(STEPS), "--min-seconds", "6"]
    args += ["--step-sleep", "0.002", "--hold-s", "1"]
    if not ctx.cpu:
        args += ["--sync-debug", "error"]
    name = "9 step split (cpu dry run)" if ctx.cpu else "9 step split on CUDA"
    code, text, _, seen = _run(ctx, name, TRAIN, args, timeout=90, watch=_split_seen)
    rank = rank_of(seen, 0) if seen else None
    if rank is None:
        figure = f"grad_wait_s or compute_s stayed null; {_ran(code, text)}"
        return [Result(name, False, figure, "both reported")]
    grad, compute = rank["grad_wait_s"], rank["compute_s"]
    figure = f"grad_wait_s {grad * 1e3:.3f} ms, compute_s {compute * 1e3:.3f} ms; job exit {code}"
    ok = code == 0 and grad >= 0 and compute > 0
    if code != 0:
        figure += f"; {tail(text)}"
    expected = "both reported, exit 0" + ("" if ctx.cpu else " under sync debug 'error'")
    results = [Result(name, ok, figure, expected)]
    if ctx.cpu:
        results.append(skip("9 step split on CUDA (CudaClock)", NO_GPU))
    return results
