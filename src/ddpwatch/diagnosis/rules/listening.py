"""The server's own view: when it has fallen behind its ranks' messages it names no rank
silent or stalled (``Facts.now`` is as of what it has read), and says why it is quiet."""

from __future__ import annotations

from ddpwatch.core.vocabulary import AlertKind, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.status.fmt import seconds


@rule(AlertKind.SERVER_BEHIND)
def rule_server_behind(f: Facts) -> list[Alert]:
    """Not caught up with its queue for longer than the silent threshold: a warning with no
    culprit, so that the absence of other alerts is not read as a healthy job."""
    if f.lag <= f.th.silent or not f.state.ranks:
        return []
    message = (
        f"the server has not caught up with its ranks' messages for {seconds(f.lag)} "
        f"({len(f.state.ranks)} ranks): it judges every rank as of then and names none "
        "silent or stalled until it catches up"
    )
    hint = (
        "one server takes about 60,000 heartbeats a second (30,000 ranks) on a core it shares "
        "(docs/performance.md): give it a core of its own, and run a relay per node (`ddpwatch "
        "run --addr` starts one, `ddpwatch relay --to HOST:PORT` by hand)"
    )
    return [alert(AlertKind.SERVER_BEHIND, Severity.WARNING, [], [], message, hint)]
