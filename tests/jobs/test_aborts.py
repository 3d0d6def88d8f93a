"""A C++ abort's own words, read from the job's stderr (``jobs/aborts.py``): the lines the C++
runtime writes for an exception nothing caught, as gloo and NCCL end ranks with them."""

from __future__ import annotations

import time
from pathlib import Path

from ddpwatch.core.boxreader import BackendAbort
from ddpwatch.jobs.aborts import AbortLines
from ddpwatch.jobs.output import LogFollower, OutputTail

GLOO = [
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
    "  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match "
    "expected size. Is there a distributed collective mismatch in your code?",
]
NCCL = [
    "terminate called after throwing an instance of 'c10::DistBackendError'",
    "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread "
    "terminated with exception: [Rank 1] Watchdog caught collective operation timeout",
]


def read(lines: list[str]) -> list[BackendAbort]:
    seen: list[BackendAbort] = []
    watch = AbortLines(seen.append, clock=lambda: 7.0)
    for line in lines:
        watch.feed(line)
    return seen


def test_gloos_abort_is_read_with_its_type_and_message_and_no_rank() -> None:
    (abort,) = read(["W1202 torchrun: starting", *GLOO, "Traceback (most recent call last):"])
    assert (abort.at, abort.type, abort.rank) == (7.0, "gloo::EnforceNotMet", None)
    assert "Received data size doesn't match expected size" in abort.message
    assert abort.message.startswith("[enforce fail at")


def test_the_rank_is_taken_from_nccls_text_or_a_launchers_prefix() -> None:
    (nccl,) = read(NCCL)
    assert (nccl.type, nccl.rank) == ("c10::DistBackendError", 1)
    (prefixed,) = read([f"[rank2]: {line}" for line in GLOO])
    assert prefixed.rank == 2


def test_a_terminate_line_without_its_what_soon_after_is_no_abort() -> None:
    lines = [GLOO[0], "a", "b", "c", GLOO[1]]
    assert read(lines) == []
    assert read(["  what():  something without a terminate line"]) == []
    assert len(read(GLOO + GLOO)) == 2


def test_the_dashboards_log_is_followed_as_the_job_writes_it(tmp_path: Path) -> None:
    """Under ``run --tui`` the job writes its output to a log itself; a follower reads it as
    it grows, so a C++ abort's words reach the box reader there too, lines cut across
    writes joined, and the last bytes read when it stops."""
    log = tmp_path / "ddpwatch-run-1.log"
    seen: list[BackendAbort] = []
    with open(log, "wb", buffering=0) as job:
        follower = LogFollower(str(log), OutputTail(on_line=AbortLines(seen.append).feed), 0.01)
        job.write(b"step 1\n" + GLOO[0].encode() + b"\n  what():  [enforce fail")
        deadline = time.monotonic() + 5
        while follower.tail.lines()[:2] != ["step 1", GLOO[0]]:
            assert time.monotonic() < deadline, follower.tail.lines()
            time.sleep(0.01)
        job.write(GLOO[1].encode()[len("  what():  [enforce fail") :] + b"\n")
        follower.stop()
    assert [(a.type, a.rank) for a in seen] == [("gloo::EnforceNotMet", None)]
    assert "Received data size doesn't match" in seen[0].message
    LogFollower(str(tmp_path / "gone.log"), OutputTail()).stop()  # no file: nothing, no error
