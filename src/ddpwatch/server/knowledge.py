"""Known error signatures of distributed PyTorch: what an error text means and what to do.

The patterns match the texts torch, NCCL and gloo really print (checked against
torch 2.13's binaries and against reports of real failures). Order matters: the
first match wins, so the peer-failure texts come first — when one rank dies,
every peer blocked with it prints one of them, and diagnosis must treat those as
consequences, never as the cause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ddpwatch.protocol import ErrorInfo


@dataclass(frozen=True)
class Signature:
    """One known error: how to recognise it, why it happens, and how to fix it."""

    name: str
    pattern: re.Pattern[str]
    cause: str
    hint: str
    peer_failure: bool = False
    kind: str | None = None  # the alert kind this error implies, if any


def _sig(
    name: str,
    regex: str,
    cause: str,
    hint: str,
    *,
    peer_failure: bool = False,
    kind: str | None = None,
) -> Signature:
    return Signature(name, re.compile(regex, re.IGNORECASE), cause, hint, peer_failure, kind)


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
        peer_failure=True,
    ),
    _sig(
        "nccl_aborted",
        r"NCCL communicator was aborted|ProcessGroupNCCL[^\n]*\baborted",
        "the NCCL communicator was aborted because another rank failed",
        _PEER_HINT,
        peer_failure=True,
    ),
    _sig(
        "store_closed",
        r"Failed to (?:recv|send), (?:got|sent) 0 bytes",
        "the rendezvous store went away: the rank hosting it (usually rank 0) exited or crashed",
        _PEER_HINT,
        peer_failure=True,
    ),
    _sig(
        "gloo_broken_pipe",
        r"(?:gloo|pair\.cc|Write error|Read error)[^\n]*Broken pipe"
        r"|Broken pipe[^\n]*(?:gloo|pair\.cc)",
        "gloo wrote to a rank that had already gone away",
        _PEER_HINT,
        peer_failure=True,
    ),
    _sig(
        "connection_closed",
        r"Connection closed by (?:remote )?peer|Remote peer closed the connection",
        "another rank closed its connection: it crashed, was killed or exited early",
        _PEER_HINT,
        peer_failure=True,
    ),
    _sig(
        "connection_reset",
        r"Connection reset by peer|ECONNRESET",
        "another rank's connection was reset: it crashed, was killed or the network dropped",
        _PEER_HINT,
        peer_failure=True,
    ),
)

TIMEOUTS = (
    _sig(
        "monitored_barrier",
        r"failed to pass monitoredBarrier",
        "the named rank did not reach the monitored barrier in time: it is slow, hung or dead",
        "look at what the named rank was doing (its stack) when the others reached the barrier",
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
    ),
    _sig(
        "gloo_timeout",
        r"Timed out waiting \d+ ?ms for (?:recv|send) operation|gloo[^\n]*(?:timed out|timeout)",
        "a gloo collective waited longer than the process-group timeout: "
        "another rank never joined it (hung, slow or calling a different collective)",
        "find the rank that did not reach the collective (ddpwatch names it as a straggler "
        "before the timeout); raise timeout= in init_process_group only for slow steps",
    ),
)

_SET_DEVICE = (
    "call torch.cuda.set_device(local_rank) with local_rank = int(os.environ['LOCAL_RANK']) "
    "before init_process_group"
)

ROOT_CAUSES = (
    _sig(
        "invalid_device_ordinal",
        r"invalid device ordinal",
        "the global rank was used as a CUDA device index; on a host with fewer GPUs than "
        "the world size that index does not exist",
        "use torch.cuda.set_device(local_rank) with LOCAL_RANK, not the global rank "
        "(torch.device(f'cuda:{local_rank}'))",
        kind="device_ordinal",
    ),
    _sig(
        "duplicate_gpu",
        r"Duplicate GPU detected",
        "two ranks use the same GPU; NCCL needs one GPU per rank",
        _SET_DEVICE + ", and check CUDA_VISIBLE_DEVICES (one GPU per rank, not the same one)",
        kind="duplicate_device",
    ),
    _sig(
        "address_in_use",
        r"Address already in use|EADDRINUSE|errno: 98\b",
        "MASTER_PORT is already taken by another job or by a leftover process of an earlier run",
        "pick another MASTER_PORT (torchrun --master-port or --rdzv-endpoint host:port), "
        "or find and kill the old job (ss -ltnp | grep PORT)",
    ),
    _sig(
        "cuda_oom",
        r"CUDA out of memory|OutOfMemoryError",
        "the GPU ran out of memory on this rank",
        "lower the per-rank batch size, use mixed precision or activation checkpointing; "
        "check with nvidia-smi that no other process holds memory on this GPU and that "
        "every rank uses its own GPU (set_device(local_rank))",
    ),
    _sig(
        "collective_mismatch",
        r"Received data size doesn't match expected size|distributed collective mismatch"
        r"|Detected mismatch between collectives",
        "the ranks called different collectives, or the same one with different tensor sizes",
        "make every rank call the same collectives in the same order with the same shapes: "
        "look for a dist.* call under `if rank == 0` (metrics, logging) or a data-dependent "
        "shape; TORCH_DISTRIBUTED_DEBUG=DETAIL names the mismatching call",
        kind="collective_mismatch",
    ),
    _sig(
        "ddp_unused_parameters",
        r"Expected to have finished reduction in the prior iteration",
        "some model parameters did not take part in computing the loss, so DDP waited for "
        "their gradients forever",
        "make every parameter take part in the loss, or pass find_unused_parameters=True "
        "to DistributedDataParallel (slower); TORCH_DISTRIBUTED_DEBUG=DETAIL names them",
    ),
    _sig(
        "ddp_ready_twice",
        r"Expected to mark a variable ready only once",
        "a parameter's gradient was produced twice in one step, typically by reentrant "
        "activation checkpointing or a module used twice under DDP",
        "use torch.utils.checkpoint with use_reentrant=False, or set static_graph=True "
        "on DistributedDataParallel",
    ),
    _sig(
        "ddp_model_mismatch",
        r"DDP expects same model across all ranks",
        "the ranks built different models (different parameter counts or shapes)",
        "build the model identically on every rank: no rank-dependent layers or config",
    ),
    _sig(
        "store_clients_timeout",
        r"waiting for clients\. \d+/\d+ clients joined",
        "the rendezvous host waited for the other ranks and not all of them came",
        "check that every rank was started (nnodes x nproc_per_node = WORLD_SIZE), that "
        "none crashed before init_process_group, and that they can reach MASTER_ADDR:MASTER_PORT",
    ),
    _sig(
        "rendezvous",
        r"RendezvousTimeoutError|RendezvousConnectionError|Connection refused|ECONNREFUSED"
        r"|DistNetworkError|failed to connect|The client socket has timed out",
        "this rank could not reach the rendezvous at MASTER_ADDR:MASTER_PORT: rank 0 has not "
        "started, the address or port is wrong, or a firewall blocks it",
        "check MASTER_ADDR and MASTER_PORT (--rdzv-endpoint) on every node, that rank 0 runs, "
        "and that the port is open between the hosts",
    ),
    _sig(
        "no_cuda_gpus",
        r"No CUDA GPUs are available|CUDA driver initialization failed|found no NVIDIA driver",
        "this process sees no GPU: CUDA_VISIBLE_DEVICES is empty or wrong, or no driver",
        "check CUDA_VISIBLE_DEVICES and nvidia-smi on that host (in containers: --gpus all)",
    ),
    _sig(
        "nccl_cpu_tensor",
        r"Tensors must be CUDA and dense|No backend type associated with device type cpu",
        "a CPU tensor was passed to an NCCL collective",
        "move the tensor to this rank's GPU (tensor.cuda()) or use a gloo process group",
    ),
    _sig(
        "device_side_assert",
        r"device-side assert triggered",
        "a CUDA kernel assertion failed, usually an index out of range "
        "(a label >= the number of classes, a token id >= the vocabulary size)",
        "rerun with CUDA_LAUNCH_BLOCKING=1, or on CPU, to get the failing line",
    ),
    _sig(
        "illegal_memory_access",
        r"an illegal memory access was encountered",
        "a CUDA kernel read or wrote outside its memory",
        "rerun with CUDA_LAUNCH_BLOCKING=1 to find the kernel; check custom kernels and "
        "tensors used on the wrong device",
    ),
    _sig(
        "pg_not_initialized",
        r"Default process group has not been initialized",
        "a torch.distributed call ran before init_process_group or after destroy_process_group",
        "call dist.init_process_group(...) first on every rank",
    ),
    _sig(
        "nccl_system_error",
        r"unhandled system error|ncclSystemError",
        "NCCL hit an operating-system or network failure: often a too small /dev/shm in a "
        "container, the wrong network interface, or InfiniBand trouble",
        "rerun with NCCL_DEBUG=INFO; in Docker use --ipc=host or a larger --shm-size; set "
        "NCCL_SOCKET_IFNAME to the interface the hosts share",
    ),
    _sig(
        "nccl_error",
        r"NCCL error|ncclInternalError|ncclInvalidUsage|ncclUnhandledCudaError"
        r"|ncclInvalidArgument",
        "NCCL reported an error",
        "rerun with NCCL_DEBUG=INFO to see the failing call; check that the driver, CUDA and "
        "NCCL versions match on every host",
    ),
)

SIGNATURES: tuple[Signature, ...] = PEER_FAILURES + TIMEOUTS + ROOT_CAUSES
TIMEOUT_NAMES = frozenset(sig.name for sig in TIMEOUTS)


@lru_cache(maxsize=1 << 14)
def explain(text: str) -> Signature | None:
    """The first known signature in ``text`` ("type: message\\ntraceback"), if any.

    Cached: diagnosis asks about the same few errors several times a second.
    """
    for signature in SIGNATURES:
        if signature.pattern.search(text):
            return signature
    return None


def is_peer_failure(text: str) -> bool:
    """True for the errors a healthy rank prints when another rank died."""
    signature = explain(text)
    return signature is not None and signature.peer_failure


def error_text(error: ErrorInfo) -> str:
    """The text ``explain`` reads: "type: message" and then the traceback."""
    head = f"{error.type}: {error.message}"
    return f"{head}\n{error.traceback}" if error.traceback else head


@lru_cache(maxsize=1 << 14)
def _explain_parts(type_: str, message: str, traceback: str) -> Signature | None:
    return explain(f"{type_}: {message}") or (explain(traceback) if traceback else None)


def explain_error(error: ErrorInfo) -> Signature | None:
    """Like ``explain``, but the exception's own message wins over text in its traceback.

    A traceback quotes source lines and chained exceptions; those should only decide
    when the message itself is unknown.
    """
    return _explain_parts(error.type, error.message, error.traceback)
