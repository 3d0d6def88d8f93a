"""Words for alerts: rank lists, op names, where in the code a rank is, and why a rank's CUDA
device index did not exist (durations and sizes: ``status.fmt``)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from ddpwatch.core.devices import parse_cuda_visible_devices
from ddpwatch.core.ranges import sorted_ranges
from ddpwatch.state.records import RankRecord

MAX_LISTED = 8  # rank runs written out before "and N more"


_SKIP_PARTS = frozenset({"ddpwatch", "torch", "site-packages", "dist-packages"})


_STDLIB_DIR = re.compile(r"python\d+\.\d+$|python\d{3,}$", re.IGNORECASE)
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def format_ranks(ranks: Iterable[int], limit: int = MAX_LISTED) -> str:
    """Write ranks as "rank 3", "ranks 0, 2" or "ranks 0-5, 9"; huge lists end "and 8000 more".

    Runs of three or more collapse to "a-b" so 8192 ranks stay one short phrase.
    """
    return format_sorted_ranks(sorted(set(ranks)), limit)


def format_sorted_ranks(ordered: list[int], limit: int = MAX_LISTED) -> str:
    """``format_ranks`` of ranks already sorted and unique (a wait group's own sorted list:
    131,072 ranks are not put in a set and sorted again every tick)."""
    if not ordered:
        return "no rank"
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    return "ranks " + sorted_ranges(ordered, limit, ", ", 3, " and {} more")


def verb(count: int, one: str, many: str) -> str:
    return one if count == 1 else many


def first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def collective_name(op: str, seq: int | None) -> str:
    return op if seq is None else f"{op} #{seq}"


def _is_stdlib(parts: list[str]) -> bool:
    """A frame of Python's own library ("/usr/lib/python3.11/multiprocessing/queues.py")."""
    return any(_STDLIB_DIR.match(part) for part in parts[:-1])


def _is_generated(parts: list[str]) -> bool:
    """Code torch.compile wrote ("/tmp/torchinductor_ann/ab/cabxyz.py", inductor's default
    cache): the user's line is further out."""
    return any(part.startswith("torchinductor_") for part in parts[:-1])


def location(stack: str | None) -> str | None:
    """Return "train.py:88", the innermost frame of a formatted stack in the user's own code.

    Frames inside ddpwatch, torch, threading or installed packages say nothing about
    where the user's program is, so they are skipped.
    """
    if not stack:
        return None
    for path, line in reversed(_FRAME.findall(stack)):
        parts = re.split(r"[\\/]", path)
        name = parts[-1]
        if (
            name.startswith("<")
            or _SKIP_PARTS.intersection(parts)
            or _is_stdlib(parts)
            or _is_generated(parts)
        ):
            continue
        return f"{name}:{line}"
    return None


def record_location(record: RankRecord) -> str | None:
    """Where the rank is: its captured stack, else the traceback it died with."""
    found = location(record.stack)
    if found is None and record.error is not None:
        found = location(record.error.traceback)
    return found


def where(record: RankRecord, stepping: bool = False, phase: bool = True) -> str:
    """Describe where a rank is: "in 'forward' at step 311, train.py:88", as far as known.
    ``stepping``: other ranks reported steps, so one that reported none may have made some;
    ``phase``: False where the sentence says the phase in words of its own."""
    parts = []
    if phase and record.phase:
        parts.append(f"in '{record.phase}'")
    if record.step is not None:
        parts.append(f"at step {record.step}")
    else:
        parts.append("before it reported a step" if stepping else "before its first step")
    text = " ".join(parts)
    loc = record_location(record)
    return f"{text}, {loc}" if loc else text



_LOADER_PARTS = ("torch/utils/data/", "torch\\utils\\data\\")
_WORKER_WAITS = frozenset({"_get_data", "_try_get_data"})
"""Where ``_MultiProcessingDataLoaderIter`` (torch/utils/data/dataloader.py) waits for a batch."""
_FRAME_FUNCTION = re.compile(r'File "([^"]+)", line \d+, in (\w+)')
_MULTIPROCESSING = re.compile(r"[\\/]multiprocessing[\\/]")


def in_data_loading(stack: str | None) -> bool:
    """The rank's main thread waits for a DataLoader worker's batch: only a loader with
    ``num_workers > 0`` has workers; with none, the batch is made on the main thread and
    its stack shows the dataset's own code (the loader is not what to blame)."""
    if not stack:
        return False
    in_loader = False
    for path, function in _FRAME_FUNCTION.findall(stack):  # outermost first
        if any(part in path for part in _LOADER_PARTS):
            if function in _WORKER_WAITS:
                return True
            in_loader = True
        elif in_loader and _MULTIPROCESSING.search(path):
            return True  # the loader reads a worker's queue
    return False


def gpus_seen(record: RankRecord) -> int | None:
    """How many GPUs the rank saw: its device count, else what its ``CUDA_VISIBLE_DEVICES``
    lets CUDA show (none when it hides every GPU, at most the ones it lists); None: unknown."""
    if record.device_count is not None:
        return record.device_count
    listed = parse_cuda_visible_devices(record.cuda_visible_devices)
    return None if listed is None else len(listed)


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def ordinal_advice(record: RankRecord) -> tuple[str, str] | None:
    """Why the rank's ``cuda:<index>`` did not exist, and what to do, from what the rank saw
    (``invalid device ordinal``): (cause, fix), or None when the global rank used as the index
    is the explanation, or too little is known (then ``set_device(local_rank)`` is the fix).

    Only a local rank that differs from the global rank and lies within the rank's GPUs makes
    ``set_device(local_rank)`` right: a rank that sees no GPU, or a node that runs more ranks
    than it has GPUs, would crash the same way with it.
    """
    seen, local, host = gpus_seen(record), record.local_rank, record.host or "?"
    if seen == 0:
        hidden = parse_cuda_visible_devices(record.cuda_visible_devices) == []
        why = (
            f"CUDA_VISIBLE_DEVICES={record.cuda_visible_devices!r} hides every GPU"
            if hidden
            else "it counts 0 CUDA devices"
        )
        return (
            f"rank {record.rank} sees no GPU on host {host} ({why})",
            "the machine or container shows this rank no GPU: check the driver (nvidia-smi), "
            "the container's GPUs (docker --gpus) and CUDA_VISIBLE_DEVICES, or the job's GPU "
            "allocation; or run on CPU: the gloo backend and no cuda device",
        )
    if local is None:
        return None
    per_node = record.local_world_size
    if seen is not None and local >= seen:
        ranks = f"{per_node} ranks" if per_node else f"at least {local + 1} ranks"
        wanted = per_node or local + 1
        return (
            f"host {host} runs {ranks} but rank {record.rank} sees {_gpus(seen)}: local rank "
            f"{local} has no cuda:{local}",
            f"this node runs more ranks than it has GPUs (--nproc-per-node {wanted} for "
            f"{_gpus(seen)}): lower --nproc-per-node to {seen}, or expose {wanted} GPUs to "
            "each node (the job's GPU allocation, CUDA_VISIBLE_DEVICES)",
        )
    if local != record.rank:
        return None  # the global rank as the index: set_device(local_rank)
    if seen is None:
        return (
            f"its local rank is its global rank ({local}), so the index was its local rank, "
            f"past the GPUs host {host} shows it",
            "this node runs more ranks than it has GPUs: lower --nproc-per-node to the GPU "
            "count (nvidia-smi -L), or expose more GPUs (the job's GPU allocation, "
            "CUDA_VISIBLE_DEVICES)",
        )
    return (
        f"cuda:{local}, rank {record.rank}'s own index, exists ({_gpus(seen)} on host {host}): "
        "another index was asked for",
        "look for a hard-coded device index (cuda:N), one read from a config, or a checkpoint "
        "loaded onto the GPU it was saved from (torch.load(..., "
        "map_location=f'cuda:{local_rank}'))",
    )
