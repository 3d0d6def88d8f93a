"""Start-up configuration that differs between ranks: the odd rank named with both values,
and one rank reported by two live processes (``duplicate_rank``).

Ranks started by hand (an ``srun`` line, a script per node) can disagree on what their
rendezvous depends on: one rank's ``MASTER_PORT`` or ``WORLD_SIZE`` is another's, and every
rank waits in ``init_process_group`` until its timeout (minutes) with nothing to say which.
Each rank's identity carries those values (``protocol.Identity``: read by the agent at
interpreter start and again when the rank calls ``init_process_group``), so the server names
the rank that differs from the majority while the others wait, with both values.

Rendezvous values are judged only among ranks that called ``init_process_group`` (their
``init_method`` is known), and only while one of them is held in the rendezvous for
``RENDEZVOUS_HOLD_S``: values that differ in a job whose group formed anyway (``localhost``
on one node, the host's name on another) did no harm and are not named. ``MASTER_ADDR`` and
``MASTER_PORT`` count only for ranks that read them (``env://``). Build values (torch, CUDA,
NCCL, the script's hash) are a warning whenever ranks of one job differ. With no strict
majority (two ranks, one value each) both sides are shown and no rank is named.
"""

from __future__ import annotations

from ddpwatch.core.vocabulary import AlertKind, Phase, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.launch import Difference, held_in_rendezvous, launch_differences
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.diagnosis.text import format_ranks, verb
from ddpwatch.status.fmt import seconds


@rule(AlertKind.CONFIG_MISMATCH, every="slow")
def rule_config_mismatch(f: Facts) -> list[Alert]:
    """Ranks whose start-up configuration differs from the others': a rendezvous value while
    the rendezvous holds (error), a build value at any time (warning)."""
    judged = f.rendezvous_split
    _, build = launch_differences(f.state)
    shown = judged + build
    if not shown:
        return []
    culprits = sorted({r for d in shown for r in d.odd})
    waiting = [r.rank for r in f.records if r.phase == Phase.RENDEZVOUS and r.init_method]
    clauses = [_clause(d) for d in shown]
    if judged:
        held = held_in_rendezvous(f.records, f.now)
        assert held is not None
        waited = f" ({seconds(held)} so far)" if held != float("inf") else ""
        message = "; ".join(clauses) + f": the ranks cannot meet in the rendezvous{waited}"
        hint = _RENDEZVOUS_HINT
        if not culprits:
            hint += "; with no majority, which side is wrong cannot be told"
        return [alert(AlertKind.CONFIG_MISMATCH, Severity.ERROR, culprits, waiting, message, hint)]
    message = "; ".join(clauses)
    return [alert(AlertKind.CONFIG_MISMATCH, Severity.WARNING, culprits, [], message, _BUILD_HINT)]


def _clause(d: Difference) -> str:
    """'rank 2 uses MASTER_PORT 41233; ranks 0, 1 use 29500' (majority), or every side."""
    sides = list(d.values.items())
    if d.odd:
        majority, rest = sides[0], sides[1:]
        odd = ", ".join(
            f"{format_ranks(ranks)} {verb(len(ranks), _verb(d), _verb(d, many=True))} "
            f"{_value(d, value)}"
            for value, ranks in rest
        )
        value, ranks = majority
        return (
            f"{odd}; {format_ranks(ranks)} {verb(len(ranks), _verb(d), _verb(d, many=True))} "
            f"{_short(d, value)}"
        )
    listed = ", ".join(f"{format_ranks(ranks)} {_short(d, value)}" for value, ranks in sides[:4])
    return f"the ranks disagree on {_what(d)}: {listed}"


def _verb(d: Difference, many: bool = False) -> str:
    run = d.field in ("torch_version", "cuda_version", "nccl_version", "script_hash")
    if run:
        return "run" if many else "runs"
    return "use" if many else "uses"


def _what(d: Difference) -> str:
    return "the script (its SHA-256)" if d.field == "script_hash" else d.name


def _value(d: Difference, value: str) -> str:
    """The odd side's value with its name: 'MASTER_PORT 41233', 'torch 2.12.0'."""
    if d.field == "script_hash":
        return f"another copy of the script (SHA-256 {value}…)"
    return f"{d.name} {value}"


def _short(d: Difference, value: str) -> str:
    return f"{value}…" if d.field == "script_hash" else value


_RENDEZVOUS_HINT = (
    "every rank must use the same MASTER_ADDR:MASTER_PORT, WORLD_SIZE and backend: set them "
    "once for the whole job (export them in the batch script before srun, or let torchrun set "
    "them) rather than per rank or per node"
)
_BUILD_HINT = (
    "run the same environment everywhere: one torch (and CUDA, NCCL) on every node, and the "
    "same copy of the script (a shared file system or one container image); mixed builds "
    "hang or fail in collectives"
)


CLAIM_FRESH_S = 15.0
"""A process still claims its rank while it repeated its identity this recently (every 10th
heartbeat: 5 s at the default interval)."""


@rule(AlertKind.DUPLICATE_RANK, every="slow")  # a claim goes stale with time, not with a change
def rule_duplicate_rank(f: Facts) -> list[Alert]:
    """Two or more live processes report the same rank (``state/claims.py``)."""
    alerts = []
    missing = f.state.missing_ranks()
    for rank, claims in sorted(f.state.claims.duplicates.items()):
        live = sorted(
            (c for c in claims.values() if f.now - c.last_seen <= CLAIM_FRESH_S),
            key=lambda c: c.pid,
        )
        if len(live) < 2:
            continue
        where = " and ".join(f"pid {c.pid}" + (f" on {c.host}" if c.host else "") for c in live[:4])
        message = (
            f"rank {rank} is reported by {len(live)} processes at once: {where}; they cannot "
            "form one process group, and their reports mix"
        )
        if missing:
            message += f" ({format_ranks(missing)} never connected: one of them was meant to be it)"
        alerts.append(
            alert(AlertKind.DUPLICATE_RANK, Severity.ERROR, [rank], [], message, _DUPLICATE_HINT)
        )
    return alerts


_DUPLICATE_HINT = (
    "give every process its own RANK: under srun take it from SLURM_PROCID (not SLURM_LOCALID, "
    "which repeats on every node); two `torchrun --standalone` on two nodes are two jobs with "
    "the same ranks (use --nnodes and one --rdzv-endpoint); or the job was started twice"
)
