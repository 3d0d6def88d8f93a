"""Who this rank is, read from the launcher's environment and, later, from torch.distributed.

Runs inside users' training processes, so nothing here raises, imports torch or touches CUDA:
garbage in the environment becomes ``None``. Sources, first present wins (fields are never mixed
across launchers, because their numbers mean different things when launchers are nested):

* ``RANK`` (torchrun, DeepSpeed's launcher, anything that exports torch's variables). torchrun
  under ``srun`` sets both torch and SLURM variables, and only torch's describe the ranks.
* Open MPI ``OMPI_COMM_WORLD_*``, then MPICH/Hydra and Intel MPI ``PMI_RANK``/``MPI_LOCAL*``:
  they beat SLURM because ``mpirun`` inside an allocation starts its daemons with ``srun``, so
  ranks inherit the daemon's ``SLURM_PROCID`` (a node index, not a rank).
* SLURM ``SLURM_PROCID``, only inside a real job step (``srun``): a batch script also carries
  ``SLURM_PROCID=0`` and ``SLURM_NTASKS``, which would describe ranks that do not exist.
* Lightning's own launcher: ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE`` and no ``RANK``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpwatch.core.rendezvous import is_generated_run_id, options_from, parse_torchrun, plan

# Variables each launcher exports; verified against the launchers' sources (torch elastic,
# deepspeed/launcher/launch.py, lightning's _SubprocessScriptLauncher, Open MPI's and Slurm's docs).
TORCH_MARKERS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
DEEPSPEED_MARKERS = ("CROSS_RANK", "CROSS_SIZE")  # set only by deepspeed.launcher.launch
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "LOCAL_RANK")

# Slurm step ids at or above this are the batch script, the extern step, the interactive step.
_SLURM_MAX_NORMAL_STEP_ID = 0xFFFFFFF0
_TASKS_PER_NODE_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


@dataclass
class RankIdentity:
    """Where one rank sits in the job; ``None`` wherever the environment does not say."""

    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    launcher: str | None = None
    job_id: str | None = None
    host: str | None = None
    pid: int | None = None
    cuda_visible_devices: str | None = None
    backend: str | None = None
    torch_version: str | None = None
    pg_timeout_s: float | None = None
    restart_count: int | None = None
    rendezvous: str | None = None
    # what the rendezvous and the build depend on: the server compares them across ranks
    master_addr: str | None = None
    master_port: str | None = None
    init_method: str | None = None
    run_id: str | None = None
    script: str | None = None
    script_hash: str | None = None
    cuda_version: str | None = None
    nccl_version: str | None = None

    def as_fields(self) -> dict[str, Any]:
        """The ``protocol.Identity`` fields this covers, ready for ``Identity(rank=..., **fields)``.

        ``rank`` is left out: it is the message's required header field and may still be
        unknown here, so the caller decides what to send.
        """
        return {
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "node_rank": self.node_rank,
            "host": self.host,
            "pid": self.pid,
            "launcher": self.launcher,
            "job_id": self.job_id,
            "backend": self.backend,
            "torch_version": self.torch_version,
            "cuda_visible_devices": self.cuda_visible_devices,
            "pg_timeout_s": self.pg_timeout_s,
            "restart_count": self.restart_count,
            "rendezvous": self.rendezvous,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "init_method": self.init_method,
            "run_id": self.run_id,
            "script": self.script,
            "script_hash": self.script_hash,
            "cuda_version": self.cuda_version,
            "nccl_version": self.nccl_version,
        }


# parsing helpers ---------------------------------------------------------------------------------


def _int(value: str | None) -> int | None:
    """A non-negative decimal integer, or ``None`` for anything else (never raises)."""
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit() or not text.isascii():
        return None
    return int(text)


def _positive(value: str | None) -> int | None:
    """A size: zero ranks or processes per node is as meaningless as garbage."""
    number = _int(value)
    return number if number else None


def _first(env: Mapping[str, str], *names: str, positive: bool = False) -> int | None:
    """The first of ``names`` that holds a valid number."""
    for name in names:
        number = _positive(env.get(name)) if positive else _int(env.get(name))
        if number is not None:
            return number
    return None


def parse_tasks_per_node(value: str | None) -> list[int] | None:
    """Expand Slurm's compressed ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"`` -> ``[2, 2, 2, 1]``)."""
    if not value:
        return None
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_PER_NODE_ITEM.match(item.strip())
        if match is None:
            return None
        repeat = int(match.group(2)) if match.group(2) else 1
        if repeat > 1_000_000:  # a garbage repeat count must not allocate gigabytes
            return None
        counts.extend([int(match.group(1))] * repeat)
    return counts


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside an ``srun`` step; false in the batch script, salloc's shell or outside Slurm."""
    if "SLURM_PROCID" not in env:
        return False
    step = _int(env.get("SLURM_STEP_ID", env.get("SLURM_STEPID")))
    return step is not None and step < _SLURM_MAX_NORMAL_STEP_ID


def _single_node(world_size: int | None, local_world_size: int | None) -> int | None:
    """Node rank 0 when every rank is local; MPI launchers export no node index otherwise."""
    if world_size is not None and world_size == local_world_size:
        return 0
    return None


# per-launcher readers ----------------------------------------------------------------------------


def _from_torch_vars(env: Mapping[str, str], ident: RankIdentity) -> None:
    ident.rank = _int(env.get("RANK"))
    ident.local_rank = _int(env.get("LOCAL_RANK"))
    ident.world_size = _first(env, "WORLD_SIZE", positive=True)
    # LOCAL_SIZE is DeepSpeed's name; CROSS_RANK its node index.
    ident.local_world_size = _first(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", positive=True)
    ident.node_rank = _first(env, "GROUP_RANK", "CROSS_RANK", "NODE_RANK")
    if any(name in env for name in DEEPSPEED_MARKERS):
        ident.launcher = "deepspeed"
    elif any(name.startswith("ACCELERATE_") for name in env):
        ident.launcher = "accelerate"  # accelerate launch runs torch elastic with its settings
    elif any(name in env for name in TORCH_MARKERS):
        ident.launcher = "torchrun"
        ident.rendezvous = torchrun_rendezvous(env)
    else:
        # RANK copied by hand (or by DeepSpeed's MPI discovery) from the real launcher's variables.
        ident.launcher = _launcher_below(env)


def _launcher_below(env: Mapping[str, str]) -> str | None:
    if "OMPI_COMM_WORLD_RANK" in env:
        return "openmpi"
    if "PMI_RANK" in env:
        return _pmi_launcher(env)
    if _in_slurm_step(env):
        return "slurm"
    return None


def _pmi_launcher(env: Mapping[str, str]) -> str:
    # srun's own PMI plugins may export PMI_RANK too; MPI_LOCALRANKID is Hydra's.
    if _in_slurm_step(env) and "MPI_LOCALRANKID" not in env:
        return "slurm"
    return "mpich"


def _from_openmpi(env: Mapping[str, str], ident: RankIdentity) -> None:
    ident.launcher = "openmpi"
    ident.rank = _int(env.get("OMPI_COMM_WORLD_RANK"))
    ident.world_size = _positive(env.get("OMPI_COMM_WORLD_SIZE"))
    ident.local_rank = _int(env.get("OMPI_COMM_WORLD_LOCAL_RANK"))
    ident.local_world_size = _positive(env.get("OMPI_COMM_WORLD_LOCAL_SIZE"))
    # OMPI_COMM_WORLD_NODE_RANK is this process's rank on its node across all jobs, not the
    # node's index, so it is not used here.
    ident.node_rank = _single_node(ident.world_size, ident.local_world_size)


def _from_pmi(env: Mapping[str, str], ident: RankIdentity) -> None:
    ident.launcher = _pmi_launcher(env)
    ident.rank = _int(env.get("PMI_RANK"))
    ident.world_size = _positive(env.get("PMI_SIZE"))
    ident.local_rank = _int(env.get("MPI_LOCALRANKID"))
    ident.local_world_size = _positive(env.get("MPI_LOCALNRANKS"))
    if ident.launcher == "slurm":
        _fill_from_slurm(env, ident, only_missing=True)
    else:
        ident.node_rank = _single_node(ident.world_size, ident.local_world_size)


def _from_slurm(env: Mapping[str, str], ident: RankIdentity) -> None:
    ident.launcher = "slurm"
    _fill_from_slurm(env, ident, only_missing=False)


def _fill_from_slurm(env: Mapping[str, str], ident: RankIdentity, only_missing: bool) -> None:
    node_id = _int(env.get("SLURM_NODEID"))
    per_node = parse_tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    )
    local_size = None
    if per_node is not None and node_id is not None and node_id < len(per_node):
        local_size = per_node[node_id] or None
    if local_size is None:
        local_size = _positive(env.get("SLURM_NTASKS_PER_NODE"))
    values = {
        "rank": _int(env.get("SLURM_PROCID")),
        "local_rank": _int(env.get("SLURM_LOCALID")),
        # inside a step SLURM_NTASKS is the step's count unless srun ran with --preserve-env
        "world_size": _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", positive=True),
        "local_world_size": local_size,
        "node_rank": node_id,
    }
    for name, value in values.items():
        if not only_missing or getattr(ident, name) is None:
            setattr(ident, name, value)


def _from_lightning(env: Mapping[str, str], ident: RankIdentity) -> None:
    ident.local_rank = _int(env.get("LOCAL_RANK"))
    ident.world_size = _positive(env.get("WORLD_SIZE"))
    ident.node_rank = _first(env, "NODE_RANK", "GROUP_RANK")
    if "NODE_RANK" in env or "WORLD_SIZE" in env:
        ident.launcher = "lightning"
    # Lightning exports no global rank; on node 0 it equals the local rank. Elsewhere it needs
    # the processes per node, which only the process group knows (see refresh_from_torch).
    if ident.node_rank == 0 and ident.local_rank is not None:
        ident.rank = ident.local_rank


def torchrun_rendezvous(env: Mapping[str, str], argv: Sequence[str] | None = None) -> str | None:
    """How this rank's torchrun found its peers (``core/rendezvous.py``), from torchrun's
    command line (``argv``, else the parent's, from /proc) and ``$PET_*``: on one node without
    ``--master-port``, a run id torchrun made (a uuid) says it picked a free port (torch 2.13);
    ``"none"``, its default, that it took the static 29500. None where it cannot be read."""
    try:
        values = parse_torchrun(_parent_argv() if argv is None else argv)
        if values is None:
            return None
        generated = is_generated_run_id(env.get("TORCHELASTIC_RUN_ID"))
        return str(plan(options_from(values, env), picks_free_port=generated).kind)
    except Exception:
        return None


def _parent_argv() -> list[str]:
    """The parent process's command line ([] where /proc cannot tell)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _job_id(env: Mapping[str, str]) -> str | None:
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "TORCHELASTIC_RUN_ID"):
        value = env.get(name, "").strip()
        if value and value != "none":  # torchrun's default --rdzv-id is the string "none"
            return value
    return None


def _torch_version() -> str | None:
    """torch's version without importing torch (seconds, and not ours to import)."""
    try:
        torch = sys.modules.get("torch")
        if torch is not None:
            version = getattr(torch, "__version__", None)
            return str(version) if version is not None else None
        from importlib import metadata

        return metadata.version("torch")
    except Exception:
        return None


SCRIPT_HASH_MAX_BYTES = 8 << 20  # a script larger than this is hashed on its first 8 MiB


@functools.lru_cache(maxsize=4)
def script_of(argv0: str) -> tuple[str | None, str | None]:
    """(absolute path, first 16 hex digits of its SHA-256) of the script ``argv0`` names, or
    Nones where it is no file (``python -c``, an interactive session); once per process."""
    try:
        path = os.path.abspath(argv0)
        if not argv0 or not os.path.isfile(path):
            return None, None
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read(SCRIPT_HASH_MAX_BYTES)).hexdigest()[:16]
        return path, digest
    except Exception:
        return None, None


def _script(ident: RankIdentity) -> None:
    argv = getattr(sys, "argv", None)
    if argv and isinstance(argv[0], str):
        ident.script, ident.script_hash = script_of(argv[0])


def read_rendezvous_env(env: Mapping[str, str], ident: RankIdentity) -> None:
    """$MASTER_ADDR and $MASTER_PORT as the rank sees them now (a script may set them itself
    before ``init_process_group``), and torchrun's run id; never raises."""
    try:
        ident.master_addr = env.get("MASTER_ADDR") or ident.master_addr
        ident.master_port = env.get("MASTER_PORT") or ident.master_port
        ident.run_id = env.get("TORCHELASTIC_RUN_ID") or ident.run_id
    except Exception:
        pass


def init_method_of(arguments: Mapping[str, Any]) -> str:
    """How ``init_process_group`` called with ``arguments`` finds its peers: its
    ``init_method`` (a URL, its per-rank query string cut), "store" for a store passed in,
    else torch's default "env://" ($MASTER_ADDR:$MASTER_PORT)."""
    method = arguments.get("init_method")
    if isinstance(method, str) and method:
        return method.split("?", 1)[0]  # tcp://host:port?rank=…&world_size=…: per rank
    return "store" if arguments.get("store") is not None else "env://"


def _host() -> str | None:
    try:
        return socket.gethostname() or None
    except Exception:
        return None


# public API --------------------------------------------------------------------------------------


def identity_from_env(
    environ: Mapping[str, str] | None = None, *, torch_version: bool = True
) -> RankIdentity:
    """Read the launcher's variables (``os.environ`` by default); never raises.
    ``torch_version=False`` skips torch's package metadata (the early hello's: tens of ms)."""
    version = _torch_version() if torch_version else None
    ident = RankIdentity(pid=os.getpid(), host=_host(), torch_version=version)
    env = os.environ if environ is None else environ
    _from_env(env, ident)
    read_rendezvous_env(env, ident)
    _script(ident)
    return ident


def rank_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The global rank the launcher's variables give, read the way ``identity_from_env`` does
    but without the host name and torch's package metadata (tens of milliseconds): the boot
    hook asks at interpreter start, before every rank's imports."""
    ident = RankIdentity()
    _from_env(os.environ if environ is None else environ, ident)
    return ident.rank


def _from_env(env: Mapping[str, str], ident: RankIdentity) -> None:
    """Fill ``ident`` from the first launcher whose variables are there; never raises."""
    try:
        ident.cuda_visible_devices = env.get("CUDA_VISIBLE_DEVICES")
        ident.job_id = _job_id(env)
        ident.restart_count = _int(env.get("TORCHELASTIC_RESTART_COUNT"))
        if "RANK" in env:
            _from_torch_vars(env, ident)
        elif "OMPI_COMM_WORLD_RANK" in env:
            _from_openmpi(env, ident)
        elif "PMI_RANK" in env:
            _from_pmi(env, ident)
        elif _in_slurm_step(env):
            _from_slurm(env, ident)
        elif "LOCAL_RANK" in env:
            _from_lightning(env, ident)
    except Exception:
        pass


def is_rank_process(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher started this process as a distributed rank.

    The environment cannot tell a rank from its DataLoader workers (they inherit it), so the
    caller still checks for those; a Slurm batch script is not a rank (no ``srun`` step).
    """
    try:
        env = os.environ if environ is None else environ
        return any(name in env for name in RANK_VARIABLES) or _in_slurm_step(env)
    except Exception:
        return False


def refresh_from_torch(ident: RankIdentity) -> RankIdentity:
    """Take rank, world size and backend from an initialised default process group.

    Returns a new identity (the old one if torch.distributed is not imported or not
    initialised). The three getters read cached state: no collective, no CUDA.
    """
    try:
        torch = sys.modules.get("torch")
        if torch is None:
            return ident
        dist = getattr(torch, "distributed", None)
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return ident
        changes: dict[str, Any] = {}
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        if isinstance(rank, int) and rank >= 0:
            changes["rank"] = rank
        if isinstance(world_size, int) and world_size > 0:
            changes["world_size"] = world_size
        try:
            backend = dist.get_backend()
            changes["backend"] = str(backend) if backend is not None else None
        except Exception:
            pass
        version = getattr(torch, "__version__", None)
        if version is not None:
            changes["torch_version"] = str(version)
        changes.update(_build_versions(torch, changes.get("backend")))
        changes["pg_timeout_s"] = _default_group_timeout(torch, dist)
        return dataclasses.replace(ident, **changes)
    except Exception:
        return ident


def _build_versions(torch: Any, backend: str | None) -> dict[str, str]:
    """CUDA's version torch was built with, and NCCL's for an nccl group (a library constant:
    no CUDA call); ranks whose builds differ may hang or fail in their first collective."""
    found: dict[str, str] = {}
    try:
        cuda = getattr(getattr(torch, "version", None), "cuda", None)
        if cuda:
            found["cuda_version"] = str(cuda)
        if backend and "nccl" in backend:
            version = torch.cuda.nccl.version()
            if isinstance(version, tuple):
                found["nccl_version"] = ".".join(str(part) for part in version)
            elif version:
                found["nccl_version"] = str(version)
    except Exception:
        pass
    return found


def _default_group_timeout(torch: Any, dist: Any) -> float | None:
    """Seconds a collective of the default group may wait before the group times out.

    Read from the backend's options (a private attribute, hence every guard): with it
    the server can say how long the ranks waiting on a straggler have left.
    """
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        backend = dist.group.WORLD._get_backend(device)
        return float(backend.options._timeout.total_seconds())
    except Exception:
        return None
