"""Every CUDA, NCCL and NVML path of ddpwatch, checked on a real GPU in one command (issue #27).

    python benchmarks/gpu_check.py [--only NAME,...] [--budget-s 480] [--cpu] [--out DIR]

Each check runs against a real ``ddpwatch serve --headless`` on this machine and prints one
line as it ends, ``PASS|FAIL|SKIP name: figure (expected ...)``; then ``SUMMARY pass=..
fail=.. skip=..``; the exit code is 1 when any check failed. Without CUDA (and without
``--cpu``) it prints one line saying so and exits 0, claiming nothing.

``--cpu``: the dry run on a machine without a GPU. The checks' orchestration runs for real
(servers, torchrun jobs, status documents, parsing) with gloo and ``cpu`` devices wherever a
check means something on the CPU; the rest SKIPs with the reason. The tests run this.

Each check runs in a child process of its own (``--one NAME``) with its own time limit, cut
to what is left of ``--budget-s``: past it the check's whole process tree is stopped and the
check FAILs as timed out, and the next one starts clean. Logs go to ``--out`` (default
``$OUT`` where set, else a temporary folder): this script's children append to a few files
there, as the device tool brings back at most 8.

Checks (``--only`` names): identity, nosync, nan (``gpu/basics.py``); memory, duplicate,
ordinal, flight (``gpu/devices.py``); overhead, split (``gpu/basics.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
for _path in (HERE, SRC):  # the ``gpu`` package; ddpwatch itself when it is not installed
    if str(_path) not in sys.path:
        sys.path.insert(0 if _path == HERE else len(sys.path), str(_path))

from gpu.common import Context, Result  # noqa: E402

# name: (module, function, time limit in seconds)
CHECKS: dict[str, tuple[str, str, float]] = {
    "identity": ("gpu.basics", "check_identity", 90),
    "nosync": ("gpu.basics", "check_no_sync", 240),
    "nan": ("gpu.basics", "check_nan", 90),
    "memory": ("gpu.devices", "check_memory", 150),
    "duplicate": ("gpu.devices", "check_duplicate_device", 120),
    "ordinal": ("gpu.devices", "check_device_ordinal", 120),
    "flight": ("gpu.devices", "check_flight_recorder", 150),
    "overhead": ("gpu.basics", "check_overhead", 240),
    "split": ("gpu.basics", "check_split", 90),
}
RESULT_TAG = "@@RESULT "
MIN_LEFT_S = 20.0  # less budget left than this: the remaining checks SKIP
NO_CUDA = "gpu_check: no CUDA device here: nothing checked"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--cpu", action="store_true", help="the dry run without a GPU")
    parser.add_argument("--out", type=Path, default=None, help="folder for logs")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one check
    return parser.parse_args(argv)


def cuda_available() -> bool:
    """Whether torch sees a CUDA device; never creates a CUDA context in this process (a
    context here would be a foreign process on the GPU to the memory checks)."""
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def header(cpu: bool) -> str:
    """torch, CUDA, driver and GPU, from torch's build and NVML (no CUDA context)."""
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    parts.append(f"CUDA {torch.version.cuda or 'none'}")
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            names = [pynvml.nvmlDeviceGetName(h) for h in handles]
        finally:
            pynvml.nvmlShutdown()
        parts.append(f"driver {decode(driver)}")
        parts.append(f"GPU {', '.join(decode(n) for n in names) or 'none'} ({count} device(s))")
    except Exception as exc:
        parts.append(f"NVML unavailable ({type(exc).__name__})")
    if cpu:
        parts.append("--cpu dry run: gloo and cpu devices, GPU-only parts SKIP")
    return "gpu_check: " + ", ".join(parts)


def decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def load(name: str) -> Callable[[Context], list[Result]] | str:
    """The check function, or why it cannot be had."""
    module_name, function, _ = CHECKS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return f"{module_name} not importable ({exc})"
    check = getattr(module, function, None)
    if not callable(check):
        return f"{module_name}.{function} missing"
    return check  # type: ignore[no-any-return]


def run_one(name: str, ctx: Context) -> int:
    """A child: run one check, print its results as tagged JSON lines."""
    check = load(name)
    if isinstance(check, str):
        results = [Result(name, None, check, "the check to exist")]
    else:
        try:
            results = check(ctx)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            results = [Result(name, False, f"the check raised {exc!r}", "no exception")]
    for result in results:
        print(RESULT_TAG + json.dumps(result.__dict__), flush=True)
    return 0


def results_of(text: str) -> list[Result]:
    results = []
    for line in text.splitlines():
        if line.startswith(RESULT_TAG):
            with_fields: dict[str, Any] = json.loads(line[len(RESULT_TAG) :])
            results.append(Result(**with_fields))
    return results


def run_child(name: str, args: argparse.Namespace, out: Path, limit: float) -> list[Result]:
    """One check in a child process of its own session, stopped whole past ``limit``."""
    from ddpwatch.jobs.stop import stop_job

    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--out", str(out)]
    if args.cpu:
        cmd.append("--cpu")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    with open(out / "gpu_check-children.log", "a") as log:
        log.write(f"===== {name}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
        timed_out = False
        try:
            stdout, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_job(proc, grace=3.0)
            try:
                stdout, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a grandchild still holds the pipe
                stdout = ""
        stdout = stdout or ""
        log.write("".join(line + "\n" for line in stdout.splitlines() if RESULT_TAG not in line))
    results = results_of(stdout)
    if timed_out:
        return [*results, Result(name, False, f"timed out after {limit:.0f} s", "to finish")]
    if not results:
        why = f"the check's process exited {proc.returncode} with no result"
        return [Result(name, False, why, "results")]
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(python=sys.executable, out=out, cpu=args.cpu)
    if args.one:
        return run_one(args.one, ctx)
    if not args.cpu and not cuda_available():
        print(NO_CUDA, flush=True)
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"gpu_check: unknown check(s) {unknown}; known: {', '.join(CHECKS)}", flush=True)
        return 2
    print(header(args.cpu), flush=True)
    print(f"gpu_check: logs in {out}", flush=True)
    started = time.monotonic()
    counts = {"pass": 0, "fail": 0, "skip": 0}
    for name in names:
        left = args.budget_s - (time.monotonic() - started)
        if left < MIN_LEFT_S:
            results = [Result(name, None, f"budget spent ({args.budget_s:.0f} s)", "time left")]
        else:
            t0 = time.monotonic()
            results = run_child(name, args, out, min(CHECKS[name][2], left - 5))
            print(f"# {name}: {time.monotonic() - t0:.1f} s", flush=True)
        for result in results:
            counts["skip" if result.ok is None else "pass" if result.ok else "fail"] += 1
            print(result.line(), flush=True)
    print(f"# all: {time.monotonic() - started:.1f} s", flush=True)
    print(f"SUMMARY pass={counts['pass']} fail={counts['fail']} skip={counts['skip']}", flush=True)
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
