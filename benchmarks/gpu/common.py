"""What every GPU check shares: its result, its context, a real ``ddpwatch serve --headless``
and a real torchrun job (``benchmarks/gpu_check.py`` drives them; issue #27).

A check is a function ``(ctx: Context) -> list[Result]``. It starts what it needs with
``served()`` and ``launch()``, reads the server's status document, and says PASS, FAIL or
SKIP with the figure it saw and what was expected. ``ctx.cpu`` is the dry run on a machine
without a GPU: a check runs there what means something on CPU (gloo, ``cpu`` devices) and
SKIPs the rest, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpwatch.core.ports import free_port_pair, pick_port
from ddpwatch.jobs.stop import stop_job
from ddpwatch.status.client import fetch_reply, fetch_status

JOBS = Path(__file__).parent / "jobs"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool | None  # None: skipped
    figure: str
    expected: str

    def line(self) -> str:
        word = "SKIP" if self.ok is None else "PASS" if self.ok else "FAIL"
        return f"{word} {self.name}: {self.figure} (expected {self.expected})"


def skip(name: str, why: str, expected: str = "a GPU") -> Result:
    return Result(name, None, why, expected)


@dataclass
class Context:
    python: str  # the interpreter that runs servers and jobs
    out: Path  # a folder for logs ($OUT on the device machine)
    cpu: bool  # the dry run on a machine without a GPU: gloo and cpu devices


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a server or a job: this one, with ``src`` importable when ddpwatch
    is not installed (the device machine runs from the checkout), one thread per rank."""
    env = dict(os.environ)
    src = str(REPO / "src")
    path = env.get("PYTHONPATH", "")
    if src not in path.split(os.pathsep):
        env["PYTHONPATH"] = src + (os.pathsep + path if path else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


class Served:
    """A real ``python -m ddpwatch serve --headless`` on free loopback ports, stopped (with
    its children) on exit. Its stdout (one JSON line per alert change) and stderr are appended
    to ``log`` when one is given, else discarded."""

    def __init__(self, python: str = sys.executable, log: Path | None = None) -> None:
        self.python = python
        self.port = free_port_pair()
        self.addr = f"127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Served:
        cmd = [
            self.python, "-m", "ddpwatch", "serve", "--headless",
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        with open(self.log or os.devnull, "a") as sink:
            self.proc = subprocess.Popen(
                cmd, env=child_env(), stdout=sink, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, text=True, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ddpwatch serve exited with {self.proc.returncode}")
            if fetch_status("127.0.0.1", self.port, 0.5) is not None:
                return self
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"ddpwatch serve did not answer on {self.addr} within 30 s")

    def __exit__(self, *exc: object) -> None:
        stop_job(self.proc, grace=3.0)

    def status(self, timeout: float = 2.0) -> dict[str, Any]:
        """The status document as JSON values; ``{}`` when the server did not answer in time."""
        reply = fetch_reply("127.0.0.1", self.port, timeout)
        return {} if reply is None else dict(json.loads(reply))

    def wait_for(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float, poll: float = 0.25
    ) -> dict[str, Any] | None:
        """The first status document that ``pred`` holds for, or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            doc = self.status()
            if doc and pred(doc):
                return doc
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll)

    def alerts(self, kind: str, doc: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The alerts of ``kind``: the active ones, then those of the history no longer active
        (as they last stood)."""
        doc = self.status() if doc is None else doc
        return alerts_of(doc, kind)


def alerts_of(doc: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """``Served.alerts`` on a document already read."""
    found = [a for a in doc.get("alerts") or [] if a.get("kind") == kind]
    seen = {(a.get("kind"), tuple(a.get("ranks") or ())) for a in found}
    for entry in reversed(doc.get("history") or []):
        alert = entry.get("alert") or {}
        key = (alert.get("kind"), tuple(alert.get("ranks") or ()))
        if alert.get("kind") == kind and key not in seen:
            seen.add(key)
            found.append(alert)
    return found


def rank_of(doc: dict[str, Any], rank: int) -> dict[str, Any] | None:
    return next((r for r in doc.get("ranks") or [] if r.get("rank") == rank), None)


def served(python: str = sys.executable, log: Path | None = None) -> Served:
    return Served(python, log)


def launch(
    script: str | Path,
    nproc: int,
    addr: str,
    *,
    env: dict[str, str] | None = None,
    args: Sequence[str] = (),
    zero_code: bool = False,
    python: str = sys.executable,
) -> subprocess.Popen[str]:
    """A real torchrun job of ``nproc`` ranks running ``script`` that reports to ``addr``
    (``DDPWATCH_ADDR``); with ``zero_code``, under ``ddpwatch run --addr addr -- torchrun …``
    instead (the script then need not import ddpwatch). In its own session, so ``stop``
    ends it whole; stdout and stderr captured (text, stderr into stdout)."""
    torchrun = [
        python, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(pick_port(29500 + os.getpid() % 1000)),
        str(script), *args,
    ]  # fmt: skip
    cmd = [python, "-m", "ddpwatch", "run", "--addr", addr, "--no-record", "--", *torchrun]
    return subprocess.Popen(
        cmd if zero_code else torchrun,
        env=child_env({"DDPWATCH_ADDR": addr, **(env or {})}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[str] | None, grace: float = 3.0) -> None:
    """End a job and every process under it (SIGTERM, then SIGKILL after ``grace``)."""
    stop_job(proc, grace=grace)


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int | None, str]:
    """Wait up to ``timeout`` for a job to end by itself: (its exit code, or None when it had
    to be stopped; its output)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        stop(proc)
        with contextlib.suppress(Exception):
            out, _ = proc.communicate(timeout=5)
            return None, out or ""
        return None, ""


def save(ctx: Context, name: str, text: str) -> Path:
    """Write a job's output under ``ctx.out`` (the device tool returns at most 8 files: checks
    keep one log each)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    path = ctx.out / f"{name}.log"
    path.write_text(text)
    return path


def append(ctx: Context, name: str, title: str, text: str) -> Path:
    """Add a titled section to ``ctx.out/<name>.log`` (several checks share one file)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    path = ctx.out / f"{name}.log"
    with open(path, "a") as log:
        log.write(f"===== {title}\n{text.rstrip()}\n\n")
    return path


class Drained:
    """A running job whose output a thread reads as it comes (the pipe never fills while a
    check polls the server)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        if self.proc.stdout is None:
            return
        with contextlib.suppress(Exception):
            for line in self.proc.stdout:
                self.lines.append(line)

    def running(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` for the job to end by itself: its exit code, or None when
        it had to be stopped. Its output is then complete in ``text()``."""
        code: int | None
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop(self.proc)
            code = None
        self._reader.join(5)
        return code


def tail(text: str, lines: int = 6) -> str:
    """The last lines of a job's output, on one line, for a FAIL's figure."""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])
