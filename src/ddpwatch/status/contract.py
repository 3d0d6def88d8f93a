"""The published contract: a JSON Schema for each JSON document ddpwatch writes for other tools.

Generated from the Structs the server encodes with (``status/schema.py``, and the report's
``status/report_schema.py``), so the schema and
the bytes cannot drift: ``msgspec.json.schema`` gives the shapes; what it cannot know from a
Struct is which keys ddpwatch always writes (a field has a default so that a document from an
older server still decodes), so ``required`` is set here from the contract's own rule: every
key is written, but those whose default is ``UNSET`` and, in a Struct that omits its defaults
(an alert), those with a default.

The schemas ship in the package (``ddpwatch/status/schemas/``, read with ``schema_text``) and
in ``docs/schemas/``; ``ddpwatch schema NAME`` prints one, ``python -m ddpwatch.status.contract
--write`` writes both copies again after a Struct changed, and ``tests/status`` checks that
the held files are what the Structs give, byte for byte. Keys are only ever added, so a
document from a newer server may hold keys a schema does not list: none forbids them.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Final

import msgspec
from msgspec import UNSET

from ddpwatch.status import report_schema, schema

DRAFT: Final = "https://json-schema.org/draft/2020-12/schema"
ID_BASE: Final = "urn:ddpwatch:schema:"
DOCUMENTS: Final[dict[str, tuple[type[msgspec.Struct], str]]] = {
    "status": (
        schema.StatusDocument,
        "The status document: `ddpwatch status --json` and the reply to the status socket's "
        "`status` request (docs/status.md).",
    ),
    "page": (
        schema.PageReply,
        "A page of ranks: the reply to `status?view=page&...` (docs/status.md, \"Pages\").",
    ),
    "summary": (
        schema.SummaryReply,
        "A summary: the reply to `status?view=summary&...` (docs/status.md, \"Pages\").",
    ),
    "refused": (
        schema.Refused,
        "The reply to a status request the server cannot answer: `{\"error\": reason}`.",
    ),
    "change": (
        schema.HistoryEntry,
        "One alert change: a line of `serve --headless`, `run`, `demo --headless` and "
        "`replay`, and an entry of the status document's `history`.",
    ),
    "report": (
        report_schema.ReportDocument,
        "The post-mortem of a recording: `ddpwatch report --format json FILE` "
        "(docs/recording.md).",
    ),
}
"""Each published document: its name, the Struct it is encoded from, what writes it."""
DOCS_DIR: Final = Path(__file__).resolve().parents[3] / "docs" / "schemas"
"""The copy in a source checkout's ``docs/`` (absent from an installed package)."""


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of document ``name`` (a key of ``DOCUMENTS``)."""
    struct, description = DOCUMENTS[name]
    generated = msgspec.json.schema(struct)
    structs = _structs()
    for title, definition in generated.get("$defs", {}).items():
        cls = structs.get(title)
        if cls is not None and definition.get("type") == "object":
            definition["required"] = _always_written(cls)
    return {
        "$schema": DRAFT,
        "$id": f"{ID_BASE}{name}:{schema.SCHEMA}",
        "title": f"ddpwatch {name}",
        "description": description,
        **generated,
    }


def schema_file_text(name: str) -> str:
    """``json_schema(name)`` as the held files write it: two-space indents, a final newline."""
    return json.dumps(json_schema(name), indent=2, ensure_ascii=False) + "\n"


def schema_text(name: str) -> str:
    """The schema of ``name`` as shipped in the package."""
    return (resources.files("ddpwatch.status") / "schemas" / f"{name}.schema.json").read_text(
        encoding="utf-8"
    )


def _structs() -> dict[str, type[msgspec.Struct]]:
    """The Structs a schema's ``$defs`` name, by name."""
    found: dict[str, type[msgspec.Struct]] = {}
    for module in (schema, report_schema):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, msgspec.Struct):
                found[value.__name__] = value
    return found


def _always_written(cls: type[msgspec.Struct]) -> list[str]:
    """The keys a Struct always writes, by their names on the wire."""
    omits = bool(cls.__struct_config__.omit_defaults)
    keys = []
    for field in msgspec.structs.fields(cls):
        has_default = field.default is not msgspec.NODEFAULT or (
            field.default_factory is not msgspec.NODEFAULT
        )
        if field.default is UNSET or (omits and has_default):
            continue
        keys.append(field.encode_name)
    return keys


def write(folders: list[Path]) -> list[Path]:
    """Write every schema into each of ``folders``; the paths written."""
    written = []
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        for name in DOCUMENTS:
            path = folder / f"{name}.schema.json"
            path.write_text(schema_file_text(name), encoding="utf-8")
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m ddpwatch.status.contract --write``: the package's and docs' copies again."""
    parser = argparse.ArgumentParser(prog="python -m ddpwatch.status.contract")
    parser.add_argument("--write", action="store_true", help="write the held schema files")
    args = parser.parse_args(argv)
    if not args.write:
        parser.print_help()
        return 0
    package = Path(__file__).resolve().parent / "schemas"
    for path in write([package, DOCS_DIR]):
        print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
