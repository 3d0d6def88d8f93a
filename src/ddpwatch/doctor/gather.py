"""What ``ddpwatch doctor`` reads of the machine, once, into a ``Setup``: the environment,
torch and NVML (imported here only, lazily), the GPUs, name lookups, ports and the server.

Nothing here raises for what it probes: torch and NVML come back as what they could not do,
and a name lookup, a port or the server as an ``Outcome`` that holds the exception, raised
again where a check reads it. The probes that depend on one another are made only where the
check would have made them (a port is tried only when the master is this host, the server
asked only with a usable CURVE key), so nothing is sent that was not sent before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, TypeVar, cast

from ddpwatch.agent.identity import identity_from_env
from ddpwatch.agent.nvml import Nvml
from ddpwatch.core.port_holder import Holder, find_holder
from ddpwatch.core.ports import host_port, resolve_endpoint
from ddpwatch.core.rendezvous import Plan, options_from, plan
from ddpwatch.core.security import (
    CLIENT_KEY_FILE_ENV,
    SERVER_KEY_ENV,
    CurveKeyError,
    client_curve_keys,
    load_key_file,
)
from ddpwatch.status.client import fetch_status
from ddpwatch.status.schema import StatusDocument

TORCHRUN_PORT = 29500  # torchrun's --master-port where it takes its default
TORCHRUN_MASTER = "127.0.0.1"  # torchrun's --master-addr when MASTER_ADDR is unset
NVIDIA_DEVICE = "/dev/nvidiactl"  # present wherever the NVIDIA driver is loaded (or passed in)

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What a probe gave: its value, or the exception it raised. ``get`` raises that exception
    again where a check reads it, so a probe that fails in a way nobody foresaw still becomes
    that check's fail line with the exception's text."""

    value: T | None = None
    error: Exception | None = None

    def get(self) -> T:
        if self.error is not None:
            raise self.error
        return cast(T, self.value)


def attempt(probe: Callable[[], T]) -> Outcome[T]:
    try:
        return Outcome(value=probe())
    except Exception as exc:
        return Outcome(error=exc)


def describe(exc: BaseException) -> str:
    """An exception as a report line shows it."""
    return f"{type(exc).__name__}: {exc}"


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
class NvmlInfo:
    """What NVML answered: the driver and its GPU count, or the step that failed (importing
    nvidia-ml-py, starting NVML, reading it) and the exception's text."""

    driver: str | None = None
    gpus: int = 0
    failed: Literal["import", "init", "read"] | None = None
    error: str = ""


@dataclass(frozen=True)
class Lookup:
    """Where a host name leads: its addresses in resolver order, and whether one of them is
    this host's (only then can a socket bind it)."""

    addresses: tuple[str, ...]
    local: bool


@dataclass(frozen=True)
class PortUse:
    """Whether c10d's TCPStore could listen on a port here: why not (its error text; None:
    free), what holds the port, and the next free one."""

    error: str | None
    holder: Holder | None = None
    spare: int | None = None


@dataclass(frozen=True)
class ServerAnswer:
    """What asking the server found: the resolver's error when its host does not resolve,
    else its status document (None: nothing answered in time)."""

    unresolved: OSError | None = None
    document: StatusDocument | None = None


@dataclass(frozen=True)
class Setup:
    """Everything the checks look at, read once."""

    env: Mapping[str, str]
    hostname: str  # this host's name, for the report's header
    torch: TorchInfo
    nvml: NvmlInfo
    nvidia_device: bool  # the NVIDIA driver's device exists here (a GPU machine)
    gpus: int | None  # GPUs this process sees (torch's count, else NVML's); None: unknown
    nproc: int | None  # ranks per node; None: unknown
    nproc_source: str  # where ``nproc`` came from, or why it is unknown
    backend: str
    backend_source: str
    master_addr: str  # $MASTER_ADDR, stripped; "" when unset
    master: Outcome[Lookup]  # the master's host ($MASTER_ADDR, else torchrun's) looked up
    master_port_raw: str | None  # $MASTER_PORT as set; None when unset
    master_port: int | None  # the port the store takes; None: not a port number, or torchrun's
    # rendezvous picks a free one
    rendezvous: Plan | None  # torchrun's, where it decides the port; None: $MASTER_PORT does
    port_use: Outcome[PortUse] | None  # None: not tried, the master is not this host
    server: str  # the agent's endpoint, tcp://host:port
    server_source: str
    server_explicit: bool  # named by --addr or $DDPWATCH_ADDR: unreachable is a failure
    server_host: str
    server_port: int | None  # None: no port (0 < port < 65535) can be read from ``server``
    curve_env: Mapping[str, str]  # the environment with the --curve-* flags applied
    curve_error: str | None
    answer: Outcome[ServerAnswer] | None  # None: not asked (no port, or no usable CURVE key)
    timeout: float


# torch, NVML and the GPUs ------------------------------------------------------------------------


def probe_torch() -> TorchInfo:
    """Import torch and read its CUDA, device count and backends; never raises, starts nothing
    (no process group, no CUDA context)."""
    try:
        import torch
    except Exception as exc:
        return TorchInfo(error=describe(exc))
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
        return TorchInfo(version=version, error=describe(exc))


def probe_nvml() -> NvmlInfo:
    """Start NVML, read the driver version and the GPU count, shut it down; never raises."""
    try:
        import pynvml
    except Exception as exc:
        return NvmlInfo(failed="import", error=describe(exc))
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return NvmlInfo(failed="init", error=describe(exc))
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception as exc:
        return NvmlInfo(failed="read", error=describe(exc))
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    if isinstance(driver, bytes):
        driver = driver.decode("utf-8", "replace")
    return NvmlInfo(driver=f"{driver}", gpus=count)


def count_gpus(info: TorchInfo, env: Mapping[str, str]) -> int | None:
    """The GPUs a rank started here would see: torch's count, else NVML's (honouring
    ``CUDA_VISIBLE_DEVICES`` as CUDA does), else None."""
    if info.usable:
        return info.gpus
    return Nvml(environ=env).visible_device_count(env.get("CUDA_VISIBLE_DEVICES"))


def this_host() -> str:
    try:
        return socket.gethostname()
    except OSError:
        return "this host"


# the settings ------------------------------------------------------------------------------------


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


def torchrun_picks_free_port() -> bool:
    """Whether this torch's torchrun, on one node without ``--master-port``, lets the OS pick
    the port (a c10d rendezvous on localhost:0, pytorch/pytorch#175699) instead of taking
    29500: its ``--master-port`` then has no default. False without torch."""
    try:
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    except Exception:
        return False
    for action in parser._actions:  # (with $PET_MASTER_PORT set its default is that: no
        if action.dest == "master_port":  # matter, torchrun then takes that port anyway)
            return action.default is None
    return False


def master_port(
    env: Mapping[str, str],
    torchrun: Mapping[str, str | bool] | None = None,
    picks_free_port: Callable[[], bool] = torchrun_picks_free_port,
) -> tuple[str | None, int | None, Plan | None]:
    """($MASTER_PORT as set, the port the store takes, torchrun's plan where it decides).

    A set $MASTER_PORT is what a launch that reads it binds (``mp.spawn``, ``srun``,
    ``init_process_group``'s env://) unless torchrun was given a port or a rendezvous
    (``torchrun``: the options doctor was given, or ``$PET_*``); torchrun itself never reads
    it. Otherwise torchrun's own decision (``core/rendezvous.py``): its default port, or none
    where it picks a free one. The port is None too where $MASTER_PORT is no port number."""
    raw = env.get("MASTER_PORT")
    options = options_from(torchrun or {}, env)
    named = (
        options.standalone
        or options.master_port is not None
        or options.rdzv_endpoint
        or options.rdzv_backend != "static"
    )
    if raw is not None and not named:
        text = raw.strip()
        port = int(text) if text.isascii() and text.isdigit() else None
        return raw, port if port is not None and 0 < port < 65536 else None, None
    torchrun_plan = plan(options, picks_free_port(), TORCHRUN_PORT)
    return raw, torchrun_plan.port, torchrun_plan


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
    return resolve_endpoint(addr, env), source, explicit


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


# names and ports ---------------------------------------------------------------------------------


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to, in resolver order; ``OSError`` when it does not."""
    infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_local(address: str) -> bool:
    """True when ``address`` belongs to this host: only then can a socket bind it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def look_up(host: str) -> Lookup:
    addresses = tuple(resolve(host))
    return Lookup(addresses, any(is_local(a) for a in addresses))


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


def next_free_port(port: int) -> int | None:
    for candidate in range(port + 1, min(port + 100, 65536)):
        if port_in_use(candidate) is None:
            return candidate
    return None


def use_of(port: int) -> PortUse:
    """Whether ``port`` is free here; when not, what holds it and the next free port."""
    error = port_in_use(port)
    if error is None:
        return PortUse(None)
    return PortUse(error, find_holder(port), next_free_port(port))


def try_port(port: int | None, master: Outcome[Lookup]) -> Outcome[PortUse] | None:
    """The master port's use, tried only where the store would listen: on this host."""
    if port is None or master.error is not None or not master.get().local:
        return None
    return attempt(lambda: use_of(port))


def ask_server(host: str, port: int, timeout: float, env: Mapping[str, str]) -> ServerAnswer:
    try:
        resolve(host)
    except OSError as exc:
        return ServerAnswer(unresolved=exc)
    return ServerAnswer(document=fetch_status(host, port, timeout, env))


# all of it ---------------------------------------------------------------------------------------


def gather(
    env: Mapping[str, str],
    *,
    nproc: int | None = None,
    addr: str | None = None,
    backend: str | None = None,
    server_key: str | None = None,
    client_key_file: str | None = None,
    timeout: float = 2.0,
    torchrun: Mapping[str, str | bool] | None = None,
) -> Setup:
    """Read torch, the GPUs, the settings, the master's host and port and the server once, for
    every check."""
    info = probe_torch()
    gpus = count_gpus(info, env)
    per_node, per_node_source = ranks_per_node(nproc, env)
    if backend is None:
        backend, backend_source = default_backend(info, gpus)
    else:
        backend_source = "--backend"
    endpoint, source, explicit = server_endpoint(addr, env)
    curve_env, curve_error = curve_environment(env, server_key, client_key_file)
    nvml = probe_nvml()
    master_addr = env.get("MASTER_ADDR", "").strip()
    master = attempt(lambda: look_up(master_addr or TORCHRUN_MASTER))
    port_raw, port, rendezvous = master_port(env, torchrun)
    port_use = try_port(port, master)
    server_host, server_port = host_port(endpoint)
    if server_port is not None and not 0 < server_port < 65535:
        server_port = None
    answer = None
    if server_port is not None and curve_error is None:
        asked = server_port
        answer = attempt(lambda: ask_server(server_host, asked, timeout, curve_env))
    return Setup(
        env=env,
        hostname=this_host(),
        torch=info,
        nvml=nvml,
        nvidia_device=os.path.exists(NVIDIA_DEVICE),
        gpus=gpus,
        nproc=per_node,
        nproc_source=per_node_source,
        backend=backend,
        backend_source=backend_source,
        master_addr=master_addr,
        master=master,
        master_port_raw=port_raw,
        master_port=port,
        rendezvous=rendezvous,
        port_use=port_use,
        server=endpoint,
        server_source=source,
        server_explicit=explicit,
        server_host=server_host,
        server_port=server_port,
        curve_env=curve_env,
        curve_error=curve_error,
        answer=answer,
        timeout=timeout,
    )
