"""Startup: ranks stuck before their first step (by startup phase) and ranks that never
connected."""

from __future__ import annotations

from collections import Counter

from ddpwatch.core.vocabulary import STARTUP_PHASES, AlertKind, Phase, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.census import missing_ranks
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.diagnosis.text import format_ranks, record_location, verb
from ddpwatch.server.records import RankRecord
from ddpwatch.status.fmt import seconds

_PHASE_ORDER = {name: index for index, name in enumerate(STARTUP_PHASES)}


def _phase_index(record: RankRecord) -> int:
    """Startup order of the rank's phase; ranks that train count as past startup."""
    index = _PHASE_ORDER.get(record.phase, len(STARTUP_PHASES)) if record.phase else 0
    return max(index, len(STARTUP_PHASES) - 1) if record.step is not None else index


_PHASE_HINTS: dict[str, str] = {
    Phase.STARTED: "the rank has not reached init_process_group: it may be downloading or "
    "preparing data while the others wait; prepare data beforehand or only on rank 0 "
    "followed by a barrier",
    Phase.RENDEZVOUS: "the ranks wait for each other in init_process_group: check that every "
    "rank started, WORLD_SIZE, and that MASTER_ADDR:MASTER_PORT is reachable",
    Phase.SETUP: "the process group exists but the rank has not wrapped its model: it may be "
    "loading data or a checkpoint, or in a branch that only some ranks take",
    Phase.DEVICE: "setting up the GPU hangs: check the GPU with nvidia-smi and "
    "CUDA_VISIBLE_DEVICES on that host",
    Phase.MODEL_WRAP: "DistributedDataParallel(...) broadcasts rank 0's parameters and checks "
    "shapes: a rank that never gets there, or builds a different model, hangs the others",
    Phase.CONFIGURE_MODEL: "the rank is in Lightning's configure_model or loads ckpt_path's "
    "weights: a model built differently on some ranks, or a slow checkpoint read, keeps the "
    "others waiting",
    Phase.STRATEGY_SETUP: "Lightning moves the model to its device, wraps it (DDP broadcasts rank "
    "0's parameters) and builds the optimizers: every rank must build the same model",
    Phase.DEEPSPEED_INIT: "deepspeed.initialize broadcasts the parameters and builds the "
    "optimizer: every rank must call it with the same model and config",
    Phase.ZERO_PARTITION: "ZeRO partitions parameters, gradients and optimizer states across the "
    "ranks: a rank with a different model, or missing from the process group, hangs the others",
    Phase.FIT_START: "on_fit_start hooks and restoring the training state from ckpt_path: a "
    "slow or rank-dependent on_fit_start, or reading a large checkpoint, keeps the others waiting",
    Phase.SANITY_CHECK: "Lightning's sanity check runs validation batches before training: a "
    "validation_step that syncs (sync_dist, all_gather) on some ranks only hangs; "
    "num_sanity_val_steps=0 tells",
    Phase.FIRST_STEP: "the first step compiles and allocates; if it lasts, a collective that only "
    "some ranks call or a rank-dependent branch keeps the ranks apart",
}


@rule(AlertKind.STARTUP_HANG)
def rule_startup_hang(f: Facts) -> list[Alert]:
    """Ranks stuck before their first step: name the ones furthest behind.

    Only ranks in a startup phase count as starting: a rank in 'train' or in a phase
    of its own ('forward', 'eval') is past startup even before its first step.
    """
    now, th = f.now, f.th
    live = f.live
    train = len(STARTUP_PHASES) - 1
    starting = [r for r in live if r.step is None and _phase_index(r) < train]
    if not starting:
        return []
    longest = max(now - (r.phase_since or r.first_seen) for r in starting)
    if longest <= th.startup_after:
        return []
    earliest = min(_phase_index(r) for r in starting)
    behind = sorted((r for r in starting if _phase_index(r) == earliest), key=lambda r: r.rank)
    ahead = sorted(r.rank for r in live if _phase_index(r) > earliest)
    missing = missing_ranks(f.state)
    if missing and not ahead:
        return [_waiting_for_missing(missing, behind, longest)]
    if not ahead and min(now - (r.phase_since or r.first_seen) for r in behind) <= th.startup_after:
        return []  # the last rank has just joined the others: the phase is about to end
    first = behind[0]
    phase = first.phase or Phase.STARTED
    culprits = sorted({r.rank for r in behind} | set(missing))
    own = max(now - (r.phase_since or r.first_seen) for r in behind)
    loc = record_location(first)
    message = (
        f"{format_ranks(r.rank for r in behind)} {verb(len(behind), 'is', 'are')} still in "
        f"'{phase}' after {seconds(own)}" + (f" ({loc})" if loc else "")
    )
    if missing:
        message += f" and {format_ranks(missing)} never connected"
    if ahead:
        ahead_phase = Counter(
            r.phase or Phase.STARTED for r in live if _phase_index(r) > earliest
        ).most_common(1)[0][0]
        message += (
            f" while {format_ranks(ahead)} {verb(len(ahead), 'waits', 'wait')} in '{ahead_phase}'"
        )
    hint = _PHASE_HINTS.get(phase, "look at the stacks of the ranks furthest behind")
    severity = Severity.ERROR if longest > 2 * th.startup_after else Severity.WARNING
    return [alert(AlertKind.STARTUP_HANG, severity, culprits, ahead, message, hint)]


def _waiting_for_missing(missing: list[int], behind: list[RankRecord], longest: float) -> Alert:
    phase = behind[0].phase or Phase.STARTED
    message = (
        f"{format_ranks(missing)} never connected while {format_ranks(r.rank for r in behind)} "
        f"{verb(len(behind), 'has', 'have')} waited in '{phase}' for {seconds(longest)}"
    )
    hint = (
        "start the missing ranks or fix their launch (nnodes x nproc_per_node must equal "
        "WORLD_SIZE); their own logs say why they did not come up"
    )
    return alert(
        AlertKind.STARTUP_HANG, Severity.ERROR, missing, [r.rank for r in behind], message, hint
    )


@rule(AlertKind.NOT_CONNECTED)
def rule_not_connected(f: Facts) -> list[Alert]:
    """Ranks of the world that never reported, some time after the first one did."""
    state, now, th = f.state, f.now, f.th
    if not f.records:
        return []
    first = state.first_report  # the earliest first_seen, kept by ``apply``
    elapsed = now - (first if first is not None else min(r.first_seen for r in f.records))
    if elapsed <= th.connect_after:
        return []
    missing = missing_ranks(f.state)
    if not missing:
        return []
    size = state.world_size
    message = (
        f"{format_ranks(missing)} of {size} {verb(len(missing), 'has', 'have')} not connected "
        f"{seconds(elapsed)} after the first rank did{_expected_where(f.records, missing)}"
    )
    hint = (
        "check that those ranks started (launcher log; nnodes x nproc_per_node = WORLD_SIZE), "
        "that they call ddpwatch.attach(), and that they can reach the ddpwatch server"
    )
    severity = Severity.ERROR if elapsed > th.startup_after else Severity.WARNING
    waiting = [r.rank for r in f.live if r.step is None]
    waiting += [r.rank for r in f.records if r.finished]  # died waiting for them (store timeout)
    return [alert(AlertKind.NOT_CONNECTED, severity, missing, waiting, message, hint)]


def _expected_where(records: list[RankRecord], missing: list[int]) -> str:
    """Where the missing ranks should run: the node their rank numbers fall on, and its host
    when another rank of that node has reported (" (expected on node 1, host gpu-b)")."""
    per_node = next((r.local_world_size for r in records if r.local_world_size), None)
    if not per_node:
        return ""
    hosts = {r.rank // per_node: r.host for r in records if r.host}
    nodes = sorted({rank // per_node for rank in missing})
    places = [f"node {n}, host {hosts[n]}" if n in hosts else f"node {n}" for n in nodes[:4]]
    more = f" and {len(nodes) - 4} more nodes" if len(nodes) > 4 else ""
    return f" (expected on {'; '.join(places)}{more}, {per_node} ranks per node)"
