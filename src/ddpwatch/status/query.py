"""A ``status?<query>`` request (docs/status.md, "Summary and pages"): ``Query`` parses one
(the server) and prints one (``ddpwatch status``, the dashboard, Prometheus, any client), so
the two sides cannot drift apart.

``Query.parse`` refuses what the server cannot answer with a ``QueryError`` whose message is
the reply's one line; a ``Query`` built in code is printed as it is, and the server judges it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Final, Literal
from urllib.parse import parse_qs, urlencode

from ddpwatch.core.ranges import parse_rank_ranges, rank_ranges
from ddpwatch.core.vocabulary import RANK_STATES
from ddpwatch.status.order import state_order

PREFIX: Final = "status?"
WHOLE: Final = b"status"
"""The request for the whole document."""
KEYS: Final = ("view", "ranks", "state", "host", "offset", "limit", "worst")
DEFAULT_LIMIT, MAX_LIMIT = 500, 5000
DEFAULT_WORST, MAX_WORST = 20, 1000
MAX_OFFSET = 1 << 31
_NUMBER = re.compile(r"[0-9]{1,10}")

View = Literal["page", "summary"]


class QueryError(ValueError):
    """A request the server cannot answer; its message is the reply's one-line ``error``."""


@dataclass(frozen=True)
class Query:
    """A summary or a page of ranks. Filters are None when not given (all ranks match);
    ``offset`` and ``limit`` are a page's, ``worst`` a summary's."""

    view: View = "page"
    ranks: frozenset[int] | None = None
    states: frozenset[str] | None = None
    hosts: frozenset[str] | None = None
    offset: int = 0
    limit: int = DEFAULT_LIMIT
    worst: int = DEFAULT_WORST

    # ---------------------------------------------------------------------- printing

    @cached_property
    def text(self) -> str:
        """The URL query, only what differs from the defaults (the view always, when it is
        a summary); ``Query.parse`` reads it back to an equal ``Query``. Written once: a
        long rank list is sorted to write it.

        >>> Query(view="summary", states=frozenset({"stalled", "silent"}), worst=5).text
        'view=summary&state=silent,stalled&worst=5'
        """
        fields: dict[str, str] = {}
        if self.view != "page":
            fields["view"] = self.view
        if self.ranks is not None:
            fields["ranks"] = rank_ranges(self.ranks, limit=len(self.ranks))
        if self.states is not None:
            fields["state"] = ",".join(sorted(self.states, key=lambda s: (state_order(s), s)))
        if self.hosts is not None:
            fields["host"] = ",".join(sorted(self.hosts))
        defaults = {"offset": 0, "limit": DEFAULT_LIMIT, "worst": DEFAULT_WORST}
        for key, number in (("offset", self.offset), ("limit", self.limit)):
            if number != defaults[key] and self.view == "page":
                fields[key] = str(number)
        if self.view == "summary" and self.worst != DEFAULT_WORST:
            fields["worst"] = str(self.worst)
        return urlencode(fields, safe=",")

    def request(self) -> bytes:
        """The bytes sent to the query socket: ``status?<query>``."""
        return f"{PREFIX}{self.text}".encode()

    # ---------------------------------------------------------------------- parsing

    @classmethod
    def from_request(cls, request: bytes) -> Query:
        """The query of ``status?<url query>``; ``QueryError`` for anything else."""
        try:
            text = request.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise QueryError("the request is not UTF-8 text") from None
        if not text.startswith(PREFIX):
            raise QueryError("unknown request; send status, or status?<query> (docs/status.md)")
        return cls.parse(text[len(PREFIX) :])

    @classmethod
    def parse(cls, query: str) -> Query:
        """A ``Query`` from a URL query string; ``QueryError`` on a bad key or value."""
        fields = _fields(query)
        view = fields.get("view", "page")
        if view not in ("page", "summary"):
            raise QueryError(f"view must be page or summary, not {_quote(view)}")
        if view == "summary" and ("offset" in fields or "limit" in fields):
            raise QueryError("offset and limit are for view=page; a summary takes worst")
        if view == "page" and "worst" in fields:
            raise QueryError("worst is for view=summary; a page takes offset and limit")
        return cls(
            view="summary" if view == "summary" else "page",
            ranks=_ranks(fields.get("ranks")),
            states=_states(fields.get("state")),
            hosts=_names("host", fields.get("host")),
            offset=_number(fields, "offset", 0, 0, MAX_OFFSET),
            limit=_number(fields, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT),
            worst=_number(fields, "worst", DEFAULT_WORST, 0, MAX_WORST),
        )


def _fields(query: str) -> dict[str, str]:
    """The URL query's keys and values: each known key at most once, no other key."""
    try:
        parsed = parse_qs(
            query,
            keep_blank_values=True,
            strict_parsing=True,
            errors="strict",
            max_num_fields=2 * len(KEYS),
        )
    except ValueError as exc:  # a UnicodeDecodeError too
        raise QueryError(f"not a URL query string: {one_line(str(exc))}") from None
    for key, values in parsed.items():
        if key not in KEYS:
            raise QueryError(f"unknown key {_quote(key)}; known: {', '.join(KEYS)}")
        if len(values) > 1:
            raise QueryError(f"{key} given more than once")
    return {key: values[0] for key, values in parsed.items()}


def _ranks(text: str | None) -> frozenset[int] | None:
    if text is None:
        return None
    try:
        return parse_rank_ranges(text)
    except ValueError as exc:
        raise QueryError(f"ranks: {exc}") from None


def _states(text: str | None) -> frozenset[str] | None:
    states = _names("state", text)
    if states is not None:
        unknown = sorted(states - set(RANK_STATES))
        if unknown:
            raise QueryError(
                f"state: unknown {_quote(unknown[0])}; known: {', '.join(RANK_STATES)}"
            )
    return states


def _names(key: str, text: str | None) -> frozenset[str] | None:
    """A comma-separated list of names, none of them empty."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise QueryError(f"{key}: an empty name in {_quote(text)}")
    return frozenset(names)


def _number(fields: dict[str, str], key: str, default: int, low: int, high: int) -> int:
    text = fields.get(key)
    if text is None:
        return default
    value = int(text) if _NUMBER.fullmatch(text) else None
    if value is None or not low <= value <= high:
        raise QueryError(f"{key} must be a whole number from {low} to {high}, not {_quote(text)}")
    return value


def _quote(text: str, width: int = 40) -> str:
    """``text`` quoted on one line, cut to about ``width``: errors echo what was sent."""
    return repr(text if len(text) <= width else text[:width] + "...")


def one_line(text: str, width: int = 80) -> str:
    """``text`` on one line, cut to about ``width``: what a refusal's ``error`` holds."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[:width] + "..."
