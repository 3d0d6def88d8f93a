"""A C++ abort's own words, read from the job's stderr (``jobs/aborts.py``): the lines the C++
runtime writes for an exception nothing caught, as gloo and NCCL end ranks with them."""

from __future__ import annotations

from ddpwatch.core.boxreader import BackendAbort
from ddpwatch.jobs.aborts import AbortLines

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
