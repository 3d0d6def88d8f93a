"""Known error signatures of distributed PyTorch: what an error text means and what to do.

The patterns match the texts torch, NCCL and gloo really print (checked against
torch 2.13's binaries, against failures reproduced with tests/scripts/error_texts.py and
against reports of real failures). Order matters: the first match wins. Local failures
whose text may quote a peer-failure text (a DataLoader worker's death is reported with
the "Connection reset by peer" of its queue) come first; then the peer-failure texts —
when one rank dies, every peer blocked with it prints one of them, and diagnosis must
treat those as consequences, never as the cause; then timeouts; then root causes, the
specific ones before the generic NCCL error.

Error texts also name ranks: the rank they blame ("Ranks 1, 2 failed to pass
monitoredBarrier") and the rank that reports ("[Rank 0]: ..."). ``named_ranks`` and
``reporting_rank`` keep the two apart; ``clients_joined`` reads how many ranks reached
the rendezvous.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ddpwatch.core.protocol import ErrorInfo
from ddpwatch.core.vocabulary import AlertKind


@dataclass(frozen=True)
class Signature:
    """One known error: how to recognise it, why it happens, and how to fix it."""

    name: str
    pattern: re.Pattern[str]
    cause: str
    hint: str
    peer_failure: bool = False
    kind: str | None = None  # the alert kind this error implies, if any
    family: str = ""  # the broad cause ("data_loading", "rendezvous"...), one of FAMILIES


FAMILIES = (
    "peer_failure",  # a consequence of another rank's failure
    "timeout",  # waited for other ranks longer than allowed
    "collective_mismatch",  # ranks made different collective calls
    "rendezvous",  # the ranks could not find or reach each other at startup
    "device_setup",  # the wrong GPU, a shared GPU or none
    "gpu_memory",
    "cuda_kernel",  # a kernel failed on the GPU
    "ddp_model",  # the model does not fit DistributedDataParallel's rules
    "process_group",  # torch.distributed used in the wrong order
    "nccl",  # NCCL itself or the network under it failed
    "data_loading",  # a DataLoader worker died or stalled
)


def _sig(
    name: str,
    regex: str,
    cause: str,
    hint: str,
    *,
    family: str,
    peer_failure: bool = False,
    kind: str | None = None,
) -> Signature:
    pattern = re.compile(regex, re.IGNORECASE)
    return Signature(name, pattern, cause, hint, peer_failure, kind, family)


_DATA_HINT = (
    "look for 'Out of memory: Killed process' in the host's kernel log (dmesg) and give the "
    "job more RAM or fewer workers (num_workers, prefetch_factor, a smaller batch); in a "
    "container raise /dev/shm (docker --shm-size or --ipc=host); rerun with num_workers=0 "
    "to see the dataset's own error if the worker crashed"
)

DATALOADER_WORKER_DIED = _sig(
    "dataloader_worker_died",
    r"DataLoader worker \(pid(?:\(s\))? [\d, ]+\) "
    r"(?:exited unexpectedly|is killed by signal)",
    "data loading: a DataLoader worker died (often the OOM killer or /dev/shm too small "
    "in a container)",
    _DATA_HINT,
    family="data_loading",
)

LOCAL_FIRST = (
    _sig(
        "dataloader_shm",
        r"DataLoader worker \(pid[^)]*\) is killed by signal: Bus error"
        r"|Unexpected bus error encountered in worker[^\n]*shared memory",
        "data loading: a DataLoader worker died of a bus error: /dev/shm is too small for "
        "the batches the workers hand over (typical in containers)",
        "give the container more shared memory (docker --shm-size=8g or --ipc=host, "
        "Kubernetes: an emptyDir with medium Memory on /dev/shm) or lower num_workers",
        family="data_loading",
    ),
    DATALOADER_WORKER_DIED,
    _sig(
        "dataloader_timeout",
        r"DataLoader timed out after \d+ seconds",
        "data loading: no DataLoader worker delivered a batch within DataLoader(timeout=...): "
        "slow storage or network, or a worker hung in the dataset code",
        "find where the workers wait (py-spy dump --pid of a worker), check the storage, or "
        "raise DataLoader's timeout for legitimately slow batches",
        family="data_loading",
    ),
    _sig(
        "gloo_connect",
        r"connectFullMesh failed[^\n]*(?:timed out connecting|Connection refused)",
        "the ranks could not open their gloo connections to each other in "
        "init_process_group: a peer refused or never answered (it had died or left before "
        "connecting, as after a restart, or a firewall or the wrong network interface blocks "
        "it)",
        "check that every rank of this attempt started and reached init_process_group; right "
        "after torchrun restarted the workers (--max-restarts), the new attempt can read the "
        "address a stopped rank of the last one left in the store torchrun keeps across "
        "attempts (torch 2.13, with and without ddpwatch): give "
        "init_process_group a store per attempt, store=dist.PrefixStore(f'attempt_{"
        "TORCHELASTIC_RESTART_COUNT}', store); on several hosts set GLOO_SOCKET_IFNAME to the "
        "interface they share and open the ports between them",
        family="rendezvous",
    ),
)

_PEER_HINT = (
    "this rank only noticed that another one failed: look for the rank that failed first "
    "(the other alerts name it; torchrun prints it as 'Root Cause (first observed failure)')"
)

PEER_FAILURES = (
    _sig(
        "nccl_remote_error",
        r"remote process exited or there was a network error|ncclRemoteError",
        "NCCL lost a peer: a remote rank exited early or the network between them failed",
        _PEER_HINT + "; if no rank failed, check the network (NCCL_DEBUG=INFO, InfiniBand links)",
        family="peer_failure",
        peer_failure=True,
    ),
    _sig(
        "nccl_aborted",
        r"NCCL communicator was aborted|ProcessGroupNCCL[^\n]*\baborted",
        "the NCCL communicator was aborted because another rank failed",
        _PEER_HINT,
        family="peer_failure",
        peer_failure=True,
    ),
    _sig(
        "monitored_barrier_peer",
        r"successfully reached monitoredBarrier, but received errors",
        "this rank reached the monitored barrier, but rank 0 (which checks the others) failed "
        "or gave up on another rank",
        _PEER_HINT + "; rank 0's error names the rank that did not arrive",
        family="peer_failure",
        peer_failure=True,
    ),
    _sig(
        "store_closed",
        r"Failed to (?:recv|send), (?:got|sent) 0 bytes",
        "the rendezvous store went away: the rank hosting it (usually rank 0) exited or crashed",
        _PEER_HINT,
        family="peer_failure",
        peer_failure=True,
    ),
    _sig(
        "gloo_broken_pipe",
        r"(?:gloo|pair\.cc|Write error|Read error)[^\n]*Broken pipe"
        r"|Broken pipe[^\n]*(?:gloo|pair\.cc)",
        "gloo wrote to a rank that had already gone away",
        _PEER_HINT,
        family="peer_failure",
        peer_failure=True,
    ),
    _sig(
        "connection_closed",
        r"Connection closed by (?:remote )?peer|Remote peer closed the connection",
        "another rank closed its connection: it crashed, was killed or exited early",
        _PEER_HINT,
        family="peer_failure",
        peer_failure=True,
    ),
    _sig(
        "connection_reset",
        r"Connection reset by peer|ECONNRESET",
        "another rank's connection was reset: it crashed, was killed or the network dropped",
        _PEER_HINT,
        family="peer_failure",
        peer_failure=True,
    ),
)

TIMEOUTS = (
    _sig(
        "monitored_barrier",
        r"failed to pass monitoredBarrier|timed out in monitoredBarrier",
        "the named rank did not reach the monitored barrier in time: it is slow, hung or dead",
        "look at what the named rank was doing (its stack) when the others reached the barrier",
        family="timeout",
    ),
    _sig(
        "nccl_timeout",
        r"Watchdog caught collective operation timeout|Timeout at NCCL work"
        r"|ProcessGroupNCCL[^\n]*timed out",
        "an NCCL collective did not finish within the process-group timeout: "
        "another rank never joined it (hung, slow or calling a different collective)",
        "find the rank that did not reach the collective (ddpwatch names it as a straggler "
        "before the timeout); TORCH_NCCL_TRACE_BUFFER_SIZE and the flight recorder show "
        "each rank's last collective; raise the timeout in init_process_group only for "
        "legitimately slow steps",
        family="timeout",
    ),
    _sig(
        "gloo_timeout",
        r"Timed out waiting \d+ ?ms for (?:recv|send) operation|gloo[^\n]*timed out",
        "a gloo collective waited longer than the process-group timeout: "
        "another rank never joined it (hung, slow or calling a different collective)",
        "find the rank that did not reach the collective (ddpwatch names it as a straggler "
        "before the timeout); TORCH_DISTRIBUTED_DEBUG=DETAIL turns a different collective "
        "into an immediate error; raise timeout= in init_process_group only for slow steps",
        family="timeout",
    ),
    _sig(
        "store_wait_timeout",
        r"wait timeout after \d+ ?ms, keys:",
        "this rank waited in the rendezvous store for a key another rank never wrote (its "
        "address, in init_process_group or new_group): that rank did not start, crashed, or "
        "is stuck before the same call",
        "find the rank that never reached init_process_group/new_group (ddpwatch lists the "
        "ranks that never connected); every rank must create the same groups in the same order",
        family="timeout",
    ),
)

_SET_DEVICE = (
    "call torch.cuda.set_device(local_rank) with local_rank = int(os.environ['LOCAL_RANK']) "
    "before init_process_group"
)

_MISMATCH_HINT = (
    "make every rank call the same collectives in the same order with the same shapes: "
    "look for a dist.* call under `if rank == 0` (metrics, logging) or a data-dependent "
    "shape (pad it, or all_gather the sizes first); TORCH_DISTRIBUTED_DEBUG=DETAIL names "
    "the mismatching call"
)

ROOT_CAUSES = (
    _sig(
        "invalid_device_ordinal",
        r"invalid device ordinal",
        "the global rank was used as a CUDA device index; on a host with fewer GPUs than "
        "the world size that index does not exist",
        "use torch.cuda.set_device(local_rank) with LOCAL_RANK, not the global rank "
        "(torch.device(f'cuda:{local_rank}'))",
        family="device_setup",
        kind=AlertKind.DEVICE_ORDINAL,
    ),
    _sig(
        "duplicate_gpu",
        r"Duplicate GPU detected",
        "two ranks use the same GPU; NCCL needs one GPU per rank",
        _SET_DEVICE + ", and check CUDA_VISIBLE_DEVICES (one GPU per rank, not the same one)",
        family="device_setup",
        kind=AlertKind.DUPLICATE_DEVICE,
    ),
    _sig(
        "address_in_use",
        r"Address already in use|EADDRINUSE|errno: 98\b",
        "MASTER_PORT is already taken by another job or by a leftover process of an earlier run",
        "pick another MASTER_PORT (torchrun --master-port or --rdzv-endpoint host:port), "
        "or find and kill the old job (ss -ltnp | grep PORT)",
        family="rendezvous",
    ),
    _sig(
        "cuda_oom",
        r"CUDA out of memory|OutOfMemoryError",
        "the GPU ran out of memory on this rank",
        "lower the per-rank batch size, use mixed precision or activation checkpointing; "
        "check with nvidia-smi that no other process holds memory on this GPU and that "
        "every rank uses its own GPU (set_device(local_rank))",
        family="gpu_memory",
    ),
    _sig(
        "collective_mismatch",
        r"Detected mismatch between collectives|is running inconsistent collective"
        r"|Mismatched collective detected"
        r"|Received data size doesn't match expected size|distributed collective mismatch",
        "the ranks called different collectives, or the same one with different tensor sizes",
        _MISMATCH_HINT,
        family="collective_mismatch",
        kind=AlertKind.COLLECTIVE_MISMATCH,
    ),
    _sig(
        "collective_size_mismatch",
        r"invalid tensor size at index \d+"
        r"|output tensor size must be equal to world_size times input tensor size"
        r"|input tensor must be the same size as output size times world size",
        "this rank's tensors for a collective do not fit together: its input has another "
        "size than the outputs it allocated for every rank's part, usually because its data "
        "gave it another size than the other ranks",
        _MISMATCH_HINT,
        family="collective_mismatch",
        kind=AlertKind.COLLECTIVE_MISMATCH,
    ),
    _sig(
        "nccl_net_size_mismatch",
        r"collective mismatch error,? local size \d+ remote(?: size)? \d+",
        "NCCL's network transport received more data than the receiving rank posted: the "
        "ranks called different collectives or sizes, or (if the code is the same on every "
        "rank) the InfiniBand setup corrupts transfers",
        _MISMATCH_HINT + "; if every rank makes the same calls, retry with NCCL_IB_DISABLE=1 "
        "to rule out the InfiniBand setup (PCI relaxed ordering, GPUDirect RDMA)",
        family="collective_mismatch",
        kind=AlertKind.COLLECTIVE_MISMATCH,
    ),
    _sig(
        "ddp_unused_parameters",
        r"Expected to have finished reduction in the prior iteration",
        "some model parameters did not take part in computing the loss, so DDP waited for "
        "their gradients forever",
        "make every parameter take part in the loss, or pass find_unused_parameters=True "
        "to DistributedDataParallel (slower); TORCH_DISTRIBUTED_DEBUG=INFO names them",
        family="ddp_model",
    ),
    _sig(
        "ddp_ready_twice",
        r"Expected to mark a variable ready only once",
        "a parameter's gradient was produced twice in one step, typically by reentrant "
        "activation checkpointing or a module used twice under DDP",
        "use torch.utils.checkpoint with use_reentrant=False, or set static_graph=True "
        "on DistributedDataParallel",
        family="ddp_model",
    ),
    _sig(
        "ddp_model_mismatch",
        r"DDP expects same model across all ranks",
        "the ranks built different models (different parameter counts or shapes)",
        "build the model identically on every rank: no rank-dependent layers or config",
        family="ddp_model",
    ),
    _sig(
        "store_clients_timeout",
        r"waiting for (?:clients|workers)\. \d+/\d+ (?:clients|workers) joined"
        r"|Timed out initializing process group in store based barrier",
        "the rendezvous host waited for the other ranks and not all of them came",
        "check that every rank was started (nnodes x nproc_per_node = WORLD_SIZE), that "
        "none crashed before init_process_group, and that they can reach MASTER_ADDR:MASTER_PORT; "
        "more ranks than expected means another job uses the same MASTER_PORT",
        family="rendezvous",
    ),
    _sig(
        "rendezvous_timeout",
        r"RendezvousTimeoutError",
        "torchrun's rendezvous timed out: not all nodes joined it in time (a node was not "
        "started, or cannot reach the rendezvous endpoint)",
        "start the launcher on every node (--nnodes must match) with the same --rdzv-endpoint "
        "and --rdzv-id; check that each node reaches that host:port",
        family="rendezvous",
    ),
    _sig(
        "rendezvous",
        r"RendezvousConnectionError|Connection refused|ECONNREFUSED"
        r"|DistNetworkError|failed to connect|The client socket has timed out",
        "this rank could not reach the rendezvous at MASTER_ADDR:MASTER_PORT: rank 0 has not "
        "started, the address or port is wrong, or a firewall blocks it",
        "check MASTER_ADDR and MASTER_PORT (--rdzv-endpoint) on every node, that rank 0 runs, "
        "and that the port is open between the hosts",
        family="rendezvous",
    ),
    _sig(
        "no_cuda_gpus",
        r"No CUDA GPUs are available|CUDA driver initialization failed|found no NVIDIA driver",
        "this process sees no GPU: CUDA_VISIBLE_DEVICES is empty or wrong, or no driver",
        "check CUDA_VISIBLE_DEVICES and nvidia-smi on that host (in containers: --gpus all)",
        family="device_setup",
    ),
    _sig(
        "nccl_cpu_tensor",
        r"Tensors must be CUDA and dense|No backend type associated with device type cpu",
        "a CPU tensor was passed to an NCCL collective",
        "move the tensor to this rank's GPU (tensor.cuda()) or use a gloo process group",
        family="device_setup",
    ),
    _sig(
        "device_side_assert",
        r"device-side assert triggered",
        "a CUDA kernel assertion failed, usually an index out of range "
        "(a label >= the number of classes, a token id >= the vocabulary size)",
        "rerun with CUDA_LAUNCH_BLOCKING=1, or on CPU, to get the failing line",
        family="cuda_kernel",
    ),
    _sig(
        "illegal_memory_access",
        r"an illegal memory access was encountered",
        "a CUDA kernel read or wrote outside its memory",
        "rerun with CUDA_LAUNCH_BLOCKING=1 to find the kernel; check custom kernels and "
        "tensors used on the wrong device",
        family="cuda_kernel",
    ),
    _sig(
        "pg_not_initialized",
        r"Default process group has not been initialized",
        "a torch.distributed call ran before init_process_group or after destroy_process_group",
        "call dist.init_process_group(...) first on every rank",
        family="process_group",
    ),
    _sig(
        "nccl_system_error",
        r"unhandled system error|ncclSystemError",
        "NCCL hit an operating-system or network failure: often a too small /dev/shm in a "
        "container, the wrong network interface, or InfiniBand trouble",
        "rerun with NCCL_DEBUG=INFO; in Docker use --ipc=host or a larger --shm-size; set "
        "NCCL_SOCKET_IFNAME to the interface the hosts share",
        family="nccl",
    ),
    _sig(
        "nccl_error",
        r"NCCL error|ncclInternalError|ncclInvalidUsage|ncclUnhandledCudaError"
        r"|ncclInvalidArgument",
        "NCCL reported an error",
        "rerun with NCCL_DEBUG=INFO to see the failing call; check that the driver, CUDA and "
        "NCCL versions match on every host",
        family="nccl",
    ),
)

SIGNATURES: tuple[Signature, ...] = LOCAL_FIRST + PEER_FAILURES + TIMEOUTS + ROOT_CAUSES
TIMEOUT_NAMES = frozenset(sig.name for sig in TIMEOUTS)
WAIT_NAMES = TIMEOUT_NAMES | {"store_clients_timeout"}
"""Errors that only say a rank waited too long for others (the store host's "2/3 clients
joined" too): never a cause while a rank that failed, or one that never came, is in view."""


@lru_cache(maxsize=1 << 14)
def explain(text: str) -> Signature | None:
    """The first known signature in ``text`` ("type: message\\ntraceback"), if any.

    Cached: diagnosis asks about the same few errors several times a second.
    """
    for signature in SIGNATURES:
        if signature.pattern.search(text):
            return signature
    return None


# The main process reads a DataLoader worker's batches through a socket; when the worker is
# killed mid-batch, that read can fail with a bare ConnectionResetError before DataLoader's
# own check names the worker (seen here in 2 of 6 runs of error_texts.py dataloader_killed).
_DATALOADER_READ = re.compile(r"in _try_get_data\n")


@lru_cache(maxsize=1 << 14)
def _explain_parts(type_: str, message: str, traceback: str) -> Signature | None:
    found = explain(f"{type_}: {message}")
    if found is None:
        return explain(traceback) if traceback else None
    if found.peer_failure and _DATALOADER_READ.search(traceback):
        return DATALOADER_WORKER_DIED
    return found


def explain_error(error: ErrorInfo) -> Signature | None:
    """Like ``explain``, but the exception's own message wins over text in its traceback.

    A traceback quotes source lines and chained exceptions; those should only decide
    when the message itself is unknown, or when they show that a "peer" that reset the
    connection was this rank's own DataLoader worker.
    """
    return _explain_parts(error.type, error.message, error.traceback)


# --------------------------------------------------------------------------- ranks in texts

_BLAMED = tuple(
    re.compile(regex, re.IGNORECASE)
    for regex in (
        # DDP, on the rank whose parameters got no gradient (INFO adds the names)
        r"did not receive grad for rank (\d+)",
        # monitored_barrier on rank 0: "Rank 1 failed..." or, wait_all_ranks, "Ranks 1, 2 failed"
        r"Ranks? (\d+(?:, \d+)*) (?:failed to pass|timed out in) monitoredBarrier",
        # TORCH_DISTRIBUTED_DEBUG=DETAIL: "Rank <self> is running collective: A, but Rank <other>
        # is running collective: B"; before torch 2.0 "Rank <other> is running inconsistent ..."
        r"but Rank (\d+) is running collective",
        r"Rank (\d+) is running inconsistent collective",
        # DDP's model check: "but Rank <self> has 2 params, while rank <other> has inconsistent"
        r"while rank (\d+) has inconsistent",
        # NCCL: both ranks share the GPU
        r"Duplicate GPU detected : rank (\d+) and rank (\d+)",
        r"Mismatched collective detected, please check your collective calls at and around "
        r"rank (\d+)",
    )
)

_REPORTING = tuple(
    re.compile(regex, re.IGNORECASE)
    for regex in (
        r"\[(?:PG ID \d+ PG GUID [^\]]*? )?Rank (\d+)\]",  # "[Rank 0]: ...", NCCL's watchdog
        r"(?<!but )Rank (\d+) is running collective",  # DETAIL: the first rank named is its own
        r"DDP expects same model across all ranks, but Rank (\d+) has",
        r"Rank (\d+) successfully reached monitoredBarrier",
        r"store based barrier on rank: (\d+)",
        r"NCCL communicator was aborted on rank (\d+)",
    )
)

_JOINED = (
    # TCPStore's host (torch >= 2.2; "workers" before): (joined, expected)
    (re.compile(r"waiting for (?:clients|workers)\. (\d+)/(\d+) (?:clients|workers) joined"), 1, 2),
    # torch < 2.0's store-based barrier: (world_size=expected, worker_count=joined)
    (re.compile(r"\(world_size=(\d+), worker_count=(\d+)"), 2, 1),
)


def _parts(error: ErrorInfo) -> tuple[str, str]:
    return f"{error.type}: {error.message}", error.traceback


@lru_cache(maxsize=1 << 12)
def _blamed_in(text: str) -> tuple[int, ...]:
    found: set[int] = set()
    for pattern in _BLAMED:
        for match in pattern.finditer(text):
            for group in match.groups():
                found.update(int(rank) for rank in group.split(","))
    return tuple(sorted(found))


def named_ranks(error: ErrorInfo) -> tuple[int, ...]:
    """The ranks the error text itself blames, sorted; empty when it names none.

    The rank that reports (``reporting_rank``) is left out unless the text blames it too
    (DDP names the rank whose parameters got no gradient, and that rank raises it).
    The message decides; the traceback only when the message names no rank.
    """
    head, traceback = _parts(error)
    return _blamed_in(head) or (_blamed_in(traceback) if traceback else ())


@lru_cache(maxsize=1 << 12)
def _reporter_in(text: str) -> int | None:
    for pattern in _REPORTING:
        match = pattern.search(text)
        if match:
            return int(match.group(1))
    return None


def reporting_rank(error: ErrorInfo) -> int | None:
    """The rank that says it raised the error ("[Rank 0]: ...", "Rank 2 is running
    collective: ..."), if the text says so; not a rank to blame."""
    for text in (error.message, error.traceback):
        found = _reporter_in(text) if text else None
        if found is not None:
            return found
    return None


def clients_joined(error: ErrorInfo) -> tuple[int, int] | None:
    """(joined, expected) from a rendezvous that gave up waiting for ranks, e.g. "2/3
    clients joined" gives (2, 3); None for any other error. Joined can exceed expected
    when two jobs share a MASTER_PORT."""
    for text in _parts(error):
        for pattern, joined, expected in _JOINED:
            match = pattern.search(text)
            if match:
                return int(match.group(joined)), int(match.group(expected))
    return None


_RENDEZVOUS_IN_USE = {
    "static": "a static rendezvous (--master-addr/--master-port)",
    "standalone": "a c10d rendezvous on a free port of one node (--standalone, or torchrun's "
    "default on one node)",
    "c10d": "a c10d rendezvous (--rdzv-endpoint)",
}
_STORE_KEPT = "the store torchrun keeps across attempts"
_SEVERAL_HOSTS = "; on several hosts set GLOO_SOCKET_IFNAME"


def fitted_hint(signature: Signature, rendezvous: str | None) -> str:
    """A rendezvous signature's fix, naming the rendezvous the rank's torchrun used (the
    identity's ``rendezvous``; ``core/rendezvous.py``): its store, and no advice about other
    hosts for a job on one node. Other signatures, or an unknown rendezvous: as written."""
    hint = signature.hint
    if signature.family != "rendezvous" or _STORE_KEPT not in hint:
        return hint
    named = _RENDEZVOUS_IN_USE.get(rendezvous or "")
    if named is None:
        return hint
    hint = hint.replace(_STORE_KEPT, f"the store of {named}, kept across attempts")
    if rendezvous == "standalone":
        hint = hint.split(_SEVERAL_HOSTS, 1)[0]  # one node: no interface between hosts
    return hint

