"""Checks 4-7 of issue #27: memory, the two seed failures for real, the flight recorder.

Each check starts its own ``ddpwatch serve --headless`` and torchrun jobs of
``jobs/dev_train.py`` (one rank of a small DDP model; how it picks its GPU, the memory it
holds and how long it runs are its arguments), reads the server's status document, stops
everything it started, and keeps one log, ``<check>.log`` under ``ctx.out``, with every job's
output, the ranks' own reports and the server's alert lines.

4. memory: (a) the allocator and NVML figures of a rank against ``torch.cuda.memory_reserved()``
   and ``nvidia-smi``; (b) a process outside the job holding 2 GiB raises ``foreign_memory``
   naming its pid; (c) two gloo ranks on ``cuda:0``, one holding 10 GiB more, raise
   ``uneven_memory`` naming it.
5. seed 002: two NCCL ranks on ``cuda:0``: ``duplicate_device`` names both, with the fix, and
   the crash alert carries NCCL's text.
6. seed 000: ``torch.cuda.set_device(rank)`` for two ranks on one GPU: rank 1 gets
   ``device_ordinal``.
7. the flight recorder: a one-rank NCCL job's ``collectives.fr`` counts rise while it steps;
   what ``pg_status`` holds, with and without ``TORCH_NCCL_ENABLE_TIMING=1``.

With ``ctx.cpu`` (no GPU): 4a compares the rank's host memory instead, 7 runs with gloo, and
the rest is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
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
    child_env,
    launch,
    rank_of,
    served,
    skip,
    stop,
)

TRAIN = JOBS / "dev_train.py"
HOG = JOBS / "dev_hog.py"
MIB = 1 << 20
GIB = 1 << 30
ALLOCATOR_TOLERANCE = 0.03  # status vs torch.cuda.memory_reserved(): the same counter
NVML_TOLERANCE = 0.05  # status vs nvidia-smi: "within a few percent"
SET_DEVICE_FIX = "torch.cuda.set_device(local_rank)"
LOG_NAME = "devices"  # ctx.out/devices.log: checks 4-7 share one file (few come back)
# each check's own budget, under the driver's limit for it (gpu_check.CHECKS): past the
# driver's limit a check's results are lost, so a check cuts its waits to fit its budget
BUDGET_S = {"memory": 135.0, "duplicate": 105.0, "ordinal": 105.0, "flight": 135.0}
RESERVE_S = 10.0  # kept for stopping jobs and servers after the last wait
MIN_PART_S = 20.0  # a part that cannot have this much is skipped, not started

Doc = dict[str, Any]


# pure helpers (tests/benchmarks/test_gpu_devices.py) ----------------------------------------------
def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a file written line by line; a missing file, a line cut off by a
    killed writer or any other garbage is left out."""
    try:
        text = path.read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


def parse_smi_memory(text: str) -> list[tuple[str | None, int]]:
    """``nvidia-smi --query-gpu=uuid,memory.used --format=csv,noheader,nounits`` (or
    ``memory.used`` alone) as ``(uuid or None, bytes used)`` per GPU; MiB in, bytes out.
    Lines it cannot read (``[N/A]``, a warning) are left out."""
    found: list[tuple[str | None, int]] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if not parts or not parts[-1]:
            continue
        try:
            used = int(float(parts[-1]) * MIB)
        except ValueError:
            continue
        uuid = parts[0] if len(parts) > 1 and parts[0].startswith(("GPU-", "MIG-")) else None
        found.append((uuid, used))
    return found


def smi_used_for(rows: Sequence[tuple[str | None, int]], uuid: str | None) -> int | None:
    """The ``nvidia-smi`` figure of the GPU with ``uuid`` (else of the only GPU listed)."""
    if uuid:
        for row_uuid, used in rows:
            if row_uuid and row_uuid.lower() == uuid.lower():
                return used
    return rows[0][1] if len(rows) == 1 else None


def rel_diff(a: float | None, b: float | None) -> float | None:
    """``|a - b| / b``; None when either is unknown or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return abs(a - b) / abs(b)


def gib(n: float | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f} %"


def fr_count(rank: Doc | None, group: str = "0") -> int | None:
    """A status rank's flight-recorder count of ``group`` (``collectives.fr``), or None."""
    fr = ((rank or {}).get("collectives") or {}).get("fr") or {}
    value = fr.get(group)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def rising(values: Sequence[int | None]) -> bool:
    """Whether a series of counts went up at least twice (three distinct values, in order),
    never down: counts seen while steps run, not one late jump."""
    known = [v for v in values if v is not None]
    if any(b < a for a, b in itertools.pairwise(known)):
        return False
    return len(set(known)) >= 3


def pg_summary(pg_status: Any, group: str = "0") -> str:
    """What the flight recorder's ``pg_status`` holds for ``group``, every key as dumped
    (``last_enqueued_collective`` → ``enqueued``), or why there is nothing to say."""
    if not isinstance(pg_status, dict):
        return "no pg_status (this torch dumps none)"
    if "error" in pg_status:
        return f"pg_status unreadable: {pg_status['error']}"
    status = pg_status.get(group)
    if not isinstance(status, dict):
        return f"pg_status has no group {group} (groups: {sorted(pg_status)})"
    parts = []
    for key, value in status.items():
        short = key.removeprefix("last_").removesuffix("_collective")
        parts.append(f"{short} {value}")
    return ", ".join(parts) or "pg_status of group 0 is empty"


def names(alert: Doc | None, ranks: Sequence[int]) -> bool:
    """Whether ``alert`` names every one of ``ranks`` as a culprit."""
    return alert is not None and set(ranks) <= set(alert.get("ranks") or ())


def first_naming(alerts: Sequence[Doc], ranks: Sequence[int]) -> Doc | None:
    return next((a for a in alerts if names(a, ranks)), None)


def first_raised(doc: Doc, kind: str) -> float | None:
    """``elapsed_s`` of the first ``raised`` of ``kind`` in the timeline, or None."""
    for entry in doc.get("history") or []:
        alert = entry.get("alert") or {}
        if entry.get("event") == "raised" and alert.get("kind") == kind:
            value = entry.get("elapsed_s")
            return float(value) if isinstance(value, (int, float)) else None
    return None


def clip(text: str | None, n: int = 220) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


# running things ----------------------------------------------------------------------------------
class Log:
    """A check's log and its time budget. Sections go to ``ctx.out/devices.log`` as they come
    (a check stopped by the driver keeps what it wrote); without a ``ctx``, kept in memory."""

    def __init__(self, ctx: Context | None, budget_s: float) -> None:
        self.ctx = ctx
        self.parts: list[str] = []
        self.deadline = time.monotonic() + budget_s

    def add(self, title: str, text: str) -> None:
        if self.ctx is not None:
            append(self.ctx, LOG_NAME, title, text)
        else:
            self.parts.append(f"===== {title}\n{text.rstrip()}\n")

    def text(self) -> str:
        return "\n".join(self.parts)

    def left(self) -> float:
        """Seconds left for waiting, the reserve for stopping everything kept."""
        return self.deadline - time.monotonic() - RESERVE_S

    def cap(self, seconds: float) -> float:
        """``seconds``, or less when the budget has less left (never below 1 s)."""
        return max(1.0, min(seconds, self.left()))


@contextlib.contextmanager
def job(
    ctx: Context,
    log: Log,
    title: str,
    srv: Served,
    nproc: int,
    args: Sequence[str],
    env: dict[str, str] | None = None,
) -> Iterator[Drained]:
    """``dev_train.py`` under torchrun, reporting to ``srv``; stopped and logged on exit."""
    running = Drained(launch(TRAIN, nproc, srv.addr, env=env, args=args, python=ctx.python))
    try:
        yield running
    finally:
        running.finish(0)  # stops it (and every process under it) if still running
        log.add(f"{title}: torchrun exit {running.proc.returncode}", running.text())


@contextlib.contextmanager
def server(log: Log, title: str, ctx: Context) -> Iterator[Served]:
    """A fresh server per part, so no alert of one part is read in another."""
    with tempfile.TemporaryDirectory(prefix="ddpw-dev-") as tmp:
        path = Path(tmp) / "serve.log"
        srv = served(ctx.python, log=path)
        try:
            with srv:
                yield srv
                final = srv.status()
                log.add(
                    f"{title}: final status (alerts)", json.dumps(final.get("alerts"), indent=1)
                )
        finally:
            with contextlib.suppress(OSError):
                log.add(f"{title}: server output", path.read_text())


def log_reports(log: Log, title: str, folder: Path) -> None:
    for path in sorted(folder.glob("*.jsonl")):
        log.add(f"{title}: {path.name}", path.read_text())


def wait(
    srv: Served, pred: Callable[[Doc], bool], timeout: float, running: Drained | None = None
) -> tuple[Doc | None, Doc]:
    """``srv.wait_for`` that also gives up once ``running`` has ended (after one more look):
    (the document ``pred`` held for, or None; the last document read)."""
    last: Doc = {}
    deadline = time.monotonic() + timeout
    ended_at: float | None = None
    while True:
        doc = srv.status()
        if doc:
            last = doc
            if pred(doc):
                return doc, doc
        now = time.monotonic()
        if running is not None and not running.running():
            ended_at = now if ended_at is None else ended_at
            if now - ended_at > 3.0:  # the server has had time to read its last messages
                return None, last
        if now >= deadline:
            return None, last
        time.sleep(0.25)


def steps(doc: Doc, rank: int) -> int:
    entry = rank_of(doc, rank) or {}
    step = entry.get("step")
    return step if isinstance(step, int) else -1


def nvidia_smi_rows() -> tuple[list[tuple[str | None, int]], str]:
    cmd = ["nvidia-smi", "--query-gpu=uuid,memory.used", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"nvidia-smi failed: {exc}"
    return parse_smi_memory(out.stdout), out.stdout + out.stderr


# 4. memory ---------------------------------------------------------------------------------------
def check_memory(ctx: Context) -> list[Result]:
    log = Log(ctx, BUDGET_S["memory"])
    results = [_guarded("4a memory figures", _memory_figures, ctx, log)]
    if ctx.cpu:
        why = "no GPU: NVML pids and GPU memory exist only on a GPU"
        results.append(skip("4b foreign_memory", why, "foreign_memory naming the 2 GiB process"))
        results.append(skip("4c uneven_memory", why, "uneven_memory naming rank 1"))
    else:
        results.append(_guarded("4b foreign_memory", _foreign_memory, ctx, log))
        results.append(_guarded("4c uneven_memory", _uneven_memory, ctx, log))
    return results


def _guarded(
    name: str, part: Callable[[Context, Log], Result], ctx: Context, log: Log, expected: str = ""
) -> Result:
    """Run one part; an exception of the check itself is a FAIL, not a crash of the driver;
    a part the budget has no room for left is skipped."""
    if log.left() < MIN_PART_S:
        return skip(name, f"no time left in the check's budget ({log.left():.0f} s)", expected)
    log.add(f"{name}: start", time.strftime("%H:%M:%S"))
    try:
        return part(ctx, log)
    except Exception as exc:
        log.add(f"{name}: check raised", f"{type(exc).__name__}: {exc}")
        return Result(name, False, f"the check raised {type(exc).__name__}: {exc}", expected or "")


def _memory_figures(ctx: Context, log: Log) -> Result:
    name = "4a memory figures"
    with tempfile.TemporaryDirectory(prefix="ddpw-dev-") as tmp:
        report = Path(tmp) / "mem.jsonl"
        if ctx.cpu:
            args = ["--device", "cpu", "--backend", "gloo", "--hold-mib", "256"]
        else:
            args = ["--device", "cuda", "--backend", "nccl", "--hold-mib", "4096"]
        args += ["--seconds", "50", "--report", str(report)]
        with server(log, name, ctx) as srv, job(ctx, log, name, srv, 1, args) as running:

            def ready(doc: Doc) -> bool:  # the held memory shows (NVML may never: then FAIL)
                r = rank_of(doc, 0) or {}
                if ctx.cpu:
                    return steps(doc, 0) >= 20 and (r.get("host_rss_bytes") or 0) >= 256 * MIB
                return steps(doc, 0) >= 20 and (r.get("mem_reserved_bytes") or 0) >= 4 * GIB

            doc, last = wait(srv, ready, log.cap(40), running)
            if doc is None:
                return Result(
                    name, False, f"rank 0 never reported memory: {_state(last, 0)}", "figures"
                )
            time.sleep(1.0)  # steady: the held memory is allocated, the steps allocate none
            doc = srv.status()
            smi_rows, smi_text = ([], "") if ctx.cpu else nvidia_smi_rows()
            reports = read_json_lines(report.with_name("mem-rank0.jsonl"))
        if not ctx.cpu:
            log.add(f"{name}: nvidia-smi", smi_text)
        log_reports(log, name, Path(tmp))
    r = rank_of(doc, 0) or {}
    beats = [b for b in reports if b.get("event") == "beat"]
    own = beats[-1] if beats else {}
    if ctx.cpu:
        d = rel_diff(r.get("host_rss_bytes"), own.get("rss"))
        figure = (
            f"cpu: host RSS in status {gib(r.get('host_rss_bytes'))} vs the rank's own "
            f"{gib(own.get('rss'))} ({pct(d)}); mem_reserved_bytes {r.get('mem_reserved_bytes')}"
        )
        ok = d is not None and d <= NVML_TOLERANCE and r.get("mem_reserved_bytes") is None
        return Result(name + " (cpu: host RSS)", ok, figure, "within 5 %, no allocator figure")
    d_alloc = rel_diff(r.get("mem_reserved_bytes"), own.get("reserved"))
    smi = smi_used_for(smi_rows, r.get("device_uuid"))
    d_nvml = rel_diff(r.get("gpu_mem_used_bytes"), smi)
    figure = (
        f"allocator: status {gib(r.get('mem_reserved_bytes'))} vs memory_reserved() "
        f"{gib(own.get('reserved'))} ({pct(d_alloc)}); NVML: status "
        f"{gib(r.get('gpu_mem_used_bytes'))} vs nvidia-smi {gib(smi)} ({pct(d_nvml)}, "
        f"{_mib_diff(r.get('gpu_mem_used_bytes'), smi)}); 4 GiB held on {r.get('device')}"
    )
    ok = (
        d_alloc is not None
        and d_alloc <= ALLOCATOR_TOLERANCE
        and d_nvml is not None
        and d_nvml <= NVML_TOLERANCE
    )
    return Result(name, ok, figure, "allocator within 3 %, NVML within 5 % of nvidia-smi")


def _mib_diff(a: int | None, b: int | None) -> str:
    return "?" if a is None or b is None else f"{(a - b) / MIB:+.0f} MiB"


def _state(doc: Doc, rank: int) -> str:
    r = rank_of(doc, rank)
    if r is None:
        return f"rank {rank} never reported"
    err = r.get("error") or {}
    what = f"; error {err.get('type')}: {clip(err.get('message'), 160)}" if err else ""
    return f"rank {rank} {r.get('state')} at step {r.get('step')} in {r.get('phase')}{what}"


def _foreign_memory(ctx: Context, log: Log) -> Result:
    name = "4b foreign_memory"
    expected = "foreign_memory on rank 0 naming the 2 GiB process's pid"
    with tempfile.TemporaryDirectory(prefix="ddpw-dev-") as tmp:
        hog_report = Path(tmp) / "hog.json"
        hog_log = Path(tmp) / "hog.log"
        with hog_log.open("w") as sink:
            hog = subprocess.Popen(
                [ctx.python, str(HOG), "--gib", "2", "--seconds", "120",
                 "--report", str(hog_report)],
                env=child_env(), stdout=sink, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, text=True,
            )  # fmt: skip
        try:
            hog_pid = _wait_hog(hog, hog_report, log.cap(25))
            if hog_pid is None:
                return Result(name, False, "the 2 GiB process never got ready", expected)
            result = _foreign_job(ctx, log, name, expected, hog_pid, Path(tmp))
        finally:
            stop(hog)
            with contextlib.suppress(OSError):
                log.add(f"{name}: the 2 GiB process", hog_log.read_text())
    return result


def _wait_hog(hog: subprocess.Popen[str], report: Path, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and hog.poll() is None:
        lines = read_json_lines(report)
        if lines and isinstance(lines[0].get("pid"), int):
            return int(lines[0]["pid"])
        time.sleep(0.2)
    return None


def _foreign_job(
    ctx: Context, log: Log, name: str, expected: str, hog_pid: int, tmp: Path
) -> Result:
    args = ["--device", "cuda", "--backend", "nccl", "--seconds", "45",
            "--report", str(tmp / "foreign.jsonl")]  # fmt: skip
    with server(log, name, ctx) as srv, job(ctx, log, name, srv, 1, args) as running:
        unmatched: list[float] = []  # when the rank's pid was first missing from its GPU's

        def decided(doc: Doc) -> bool:
            if alerts_of(doc, "foreign_memory"):
                return True
            r = rank_of(doc, 0) or {}
            if steps(doc, 0) < 1 or r.get("pid") in (r.get("gpu_pids") or []):
                unmatched.clear()
                return False
            # NVML in another PID namespace (or no pids at all): nothing will change, but give
            # NVML's process list 8 s to catch up with a process that just started
            if not unmatched:
                unmatched.append(time.monotonic())
            return time.monotonic() - unmatched[0] > 8.0

        doc, last = wait(srv, decided, log.cap(35), running)
        doc = doc or last
    log_reports(log, name, tmp)
    alerts = alerts_of(doc, "foreign_memory")
    r = rank_of(doc, 0) or {}
    pids, pid = r.get("gpu_pids"), r.get("pid")
    seen = f"rank 0 pid {pid}, NVML's pids on its GPU {pids}, the 2 GiB process {hog_pid}"
    if alerts:
        a = alerts[0]
        ok = names(a, [0]) and str(hog_pid) in (a.get("message") or "")
        return Result(name, ok, f"{clip(a.get('message'))} [{seen}]", expected)
    if isinstance(pids, list) and pids and pid not in pids:
        why = (
            f"NVML lists pids that are not this container's ({seen}): the rule stays silent "
            "where it cannot tell a rank's pid from a foreign one (by design)"
        )
        return Result(name, None, why, expected)
    return Result(name, False, f"no foreign_memory alert; {seen}; {_state(doc, 0)}", expected)


def _uneven_memory(ctx: Context, log: Log) -> Result:
    name = "4c uneven_memory"
    expected = "uneven_memory naming rank 1 alone"
    with tempfile.TemporaryDirectory(prefix="ddpw-dev-") as tmp:
        args = ["--device", "cuda", "--backend", "gloo", "--cuda-index", "zero",
                "--extra-rank", "1", "--extra-mib", "10240", "--seconds", "50",
                "--report", str(Path(tmp) / "uneven.jsonl")]  # fmt: skip
        with server(log, name, ctx) as srv, job(ctx, log, name, srv, 2, args) as running:

            def decided(doc: Doc) -> bool:
                if alerts_of(doc, "uneven_memory"):
                    return True
                held = (rank_of(doc, 1) or {}).get("mem_reserved_bytes") or 0
                light = (rank_of(doc, 0) or {}).get("mem_reserved_bytes")
                stepping = min(steps(doc, 0), steps(doc, 1)) >= 60
                return stepping and held >= 10 * GIB and light is not None

            doc, last = wait(srv, decided, log.cap(40), running)
            if doc is not None and not alerts_of(doc, "uneven_memory"):
                doc, last = wait(
                    srv, lambda d: bool(alerts_of(d, "uneven_memory")), log.cap(5), running
                )
            doc = doc or last
        log_reports(log, name, Path(tmp))
    per_rank = "; ".join(
        f"rank {i}: reserved {gib((rank_of(doc, i) or {}).get('mem_reserved_bytes'))}, "
        f"NVML used {gib((rank_of(doc, i) or {}).get('gpu_mem_used_bytes'))}"
        for i in (0, 1)
    )
    dup = alerts_of(doc, "duplicate_device")
    side = f"; duplicate_device too: {clip(dup[0].get('message'), 120)}" if dup else ""
    alerts = alerts_of(doc, "uneven_memory")
    if alerts:
        a = alerts[0]
        ok = (a.get("ranks") or []) == [1]
        return Result(name, ok, f"{clip(a.get('message'))} [{per_rank}]{side}", expected)
    used = [(rank_of(doc, i) or {}).get("gpu_mem_used_bytes") for i in (0, 1)]
    why = ""
    if used[0] is not None and used[0] == used[1]:
        why = (
            " (both ranks report the one GPU's NVML total, and the rule compares "
            "gpu_mem_used_bytes before the allocator's figures)"
        )
    figure = f"no uneven_memory alert{why}: {per_rank}; {_state(doc, 1)}{side}"
    return Result(name, False, figure, expected)


# 5. seed 002: two NCCL ranks on one GPU ----------------------------------------------------------
def check_duplicate_device(ctx: Context) -> list[Result]:
    name = "5 duplicate_device (seed 002)"
    expected = (
        f"duplicate_device naming ranks 0, 1 with '{SET_DEVICE_FIX}'; the crash alert "
        "carries NCCL's text"
    )
    if ctx.cpu:
        return [skip(name, "no GPU: NCCL and two ranks on one cuda device need one", expected)]
    log = Log(ctx, BUDGET_S["duplicate"])
    result = _guarded(name, lambda c, lg: _duplicate(c, lg, name, expected), ctx, log, expected)
    return [result]


def _duplicate(ctx: Context, log: Log, name: str, expected: str) -> Result:
    with tempfile.TemporaryDirectory(prefix="ddpw-dev-") as tmp:
        args = ["--device", "cuda", "--backend", "nccl", "--cuda-index", "zero",
                "--seconds", "20", "--report", str(Path(tmp) / "dup.jsonl")]  # fmt: skip
        with server(log, name, ctx) as srv, job(ctx, log, name, srv, 2, args) as running:

            def decided(doc: Doc) -> bool:
                named = first_naming(alerts_of(doc, "duplicate_device"), [0, 1])
                return named is not None and bool(alerts_of(doc, "crashed"))

            doc, last = wait(srv, decided, log.cap(70), running)
            doc = doc or last
            if doc is not last:
                time.sleep(1.0)  # the crash alerts of the other rank, if any
                doc = srv.status() or doc
        log_reports(log, name, Path(tmp))
    dup = first_naming(alerts_of(doc, "duplicate_device"), [0, 1])
    crashed = alerts_of(doc, "crashed")
    crash_text = next(
        (a.get("message") or "" for a in crashed if "NCCL" in (a.get("message") or "")), None
    )
    dup_nccl = dup is not None and "NCCL" in (dup.get("message") or "")
    errors = [(rank_of(doc, i) or {}).get("error") or {} for i in (0, 1)]
    nccl_error = next((e.get("message") for e in errors if "Duplicate GPU" in str(e)), None)
    when = (
        f"duplicate_device at +{first_raised(doc, 'duplicate_device')} s, first crash alert at "
        f"+{first_raised(doc, 'crashed')} s"
    )
    if dup is None:
        figure = (
            f"no duplicate_device naming ranks 0, 1; {when}; {_state(doc, 0)}; {_state(doc, 1)}"
        )
        return Result(name, False, figure, expected)
    hint_ok = SET_DEVICE_FIX in (dup.get("hint") or "")
    ok = hint_ok and (crash_text is not None or dup_nccl)
    figure = (
        f"{clip(dup.get('message'), 160)}; hint has the fix: {hint_ok}; crash alert: "
        f"{clip(crash_text, 160) if crash_text else 'none carrying NCCL text'}; {when}; "
        f"rank error: {clip(nccl_error, 160) if nccl_error else 'no Duplicate GPU text'}"
    )
    if not alerts_of(doc, "crashed") and not any(errors):
        figure += " (NCCL did not abort: both ranks ran on)"
    return Result(name, ok, figure, expected)


# 6. seed 000: the global rank as the device index ------------------------------------------------
def check_device_ordinal(ctx: Context) -> list[Result]:
    name = "6 device_ordinal (seed 000)"
    expected = "device_ordinal naming rank 1 with 'invalid device ordinal' and the explanation"
    if ctx.cpu:
        return [skip(name, "no GPU: 'invalid device ordinal' comes from CUDA", expected)]
    log = Log(ctx, BUDGET_S["ordinal"])
    result = _guarded(name, lambda c, lg: _ordinal(c, lg, name, expected), ctx, log, expected)
    return [result]


def _ordinal(ctx: Context, log: Log, name: str, expected: str) -> Result:
    with tempfile.TemporaryDirectory(prefix="ddpw-dev-") as tmp:
        args = ["--device", "cuda", "--backend", "nccl", "--cuda-index", "rank",
                "--seconds", "20", "--report", str(Path(tmp) / "ordinal.jsonl")]  # fmt: skip
        env = {"CUDA_VISIBLE_DEVICES": "0"}  # one GPU, whatever the machine has
        with server(log, name, ctx) as srv, job(ctx, log, name, srv, 2, args, env) as running:

            def decided(doc: Doc) -> bool:
                return first_naming(alerts_of(doc, "device_ordinal"), [1]) is not None

            doc, last = wait(srv, decided, log.cap(70), running)
            doc = doc or last
        log_reports(log, name, Path(tmp))
    found = first_naming(alerts_of(doc, "device_ordinal"), [1])
    crashed = alerts_of(doc, "crashed")
    side = f"; crashed alert: {clip(crashed[0].get('message'), 160)}" if crashed else ""
    if found is None:
        figure = f"no device_ordinal naming rank 1; {_state(doc, 1)}{side}"
        return Result(name, False, figure, expected)
    message = found.get("message") or ""
    ok = "invalid device ordinal" in message.lower() and "—" in message  # error, then cause
    figure = f"{clip(message, 260)}; hint: {clip(found.get('hint'), 140)}{side}"
    return Result(name, ok, figure, expected)


# 7. the flight recorder --------------------------------------------------------------------------
def check_flight_recorder(ctx: Context) -> list[Result]:
    log = Log(ctx, BUDGET_S["flight"])
    runs: list[tuple[str, dict[str, str], list[str]]]
    if ctx.cpu:
        runs = [("7 flight recorder (cpu, gloo)", {}, ["--device", "cpu", "--backend", "gloo"])]
    else:
        cuda = ["--device", "cuda", "--backend", "nccl"]
        runs = [
            ("7 flight recorder (nccl)", {}, cuda),
            ("7 flight recorder (nccl, TORCH_NCCL_ENABLE_TIMING=1)",
             {"TORCH_NCCL_ENABLE_TIMING": "1"}, cuda),
        ]  # fmt: skip
    results = []
    for name, env, args in runs:
        expected = "collectives.fr rising while steps run; pg_status reported as a figure"
        part = _flight_part(name, env, args)
        results.append(_guarded(name, part, ctx, log, expected))
    return results


def _flight_part(
    name: str, env: dict[str, str], device_args: list[str]
) -> Callable[[Context, Log], Result]:
    def part(ctx: Context, log: Log) -> Result:
        expected = "collectives.fr rising while steps run; pg_status reported as a figure"
        counts: list[tuple[float, int | None]] = []
        with tempfile.TemporaryDirectory(prefix="ddpw-dev-") as tmp:
            args = [*device_args, "--seconds", "30", "--report", str(Path(tmp) / "fr.jsonl")]
            # the environment as the user would set it; unset TORCH_NCCL_ENABLE_TIMING otherwise
            full = {"TORCH_NCCL_ENABLE_TIMING": "0", **env}
            with server(log, name, ctx) as srv, job(ctx, log, name, srv, 1, args, full) as running:
                first, last = wait(srv, lambda d: steps(d, 0) >= 1, log.cap(45), running)
                start = time.monotonic()
                while first is not None and time.monotonic() - start < 6 and running.running():
                    doc = srv.status()
                    counts.append((time.monotonic() - start, fr_count(rank_of(doc, 0))))
                    time.sleep(0.5)
                last = srv.status() or last
            reports = read_json_lines(Path(tmp) / "fr-rank0.jsonl")
            log_reports(log, name, Path(tmp))
        log.add(f"{name}: fr counts seen in the status", repr(counts))
        if not counts:
            return Result(name, False, f"the rank never stepped: {_state(last, 0)}", expected)
        values = [c for _, c in counts]
        known = [v for v in values if v is not None]
        beats = [b for b in reports if b.get("event") == "beat"]
        pg = pg_summary(beats[-1].get("pg_status")) if beats else "no report from the rank"
        span = f"{known[0]}→{known[-1]}" if known else "none"
        figure = (
            f"collectives.fr[0] {span} over {counts[-1][0]:.1f} s ({len(known)} readings); "
            f"torch's pg_status of group 0: {pg}"
        )
        return Result(name, rising(values), figure, expected)

    return part
