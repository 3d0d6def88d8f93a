"""A per-node relay that went away: one alert about the relay, not one per rank it carried.

A relay's batches are its heartbeat. When they stop, its ranks either went silent with it
(the node, its network, or the relay with ranks that cannot reach the server directly: one
error naming that node's ranks) or moved to the server directly (a warning: nothing is lost
but the batching). Ranks that went silent with their relay are left out of ``silent``
(``Facts.relay_silent``, read by ``find_cascade``), so the culprit is said once, as the relay,
and only once every rank it carried to its end is silent or heard directly: its ranks' last
frames came in its last batches, not all in one, so they go silent a batch apart.
"""

from __future__ import annotations

from ddpwatch.core.vocabulary import AlertKind, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.diagnosis.text import format_ranks, verb
from ddpwatch.state.relays import LostRelay
from ddpwatch.status.fmt import seconds


@rule(AlertKind.RELAY_LOST)
def rule_relay_lost(facts: Facts) -> list[Alert]:
    alerts: list[Alert] = []
    moved: list[LostRelay] = []
    if not facts.lost_relays:
        return alerts
    waiting = [r.rank for r in facts.live if r.collective is not None]
    for lost in facts.lost_relays:
        if lost.going:
            continue  # said once its ranks are all silent or moved: one alert, all its ranks
        if not lost.silent:
            moved.append(lost)
            continue
        relay, ranks = lost.relay, [r.rank for r in lost.silent]
        age = facts.now - relay.last_seen
        message = (
            f"the relay on host {relay.host or relay.name} was lost {seconds(age)} ago and "
            f"{verb(len(ranks), 'its rank', 'its ranks')} {format_ranks(ranks)} went silent "
            "with it: the node or its network is gone, or the relay died and "
            f"{verb(len(ranks), 'the rank cannot', 'the ranks cannot')} reach the server"
        )
        hint = (
            f"check host {relay.host or relay.name}: is it up, and are its ranks alive "
            "(ps, nvidia-smi)? If they are, the relay process died and the server is "
            "not reachable from that node directly: restart `ddpwatch relay` there"
        )
        alerts.append(alert(AlertKind.RELAY_LOST, Severity.ERROR, ranks, waiting, message, hint))
    if moved:
        hosts = ", ".join(sorted({m.relay.host or m.relay.name for m in moved}))
        count = sum(len(m.moved) for m in moved)
        message = (
            f"{verb(len(moved), 'the relay', 'the relays')} on {hosts} stopped; "
            f"{verb(count, 'its rank reports', 'their ranks report')} to the server directly"
        )
        hint = (
            "nothing is lost but the batching; restart `ddpwatch relay` on that node: its "
            "ranks go back to it within 10 s"
        )
        alerts.append(alert(AlertKind.RELAY_LOST, Severity.WARNING, [], [], message, hint))
    return alerts
