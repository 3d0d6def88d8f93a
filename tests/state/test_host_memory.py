"""Host memory: the agent's /proc and cgroup reader, the growth the server keeps per rank,
the ``host_memory`` rule (a leak towards the OOM killer, a rank far above its host's others),
quiet on healthy jobs, and the OOM killer named when a growing rank falls silent.

Jobs go through ``ServerState.apply`` with real samples, two a second, as ranks send them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ddpwatch.agent import hostmem
from ddpwatch.agent.hostmem import HostMemory, cgroup_dirs, meminfo_bytes
from ddpwatch.core.protocol import Sample
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.rules import diagnose, rule_cascade, rule_host_memory
from ddpwatch.server.document import status_document
from ddpwatch.state.host_memory import WARM_S, growth, note
from ddpwatch.state.state import ServerState
from ddpwatch.status.schema import RankEntry

T0 = 1000.0
TH = Thresholds()
MIB = 1 << 20
GIB = 1 << 30
BASE = 3 * GIB  # a CPU rank with torch loaded
Memory = Callable[[int, float], int]  # (rank, seconds since start) -> bytes


def job(
    rss: Memory,
    world: int = 4,
    seconds: float = 20.0,
    quiet_after: dict[int, float] | None = None,
    **fields: Any,
) -> ServerState:
    """``world`` ranks on one host sending a heartbeat every 0.5 s for ``seconds``; rank r
    holds ``rss(r, t)`` bytes; a rank in ``quiet_after`` stops sending after that many s."""
    state = ServerState(started=T0 - 1)
    fields = {"host_available_bytes": 100 * GIB, "host_total_bytes": 128 * GIB, **fields}
    for k in range(int(seconds / 0.5) + 1):
        t = k * 0.5
        for r in range(world):
            if quiet_after and t > quiet_after.get(r, float("inf")):
                continue
            sample = Sample(
                v=1,
                rank=r,
                t=T0 + t,
                pid=100 + r,
                host="node0",
                world_size=world,
                local_rank=r,
                step=k,
                host_rss_bytes=rss(r, t),
                workers_rss_bytes=0,
                **fields,
            )
            state.apply(sample, T0 + t)
    return state


def end(seconds: float = 20.0) -> float:
    return T0 + seconds


def leak(rank: int, rate: float, start: float = 2.0) -> Memory:
    """Rank ``rank`` grows ``rate`` bytes a second from ``start``; the others stay flat."""
    return lambda r, t: int(BASE + (rate * max(0.0, t - start) if r == rank else 0))


def alerts_of(state: ServerState, seconds: float = 20.0) -> list[Alert]:
    return rule_host_memory(state, end(seconds), TH)


# ------------------------------------------------------------------------------- quiet jobs


@pytest.mark.parametrize(
    "rss",
    [
        pytest.param(lambda r, t: BASE, id="flat"),
        pytest.param(lambda r, t: BASE + (2 * GIB if t >= 3 else 0), id="one step up"),
        pytest.param(
            lambda r, t: BASE + (GIB if t >= 8 else 0) + (GIB if t >= 14 else 0), id="two"
        ),
        pytest.param(lambda r, t: int(BASE + 2 * MIB * t), id="all alike, slowly"),
        pytest.param(lambda r, t: int(BASE + 8 * MIB * t), id="all alike, fast, room"),
        pytest.param(leak(1, 20 * MIB, start=14.0), id="a leak of 6 s"),
        pytest.param(leak(1, 3 * MIB), id="a slow leak"),
        pytest.param(
            lambda r, t: BASE + random.Random(int(t * 2) * 7 + r).randrange(-50, 50) * MIB,
            id="noisy",
        ),
    ],
)
def test_a_healthy_job_stays_silent(rss: Memory) -> None:
    state = job(rss)
    assert alerts_of(state) == []
    assert [a for a in diagnose(state, end(), TH) if a.kind == "host_memory"] == []


def test_a_rank_of_its_own_and_unknown_memory_stay_silent() -> None:
    assert alerts_of(job(lambda r, t: BASE, world=1)) == []
    state = ServerState(started=T0)
    state.apply(Sample(v=1, rank=0, t=T0, pid=1, step=1), T0)  # an older agent: no field
    assert rule_host_memory(state, T0 + 1, TH) == []


# ------------------------------------------------------------------------------- the leak


def test_a_steady_leak_is_a_warning_with_the_time_left() -> None:
    state = job(leak(1, 20 * MIB))
    (found,) = alerts_of(state)
    assert (found.kind, found.severity, found.ranks, found.waiting) == (
        "host_memory",
        "warning",
        (1,),
        (),
    )
    assert found.message.startswith("rank 1's host memory grows 20.0 MiB/s, steadily for 15 s")
    assert "the others' median 0.0 MiB/s" in found.message
    # 100 GiB available at 20 MiB/s
    assert "the node's memory (100.0 GiB left) runs out in about 85 min" in found.message
    assert "pytorch#13246" in found.hint and ".item()" in found.hint


def test_a_leak_that_runs_out_within_a_minute_is_an_error() -> None:
    state = job(leak(1, 20 * MIB), host_available_bytes=600 * MIB)
    (found,) = alerts_of(state)
    assert found.severity == "error"
    assert "the node's memory (600 MiB left) runs out in about 30 s" in found.message
    assert "OOM killer" in found.message


def test_the_cgroup_limit_binds_before_the_node() -> None:
    state = job(leak(2, 10 * MIB), cgroup_limit_bytes=16 * GIB, cgroup_used_bytes=15 * GIB)
    (found,) = alerts_of(state)
    assert (found.ranks, found.severity) == ((2,), "warning")
    assert "its cgroup's memory limit (1.0 GiB left) runs out in about 2 min" in found.message


def test_workers_growth_counts_and_is_named() -> None:
    state = ServerState(started=T0)
    for k in range(41):
        t = k * 0.5
        for r in range(3):
            workers = int(GIB + (30 * MIB * t if r == 0 else 0))
            state.apply(
                Sample(
                    v=1, rank=r, t=T0 + t, pid=100 + r, host="h", step=k,
                    host_rss_bytes=BASE, workers_rss_bytes=workers,
                ),
                T0 + t,
            )  # fmt: skip
    (found,) = alerts_of(state)
    assert found.ranks == (0,)
    assert "(the rank 3.0 GiB, its workers 1.6 GiB)" in found.message
    assert "how much memory is left is not known" in found.message


def test_every_rank_growing_alike_warns_when_the_node_runs_out_soon() -> None:
    """The same bug on every rank (a cache every rank fills, pytorch#13246 in every rank's
    workers): alike, but four ranks at 10 MiB/s empty 4 GiB in under two minutes."""
    state = job(lambda r, t: int(BASE + 10 * MIB * t), host_available_bytes=4 * GIB)
    found = alerts_of(state)
    assert sorted(a.ranks for a in found) == [(0,), (1,), (2,), (3,)]
    assert all("runs out in about 2 min" in a.message for a in found)


# ------------------------------------------------------------------------------- uneven


@pytest.mark.parametrize(
    ("gib", "culprits"),
    [
        ((9, 3, 3, 3), (0,)),
        ((4, 3, 3, 3), ()),  # 1.3x
        ((1.5, 0.5, 0.5, 0.5), ()),  # 3x but 1 GiB apart
    ],
)
def test_one_rank_far_above_its_hosts_others(
    gib: tuple[float, ...], culprits: tuple[int, ...]
) -> None:
    state = job(lambda r, t: int(gib[r] * GIB))
    found = alerts_of(state)
    assert [a.ranks for a in found] == ([culprits] if culprits else [])
    if culprits:
        assert found[0].message == (
            "rank 0 holds 9.0 GiB of host memory, 3.0x the median 3.0 GiB of the 4 ranks on node0"
        )


# ------------------------------------------------------------------------------- the OOM killer


def test_a_growing_rank_that_falls_silent_is_likely_the_oom_killer() -> None:
    state = job(leak(1, 20 * MIB), seconds=26.0, quiet_after={1: 20.0})
    (silent,) = [a for a in rule_cascade(state, end(26.0), TH) if a.kind == "silent"]
    assert silent.ranks == (1,)
    assert "its last heartbeats showed its host memory growing 20.0 MiB/s" in silent.message
    assert "likely the OOM killer" in silent.message
    near = job(
        lambda r, t: BASE,
        seconds=26.0,
        quiet_after={1: 20.0},
        cgroup_limit_bytes=10 * GIB,
        cgroup_used_bytes=int(9.8 * GIB),
    )
    (silent,) = [a for a in rule_cascade(near, end(26.0), TH) if a.kind == "silent"]
    assert "98% of its cgroup's memory limit in use" in silent.message
    flat = job(lambda r, t: BASE, seconds=26.0, quiet_after={1: 20.0})
    (silent,) = [a for a in rule_cascade(flat, end(26.0), TH) if a.kind == "silent"]
    assert "likely the OOM killer" not in silent.message


def test_of_two_ranks_silent_at_once_the_one_the_oom_killer_was_coming_for_is_named() -> None:
    """host-leak, 1 run in 3: the OOM killer's SIGKILL took rank 1, and gloo aborted rank 0
    from C++ (no report) as its peer vanished; rank 0's last heartbeat was the older, by
    0.5 s. Silence alone cannot order them: rank 1's growing memory does, and rank 0 is a
    victim. Silent together with nothing to tell them apart, both stay named."""
    state = job(leak(1, 20 * MIB), seconds=26.0, quiet_after={0: 19.5, 1: 20.0})
    (silent,) = [a for a in rule_cascade(state, end(26.0), TH) if a.kind == "silent"]
    assert (silent.ranks, silent.waiting) == ((1,), (0,)), silent.message
    flat = job(lambda r, t: BASE, seconds=26.0, quiet_after={0: 19.5, 1: 20.0})
    (silent,) = [a for a in rule_cascade(flat, end(26.0), TH) if a.kind == "silent"]
    assert silent.ranks == (0, 1)


# ------------------------------------------------------------------------------- warm-up

START = 100 * MIB
PLATEAU = 310 * MIB
Steps = Callable[[int, float], "int | None"]  # (rank, seconds since start) -> step, None before


def ramp(plateau_s: dict[int, float], default: float) -> Memory:
    """A rank's start as real 3-rank gloo jobs on a loaded 2-core machine show it: its memory
    climbs from 100 to 310 MiB (torch imported, the model, DDP, the first steps) until its
    plateau, at ``plateau_s[rank]`` s (else ``default``), then flat to the byte."""
    return lambda r, t: int(START + (PLATEAU - START) * min(1.0, t / plateau_s.get(r, default)))


def stepping(first_s: float, per_s: float) -> Steps:
    """Every rank's first step at ``first_s``, then ``per_s`` steps a second; None before."""
    return lambda r, t: None if t < first_s else 1 + int((t - first_s) * per_s)


def watch(
    rss: Memory, steps: Steps, world: int = 3, seconds: float = 40.0, **fields: Any
) -> list[tuple[float, Alert]]:
    """``world`` ranks on one host, a heartbeat every 0.5 s with ``steps(r, t)``, the
    ``host_memory`` rule run every second as the server's slow cadence does: every alert it
    raised, with the seconds since the start it was raised at."""
    state = ServerState(started=T0 - 1)
    fields = {"host_available_bytes": 100 * GIB, "host_total_bytes": 128 * GIB, **fields}
    raised = []
    for k in range(int(seconds / 0.5) + 1):
        t = k * 0.5
        for r in range(world):
            sample = Sample(
                v=1, rank=r, t=T0 + t, pid=100 + r, host="node0", world_size=world,
                local_rank=r, step=steps(r, t), host_rss_bytes=rss(r, t), workers_rss_bytes=0,
                **fields,
            )  # fmt: skip
            state.apply(sample, T0 + t)
        if k % 2 == 0:
            raised += [(t, a) for a in rule_host_memory(state, T0 + t, TH)]
    return raised


@pytest.mark.parametrize("late_s", [3.5, 4.0])
@pytest.mark.parametrize("per_s", [10.0, 2.0], ids=["10 steps a second", "2 steps a second"])
@pytest.mark.parametrize("available", [100 * GIB, 4 * GIB], ids=["room", "4 GiB left"])
@pytest.mark.parametrize("stepping_s", [1.0, 6.0], ids=["its last 1 s", "its last 6 s"])
def test_a_rank_that_reaches_its_plateau_late_is_no_leak(
    late_s: float, per_s: float, available: int, stepping_s: float
) -> None:
    """Issue #32: healthy 3-rank jobs on a busy machine named the rank that reached its
    plateau last ("rank 2's host memory grows 7.4 MiB/s, steadily for 9 of the last 11 s
    (the rank 312 MiB); the others' median 1.7 MiB/s"; with little memory left, "runs out in
    about 29 min"). Its climb is its start, about over when the ranks step together, or
    going on through the first ``stepping_s`` seconds of steps."""
    plateau = 5.0 + late_s
    rss = ramp({2: plateau}, 5.0)
    steps = stepping(plateau - stepping_s, per_s)
    assert watch(rss, steps, host_available_bytes=available) == []


def test_every_rank_starting_at_its_own_pace_is_no_leak() -> None:
    """Plateaus from 7 to 12 s after the first report, the first step at 8 s."""
    rss = ramp({0: 7.0, 1: 9.0, 2: 12.0}, 7.0)
    assert watch(rss, stepping(8.0, 10.0), host_available_bytes=4 * GIB) == []


def test_a_leak_after_the_start_is_named_within_10_s() -> None:
    """host-leak's shape: rank 1 keeps 1 MiB a step from step 20, ~10 steps a second, right
    after a start whose late rank (2) reaches its plateau 4 s after the others."""
    steps = stepping(8.0, 10.0)
    leak_from = 8.0 + 19 / 10.0  # step 20

    def rss(r: int, t: float) -> int:
        held = ramp({2: 9.0}, 5.0)(r, t)
        step = steps(r, t)
        return held + (MIB * max(0, step - 19) if r == 1 and step is not None else 0)

    raised = watch(rss, steps)
    assert raised, "the leak was not named"
    at, first = raised[0]
    assert first.ranks == (1,) and at - leak_from <= 10.0, (at - leak_from, first.message)
    assert {a.ranks for _, a in raised} == {(1,)}
    assert first.message.startswith("rank 1's host memory grows 10.0 MiB/s, steadily for ")
    assert " steps, 1.0 MiB a step (the rank " in first.message
    assert "runs out in about" in first.message


@pytest.mark.parametrize("spread_s", [0.0, 3.0], ids=["at once", "over 3 s"])
def test_a_checkpoints_one_off_buffer_is_no_leak(spread_s: float) -> None:
    """+500 MiB on one rank at 20 s (a checkpoint's buffers, at once or written over 3 s),
    then flat: neither a leak nor uneven memory."""

    def rss(r: int, t: float) -> int:
        extra = (
            0.0 if r != 0 else min(1.0, max(0.0, (t - 20.0) / spread_s if spread_s else t - 20.0))
        )
        return int(BASE + (t >= 20.0) * 500 * MIB * (extra if spread_s else 1.0))

    assert watch(rss, stepping(1.0, 10.0), seconds=45.0) == []


def test_a_rank_that_stops_stepping_and_grows_is_named_per_second() -> None:
    """Settled, then rank 1 stalls (no step since 15 s) while its memory grows 10 MiB/s:
    judged per second, as memory runs out (12 s: three quarters of a full window rising)."""

    def steps(r: int, t: float) -> int:
        return 1 + int(min(t, 15.0) * 10) if r == 1 else 1 + int(t * 10)

    raised = watch(lambda r, t: int(BASE + (10 * MIB * max(0.0, t - 15.0) if r == 1 else 0)), steps)
    at, first = raised[0]
    assert first.ranks == (1,) and at <= 15.0 + 12.0, first.message
    assert "steadily for 12 of the last 15 s, taking no step (the rank" in first.message


def test_a_rank_that_never_steps_is_judged_once_its_start_is_long_past() -> None:
    """No step seen (a job the agent counts no steps of): memory that grows during its first
    ``IDLE_WARM_S`` is its start (a dataset loaded); growth past it is judged per second."""
    grows = lambda r, t: int(BASE + (8 * MIB * t if r == 0 else 0))  # noqa: E731
    raised = watch(grows, lambda r, t: None, seconds=80.0)
    assert raised and raised[0][0] >= 60.0 and raised[0][1].ranks == (0,)


def test_uneven_memory_is_compared_on_settled_ranks() -> None:
    """Rank 0 loads its 9 GiB at once, the others over 6 s, before the first step at 7 s:
    only the ranks' settled memory says one holds far more than its peers."""
    rss = lambda r, t: int(9 * GIB * (1.0 if r == 0 else min(1.0, 0.1 + t / 6.0)))  # noqa: E731
    assert watch(rss, stepping(7.0, 10.0), world=4) == []
    heavy = lambda r, t: int(9 * GIB if r == 0 else 3 * GIB)  # noqa: E731
    raised = watch(heavy, stepping(7.0, 10.0), world=4, seconds=15.0)
    assert raised and raised[0][1].ranks == (0,) and raised[0][0] >= 7.0 + WARM_S


# ------------------------------------------------------------------------------- the window


def test_the_window_keeps_a_point_a_second_and_sixteen_of_them() -> None:
    points = None
    for k in range(80):
        points = note(points, T0 + k * 0.25, k, k // 4 or None)
    assert points is not None and len(points) == 48
    assert list(points[-3:]) == [T0 + 19.0, 76.0, 19.0] and points[0] == T0 + 4.0
    assert note(None, T0, 1, None)[2] == -1.0  # no step yet


def test_growth_is_told_per_step_while_it_grew() -> None:
    """Steps count where memory grew: 10 a second, 1 MiB each, is 1 MiB a step; a rank
    that grew taking no step has none (judged per second)."""
    points = None
    for k in range(12):
        points = note(points, float(k), BASE + k * 10 * MIB, 100 + 10 * k)
    found = growth(points)
    assert found is not None and found.steady and found.per_step == pytest.approx(MIB)
    assert found.rising_steps == 110
    stalled = None
    for k in range(12):
        stalled = note(stalled, float(k), BASE + k * 10 * MIB, 100)
    found = growth(stalled)
    assert found is not None and found.steady and found.per_step is None


def test_growth_leaves_a_one_off_jump_out() -> None:
    points = None
    for k in range(16):
        points = note(points, float(k), BASE + (4 * GIB if k >= 9 else 0) + k * 100, k)
    found = growth(points)
    assert found is not None and abs(found.rate) < MIB and not found.steady
    assert growth(note(None, 0.0, 1, None)) is None


def test_the_status_document_shows_host_memory() -> None:
    state = job(leak(1, 20 * MIB), cgroup_limit_bytes=64 * GIB, cgroup_used_bytes=20 * GIB)
    ranks = status_document(state, [], end(), TH).ranks
    assert ranks[1].host_rss_bytes == BASE + 18 * 20 * MIB
    assert ranks[1].host_mem_growth_bytes_per_s == pytest.approx(20 * MIB)
    assert ranks[0].host_mem_growth_bytes_per_s == 0.0
    assert (ranks[0].workers_rss_bytes, ranks[0].cgroup_limit_bytes) == (0, 64 * GIB)
    assert ranks[0].host_available_bytes == 100 * GIB


# ------------------------------------------------------------------------------- the agent


def _fake_proc(tmp_path: Path, children: dict[int, int], cgroup: str) -> tuple[Path, Path]:
    """A /proc with this process's statm (1000 pages resident), its children's (pid: pages)
    and meminfo, and a cgroup root; returns (proc, cgroup root)."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    pid = os.getpid()
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "statm").write_text("50000 1000 300 10 0 4000 0\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    task = proc / str(pid) / "task" / str(pid)
    task.mkdir(parents=True)
    (task / "children").write_text(" ".join(map(str, children)) + " ")
    for child, pages in children.items():
        (proc / str(child) / "task" / str(child)).mkdir(parents=True)
        (proc / str(child) / "task" / str(child) / "children").write_text("")
        (proc / str(child) / "statm").write_text(f"9000 {pages} 100 1 0 500 0\n")
    (proc / "meminfo").write_text(
        "MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   16000000 kB\n"
    )
    return proc, root


def test_the_agent_reads_proc_and_a_cgroup_v2_limit(tmp_path: Path) -> None:
    proc, root = _fake_proc(tmp_path, {71: 200, 72: 300}, "0::/job/rank1\n")
    leaf = root / "job" / "rank1"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text("123456\n")
    (root / "job" / "memory.max").write_text("4294967296\n")
    (root / "job" / "memory.current").write_text("2000000000\n")
    clock = [0.0]
    reader = HostMemory(str(proc), str(root), clock=lambda: clock[0])
    page = reader.page
    info = reader.read()
    assert info.host_rss_bytes == 1000 * page
    assert info.workers_rss_bytes == 500 * page
    assert (info.host_available_bytes, info.host_total_bytes) == (16000000 * 1024, 32000000 * 1024)
    # the job's limit binds: its usage, not the rank's own cgroup's
    assert (info.cgroup_limit_bytes, info.cgroup_used_bytes) == (4 << 30, 2000000000)
    # node-wide values are read every 2 s, resent in between
    (proc / "meminfo").write_text("MemTotal: 32000000 kB\nMemAvailable: 8 kB\n")
    (proc / "self" / "statm").write_text("50000 2000 300 10 0 4000 0\n")
    clock[0] = 1.0
    info = reader.read()
    assert (info.host_rss_bytes, info.host_available_bytes) == (2000 * page, 16000000 * 1024)
    clock[0] = 2.0
    assert reader.read().host_available_bytes == 8 * 1024


def test_the_agent_reads_cgroup_v1_and_never_raises(tmp_path: Path) -> None:
    proc, root = _fake_proc(tmp_path, {}, "4:memory:/process_api/abc\n0::/\n")
    v1 = root / "memory" / "process_api" / "abc"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    (v1 / "memory.usage_in_bytes").write_text("5000\n")
    info = HostMemory(str(proc), str(root)).read()
    assert (info.cgroup_limit_bytes, info.cgroup_used_bytes, info.workers_rss_bytes) == (
        None,
        5000,
        0,
    )
    # nothing readable: every field None, nothing raised
    empty = HostMemory(str(tmp_path / "nowhere"), str(tmp_path / "nowhere")).read()
    assert set(empty.as_fields().values()) == {None}
    (proc / "self" / "statm").write_text("garbage")
    assert HostMemory(str(proc), str(root)).read().host_rss_bytes is None


def test_cgroup_paths_and_meminfo_parsing() -> None:
    assert cgroup_dirs(b"0::/\n", "/nonexistent") == []
    assert meminfo_bytes(b"MemTotal: 10 kB\nMemAvailable:  4 kB", b"MemAvailable") == 4096
    assert meminfo_bytes(b"MemTotal: 10 kB\n", b"MemAvailable") is None


def test_the_agent_reads_this_process() -> None:
    info = hostmem.read()
    assert info.host_rss_bytes is not None and info.host_rss_bytes > 10 * MIB
    assert info.host_available_bytes is not None and info.host_total_bytes is not None
    assert 0 < info.host_available_bytes <= info.host_total_bytes
    assert info.workers_rss_bytes is not None  # 0 or pytest's own children


def test_the_rank_detail_shows_host_memory() -> None:
    from ddpwatch.tui.widgets.detail import identity_paragraphs

    def text(row: dict[str, Any]) -> str:
        entry = msgspec.convert({"state": "running", **row}, RankEntry)
        return " | ".join(str(t) for paragraph in identity_paragraphs(entry, []) for t in paragraph)

    row = {
        "rank": 1,
        "host_rss_bytes": 3 * GIB,
        "workers_rss_bytes": GIB,
        "host_mem_growth_bytes_per_s": 20 * MIB,
    }
    assert "host mem 3.0G +1.0G workers +20.0M/s" in text(row)
    quiet = {**row, "workers_rss_bytes": 0, "host_mem_growth_bytes_per_s": 0}
    assert text(quiet).endswith("host mem 3.0G")
    assert "host mem" not in text({"rank": 1})  # an older agent: nothing said
