"""ddpwatch report: real recordings (a real Server recording what real ZeroMQ publishers
send) turned into Markdown, HTML and JSON post-mortems through the real command line, and
two runs compared: "did my fix help?"."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conftest import ROOT, Recording

from ddpwatch.core.protocol import ErrorInfo, Event, Sample, encode
from ddpwatch.outputs.postmortem import SERIES_POINTS, TIMES, load_run
from ddpwatch.server.recording import MAGIC, Recorder
from ddpwatch.server.replay import replay_to_end
from ddpwatch.status.contract import schema_text

pytestmark = pytest.mark.xdist_group("report")  # one worker: its module fixture

RANKS, STEPS = 3, 20
GIB, MIB = 1 << 30, 1 << 20
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "train.py", line 41, in <module>\n'
    "    if scale < limit & mask:\n"
    'ValueError: bad batch <id=7> & "labels"'
)
STACK = 'File "train.py", line 40, in <module>\n    loss = model(batch)'


def _sample(rank: int, step: int, step_time: float) -> bytes:
    return encode(
        Sample(
            v=1, rank=rank, t=time.time(), step=step, world_size=RANKS, host="node-a",
            pid=100 + rank, local_rank=rank, phase="forward", step_time_s=step_time,
            loss=1.0 / step, mem_allocated_bytes=GIB + rank * 256 * MIB + step * MIB,
        )
    )  # fmt: skip


def _event(rank: int, event: str, **fields: Any) -> bytes:
    return encode(Event(v=1, rank=rank, t=time.time(), event=event, **fields))


def record_run(path: Path, slow_and_crash: bool) -> Path:
    """A 3-rank run recorded by a real server: with ``slow_and_crash`` rank 1 takes 0.4 s a
    step (the others 0.1 s), then crashes and the launcher stops the others; else all ranks
    take 0.1 s and exit 0."""
    live = Recording(path)
    try:
        for step in range(1, STEPS + 1):
            for rank in range(RANKS):
                live.send(_sample(rank, step, 0.4 if slow_and_crash and rank == 1 else 0.1))
            time.sleep(0.03)
        if slow_and_crash:
            error = ErrorInfo(
                type="ValueError",
                message='bad batch <id=7> & "labels"',
                traceback=TRACEBACK,
            )
            live.send(_event(1, "stack", stack=STACK))
            live.send(_event(1, "crash", step=STEPS, error=error), _event(1, "exit", exit_code=1))
            live.wait_for(lambda s: any(a["kind"] == "crashed" for a in s["alerts"]), 5)
            live.send(_event(0, "exit", signal="SIGTERM"), _event(2, "exit", signal="SIGTERM"))
            sent = RANKS * STEPS + 5
        else:
            live.send(*(_event(rank, "exit", exit_code=0) for rank in range(RANKS)))
            sent = RANKS * STEPS + RANKS
        live.wait_for(lambda s: s["stats"]["received"] == sent, 5)
        time.sleep(0.5)  # a few more diagnosis ticks on the final state
    finally:
        live.stop()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the slow run whose rank 1 crashed, the fixed run)."""
    base = tmp_path_factory.mktemp("runs")
    return record_run(base / "slow.ddpw", True), record_run(base / "fixed.ddpw", False)


SLOW_VERDICT = (
    'rank 1 crashed with ValueError (bad batch <id=7> & "labels") at step 20, which ended the '
    "job; ranks 0, 2 were stopped because of it"
)
FIXED_VERDICT = "the job finished: every rank exited 0; no problems seen"


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpwatch", "report", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


class Page(HTMLParser):
    """Checks that every tag closes in order, and collects each SVG's polylines and the
    text of each <pre> by class."""

    VOID = frozenset({"meta", "br", "hr", "img", "input", "link", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.svgs: list[list[dict[str, str | None]]] = []
        self.pre: dict[str, list[str]] = {}
        self._pre: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "svg":
            self.svgs.append([])
        if tag == "polyline":
            assert "svg" in self.open, "a polyline outside an svg"
            self.svgs[-1].append(dict(attrs))
        if tag == "pre":
            self._pre = dict(attrs).get("class") or ""
            self.pre.setdefault(self._pre, []).append("")
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open[-1] == tag, f"</{tag}> closes {self.open[-1:]}"
        self.open.pop()
        if tag == "pre":
            self._pre = None

    def handle_data(self, data: str) -> None:
        if self._pre is not None:
            self.pre[self._pre][-1] += data


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    assert page.open == [], page.open
    return page


# ------------------------------------------------------------------ one run


def test_markdown_report_tells_the_story(runs: tuple[Path, Path]) -> None:
    result = report(str(runs[0]))
    assert result.returncode == 0, result.stderr
    md = result.stdout
    assert f"verdict: {SLOW_VERDICT}" in md
    assert f"**Verdict:** {SLOW_VERDICT.replace('<', chr(92) + '<')}" in md
    timeline = md.split("## Timeline")[1].split("## Ranks")[0]
    rows = [line for line in timeline.splitlines() if line.startswith("| +")]
    assert len(rows) == 1 and "| raised #1 | error | crashed | 1 |" in rows[0], timeline
    assert "\\<id=7>" in rows[0]  # a viewer must not take it for a tag
    ranks = md.split("## Ranks")[1].split("## Culprits")[0]
    assert "| 1 | node-a | crashed | 20 | 0.400 s | 1.27 GiB | crashed |" in ranks, ranks
    assert "| 0 | node-a | stopped | 20 | 0.100 s | 1.02 GiB | — |" in ranks, ranks
    culprits = md.split("## Culprits")[1].split("## Hints")[0]
    assert "### rank 1: crashed at step 20" in culprits
    assert f"Traceback:\n\n```text\n{TRACEBACK}\n```" in culprits
    assert f"Last stack:\n\n```text\n{STACK}\n```" in culprits
    assert "- **crashed**: read the traceback of rank 1" in md.split("## Hints")[1]


def test_html_report_is_one_well_formed_page_with_a_line_per_rank(
    runs: tuple[Path, Path],
) -> None:
    result = report(str(runs[0]), "--format", "html")
    assert result.returncode == 0, result.stderr
    page = parse(result.stdout)
    assert len(page.svgs) == 2  # step time, memory
    for polylines in page.svgs:
        assert sorted(p["data-rank"] for p in polylines) == ["0", "1", "2"]
        for p in polylines:
            assert len(p["points"].split()) == STEPS
    step_time = {p["data-rank"]: p["points"] for p in page.svgs[0]}
    # rank 1's line (0.4 s) is drawn above the others (0.1 s): SVG y grows downwards
    height = {rank: float(points.split()[0].split(",")[1]) for rank, points in step_time.items()}
    assert height["1"] < height["0"] == height["2"]
    assert page.pre["traceback"] == [TRACEBACK]
    assert page.pre["stack"] == [STACK]
    assert "if scale &lt; limit &amp; mask:" in result.stdout
    assert "if scale < limit & mask" not in result.stdout
    for fetches in ("<script", "src=", "href=", "@import"):
        assert fetches not in result.stdout  # self-contained: nothing to fetch
    assert html.escape(SLOW_VERDICT) in result.stdout


def test_json_report_has_every_ranks_series(runs: tuple[Path, Path]) -> None:
    result = report(str(runs[0]), "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["verdict"] == SLOW_VERDICT
    assert [(e["kind"], e["ranks"], e["cleared_s"]) for e in data["episodes"]] == [
        ("crashed", [1], None)
    ]
    assert data["attempts"] == [{"attempt": 1, "verdict": SLOW_VERDICT}]
    assert data["time_lost"] == []
    assert sorted(data["series"]) == ["0", "1", "2"]
    for rank, series in data["series"].items():
        assert [v for _, v in series["step"]] == list(range(1, STEPS + 1))
        want = 0.4 if rank == "1" else 0.1
        assert [v for _, v in series["step_time_s"]] == [want] * STEPS
        memory = [v for _, v in series["mem_allocated_bytes"]]
        assert memory[-1] == GIB + int(rank) * 256 * MIB + STEPS * MIB
        times = [t for t, _ in series["step"]]
        assert times == sorted(times) and 0 <= times[0] < times[-1]
    assert [r["median_step_time_s"] for r in data["ranks"]] == [0.1, 0.4, 0.1]
    culprit = data["culprits"][0]
    assert culprit["rank"] == 1 and culprit["error"]["traceback"] == TRACEBACK
    assert culprit["alerts"][0]["kind"] == "crashed"
    assert [e["alert"]["kind"] for e in data["status"]["history"]] == ["crashed"]
    assert data["undecodable_frames"] == 0 and data["tail_bytes"] == 0
    jsonschema.validate(data, json.loads(schema_text("report")))  # the published contract


def test_output_file(runs: tuple[Path, Path], tmp_path: Path) -> None:
    target = tmp_path / "post-mortem.html"
    result = report(str(runs[0]), "--format", "html", "-o", str(target))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target)
    parse(target.read_text(encoding="utf-8"))


def test_a_torn_recording_still_reports_and_says_so(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    torn = tmp_path / "torn.ddpw"
    shutil.copy(runs[0], torn)
    with torn.open("ab") as file:
        file.write(b"\x40\x00\x00\x00\x01")  # the server died mid-write
    result = report(str(torn))
    assert result.returncode == 0, result.stderr
    assert "partial record: its last 5 bytes were not read" in result.stdout
    assert "verdict: rank 1 crashed with ValueError" in result.stdout


# ------------------------------------------------------------------ two runs


def test_comparison_shows_the_step_time_change(runs: tuple[Path, Path]) -> None:
    slow, fixed = (str(p) for p in runs)
    md = report(slow, fixed)
    assert md.returncode == 0, md.stderr
    assert (
        f"| median step time, slowest rank | 0.400 s | 0.100 s | -75.0% ({TIMES}0.25) |"
        in md.stdout
    )
    assert f"| median step time, all ranks | 0.100 s | 0.100 s | +0.0% ({TIMES}1.00) |" in md.stdout
    slow_cell = SLOW_VERDICT.replace("<", "\\<")
    assert f"| verdict | {slow_cell} | {FIXED_VERDICT} |  |" in md.stdout
    assert (
        f"| 1 | 20 | 20 | 0.400 s | 0.100 s | -75.0% ({TIMES}0.25) | 1.27 GiB | 1.27 GiB |"
        in md.stdout
    )
    assert "| crashed | — |" in md.stdout

    data = json.loads(report(slow, fixed, "--format", "json").stdout)
    assert data["ratio"]["slowest_step_time"] == pytest.approx(0.25)
    assert [r["step_time_ratio"] for r in data["ranks"]] == pytest.approx([1.0, 0.25, 1.0])
    assert data["ranks"][1]["runs"][0]["alerts"] == ["crashed"]
    assert data["ranks"][1]["runs"][1]["alerts"] == []

    html = report(slow, fixed, "--format", "html")
    assert html.returncode == 0, html.stderr
    page = parse(html.stdout)
    assert len(page.svgs) == 4  # step time and memory, for A and for B
    assert all(sorted(p["data-rank"] for p in svg) == ["0", "1", "2"] for svg in page.svgs)
    # one scale for both runs: the fixed rank 1 is drawn lower than the slow one
    first_y = [float(s[1]["points"].split()[0].split(",")[1]) for s in page.svgs[:2]]
    assert first_y[0] < first_y[1]
    assert f"-75.0% ({TIMES}0.25)" in html.stdout


# ------------------------------------------------------------------ long runs and bad files


def test_a_long_run_is_downsampled_but_keeps_its_spike(tmp_path: Path) -> None:
    path = tmp_path / "long.ddpw"
    t0 = 1_000_000.0
    recorder = Recorder(path, {"started": t0, "ticks": True})
    for step in range(1, 3001):
        t = t0 + step * 0.1
        slow = 5.0 if step == 1777 else 0.2
        for rank in range(2):
            frame = Sample(
                v=1, rank=rank, t=t, step=step, world_size=2, step_time_s=slow,
                mem_allocated_bytes=GIB + (512 * MIB if step == 2222 else 0),
            )  # fmt: skip
            recorder.frame(t, encode(frame))
        if step % 5 == 0:
            recorder.tick(t)
    recorder.frame(t0 + 400, b"\x93not a message")  # a frame that no longer decodes
    recorder.close()
    run = load_run(path, *replay_to_end(path))
    assert run.undecodable == 1 and run.frames == 6001
    for series in run.series.values():
        assert series.samples == 3000 and series.max_step == 3000
        for metric in ("step", "step_time_s", "mem_allocated_bytes"):
            assert 100 < len(series.points[metric]) <= SERIES_POINTS, metric
        step_times = [v for _, v in series.points["step_time_s"]]
        assert max(step_times) == 5.0  # the one slow step survives downsampling
        assert max(v for _, v in series.points["mem_allocated_bytes"]) == GIB + 512 * MIB
        assert series.points["step"][-1] == (pytest.approx(299.9), 3000.0)  # the last is kept
        assert series.peak_mem_bytes == GIB + 512 * MIB
    # the median is over every step, not the plotted ones: the server's, in the document
    assert [r.median_step_time_s for r in run.ranks] == [0.2, 0.2]


@pytest.mark.parametrize("kind", ["missing", "text", "garbage"])
def test_a_file_that_is_not_a_readable_recording_fails_in_one_line(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "run.ddpw"
    if kind == "text":
        path.write_text("my notes\n")
    elif kind == "garbage":
        path.write_bytes(MAGIC + b"\xff" * 64)
    result = report(str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("ddpwatch report: ") and str(path) in result.stderr
    assert "Traceback" not in result.stderr
