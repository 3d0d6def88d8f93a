"""The end-of-run summary: how long, which ranks, the alerts in order, how each rank ended,
and one verdict line ("rank 1 exited with code 3 at step 51; ranks 0, 2 failed because of it").

A pure function of the status document: it words the document's own ``verdict`` (the server
judged the run, ``Engine.final_document``) and judges nothing itself, so ``ddpwatch run``,
``demo``, ``serve`` and ``ddpwatch report`` on a recording all print the same story.
"""

from __future__ import annotations

import shlex
import statistics
from typing import Any

from ddpwatch.core.vocabulary import RankState
from ddpwatch.status.fmt import NEW_ATTEMPT, duration, elapsed, step_seconds
from ddpwatch.status.order import median_steps
from ddpwatch.status.schema import EpisodeEntry, RankEntry, StatusDocument, Verdict

ALERTS_LISTED = 20

UNJUDGED = Verdict(
    text="not judged (the document holds no verdict: a page, or an older server's)",
    named=[],
    attempts=[],
    run_s=None,
    median_step_s=None,
    time_lost=[],
)
"""What a document without a ``verdict`` is worded from: nothing is made up for it."""


def told(document: StatusDocument) -> Verdict:
    """The document's verdict, ``UNJUDGED`` where it holds none."""
    return document.verdict if document.verdict is not None else UNJUDGED


def summary_lines(document: StatusDocument, recording: str | None = None) -> list[str]:
    """The summary, one line per item, without a prefix; a job that never started says why
    in its verdict (``job_end``). ``recording``: where the run was recorded, named where the
    summary sends the reader to it."""
    run = told(document)
    lines = [_overview(document, run)]
    if run.episodes:
        lines.append("alerts, in order:")
        several = len(run.attempts) > 1
        attempt = 0
        for episode in run.episodes[:ALERTS_LISTED]:
            if several and episode.attempt != attempt:
                attempt = episode.attempt
                lines.append(f" attempt {attempt}:")
            lines.append("  " + episode_line(episode))
        if len(run.episodes) > ALERTS_LISTED:
            more = len(run.episodes) - ALERTS_LISTED
            where = shlex.quote(recording) if recording else "on the recording"
            lines.append(f"  and {more} more (all of them: ddpwatch report {where})")
    else:
        lines.append("alerts: none")
    lost = lost_line(run)
    if lost:
        lines.append(lost)
    ends = [(r.rank, _ending(r)) for r in document.ranks]
    if any(end for _, end in ends):
        lines.append("ranks: " + " · ".join(f"{rank} {end}" for rank, end in ends if end))
    if len(run.attempts) <= 1:
        lines.append("verdict: " + run.text)
    else:
        total = len(run.attempts)
        lines += [f"verdict: attempt {a.attempt} of {total}: {a.verdict}" for a in run.attempts]
    return lines


def verdict(document: StatusDocument) -> str:
    """One sentence (one per attempt, joined): what ended the job, or that it finished or
    is running; then who held the others up and for how long, and the other errors: the
    document's own ``verdict`` (the server judged it)."""
    return told(document).text


def run_seconds(document: StatusDocument) -> float | None:
    """How long the run lasted (the verdict's ``run_s``): what the summary's "ran ..." says."""
    return told(document).run_s


def figures_lines(document: StatusDocument) -> list[str]:
    """The run's figures as the summary words them: how long it ran, its ranks and steps,
    the median step; the time lost. ``ddpwatch status`` prints them too, so the two agree
    figure for figure."""
    run = told(document)
    lost = lost_line(run)
    return [_overview(document, run), *([lost] if lost else [])]


def lost_line(run: Verdict) -> str | None:
    """"time lost: 1 min 4 s in all (52 % of a 2 min 9 s run): rank 3 held ...; rank 1 was
    slower than ..." (the total where there are several culprits); None where nobody waited."""
    if not run.time_lost:
        return None
    accounts = "; ".join(a.text for a in run.time_lost)
    if len(run.time_lost) == 1:
        return f"time lost: {accounts}"
    lost_s = sum(a.seconds for a in run.time_lost)
    total = f"{duration(lost_s)} in all"
    if run.run_s:
        share = min(100.0, 100.0 * lost_s / run.run_s)
        total += f" ({share:.0f} % of a {duration(run.run_s)} run)"
    return f"time lost: {total}: {accounts}"


def median_text(medians: dict[int, float]) -> str | None:
    """The ranks' median steps in words: "median step 0.008 s", or where they differ by
    more than 10 %, "median step 0.008-0.012 s (rank 3 the slowest)"; None for none."""
    if not medians:
        return None
    low, high = min(medians.values()), max(medians.values())
    if high <= 1.1 * low:
        return f"median step {step_seconds(statistics.median(medians.values()))}"
    slowest = min(r for r, m in medians.items() if m == high)
    low_text = step_seconds(low).removesuffix(" s")
    return f"median step {low_text}-{step_seconds(high)} (rank {slowest} the slowest)"


def episode_line(episode: EpisodeEntry) -> str:
    """One alert episode with its own times: "+5.1 s [error] straggler (warning until
    +13.1 s), cleared after 10.0 s: rank 0 has not entered barrier #46 …"."""
    line = f"{elapsed(episode.raised_s)} [{episode.severity}] {episode.kind}"
    if episode.escalated_s is not None:
        was = episode.first_kind or episode.first_severity
        line += f" ({was} until {elapsed(episode.escalated_s)})"
    up = duration(episode.duration_s)
    if episode.closed_by == NEW_ATTEMPT:
        line += f", ended with attempt {episode.attempt} after {up}"
    elif episode.cleared_s is not None:
        line += f", cleared after {up}"
    else:
        line += f", up until the end ({up})"
    return line + f": {episode.message}"


def _overview(document: StatusDocument, run: Verdict) -> str:
    seen = [r for r in document.ranks if r.state != RankState.NOT_CONNECTED]
    hosts = {r.host for r in seen if r.host}
    steps = [r.step for r in seen if r.step is not None]
    parts = []
    if run.run_s is not None:
        parts.append(f"ran {duration(run.run_s)}")
    if len(run.attempts) > 1:
        parts.append(f"{len(run.attempts)} attempts (the launcher restarted it)")
    host_text = f" on {len(hosts)} host{'s' if len(hosts) != 1 else ''}" if hosts else ""
    parts.append(f"{len(seen)} rank{'s' if len(seen) != 1 else ''} seen{host_text}")
    world = document.world_size
    if world is not None and world > len(seen):
        parts.append(f"{world - len(seen)} of {world} never reported")
    if steps:
        low, high = min(steps), max(steps)
        parts.append(f"last step {high}" if low == high else f"last steps {low}-{high}")
    medians = median_text(median_steps(document.ranks))
    if medians:
        parts.append(medians)
    return ", ".join(parts)


def _ending(rank: RankEntry) -> str:
    """How a rank ended: "finished", "exit 3", "SIGKILL", "crashed (RuntimeError), exit 1",
    or "" while it runs."""
    state = rank.state
    code, signal = rank.exit_code, rank.exit_signal
    how = signal if signal else (f"exit {code}" if code is not None else "")
    if state == RankState.CRASHED:
        error = rank.error
        kind = f"crashed ({error.type})" if error is not None and error.type else "crashed"
        return f"{kind}, {how}" if how else kind
    if state == RankState.EXITED and not signal and code in (0, None):
        return "finished"
    if state in (RankState.STOPPED, RankState.SILENT, RankState.NOT_CONNECTED):
        return f"{state}, {how}" if how else str(state)
    return how


def print_summary(
    document: StatusDocument, file: Any, prefix: str = "ddpwatch: ", recording: str | None = None
) -> None:
    """Write the summary under a rule line, each line prefixed like the alert stream."""
    print(f"{prefix}── summary " + "─" * 40, file=file)
    for line in summary_lines(document, recording):
        print(prefix + line, file=file)
    file.flush()
