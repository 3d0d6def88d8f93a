"""``ddpwatch schema [NAME]``: the JSON Schema of a document ddpwatch writes for other tools
(``status/contract.py``): the status document, its pages, an alert change."""

from __future__ import annotations

import argparse
import sys

from ddpwatch.commands._args import Subparsers

NAME = "schema"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    from ddpwatch.status.contract import DOCUMENTS

    schema = subparsers.add_parser(
        NAME,
        help="print the JSON Schema of a document ddpwatch writes (status, page, summary, change)",
        description="Print the JSON Schema (draft 2020-12) of a JSON document ddpwatch writes, "
        "for a tool that reads it to validate against; without NAME, list the documents.",
    )
    schema.add_argument("name", nargs="?", choices=sorted(DOCUMENTS), help="the document")
    return schema


def run(args: argparse.Namespace) -> int:
    from ddpwatch.status.contract import DOCUMENTS, schema_text

    if args.name is None:
        for name, (_, description) in DOCUMENTS.items():
            print(f"{name:8} {description}")
        return 0
    sys.stdout.write(schema_text(args.name))
    return 0
