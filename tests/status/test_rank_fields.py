"""A rank's field is declared on each layer it crosses: the wire (``core/protocol.py``'s
``Hello`` and ``Sample``), the server's record (``state/records.py``'s ``RankRecord``), the
status contract (``status/schema.py``'s ``RankEntry``, filled by ``server/document.py``'s
``rank_entry``). These tests prove the layers list the same fields with the same types, so a
field added to one and not the next fails here, named, rather than vanish on its way (#36).
What a layer keeps and the next does not is listed with its reason."""

from __future__ import annotations

from collections import deque
from typing import Any

from ddpwatch.core.protocol import Collective, CollectiveCounts, ErrorInfo, Hello, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.server.document import rank_entry
from ddpwatch.state.records import STORED_FIELDS, RankRecord
from ddpwatch.status.schema import RankEntry

DERIVED = {
    "state": "judged by the diagnosis (``rank_state``) from the whole record",
    "last_seen_s": "how long ago, from ``last_seen`` and the document's time",
    "host_mem_growth_bytes_per_s": "the host-memory rule's fitted growth",
    "phase_since_s": "how long it has been in its phase, from ``phase_since``",
    "checkpoints": "``checkpoint_paths``, the ones it saved last",
    "ended_at": "when its process ended: its exit time, or the crash's",
    "median_step_s": "the median of every step it timed (``state/step_times.py``)",
}
"""The entry's fields the server works out: on no record under that name."""

UNPUBLISHED = {
    "backend": "the launch configuration: compared across ranks (``facts/launch``), named "
    "in a config_mismatch alert's message",
    "torch_version": "the launch configuration (as above)",
    "cuda_visible_devices": "the launch configuration (as above)",
    "device_count": "the launch configuration (as above)",
    "restart_count": "the launch configuration (as above)",
    "rendezvous": "the launch configuration (as above)",
    "master_addr": "the launch configuration (as above)",
    "master_port": "the launch configuration (as above)",
    "init_method": "the launch configuration (as above)",
    "run_id": "the launch configuration (as above)",
    "script": "the launch configuration (as above)",
    "script_hash": "the launch configuration (as above)",
    "cuda_version": "the launch configuration (as above)",
    "nccl_version": "the launch configuration (as above)",
    "box": "its black box's file name, read on its host by the server, never shown",
    "cpu_s": "the process's CPU seconds: the stall rules' evidence that it still computes",
    "batch_marks": "the batch marks the desync rule compares, beat by beat",
    "backward_marks": "as above, for backward passes",
    "eval_sync_marks": "as above, for evaluation syncs",
    "forwards": "forward passes counted: the compile and stall rules' evidence",
    "compile_reason": "what torch.compile recompiles for: in the recompiling alert",
}
"""The wire's fields the record keeps and the document does not publish as a rank field."""

RETYPED = {
    ("Collective | None", "CollectiveWait | None"): "the one it waits in, with its age",
    ("Collective | None", "FinalCollective | None"): "the one it died in",
    ("ErrorInfo | None", "RankError | None"): "the contract's own copy",
    ("deque[str]", "list[str] | None"): "its last lines: a bounded deque kept, a list shown",
    ("bool", "bool | None"): "null in an entry for a rank that never reported",
    ("int", "int | None"): "as above",
}
"""(the record's type, the entry's) where a layer keeps a field another way, and why."""

_CONSTRAINED = {
    "NonNegInt": "int",
    "RankCount": "int",
    "RankId": "int",
    "Annotated[float, msgspec.Meta(ge=0)]": "float",
}
"""The wire's constrained aliases (checked as a frame decodes) and the plain type each is."""


def _annotations(cls: type) -> dict[str, str]:
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        found.update(getattr(klass, "__annotations__", {}))
    return {name: str(kind) for name, kind in found.items()}


def _plain(kind: str) -> str:
    for alias, plain in _CONSTRAINED.items():
        kind = kind.replace(alias, plain)
    return kind


WIRE = {**_annotations(Hello), **_annotations(Sample)}
RECORD = _annotations(RankRecord)
ENTRY = _annotations(RankEntry)


def test_the_record_keeps_every_wire_field_with_the_wires_type() -> None:
    differ = {f: (WIRE[f], RECORD[f]) for f in STORED_FIELDS if _plain(WIRE[f]) != RECORD[f]}
    assert differ == {}


def test_every_entry_field_is_a_record_field_of_the_same_type_or_says_why_not() -> None:
    unexplained = {}
    for name, kind in ENTRY.items():
        if name in DERIVED:
            assert name not in RECORD, f"{name} is on the record: drop it from DERIVED"
            continue
        assert name in RECORD, f"RankEntry.{name}: on no record (add it, or to DERIVED)"
        if RECORD[name] != kind and (RECORD[name], kind) not in RETYPED:
            unexplained[name] = (RECORD[name], kind)
    assert unexplained == {}


def test_every_kept_wire_field_is_published_or_says_why_not() -> None:
    unlisted = [f for f in STORED_FIELDS if f not in ENTRY and f not in UNPUBLISHED]
    assert unlisted == [], "publish them in RankEntry, or list them in UNPUBLISHED"
    stale = [f for f in UNPUBLISHED if f in ENTRY or f not in STORED_FIELDS]
    assert stale == [], "published or gone: drop them from UNPUBLISHED"


def _value(kind: str) -> Any:
    """A value of the record's type that is no field's default."""
    kind = kind.removesuffix(" | None")
    return {
        "int": 7,
        "float": 1.5,
        "str": "x",
        "bool": True,
        "list[int]": [3],
        "deque[str]": deque(["a line"]),
        "Collective": Collective("all_reduce", seq=4, since_s=1.0),
        "CollectiveCounts": CollectiveCounts(),
        "ErrorInfo": ErrorInfo("RuntimeError", "boom"),
    }[kind]


def test_rank_entry_fills_every_field_it_shares_with_the_record() -> None:
    """A record with every shared field known gives an entry with none of them unknown:
    ``rank_entry`` copies each field the layers share."""
    shared = [name for name in ENTRY if name in RECORD and name != "rank"]
    record = RankRecord(rank=3, first_seen=0.0, last_seen=9.0)
    for name in shared:
        setattr(record, name, _value(RECORD[name]))
    entry = rank_entry(record, 10.0, Thresholds(), 60.0)
    defaults = RankEntry(rank=3, state="running")
    unfilled = [n for n in shared if getattr(entry, n) == getattr(defaults, n)]
    assert unfilled == []
