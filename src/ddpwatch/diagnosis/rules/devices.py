"""Devices and memory: two ranks on one GPU, the global rank used as a CUDA index, GPUs other
than cuda:<local rank>, uneven memory and processes of other jobs on a rank's GPU."""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from operator import attrgetter
from typing import cast

from ddpwatch.core.vocabulary import AlertKind, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.diagnosis.text import (
    MAX_LISTED,
    first_line,
    format_ranks,
    ordinal_advice,
    verb,
)
from ddpwatch.state.records import RankRecord
from ddpwatch.status.fmt import GIB, gib

_GPU_USED, _RESERVED = attrgetter("gpu_mem_used_bytes"), attrgetter("mem_reserved_bytes")
_DUPLICATE_PAIR = re.compile(r"rank (\d+) and rank (\d+) both on CUDA device", re.IGNORECASE)


def _duplicate_groups(f: Facts) -> list[list[RankRecord]]:
    """Live ranks that share a GPU, by GPU, each group by rank, the group of the lowest
    rank first: from the GPUs the index saw reported twice, not from every rank."""
    ranks, is_live = f.state.ranks, f.census.is_live
    groups = []
    for members in f.devices.shared.values():
        live = sorted(r for r in members if is_live(r))
        if len(live) > 1:
            groups.append([ranks[r] for r in live])
    return sorted(groups, key=lambda g: g[0].rank)


def _duplicates(f: Facts) -> list[list[RankRecord]]:
    return f.memo("duplicate_groups", lambda: _duplicate_groups(f))


def _suspects(f: Facts) -> list[RankRecord]:
    return f.memo("ordinal_suspects", lambda: _live_flagged(f, f.devices.ordinal))


def _duplicate_culprits(group: list[RankRecord]) -> list[RankRecord]:
    """The members whose GPU is not cuda:<local rank>, when that tells them apart."""
    odd = [r for r in group if r.local_rank is not None and r.device_index != r.local_rank]
    return odd if 0 < len(odd) < len(group) else group


@rule(AlertKind.DUPLICATE_DEVICE, every="change")
def rule_duplicate_device(f: Facts) -> list[Alert]:
    """Two or more ranks on one GPU (NCCL refuses it; with gloo it silently halves speed)."""
    alerts = []
    groups = _duplicates(f)
    if groups:
        culprits = sorted({r.rank for g in groups for r in _duplicate_culprits(g)})
        first = groups[0]
        gpu = first[0].device_uuid or first[0].device or "one GPU"
        message = f"{format_ranks(r.rank for r in first)} share GPU {gpu} on host {first[0].host}"
        if len(groups) > 1:
            message += f", and {len(groups) - 1} more GPUs are shared by several ranks"
        alerts.append(
            alert(AlertKind.DUPLICATE_DEVICE, Severity.ERROR, culprits, [], message, _DUP_HINT)
        )
    crashed = f.crashes_of_kind(AlertKind.DUPLICATE_DEVICE)
    if crashed:
        ranks = {r.rank for r in crashed}
        for r in crashed:
            assert r.error is not None
            for a, b in _DUPLICATE_PAIR.findall(r.error.message):
                ranks.update((int(a), int(b)))
        error = crashed[0].error
        assert error is not None
        pair = _DUPLICATE_PAIR.search(error.message)
        message = f"{format_ranks(ranks)} use the same GPU: NCCL reported " + (
            f"'{pair.group(0)}'" if pair else f"'{first_line(error.message)}'"
        )
        alerts.append(
            alert(AlertKind.DUPLICATE_DEVICE, Severity.ERROR, sorted(ranks), [], message, _DUP_HINT)
        )
    return alerts


_DUP_HINT = (
    "call torch.cuda.set_device(local_rank) before init_process_group (LOCAL_RANK from the "
    "environment) and check CUDA_VISIBLE_DEVICES: each rank needs its own GPU"
)


def _live_flagged(f: Facts, flagged: set[int]) -> list[RankRecord]:
    """The live ones of the ranks an index flagged, by rank."""
    ranks, is_live = f.state.ranks, f.census.is_live
    return [ranks[r] for r in sorted(flagged) if is_live(r)]


def _local_rank_clause(records: list[RankRecord]) -> str:
    known = [r for r in records if r.local_rank is not None]
    if not known:
        return "LOCAL_RANK from the environment"
    if len(records) == 1:
        return f"LOCAL_RANK is {known[0].local_rank} on this rank"
    listed = ", ".join(f"{r.local_rank} on rank {r.rank}" for r in known[:3])
    return f"LOCAL_RANK is {listed}" + (", …" if len(known) > 3 else "")


@rule(AlertKind.DEVICE_ORDINAL, every="change")
def rule_device_ordinal(f: Facts) -> list[Alert]:
    """The global rank used as a CUDA device index: crashes on the second node."""
    crashed = f.crashes_of_kind(AlertKind.DEVICE_ORDINAL)
    suspects = _suspects(f)
    records = sorted({r.rank: r for r in crashed + suspects}.values(), key=lambda r: r.rank)
    if not records:
        return []
    parts = []
    if crashed:
        first = crashed[0]
        assert first.error is not None
        advice = ordinal_advice(first)
        cause = (
            advice[0]
            if advice is not None
            else f"the global rank was used as the CUDA device index{_gpus_on(first)}"
        )
        parts.append(
            f"{format_ranks(r.rank for r in crashed)} crashed with {first.error.type}: "
            f"{first_line(first.error.message)} — {cause}"
        )
    live = [r for r in suspects if r.error is None]
    if live:
        first = live[0]
        parts.append(
            f"{format_ranks(r.rank for r in live)} {verb(len(live), 'uses', 'use')} the global "
            f"rank as the CUDA device (rank {first.rank} on cuda:{first.device_index} with "
            f"local rank {first.local_rank}){_gpus_on(first)}"
        )
    message = "; ".join(parts)
    return [
        alert(
            AlertKind.DEVICE_ORDINAL,
            Severity.ERROR,
            [r.rank for r in records],
            [],
            message,
            _ordinal_hint(records),
        )
    ]


def _ordinal_hint(records: list[RankRecord]) -> str:
    """The fix, built from what each rank saw (``text.ordinal_advice``): set_device(local_rank)
    only for ranks whose local rank differs from the global rank and fits their GPUs; with
    ranks in several cases, each case's fix with its ranks."""
    fixes: dict[str, list[int]] = {}
    global_index = []
    for r in records:
        advice = ordinal_advice(r)
        if advice is None:
            global_index.append(r)
        else:
            fixes.setdefault(advice[1], []).append(r.rank)
    if global_index:
        set_device = (
            f"use torch.cuda.set_device(local_rank) — {_local_rank_clause(global_index)} — "
            "not the global rank"
        )
        fixes[set_device] = [r.rank for r in global_index]
    if len(fixes) == 1:
        return next(iter(fixes))
    ordered = sorted(fixes.items(), key=lambda item: min(item[1]))
    return "; ".join(f"{format_ranks(ranks)}: {fix}" for fix, ranks in ordered)


def _gpus_on(record: RankRecord) -> str:
    if record.device_count is None:
        return ""
    return f"; host {record.host or '?'} has {record.device_count} GPUs"


@rule(AlertKind.LOCAL_RANK_MISMATCH, every="change")
def rule_local_rank_mismatch(f: Facts) -> list[Alert]:
    """A rank on a GPU other than cuda:<local rank> (often all ranks on cuda:0)."""
    flagged = {r.rank for g in _duplicates(f) for r in _duplicate_culprits(g)}
    flagged |= {r.rank for r in _suspects(f)}
    odd = [r for r in _live_flagged(f, f.devices.off_local) if r.rank not in flagged]
    if not odd:
        return []
    first = odd[0]
    message = (
        f"{format_ranks(r.rank for r in odd)} {verb(len(odd), 'uses', 'use')} a GPU other than "
        f"cuda:<local rank> (rank {first.rank} is on cuda:{first.device_index} with local "
        f"rank {first.local_rank})"
    )
    hint = (
        "call torch.cuda.set_device(local_rank) before creating tensors or the model; if the "
        "mapping is intended, ignore this"
    )
    return [
        alert(
            AlertKind.LOCAL_RANK_MISMATCH,
            Severity.WARNING,
            [r.rank for r in odd],
            [],
            message,
            hint,
        )
    ]


@rule(AlertKind.UNEVEN_MEMORY, every="slow")
def rule_uneven_memory(f: Facts) -> list[Alert]:
    """A rank that uses far more GPU memory than the others (often rank 0).

    NVML's figure is the whole GPU's: where ranks share one (gloo over CUDA tensors allows
    it), they all report the same and none would stand out, so their allocators' own
    reservations are compared instead."""
    shared = any(group[0].device_uuid for group in _duplicates(f))  # one GPU, by its UUID
    ranks, values = _memory_figures(f.live, shared=shared)
    if len(values) < 2:
        return []
    median = statistics.median(values)
    most = max(values)
    if most <= 1.5 * median or most - median < GIB:
        return []  # not even the heaviest: no rank looked at one by one
    heavy = [
        (ranks[i], float(v)) for i, v in enumerate(values) if v > 1.5 * median and v - median >= GIB
    ]
    if not heavy:
        return []
    heavy.sort(key=lambda item: item[0].rank)
    top, value = max(heavy, key=lambda item: (item[1], -item[0].rank))
    ratio = f"{value / median:.1f}x" if median > 0 else "far above"
    if len(heavy) == 1:
        amount = f"rank {top.rank} uses {gib(value)} of GPU memory"
    else:
        who = format_ranks(r.rank for r, _ in heavy)
        amount = f"{who} use up to {gib(value)} of GPU memory (rank {top.rank})"
    message = f"{amount}, {ratio} the median {gib(median)}"
    hint = (
        "the heavy rank holds extra tensors (metrics, evaluation, gathered outputs, checkpoint "
        "state) or other ranks create a CUDA context on its GPU: call "
        "torch.cuda.set_device(local_rank) early and use map_location when loading checkpoints"
    )
    return [
        alert(
            AlertKind.UNEVEN_MEMORY, Severity.WARNING, [r.rank for r, _ in heavy], [], message, hint
        )
    ]


def _memory_figures(
    live: Sequence[RankRecord], *, shared: bool
) -> tuple[Sequence[RankRecord], list[int]]:
    """The live ranks that report GPU memory and their figures: NVML's, unless ranks share
    a GPU (each would report the whole GPU's) or none has it; else their allocators'. Two
    flat lists, no object per rank (at 131,072 ranks a tuple each woke the collector of
    the oldest generation for half the rule's time), in C loops where every rank has one."""
    if not shared:
        nvml = _reporting(live, _GPU_USED)
        if nvml[0]:
            return nvml
    return _reporting(live, _RESERVED)


def _reporting(
    live: Sequence[RankRecord], field: attrgetter[int | None]
) -> tuple[Sequence[RankRecord], list[int]]:
    """The ranks that report ``field``, and its values: most ticks every rank does, and the
    live list itself is the answer."""
    values = list(map(field, live))
    if None not in values:
        return live, cast(list[int], values)
    ranks = [r for r, v in zip(live, values, strict=True) if v is not None]
    return ranks, [v for v in values if v is not None]


def _sharing_gpus(f: Facts) -> list[RankRecord]:
    """Ranks whose GPU lists processes besides their own, on hosts where the lists can be
    read: inside containers NVML may report host pids that never match the ranks' own, so
    only hosts where at least one rank finds itself in its GPU's list count. A rank alone on
    its GPU, as most are, costs nothing: the device index has only the others
    (``DeviceIndex.sharing``), and none of them live means no rank to look at."""
    census = f.census
    if not any(map(census.is_live, f.devices.sharing)):
        return []
    live = census.live
    comparable: set[str] = set()
    others: list[RankRecord] = []
    for r in live:
        gpu_pids, host = r.gpu_pids, r.host
        if not gpu_pids or not host:
            continue
        if r.pid in gpu_pids:
            comparable.add(host)
            if len(gpu_pids) == 1:
                continue
        others.append(r)
    return [r for r in others if r.host in comparable]


@rule(AlertKind.FOREIGN_MEMORY, every="slow")
def rule_foreign_memory(f: Facts) -> list[Alert]:
    """Processes that are not ranks of this job hold memory on a rank's GPU."""
    others = _sharing_gpus(f)
    if not others:
        return []
    hosts = {r.host for r in others}
    pids: dict[str | None, set[int]] = defaultdict(set)  # of every rank, finished ones too
    for r in f.records:
        if r.host in hosts and r.pid is not None:
            pids[r.host].add(r.pid)
    culprits: list[RankRecord] = []
    foreign: set[int] = set()
    for r in others:
        known = pids[r.host]
        if known.issuperset(r.gpu_pids or ()):
            continue
        culprits.append(r)
        foreign.update(p for p in r.gpu_pids or () if p not in known)
    if not culprits:
        return []
    culprits.sort(key=lambda r: r.rank)
    listed = ", ".join(str(p) for p in sorted(foreign)[:MAX_LISTED])
    if len(foreign) > MAX_LISTED:
        listed += f" and {len(foreign) - MAX_LISTED} more"
    owner = (
        f"the GPU of rank {culprits[0].rank} ({culprits[0].device or 'cuda'} on {culprits[0].host})"
        if len(culprits) == 1
        else f"the GPUs of {format_ranks(r.rank for r in culprits)}"
    )
    message = (
        f"{owner} also {verb(len(culprits), 'holds', 'hold')} "
        f"{verb(len(foreign), 'process', 'processes')} {listed} that "
        f"{verb(len(foreign), 'is not a rank', 'are not ranks')} of this job"
    )
    hint = (
        "another job or a leftover process (an earlier run, a notebook) holds memory on this "
        "GPU: check nvidia-smi and stop it or use other GPUs; note that pids inside "
        "containers differ from the host's"
    )
    return [
        alert(
            AlertKind.FOREIGN_MEMORY,
            Severity.WARNING,
            [r.rank for r in culprits],
            [],
            message,
            hint,
        )
    ]
