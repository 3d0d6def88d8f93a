"""``ddpwatch doctor``: pre-flight checks before a launch, one line each with its fix.

A job script runs it first (``ddpwatch doctor --nproc-per-node 8 && torchrun ...``): it exits
1 when a check fails, so a job that would die at start-up with ``invalid device ordinal``,
``Address already in use`` or an unresolvable master is not started. Warnings and skips do not
fail.

The environment is read once into a ``Setup`` (torch, the GPU count, the backend, the server
the ranks would report to); each check is a function of it that returns a ``Check``. Whatever
needs torch or NVML becomes a skip line saying what could not be checked, and a check that
raises becomes a fail line with the exception's text: a pre-flight tool that dies with a
traceback has checked nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from ddpwatch.agent.identity import identity_from_env
from ddpwatch.agent.nvml import Nvml, parse_cuda_visible_devices
from ddpwatch.agent.watcher import resolve_endpoint
from ddpwatch.core.port_holder import Holder, find_holder
from ddpwatch.core.ports import host_port
from ddpwatch.core.protocol import DEFAULT_PORT
from ddpwatch.core.security import (
    CLIENT_KEY_FILE_ENV,
    SERVER_KEY_ENV,
    CurveKeyError,
    client_curve_keys,
    is_loopback,
    load_key_file,
)
from ddpwatch.core.vocabulary import RankState
from ddpwatch.status.client import fetch_status, no_answer
from ddpwatch.status.schema import StatusDocument

Status = Literal["ok", "warn", "fail", "skip"]
MARKS: dict[str, str] = {"ok": "✔", "fail": "✖", "warn": "⚠", "skip": "\u2013"}  # en dash
ASCII_MARKS: dict[str, str] = {"ok": "[ok]", "fail": "[FAIL]", "warn": "[warn]", "skip": "[skip]"}
ORDINAL = "'invalid device ordinal'"
TORCHRUN_PORT = 29500  # torchrun's --master-port when MASTER_PORT is unset
NVIDIA_DEVICE = "/dev/nvidiactl"  # present wherever the NVIDIA driver is loaded (or passed in)


@dataclass(frozen=True)
class Check:
    """One line of the report: what was found and, unless it is fine, what to do."""

    name: str
    status: Status
    what: str
    fix: str = ""


@dataclass(frozen=True)
class TorchInfo:
    """What this environment's torch offers; ``version`` is None when torch cannot be imported,
    ``error`` says why torch (or reading its CUDA and backends) failed."""

    version: str | None = None
    error: str | None = None
    cuda: str | None = None  # the CUDA torch was built with; None: a CPU build
    gpus: int = 0
    distributed: bool = False
    gloo: bool = False
    nccl: bool = False
    nccl_version: str | None = None

    @property
    def usable(self) -> bool:
        return self.version is not None and self.error is None


@dataclass(frozen=True)
class Setup:
    """Everything the checks look at, read once."""

    env: Mapping[str, str]
    torch: TorchInfo
    gpus: int | None  # GPUs this process sees (torch's count, else NVML's); None: unknown
    nproc: int | None  # ranks per node; None: unknown
    nproc_source: str  # where ``nproc`` came from, or why it is unknown
    backend: str
    backend_source: str
    server: str  # the agent's endpoint, tcp://host:port
    server_source: str
    server_explicit: bool  # named by --addr or $DDPWATCH_ADDR: unreachable is a failure
    curve_env: Mapping[str, str]  # the environment with the --curve-* flags applied
    curve_error: str | None
    timeout: float


CheckFn = Callable[[Setup], Check]


# reading the environment -------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def probe_torch() -> TorchInfo:
    """Import torch and read its CUDA, device count and backends; never raises, starts nothing
    (no process group, no CUDA context)."""
    try:
        import torch
    except Exception as exc:
        return TorchInfo(error=_describe(exc))
    version = str(getattr(torch, "__version__", "unknown"))
    try:
        import torch.distributed as dist

        cuda = torch.version.cuda
        gpus = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
        distributed = bool(dist.is_available())
        nccl = distributed and bool(dist.is_nccl_available())
        raw = torch.cuda.nccl.version() if nccl and gpus else None  # type: ignore[no-untyped-call]
        nccl_version = ".".join(map(str, raw)) if isinstance(raw, tuple) else raw
        return TorchInfo(
            version=version,
            cuda=str(cuda) if cuda else None,
            gpus=gpus,
            distributed=distributed,
            gloo=distributed and bool(dist.is_gloo_available()),
            nccl=nccl,
            nccl_version=str(nccl_version) if nccl_version else None,
        )
    except Exception as exc:
        return TorchInfo(version=version, error=_describe(exc))


def count_gpus(info: TorchInfo, env: Mapping[str, str]) -> int | None:
    """The GPUs a rank started here would see: torch's count, else NVML's (honouring
    ``CUDA_VISIBLE_DEVICES`` as CUDA does), else None."""
    if info.usable:
        return info.gpus
    return Nvml(environ=env).visible_device_count(env.get("CUDA_VISIBLE_DEVICES"))


def ranks_per_node(flag: int | None, env: Mapping[str, str]) -> tuple[int | None, str]:
    """``--nproc-per-node``, else ``$LOCAL_WORLD_SIZE``, else what a launcher's rank variables
    say (inside an ``srun`` or ``mpirun`` rank); with where it came from or why it is unknown."""
    if flag is not None:
        return flag, "--nproc-per-node"
    raw = env.get("LOCAL_WORLD_SIZE")
    if raw is not None:
        text = raw.strip()
        if text.isascii() and text.isdigit() and int(text) > 0:
            return int(text), "$LOCAL_WORLD_SIZE"
        return None, f"LOCAL_WORLD_SIZE={raw!r} is not a positive integer"
    local = identity_from_env(env).local_world_size
    if local:
        return local, "the launcher's environment"
    return None, "no --nproc-per-node, LOCAL_WORLD_SIZE unset"


def default_backend(info: TorchInfo, gpus: int | None) -> tuple[str, str]:
    """nccl when CUDA can be used, else gloo; without torch, nccl when NVML sees GPUs."""
    if info.usable:
        return ("nccl", "default: CUDA available") if info.gpus else ("gloo", "default: no CUDA")
    if gpus is None:
        return "gloo", "default: no torch or NVML to count GPUs"
    return ("nccl", "default: NVML sees GPUs") if gpus else ("gloo", "default: no GPU found")


def server_endpoint(addr: str | None, env: Mapping[str, str]) -> tuple[str, str, bool]:
    """(endpoint, where it came from, whether it was asked for) of the server the agent would
    report to, resolved exactly as the agent resolves it."""
    if addr:
        source, explicit = "--addr", True
    elif env.get("DDPWATCH_ADDR"):
        source, explicit = "$DDPWATCH_ADDR", True
    elif env.get("MASTER_ADDR"):
        source, explicit = "the agent's default, $MASTER_ADDR", False
    else:
        source, explicit = "the agent's default", False
    return resolve_endpoint(addr, dict(env)), source, explicit


def curve_environment(
    env: Mapping[str, str], server_key: str | None, client_key_file: str | None
) -> tuple[dict[str, str], str | None]:
    """The environment the agent would read its CURVE keys from, with the flags applied, and
    why those keys are unusable (None when they are fine or CURVE is off)."""
    curve_env = dict(env)
    try:
        if server_key is not None:
            if Path(server_key).is_file():  # the server's public .key file
                server_key = load_key_file(server_key, secret=False)[0].decode("ascii")
            curve_env[SERVER_KEY_ENV] = server_key
        if client_key_file is not None:
            curve_env[CLIENT_KEY_FILE_ENV] = client_key_file
        client_curve_keys(curve_env)
    except CurveKeyError as exc:
        return curve_env, str(exc)
    return curve_env, None


def gather(
    env: Mapping[str, str],
    *,
    nproc: int | None = None,
    addr: str | None = None,
    backend: str | None = None,
    server_key: str | None = None,
    client_key_file: str | None = None,
    timeout: float = 2.0,
) -> Setup:
    """Read torch, the GPUs and the settings once, for every check."""
    info = probe_torch()
    gpus = count_gpus(info, env)
    per_node, per_node_source = ranks_per_node(nproc, env)
    if backend is None:
        backend, backend_source = default_backend(info, gpus)
    else:
        backend_source = "--backend"
    endpoint, source, explicit = server_endpoint(addr, env)
    curve_env, curve_error = curve_environment(env, server_key, client_key_file)
    return Setup(
        env=env,
        torch=info,
        gpus=gpus,
        nproc=per_node,
        nproc_source=per_node_source,
        backend=backend,
        backend_source=backend_source,
        server=endpoint,
        server_source=source,
        server_explicit=explicit,
        curve_env=curve_env,
        curve_error=curve_error,
        timeout=timeout,
    )


# network helpers ---------------------------------------------------------------------------------


def _resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to, in resolver order; ``OSError`` when it does not."""
    infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _is_local(address: str) -> bool:
    """True when ``address`` belongs to this host: only then can a socket bind it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def port_in_use(port: int) -> str | None:
    """Why c10d's TCPStore could not listen on ``port`` here (its error text), or None.

    Binds every interface with ``SO_REUSEADDR``, as the store does (verified on torch 2.13: it
    binds a port a closed listener left in TIME_WAIT, which a plain ``bind`` refuses), once per
    address family, so a listener on 127.0.0.1 or on ``::`` counts too.
    """
    for family, anywhere in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((anywhere, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return exc.strerror or str(exc)
    return None


def _next_free_port(port: int) -> int | None:
    for candidate in range(port + 1, min(port + 100, 65536)):
        if port_in_use(candidate) is None:
            return candidate
    return None


# the checks --------------------------------------------------------------------------------------


def check_torch(s: Setup) -> Check:
    """torch's version, its CUDA and how many GPUs it sees."""
    info = s.torch
    if info.version is None:
        return Check(
            "torch",
            "skip",
            f"not importable ({info.error}): CUDA devices, NCCL and gloo not checked",
            "run doctor with the job's Python (the environment torchrun uses)",
        )
    if info.error is not None:
        return Check(
            "torch",
            "fail",
            f"{info.version} imports, but reading its CUDA and backends failed ({info.error})",
            "a broken install: reinstall torch (pip install --force-reinstall torch)",
        )
    if info.cuda is None:
        return Check("torch", "ok", f"{info.version}, a CPU build (no CUDA)")
    seen = _plural(info.gpus, "GPU") + " visible" if info.gpus else "no GPU visible"
    return Check("torch", "ok", f"{info.version}, CUDA {info.cuda}, {seen}")


def _backends(info: TorchInfo) -> str:
    """``torch has NCCL 2.21.5 and gloo``, ``torch has gloo, not nccl``."""
    nccl = f"NCCL {info.nccl_version}" if info.nccl_version else "nccl"
    have = [name for name, there in ((nccl, info.nccl), ("gloo", info.gloo)) if there]
    lack = [name for name, there in (("nccl", info.nccl), ("gloo", info.gloo)) if not there]
    text = f"torch has {' and '.join(have)}" if have else "torch has neither nccl nor gloo"
    return text + (f", not {lack[0]}" if have and lack else "")


def check_backend(s: Setup) -> Check:
    """The job's backend exists in this torch; the NCCL version and gloo."""
    info, backend = s.torch, s.backend
    if not info.usable:
        return Check("backend", "skip", f"{backend} ({s.backend_source}) not checked without torch")
    if not info.distributed:
        return Check(
            "backend",
            "fail",
            f"torch {info.version} has no torch.distributed",
            "install a torch build with distributed support (the pytorch.org wheels have it)",
        )
    available = info.nccl if backend == "nccl" else info.gloo
    if not available:
        fix = (
            "NCCL comes with CUDA builds of torch on Linux: install one, or train on CPU with gloo"
            if backend == "nccl"
            else "use nccl, or a torch build with gloo"
        )
        return Check("backend", "fail", f"{backend} is not in torch {info.version}", fix)
    return Check("backend", "ok", f"{backend} ({s.backend_source}) is available; {_backends(info)}")


def cpu_job(s: Setup) -> str | None:
    """Why the job is taken to run on CPU (no GPU expected), or None when it may use GPUs:
    nccl, a GPU visible, or an NVIDIA device on this machine (a GPU the driver cannot show)."""
    if s.backend == "nccl" or s.gpus or os.path.exists(NVIDIA_DEVICE):
        return None
    return f"{s.backend}, no NVIDIA GPU on this machine"


def check_nvml(s: Setup) -> Check:
    """NVML answers: what the agent reads device UUIDs, memory and processes from. A CPU job
    has no GPU to read: a missing NVML is no problem there, and no driver is to be installed."""
    on_cpu = cpu_job(s)
    cpu_line = Check(
        "NVML", "skip", f"not needed: the job runs on CPU ({on_cpu}), GPU checks skipped"
    )
    try:
        import pynvml
    except Exception as exc:
        if on_cpu:
            return cpu_line
        return Check(
            "NVML",
            "warn",
            f"nvidia-ml-py not importable ({_describe(exc)}): "
            "GPU UUIDs, memory and processes will read as null",
            "pip install nvidia-ml-py",
        )
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        if on_cpu:
            return cpu_line
        return Check(
            "NVML",
            "warn",
            f"cannot start ({_describe(exc)})",
            "install the NVIDIA driver; in a container, expose the GPUs with the NVIDIA "
            "container toolkit (--gpus all) so libnvidia-ml.so.1 is there",
        )
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception as exc:
        return Check(
            "NVML",
            "warn",
            f"starts, but reading the driver and GPUs failed ({_describe(exc)})",
            "check the driver with nvidia-smi",
        )
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    if isinstance(driver, bytes):
        driver = driver.decode("utf-8", "replace")
    return Check("NVML", "ok", f"driver {driver}, {_plural(count, 'GPU')}")


def _local_ranks(first: int, last: int) -> str:
    return f"local rank {first}" if first == last else f"local ranks {first}-{last}"


def check_gpus(s: Setup) -> Check:
    """Ranks per node against visible GPUs: the 5-ranks-on-4-GPUs ``invalid device ordinal``."""
    if s.gpus is None:
        return Check(
            "GPUs",
            "skip",
            "cannot count visible GPUs: torch is not importable and NVML is unavailable",
            "run doctor with the job's Python, or pip install nvidia-ml-py",
        )
    seen = _plural(s.gpus, "GPU") + " visible"
    if s.nproc is None:
        return Check(
            "GPUs",
            "skip",
            f"{seen}; ranks per node unknown ({s.nproc_source}): not compared",
            "pass --nproc-per-node N as given to torchrun",
        )
    ranks = f"{s.nproc} ranks per node" if s.nproc > 1 else "1 rank per node"
    if s.nproc <= s.gpus:
        idle = f", {s.gpus - s.nproc} left idle" if s.gpus > s.nproc else ""
        return Check("GPUs", "ok", f"{ranks}, {seen}{idle}")
    if s.backend != "nccl" and s.gpus == 0:
        return Check("GPUs", "ok", f"{ranks} on CPU ({s.backend}, no GPU visible)")
    failing = _local_ranks(s.gpus, s.nproc - 1)
    what = f"{ranks} but {seen}: {failing} would fail with {ORDINAL}"
    if s.backend != "nccl":
        what += " if they use cuda:LOCAL_RANK"
    if s.gpus == 0:
        fix = "NCCL needs a GPU per rank: run on a GPU node (check the job's GPU allocation and "
        fix += "CUDA_VISIBLE_DEVICES), or train on CPU with gloo"
    else:
        fix = f"use --nproc-per-node {s.gpus}, or make {s.nproc} GPUs visible "
        fix += "(the job's GPU allocation, CUDA_VISIBLE_DEVICES)"
    return Check("GPUs", "fail" if s.backend == "nccl" else "warn", what, fix)


def _cvd_problem(value: str) -> tuple[str, int] | None:
    """Where CUDA's reading of ``CUDA_VISIBLE_DEVICES`` goes wrong: ("repeat", i) when entry i
    repeats an earlier one, ("stop", i) when CUDA stops reading at entry i; None when it takes
    every entry. Found by feeding the agent's parser longer and longer prefixes."""
    entries = value.split(",")
    taken = 0
    for index in range(len(entries)):
        parsed = parse_cuda_visible_devices(",".join(entries[: index + 1])) or []
        if not parsed and taken:
            return "repeat", index
        if len(parsed) == taken:
            last = index == len(entries) - 1 and index > 0
            return None if last and not entries[index].strip() else ("stop", index)  # "0,1,"
        taken = len(parsed)
    return None


def check_cuda_visible_devices(s: Setup) -> Check:
    """``CUDA_VISIBLE_DEVICES`` read exactly as CUDA reads it: repeats, ignored entries, and
    enough GPUs listed for the ranks per node."""
    name = "CUDA_VISIBLE_DEVICES"
    raw = s.env.get(name)
    if raw is None:
        return Check(name, "ok", "unset: CUDA shows every GPU")
    parsed = parse_cuda_visible_devices(raw) or []
    entries = raw.split(",")
    problem = _cvd_problem(raw)
    if problem is not None and problem[0] == "repeat":
        repeated = entries[problem[1]].strip()
        return Check(
            name,
            "fail",
            f"{raw} repeats {repeated}: CUDA then shows no GPU at all",
            "list each GPU once",
        )
    count = len(parsed)
    listed = f"{raw!r} hides every GPU" if count == 0 else f"{raw} lists {_plural(count, 'GPU')}"
    too_few: Status = "fail" if s.backend == "nccl" else "warn"
    if s.nproc is not None and count < s.nproc and (count or s.backend == "nccl"):
        example = ",".join(str(i) for i in range(s.nproc)) if s.nproc <= 8 else "0,1,...,N-1"
        ranks = _plural(s.nproc, "rank")
        return Check(
            name,
            too_few,
            f"{listed} for {ranks} per node" if count else f"{listed}: {ranks} per node need one",
            f"list one GPU per local rank (e.g. CUDA_VISIBLE_DEVICES={example}), or lower "
            "--nproc-per-node",
        )
    if count == 0:
        if s.backend == "nccl":
            return Check(name, "warn", listed, "NCCL needs GPUs: unset it or list the GPUs to use")
        return Check(name, "ok", f"{listed} (a CPU run with {s.backend})")
    if problem is not None:
        entry = entries[problem[1]].strip()
        shown = ",".join(str(item) for item in parsed)
        return Check(
            name,
            "warn",
            f"{raw}: CUDA stops reading at {entry!r} and shows only {shown}",
            f"remove or correct {entry!r}: every entry after it is ignored",
        )
    return Check(name, "ok", listed)


def check_local_rank(s: Setup) -> Check:
    """The local rank (inside a rank) within the ranks per node, ``CUDA_VISIBLE_DEVICES`` and
    the visible GPUs: ``cuda:LOCAL_RANK`` past them is ``invalid device ordinal``."""
    raw = s.env.get("LOCAL_RANK")
    local = identity_from_env(s.env).local_rank
    if local is None:
        if raw is not None:
            return Check(
                "LOCAL_RANK",
                "fail",
                f"{raw!r} is not a non-negative integer",
                "unset it: the launcher sets LOCAL_RANK in each rank",
            )
        return Check(
            "LOCAL_RANK",
            "skip",
            "not set here: the launcher sets it in each rank",
            "to check a rank's view, run doctor as one (srun ddpwatch doctor, or under mpirun)",
        )
    bad: Status = "fail" if s.backend == "nccl" else "warn"
    if s.nproc is not None and local >= s.nproc:
        return Check(
            "LOCAL_RANK",
            "fail",
            f"{local} but {s.nproc} ranks per node (local ranks 0-{s.nproc - 1})",
            "make --nproc-per-node match the ranks the launcher starts on each node",
        )
    fix = "give each rank a GPU of its own: list them all in CUDA_VISIBLE_DEVICES, or with "
    fix += "one GPU per rank (Slurm's --gpus-per-task) use cuda:0"
    visible = s.env.get("CUDA_VISIBLE_DEVICES")
    parsed = parse_cuda_visible_devices(visible)
    if visible is not None and parsed is not None and parsed and local >= len(parsed):
        return Check(
            "LOCAL_RANK",
            bad,
            f"{local} but CUDA_VISIBLE_DEVICES={visible} shows {_plural(len(parsed), 'GPU')}: "
            f"cuda:{local} would fail with {ORDINAL}",
            fix,
        )
    if s.gpus is None:
        return Check("LOCAL_RANK", "skip", f"{local}: not compared, the GPU count is unknown")
    if local < s.gpus:
        return Check("LOCAL_RANK", "ok", f"{local}: cuda:{local} is one of {s.gpus} visible")
    if s.gpus == 0 and s.backend != "nccl":
        return Check("LOCAL_RANK", "ok", f"{local}, on CPU ({s.backend}, no GPU visible)")
    seen = _plural(s.gpus, "GPU") + " visible" if s.gpus else "no GPU visible"
    return Check(
        "LOCAL_RANK", bad, f"{local} but {seen}: cuda:{local} would fail with {ORDINAL}", fix
    )


def check_master_addr(s: Setup) -> Check:
    """``MASTER_ADDR`` resolves (an unresolvable master hangs every rank in rendezvous)."""
    host = s.env.get("MASTER_ADDR", "").strip()
    if not host:
        return Check(
            "MASTER_ADDR",
            "skip",
            "unset: nothing to resolve (torchrun takes --master-addr or --rdzv-endpoint)",
        )
    try:
        addresses = _resolve(host)
    except OSError as exc:
        return Check(
            "MASTER_ADDR",
            "fail",
            f"{host} does not resolve ({exc.strerror or exc})",
            "use a host name or IP address every node can resolve (in Slurm: the first of "
            "scontrol show hostnames $SLURM_JOB_NODELIST)",
        )
    where = "this host" if any(_is_local(a) for a in addresses) else "another host"
    shown = ", ".join(addresses[:3]) + (", ..." if len(addresses) > 3 else "")
    return Check("MASTER_ADDR", "ok", f"{host} resolves to {shown} ({where})")


def _stop_holder(holder: Holder | None, port: int) -> str:
    """How to free ``port`` from what holds it, as far as this host can tell."""
    if holder is not None and holder.pids:
        return f"stop pid {holder.pids[0]} if it is left over from an earlier run"
    if holder is not None and holder.other_user:
        return "ask its owner to stop it"
    return f"stop what holds it (ss -ltnp 'sport = :{port}' shows it)"


def check_master_port(s: Setup) -> Check:
    """``MASTER_PORT`` free on the master (a leftover job holding it: ``Address already in
    use``), torchrun's default 29500 when it is unset, naming the process that holds it. Only
    this host's ports can be tried, so another master's is left to it."""
    raw = s.env.get("MASTER_PORT")
    if raw is None:
        port: int | None = TORCHRUN_PORT
        named = f"{TORCHRUN_PORT} (unset: torchrun's default)"
    else:
        text = raw.strip()
        port = int(text) if text.isascii() and text.isdigit() else None
        named = str(port)
    if port is None or not 0 < port < 65536:
        return Check(
            "MASTER_PORT",
            "fail",
            f"{raw!r} is not a port number",
            "set MASTER_PORT to a free port between 1024 and 65535",
        )
    host = s.env.get("MASTER_ADDR", "").strip() or "127.0.0.1"  # torchrun's default master
    try:
        addresses = _resolve(host)
    except OSError:
        return Check("MASTER_PORT", "skip", f"{named} not checked: MASTER_ADDR does not resolve")
    if not any(_is_local(a) for a in addresses):
        return Check(
            "MASTER_PORT",
            "skip",
            f"{named} not checked: MASTER_ADDR {host} is another host, "
            "the port check applies on that host",
            f"run ddpwatch doctor on {host}",
        )
    error = port_in_use(port)
    if error is None:
        return Check("MASTER_PORT", "ok", f"{named} is free on this host")
    holder = find_holder(port)
    held = f": held by {holder}" if holder is not None else ""
    spare = _next_free_port(port)
    if spare is None:
        instead = "pick a free one"
    elif raw is None:
        instead = f"pick a free one (torchrun --master-port {spare}, or MASTER_PORT={spare})"
    else:
        instead = f"pick a free one (MASTER_PORT={spare})"
    return Check(
        "MASTER_PORT",
        "fail",
        f"{named} is in use on this host ({error}){held}",
        f"{instead}, or {_stop_holder(holder, port)}",
    )


def check_curve(s: Setup) -> Check:
    """The CurveZMQ keys the agent would use: well-formed, readable, and not half set."""
    host, _ = host_port(s.server)
    if s.curve_error is not None:
        return Check(
            "CURVE",
            "fail",
            s.curve_error,
            f"{SERVER_KEY_ENV} is the server's public key (ddpwatch keygen prints it), "
            f"{CLIENT_KEY_FILE_ENV} a client's .key_secret file (docs/security.md)",
        )
    server_key = s.curve_env.get(SERVER_KEY_ENV, "").strip()
    client_file = s.curve_env.get(CLIENT_KEY_FILE_ENV, "").strip()
    if server_key:
        client = f"client key {client_file}" if client_file else "a fresh client key per socket"
        return Check("CURVE", "ok", f"on: the server key is valid, {client}")
    if client_file:
        return Check(
            "CURVE",
            "warn",
            f"{CLIENT_KEY_FILE_ENV} is set but {SERVER_KEY_ENV} is not: "
            "the client key is unused and traffic is plain TCP",
            f"export {SERVER_KEY_ENV}='<the server's public key>' (ddpwatch keygen printed it)",
        )
    if is_loopback(host):
        return Check("CURVE", "ok", f"off: plain TCP to {host}, which only this host can reach")
    return Check(
        "CURVE",
        "warn",
        f"off: plain TCP to {host}: anyone on the path can read stacks and tracebacks",
        f"ddpwatch keygen, serve with --curve-secret-file, export {SERVER_KEY_ENV} "
        "(docs/security.md)",
    )


def _ranks_seen(document: StatusDocument) -> str:
    connected = sum(1 for r in document.ranks if r.state != RankState.NOT_CONNECTED)
    world = document.world_size
    if world is not None:
        return f"{connected} of {_plural(world, 'rank')} connected"
    return f"{_plural(connected, 'rank')} connected" if connected else "no rank connected yet"


def _server_fix(s: Setup, host: str, port: int) -> str:
    local = is_loopback(host)
    serve = "ddpwatch serve" + ("" if local else " --host 0.0.0.0")
    serve += "" if port == DEFAULT_PORT else f" --port {port}"
    fix = f"start it: {serve}" + ("" if local else f" on {host}, ports {port}-{port + 1} open")
    if s.curve_env.get(SERVER_KEY_ENV, "").strip():
        fix += f"; with {SERVER_KEY_ENV} set, it must run with --curve-secret-file of that key"
    else:
        fix += f"; a server with --curve-secret-file answers only with {SERVER_KEY_ENV} set"
    if not s.server_explicit:
        fix += "; without one the ranks train as before, unwatched"
    return fix


def check_server(s: Setup) -> Check:
    """The ddpwatch server the ranks will report to answers its status query (port + 1)."""
    host, port = host_port(s.server)
    bad: Status = "fail" if s.server_explicit else "warn"
    if port is None or not 0 < port < 65535:
        return Check(
            "server",
            bad,
            f"cannot read a host:port from {s.server} ({s.server_source})",
            "give it as HOST:PORT, e.g. --addr node0:5599",
        )
    where = f"{host}:{port} ({s.server_source})"
    if s.curve_error is not None:
        return Check("server", "skip", f"{where} not asked: the CURVE key is unusable")
    try:
        _resolve(host)
    except OSError as exc:
        return Check(
            "server",
            bad,
            f"{where}: {host} does not resolve ({exc.strerror or exc})",
            "use a host name or IP address this host can resolve",
        )
    document = fetch_status(host, port, s.timeout, s.curve_env)
    if document is None:
        return Check(
            "server",
            bad,
            f"{where}: {no_answer(host, port, s.timeout)}",
            _server_fix(s, host, port),
        )
    return Check("server", "ok", f"{where} answered: {_ranks_seen(document)}")


CHECKS: tuple[tuple[str, CheckFn], ...] = (
    ("torch", check_torch),
    ("backend", check_backend),
    ("NVML", check_nvml),
    ("GPUs", check_gpus),
    ("CUDA_VISIBLE_DEVICES", check_cuda_visible_devices),
    ("LOCAL_RANK", check_local_rank),
    ("MASTER_ADDR", check_master_addr),
    ("MASTER_PORT", check_master_port),
    ("CURVE", check_curve),
    ("server", check_server),
)


# the runner --------------------------------------------------------------------------------------


def run_checks(setup: Setup, checks: Sequence[tuple[str, CheckFn]] = CHECKS) -> list[Check]:
    """Every check in order; one that raises becomes a fail line with the exception's text."""
    results = []
    for name, check in checks:
        try:
            results.append(check(setup))
        except Exception as exc:
            results.append(
                Check(
                    name,
                    "fail",
                    f"the check itself failed ({_describe(exc)})",
                    "a ddpwatch bug: please report this line",
                )
            )
    return results


def exit_code(checks: Sequence[Check]) -> int:
    """1 if any check failed; warnings and skips do not fail."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def header(setup: Setup) -> str:
    try:
        host = socket.gethostname()
    except OSError:
        host = "this host"
    if setup.nproc is not None:
        ranks = f"{_plural(setup.nproc, 'rank')} per node ({setup.nproc_source})"
    else:
        ranks = "ranks per node unknown"
    return f"ddpwatch doctor on {host}: {ranks}, backend {setup.backend} ({setup.backend_source})"


def summary(checks: Sequence[Check]) -> str:
    counts = {status: sum(1 for c in checks if c.status == status) for status in MARKS}
    return (
        f"{counts['ok']} ok, {counts['fail']} failed, "
        f"{_plural(counts['warn'], 'warning')}, {counts['skip']} skipped"
    )


def report(setup: Setup, checks: Sequence[Check], marks: Mapping[str, str] = MARKS) -> list[str]:
    """The lines doctor prints: a header, each check (and its fix unless it passed), a summary."""
    lines = [header(setup)]
    for check in checks:
        lines.append(f"{marks[check.status]} {check.name}: {check.what}")
        if check.fix and check.status != "ok":
            lines.append(f"    fix: {check.fix}")
    lines.append(summary(checks))
    return lines


def _marks_for(stream: IO[str]) -> dict[str, str]:
    """The marks where the stream can encode them (a job log in an ASCII locale cannot)."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        "".join(MARKS.values()).encode(encoding)
    except (UnicodeError, LookupError):
        return ASCII_MARKS
    return MARKS


def _write(lines: Sequence[str], stream: IO[str]) -> None:
    text = "\n".join(lines) + "\n"
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except (UnicodeError, LookupError):
        text = text.encode("ascii", "replace").decode("ascii")
    stream.write(text)
    stream.flush()


def doctor_main(args: argparse.Namespace, stream: IO[str] | None = None) -> int:
    """``ddpwatch doctor``: print every check; 0 when none failed, else 1."""
    out = sys.stdout if stream is None else stream
    marks = _marks_for(out)
    try:
        setup = gather(
            os.environ,
            nproc=args.nproc_per_node,
            addr=args.addr,
            backend=args.backend,
            server_key=args.curve_server_key,
            client_key_file=args.curve_client_key_file,
            timeout=args.timeout,
        )
    except Exception as exc:
        _write([f"{marks['fail']} doctor: cannot read this environment ({_describe(exc)})"], out)
        return 1
    checks = run_checks(setup)
    _write(report(setup, checks, marks), out)
    return exit_code(checks)
