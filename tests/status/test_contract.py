"""The published JSON Schemas (``status/contract.py``): the files shipped in the package and
in ``docs/schemas/`` are what the Structs give, byte for byte, and every document the contract
tests hold (``tests/status/status_contract/``: varied states, pages, summaries, a refusal, a
replay, a restarted job), every alert change in their timelines, and the documents of a live
server validate against them; documents that break the contract do not. After a Struct
changed, write the files again: ``python -m ddpwatch.status.contract --write``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from ddpwatch.core.ports import free_port_pair
from ddpwatch.core.protocol import Hello, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.server.service import Server
from ddpwatch.status.contract import DOCS_DIR, DOCUMENTS, schema_file_text, schema_text

HELD = Path(__file__).parent / "status_contract"


def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(schema_text(name))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def which(held: Path) -> str:
    """The schema a held document is written to, by its name."""
    stem = held.stem
    if stem.endswith("_refused"):
        return "refused"
    if "_page_" in stem:
        return "page"
    if "_summary" in stem:
        return "summary"
    return "status"


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_the_shipped_schemas_are_what_the_structs_give(name: str) -> None:
    again = "python -m ddpwatch.status.contract --write"
    assert schema_text(name) == schema_file_text(name), again
    docs = DOCS_DIR / f"{name}.schema.json"
    assert docs.read_text(encoding="utf-8") == schema_file_text(name), docs


@pytest.mark.parametrize("held", sorted(HELD.glob("*.json")), ids=lambda p: p.stem)
def test_every_held_document_and_its_timeline_validate(held: Path) -> None:
    document = json.loads(held.read_text())
    validator(which(held)).validate(document)
    for entry in document.get("history", []):
        validator("change").validate(entry)


def test_a_live_servers_documents_validate() -> None:
    """A server fed real frames: its document, a page, a summary, a refusal."""
    server = Server("127.0.0.1", free_port_pair(), Thresholds())
    try:
        now = server.clock()
        for rank in range(3):
            hello = Hello(v=1, rank=rank, t=now, world_size=4, host="node-a", pid=10 + rank)
            server.state.apply(hello, now)
            server.state.apply(Sample(v=1, rank=rank, t=now, step=5, phase="forward"), now)
        server.tick()
        validator("status").validate(json.loads(server.status_json()))
        validator("page").validate(json.loads(server.query_json(b"status?limit=2")))
        validator("summary").validate(json.loads(server.query_json(b"status?view=summary")))
        validator("refused").validate(json.loads(server.query_json(b"status?limit=0")))
    finally:
        server.collector.close()


def broken(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Copies of a document that each break the contract one way."""
    no_ranks = {k: v for k, v in document.items() if k != "ranks"}
    bad_rank = json.loads(json.dumps(document))
    bad_rank["ranks"][0]["rank"] = "zero"
    unknown_missing = json.loads(json.dumps(document))
    del unknown_missing["ranks"][0]["loss"]  # "unknown values are null, never omitted"
    alert_text = json.loads(json.dumps(document))
    alert_text["alerts"][0]["ranks"] = "1"
    return [no_ranks, bad_rank, unknown_missing, alert_text]


def test_documents_that_break_the_contract_do_not_validate() -> None:
    document = json.loads((HELD / "rich.json").read_text())
    check = validator("status")
    for copy in broken(document):
        assert not check.is_valid(copy)


def test_ddpwatch_schema_prints_the_shipped_schema() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "schema", "status"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout == schema_text("status")
    listing = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "schema"], capture_output=True, text=True, check=True
    )
    assert [line.split()[0] for line in listing.stdout.splitlines()] == list(DOCUMENTS)


def _fields(cls: type) -> dict[str, str]:
    """A dataclass's or a Struct's fields and their types, as written (tuples as lists)."""
    import dataclasses

    import msgspec

    if dataclasses.is_dataclass(cls):
        found = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    else:
        found = {f.name: str(f.type) for f in msgspec.structs.fields(cls)}  # type: ignore[arg-type]
    return {
        name: kind.replace("tuple[", "list[").replace(", ...]", "]").replace("<class '", "")
        .replace("'>", "")
        for name, kind in found.items()
    }


def test_the_verdicts_episodes_and_time_lost_carry_what_the_diagnosis_keeps() -> None:
    """The document's Structs declare the fields of the figures they are filled from once
    more (the diagnosis keeps dataclasses): the same names, the same types, so a field added
    to one and not the other fails here rather than vanish from the JSON."""
    from ddpwatch.diagnosis.episodes import Episode
    from ddpwatch.diagnosis.figures import Lost
    from ddpwatch.outputs.postmortem import RankStats
    from ddpwatch.status.report_schema import ReportRank
    from ddpwatch.status.schema import EpisodeEntry, TimeLost

    episode = _fields(EpisodeEntry)
    assert episode.pop("duration_s") == "float"  # Episode's duration_s(end_s), as of the verdict
    assert episode == _fields(Episode)
    lost = _fields(TimeLost)
    assert (lost.pop("rank"), lost.pop("seconds")) == ("int", "float")  # Lost's properties
    assert lost.pop("text") == "str"  # its words (``lost_text``)
    assert lost == _fields(Lost)
    assert _fields(ReportRank) == _fields(RankStats)
