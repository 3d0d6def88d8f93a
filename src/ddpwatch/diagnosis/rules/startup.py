"""Startup: ranks stuck before their first step (by startup phase) and ranks that never
connected."""

from __future__ import annotations

from collections import Counter

from ddpwatch.core.vocabulary import STARTUP_PHASES, AlertKind, Phase, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.census import missing_ranks, world_complete
from ddpwatch.diagnosis.facts.ranks import cpu_growing, still_working
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.diagnosis.text import format_ranks, record_location, verb
from ddpwatch.state.records import RankRecord
from ddpwatch.status.fmt import seconds

_PHASE_ORDER = {name: index for index, name in enumerate(STARTUP_PHASES)}


def _phase_index(record: RankRecord) -> int:
    """Startup order of the rank's phase; ranks that train count as past startup."""
    index = _PHASE_ORDER.get(record.phase, len(STARTUP_PHASES)) if record.phase else 0
    return max(index, len(STARTUP_PHASES) - 1) if record.step is not None else index


WORKING_WARN_S = 120.0
"""A rank that works (its CPU time grows) in a start-up phase is a note (``info``), a warning
only past twice ``--startup-after`` and this long at least: twice the default 60 s. Under it,
whatever the threshold, slow is not wrong: on a loaded machine DeepSpeed's initialize alone
takes 20 s, Lightning's imports as long."""
_BEFORE_INIT = (Phase.STARTING, Phase.STARTED)


def _in_phase(record: RankRecord, now: float) -> float:
    return now - (record.phase_since or record.first_seen)


def still_starting(record: RankRecord, now: float) -> bool:
    """A rank before ``init_process_group`` whose CPU time grows: importing or preparing, slow
    on a loaded machine but working, not hung (the early hello's 'starting', or 'started')."""
    phase = record.phase or Phase.STARTED
    return phase in _BEFORE_INIT and cpu_growing(record, now)


_PHASE_HINTS: dict[str, str] = {
    Phase.STARTING: "the interpreter runs but the rank has not reached torch or "
    "init_process_group yet: its imports (torch, Lightning) or the script's first lines are "
    "slow; a loaded machine or a slow file system stretches them",
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
    of its own ('forward', 'eval') is past startup even before its first step. Ranks that
    are behind but working (``still_working``: their CPU time grows) are a note, not a hang,
    and never named beside one that is; a phase every rank of the job is in names no
    culprit: none holds the others.
    """
    if not any(map(f.census.is_live, f.flags.unstepped)):
        return []  # every live rank has stepped: no rank looked at one by one
    now, th = f.now, f.th
    live = f.live
    train = len(STARTUP_PHASES) - 1
    starting = [r for r in live if r.step is None and _phase_index(r) < train]
    if not starting:
        return []
    longest = max(_in_phase(r, now) for r in starting)
    earliest = min(_phase_index(r) for r in starting)
    if longest <= th.startup_after or _config_tells(f, earliest):
        return []
    behind = sorted((r for r in starting if _phase_index(r) == earliest), key=lambda r: r.rank)
    ahead = sorted(r.rank for r in live if _phase_index(r) > earliest)
    missing = missing_ranks(f.state)
    if missing and not ahead:
        phase = behind[0].phase or Phase.STARTED
        return [_waiting_for_missing(missing, [r.rank for r in behind], phase, longest)]
    if missing and all(still_starting(r, now) for r in behind):
        # the ranks behind are on their way: the missing ones are not
        phase, note = _ahead_phase(live, earliest), _working_note(behind, now)
        return [_waiting_for_missing(missing, ahead, phase, longest, note)]
    # with ranks missing, ranks past init_process_group are judged as they always were
    busy = [] if missing else [r for r in behind if still_working(r, now)]
    hung = [r for r in behind if r not in busy]
    if not ahead and min(_in_phase(r, now) for r in behind) <= th.startup_after:
        return []  # the last rank has just joined the others: the phase is about to end
    severity = _severity(longest, th.startup_after, not hung)
    if not ahead and len(behind) == len(live) and world_complete(f.state, live):
        return [_job_wide(behind, now, severity)]
    if not hung:
        return [_still_working(behind, f, earliest, severity)]
    return [_hung(hung, busy, missing, f, earliest, severity)]


def _hung(
    hung: list[RankRecord],
    busy: list[RankRecord],
    missing: list[int],
    f: Facts,
    earliest: int,
    severity: Severity,
) -> Alert:
    """The ranks behind that do not work (their CPU time stopped, or they wait), named with
    the missing ones; those behind beside them that still work are a note, never named."""
    now, live = f.now, f.live
    ahead = sorted(r.rank for r in live if _phase_index(r) > earliest)
    first = hung[0]
    phase = first.phase or Phase.STARTED
    culprits = sorted({r.rank for r in hung} | set(missing))
    own = max(_in_phase(r, now) for r in hung)
    loc = record_location(first)
    message = (
        f"{format_ranks(r.rank for r in hung)} {verb(len(hung), 'is', 'are')} still in "
        f"'{phase}' after {seconds(own)}" + (f" ({loc})" if loc else "")
    )
    if missing:
        message += f" and {format_ranks(missing)} never connected"
    if ahead:
        message += (
            f" while {format_ranks(ahead)} {verb(len(ahead), 'waits', 'wait')} in "
            f"'{_ahead_phase(live, earliest)}'"
        )
    if busy:
        message += f"; {_working_note(busy, now)} (working, not hung)"
    hint = _PHASE_HINTS.get(phase, "look at the stacks of the ranks furthest behind")
    return alert(AlertKind.STARTUP_HANG, severity, culprits, ahead, message, hint)


def _config_tells(f: Facts, earliest: int) -> bool:
    """The ranks behind wait in a rendezvous whose ranks disagree on its values:
    ``config_mismatch`` names the odd rank, never the ones still waiting for it."""
    return STARTUP_PHASES[earliest] == Phase.RENDEZVOUS and any(d.odd for d in f.rendezvous_split)


def _severity(longest: float, startup_after: float, working: bool) -> Severity:
    """Warning past ``startup_after``, error past twice that; for ranks that are still
    working (their CPU time grows) a note, a warning only past ``WORKING_WARN_S`` as well,
    never an error."""
    late = longest > 2 * startup_after
    if working:
        return Severity.WARNING if late and longest > WORKING_WARN_S else Severity.INFO
    return Severity.ERROR if late else Severity.WARNING


def _ahead_phase(live: list[RankRecord], earliest: int) -> str:
    """The phase most of the ranks ahead of the ones behind are in."""
    phases = Counter(r.phase or Phase.STARTED for r in live if _phase_index(r) > earliest)
    return phases.most_common(1)[0][0]


def _working_note(behind: list[RankRecord], now: float) -> str:
    """'ranks 1, 2 are still starting after 5.9 s, their CPU time growing', or past
    init_process_group 'rank 0 is still in 'deepspeed_init' after 17.4 s, its CPU time
    growing'."""
    own = max(_in_phase(r, now) for r in behind)
    phase = behind[0].phase or Phase.STARTED
    where = "starting" if phase in _BEFORE_INIT else f"in '{phase}'"
    return (
        f"{format_ranks(r.rank for r in behind)} {verb(len(behind), 'is', 'are')} still "
        f"{where} after {seconds(own)}, {verb(len(behind), 'its', 'their')} CPU time growing"
    )


def _still_working(behind: list[RankRecord], f: Facts, earliest: int, severity: Severity) -> Alert:
    """Ranks behind that are still working: say so, and for how long, and who waits for them,
    without calling them hung (on a loaded machine a rank's imports alone take seconds,
    DeepSpeed's initialize tens of seconds)."""
    ahead = [r for r in f.live if _phase_index(r) > earliest]
    phase = behind[0].phase or Phase.STARTED
    starting = phase in _BEFORE_INIT
    message = _working_note(behind, f.now) + (
        " (importing or preparing, not hung)" if starting else " (working, not hung)"
    )
    if ahead:  # how long those before their first step have waited (a step ends no wait)
        waits = [_in_phase(r, f.now) for r in ahead if r.step is None]
        message += (
            f" while {format_ranks(r.rank for r in ahead)} {verb(len(ahead), 'has', 'have')} "
            f"waited in '{_ahead_phase(f.live, earliest)}'"
            + (f" for {seconds(max(waits))}" if waits else "")
        )
    doing = (
        "a slow start (imports of torch or Lightning, data preparation)"
        if starting
        else f"'{phase}' is slow on {verb(len(behind), 'it', 'them')} (a large model or "
        "checkpoint, a cold cache)"
    )
    stacks = verb(len(behind), "its stack", "their stacks")
    hint = (
        f"nothing to do while {verb(len(behind), 'its', 'their')} CPU time grows: {doing}, "
        f"stretched on a loaded machine; if it lasts, look at {stacks} (py-spy dump --pid) "
        "and at what else runs on the node"
    )
    culprits, waiting = [r.rank for r in behind], [r.rank for r in ahead]
    return alert(AlertKind.STARTUP_HANG, severity, culprits, waiting, message, hint)


def _job_wide(behind: list[RankRecord], now: float, severity: Severity) -> Alert:
    """Every rank of the job in the same startup phase, long: the phase is slow everywhere,
    and no rank is to blame for the others (no culprit, nobody waits on anyone)."""
    phase = behind[0].phase or Phase.STARTED
    shortest = min(_in_phase(r, now) for r in behind)
    count = f"all {len(behind)} ranks" if len(behind) > 1 else "the only rank"
    message = (
        f"{count} {verb(len(behind), 'has', 'have')} been in '{phase}' for {seconds(shortest)}: "
        f"slow start-up on every rank, no rank holds the others"
    )
    hint = (
        "every rank is slow in the same phase: a loaded machine (compare the ranks' CPU use), "
        "a large model or checkpoint, or something they all wait on (MASTER_ADDR:MASTER_PORT, "
        "a file system, a download); one rank's stack shows where"
    )
    capped = Severity.INFO if severity == Severity.INFO else Severity.WARNING
    return alert(AlertKind.STARTUP_HANG, capped, [], [], message, hint)


def _waiting_for_missing(
    missing: list[int], waiters: list[int], phase: str, longest: float, note: str = ""
) -> Alert:
    """Ranks that never connected, named; ``note`` says which others are still starting."""
    waited = "been starting" if phase == Phase.STARTING else f"waited in '{phase}'"
    message = (
        f"{format_ranks(missing)} never connected while {format_ranks(waiters)} "
        f"{verb(len(waiters), 'has', 'have')} {waited} for {seconds(longest)}"
    ) + (f"; {note}" if note else "")
    hint = (
        "start the missing ranks or fix their launch (nnodes x nproc_per_node must equal "
        "WORLD_SIZE); their own logs say why they did not come up"
    )
    return alert(AlertKind.STARTUP_HANG, Severity.ERROR, missing, waiters, message, hint)


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
    waiting = [r.rank for r in f.live if r.step is None and not still_starting(r, now)]
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
