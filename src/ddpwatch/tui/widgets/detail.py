"""The detail pane of the selected rank: identity, environment, sparklines, stack or traceback."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.geometry import Size
from textual.widget import Widget
from textual.widgets import Static

from ddpwatch.core.vocabulary import AlertKind, RankState
from ddpwatch.status.fmt import MIB, NA, human_bytes, short_seconds
from ddpwatch.status.schema import AlertEntry, RankEntry
from ddpwatch.tui.data.model import step_split
from ddpwatch.tui.widgets.fmt import loss_text, sparkline
from ddpwatch.tui.widgets.header import SEVERITY_GLYPH, SEVERITY_STYLE
from ddpwatch.tui.widgets.packed import Packed

STATE_STYLE: dict[str, str] = {
    RankState.RUNNING: "bold green",
    RankState.WAITING: "bold yellow",
    RankState.STALLED: "bold yellow",
    RankState.BUSY: "bold cyan",
    RankState.SILENT: "bold red",
    RankState.CRASHED: "bold red",
    RankState.NOT_CONNECTED: "bold red",
    RankState.EXITED: "dim",
    RankState.STOPPED: "dim italic",
}


def _v(value: Any) -> str:
    return NA if value is None else str(value)


def _host_memory(row: RankEntry, kv: Any) -> list[Text]:
    """The rank's host memory, its workers' and how fast they grow ("host mem 3.1G +1.2G workers
    +20.1M/s"), where its agent tells (``host_memory`` alerts read the same)."""
    rss = row.host_rss_bytes
    if rss is None:
        return []
    text = human_bytes(rss)
    if row.workers_rss_bytes:
        text += f" +{human_bytes(row.workers_rss_bytes)} workers"
    rate = row.host_mem_growth_bytes_per_s
    if rate is not None and abs(rate) >= MIB:
        text += f" {'+' if rate > 0 else '-'}{human_bytes(abs(rate))}/s"
    return [kv("host mem", text)]


def split_text(row: RankEntry) -> Text | None:
    """Where the rank's step goes, in words: "input 12ms · compute 235ms · waiting 3ms (1%) of
    a 250ms step"; the wait's two parts named when both took time ("waiting 90ms (36%: 60ms in
    DDP's all-reduce, 30ms in collectives)"). None when the rank reports no split."""
    split = step_split(row)
    if split is None:
        return None
    inputs, compute, wait = split
    step = inputs + compute + wait
    share = f"{round(100 * wait / step)}%"
    grads = min(wait, row.grad_wait_s or 0.0)
    if 0 < grads < wait:
        share += (
            f": {short_seconds(grads)} in DDP's all-reduce, "
            f"{short_seconds(wait - grads)} in collectives"
        )
    return Text.assemble(
        ("input ", "dim"),
        (short_seconds(inputs), "bold"),
        (" · compute ", "dim"),
        (short_seconds(compute), "bold"),
        (" · waiting ", "dim"),
        (short_seconds(wait), "bold"),
        (f" ({share}) of a ", "dim"),
        (short_seconds(step), "bold"),
        (" step", "dim"),
    )


def identity_paragraphs(row: RankEntry, alerts: list[AlertEntry]) -> list[list[Text]]:
    """Who the rank is, where it runs, what it does now, where its step goes, and the alerts
    that name it."""

    def kv(label: str, value: str, style: str = "bold") -> Text:
        return Text.assemble((label + " ", "dim"), (value, style))

    rank = row.rank
    loss = loss_text(row.loss)
    if row.loss is None and any(a.kind == AlertKind.NAN_LOSS and rank in a.ranks for a in alerts):
        loss = "nan"
    local = _v(row.local_rank)
    if row.local_world_size is not None:
        local += f"/{row.local_world_size}"
    state = row.state or RankState.NOT_CONNECTED
    state_text = Text.assemble(("state ", "dim"), (state, STATE_STYLE.get(state, "bold")))
    if row.exit_code is not None or row.exit_signal:
        how = f"code {row.exit_code}" if row.exit_code is not None else ""
        if row.exit_signal:
            how = f"{how} {row.exit_signal}".strip()
        state_text.append(f" ({how})", style="dim")
    seen = row.last_seen_s
    gpu = f"{human_bytes(row.gpu_mem_used_bytes)}/{human_bytes(row.gpu_mem_total_bytes)}"
    paragraphs: list[list[Text]] = [
        [
            Text(f" rank {rank} ", style="bold reverse"),
            Text("simulated", style="italic magenta") if row.simulated else Text(""),
            kv("host", _v(row.host)),
            kv("pid", _v(row.pid)),
            kv("local rank", local),
            kv("node", _v(row.node_rank)),
            kv("launcher", _v(row.launcher)),
            kv("device", _v(row.device)),
            Text(row.device_name or "", style="bold"),
            kv("uuid", _v(row.device_uuid)),
            kv("gpu pids", ",".join(map(str, row.gpu_pids))) if row.gpu_pids else Text(""),
        ],
        [
            state_text,
            kv("phase", _v(row.phase)),
            kv("step", _v(row.step)),
            kv("seen", NA if seen is None else f"{short_seconds(seen)} ago"),
            kv("loss", loss, "bold red" if loss == "nan" else "bold"),
            kv("step time", short_seconds(row.step_time_s)),
            kv("avg", short_seconds(row.avg_step_time_s)),
            kv("data wait", short_seconds(row.data_wait_s)),
            kv("in collectives", short_seconds(row.collective_time_s)),
        ],
        [
            kv("alloc", human_bytes(row.mem_allocated_bytes)),
            kv("reserved", human_bytes(row.mem_reserved_bytes)),
            kv("peak", human_bytes(row.mem_peak_bytes)),
            kv("gpu", gpu),
            *_host_memory(row, kv),
        ],
    ]
    split = split_text(row)
    if split is not None:
        paragraphs.insert(2, [split])
    coll = row.collective
    if coll is not None:
        seq = f" #{coll.seq}" if coll.seq is not None else ""
        paragraphs.append(
            [
                Text.assemble(
                    ("in collective ", "dim"),
                    (f"{coll.op}{seq}", "bold"),
                    (" for ", "dim"),
                    (short_seconds(coll.since_s), "bold yellow"),
                )
            ]
        )
    return paragraphs


def trouble_paragraphs(row: RankEntry, alerts: list[AlertEntry]) -> list[list[Text]]:
    """The rank's exception, if any, and the alerts that name it (as culprit or as waiting)."""
    rank = row.rank
    paragraphs: list[list[Text]] = []
    error = row.error
    if error is not None:
        paragraphs.append(
            [Text.assemble((f"{error.type or 'Error'}: ", "bold red"), (error.message, "red"))]
        )
    for alert in alerts:
        severity = alert.severity
        role = "culprit" if rank in alert.ranks else "waiting"
        paragraphs.append(
            [
                Text.assemble(
                    (
                        f"{SEVERITY_GLYPH.get(severity, '●')} {alert.kind}",
                        SEVERITY_STYLE.get(severity, "bold"),
                    ),
                    (f" ({role}) ", "dim"),
                    (alert.message, ""),
                )
            ]
        )
    return paragraphs


def stack_text(row: RankEntry) -> Text:
    """The exception and its traceback, or the current stack, or why there is none."""
    error = row.error
    if error is not None:
        text = Text()
        traceback = error.traceback.rstrip()
        if traceback:
            if not traceback.startswith("Traceback"):
                text.append("traceback:\n", style="dim")
            text.append_text(_code(traceback))
        else:
            text.append(
                "no traceback (the rank died without running its excepthook)", style="dim italic"
            )
        stack = row.stack
        if stack and stack.strip() != traceback:
            text.append("\nstack at crash:\n", style="dim")
            text.append_text(_code(stack.rstrip()))
        return text
    stack = row.stack
    if stack:
        return Text.assemble(("current stack:\n", "dim"), _code(stack.rstrip()))
    return Text(
        "no stack yet (a rank sends its stack once it has made no step for a few seconds)",
        style="dim italic",
    )


def _code(block: str) -> Text:
    text = Text()
    for i, raw in enumerate(block.splitlines()):
        if i:
            text.append("\n")
        stripped = raw.lstrip()
        if stripped.startswith("File "):
            text.append(raw, style="cyan")
        elif stripped.startswith(("Traceback", "Thread", "Current thread")):
            text.append(raw, style="dim")
        elif raw and not raw.startswith(" ") and ":" in raw:
            text.append(raw, style="bold red")
        else:
            text.append(raw)
    return text


class Sparks(Widget):
    """Sparklines of step time, loss and memory, sized to the pane's width."""

    DEFAULT_CSS = """
    Sparks { height: 3; }
    """

    LABELS = (
        ("step_time", "step time", short_seconds),
        ("loss", "loss", loss_text),
        ("mem", "memory", human_bytes),
    )

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.series: dict[str, list[float | None]] = {}

    def show(self, series: dict[str, list[float | None]]) -> None:
        self.series = series
        self.refresh()

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return 3

    def render(self) -> Text:
        width = self.content_size.width or 60
        lines = []
        for key, label, fmt in self.LABELS:
            values = self.series.get(key) or []
            last = next((v for v in reversed(values) if v is not None), None)
            value = fmt(last) if last is not None else NA
            room = max(0, width - 10 - 9)
            spark = sparkline(values, room)
            lines.append(
                Text.assemble(
                    (f"{label:<10}", "dim"),
                    (spark.ljust(room), "green" if key != "loss" else "cyan"),
                    (f" {value:>8}", "bold"),
                )
            )
        return Text("\n").join(lines)


def log_text(row: RankEntry) -> Text:
    """The last lines the rank printed (its stdout and stderr, through the agent)."""
    lines = row.log_tail or []
    if not lines:
        return Text("")
    return Text.assemble(("\noutput (last lines):\n", "dim"), ("\n".join(lines), ""))


class RankDetail(VerticalScroll, can_focus=True):
    """Everything about one rank; follows the table's cursor."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rank: int | None = None

    def compose(self) -> ComposeResult:
        yield Packed(id="detail-identity")
        yield Packed(id="detail-trouble")
        yield Sparks(id="detail-sparks")
        yield Static(id="detail-stack")
        yield Static(id="detail-log")

    def show(
        self,
        row: RankEntry | None,
        series: dict[str, list[float | None]],
        alerts: list[AlertEntry],
    ) -> None:
        if row is None:
            self.rank = None
            self.border_title = "detail"
            self.query_one("#detail-identity", Packed).show(
                [[Text("no rank selected", style="dim")]]
            )
            self.query_one(Sparks).show({})
            self.query_one("#detail-trouble", Packed).show([])
            self.query_one("#detail-stack", Static).update("")
            self.query_one("#detail-log", Static).update("")
            return
        if row.rank != self.rank:
            self.scroll_home(animate=False)
        self.rank = row.rank
        title = f"rank {row.rank}"
        if row.host:
            title += f" · {row.host}"
        self.border_title = title
        named = [a for a in alerts if row.rank in a.ranks or row.rank in a.waiting]
        self.query_one("#detail-identity", Packed).show(identity_paragraphs(row, named))
        self.query_one(Sparks).show(series)
        self.query_one("#detail-trouble", Packed).show(trouble_paragraphs(row, named))
        self.query_one("#detail-stack", Static).update(stack_text(row))
        self.query_one("#detail-log", Static).update(log_text(row))
