"""The server's own view: when it has fallen behind its ranks' messages it names no rank
silent or stalled (``Facts.now`` is as of what it has read), and says why it is quiet. A
collector that stopped (its thread ended: ``state.collector_stopped``) or keeps failing
(``state.collector_failure``) is said in so many words: the same quiet, but no load explains
it, and the absence of other alerts must not read as a healthy job."""

from __future__ import annotations

import time

from ddpwatch.core.vocabulary import AlertKind, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.status.fmt import seconds

_REPORT_HINT = (
    "a bug in ddpwatch, not in the job: the server printed its traceback to stderr; please "
    "report it. The job itself is not affected; restart the watch to see it live again"
)


@rule(AlertKind.SERVER_BEHIND)
def rule_server_behind(f: Facts) -> list[Alert]:
    """Not caught up with its queue for longer than the silent threshold: a warning with no
    culprit, so that the absence of other alerts is not read as a healthy job. A collector
    whose thread stopped is an error at once, whether or not a rank has reported."""
    if f.state.collector_stopped is not None:
        return [_collector_stopped(f, f.state.collector_stopped)]
    if f.lag <= f.th.silent or not f.state.ranks:
        return []
    failure = f.state.collector_failure
    if failure is not None:
        message = (
            f"the server has not taken in its ranks' messages for {seconds(f.lag)}: its "
            f"collector fails ({failure}); it judges every rank as of then and names none "
            "silent or stalled"
        )
        return [alert(AlertKind.SERVER_BEHIND, Severity.WARNING, [], [], message, _REPORT_HINT)]
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


def _collector_stopped(f: Facts, stopped: float) -> Alert:
    """The collector's thread ended: live data stopped when it last read its queue dry."""
    heard = f.state.heard_until
    until = stopped if heard is None else min(heard, stopped)
    message = (
        f"the collector stopped: {f.state.collector_failure or 'its thread ended'}; live data "
        f"stopped at {time.strftime('%H:%M:%S', time.localtime(until))} "
        f"({seconds(max(0.0, f.clock - until))} ago): every rank is judged as of then, none "
        "named silent or stalled, and how the job ends is not seen"
    )
    return alert(AlertKind.SERVER_BEHIND, Severity.ERROR, [], [], message, _REPORT_HINT)
