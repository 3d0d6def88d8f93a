"""Bounded per-rank history for the detail pane's sparklines, kept by the view.

The status document holds only the latest values; the view remembers the last
``capacity`` steps of every rank in flat ``array('f')`` rings (12 bytes per rank
per point for step time, loss and memory: 5.9 MB at 8,192 ranks x 60 points),
so switching the selected rank shows its past at once.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

from ddpwatch.status.schema import RankEntry

METRICS = ("step_time", "loss", "mem")
_FIELDS = {"step_time": "step_time_s", "loss": "loss", "mem": "mem_allocated_bytes"}
_NAN = float("nan")


class History:
    """A ring of ``capacity`` points per rank and metric; a point per step a rank moves on."""

    def __init__(self, capacity: int = 60) -> None:
        self.capacity = capacity
        self._slot: dict[int, int] = {}
        self._last_step: list[int | None] = []
        self._pos: list[int] = []
        self._count: list[int] = []
        self._data = {name: array("f") for name in METRICS}

    def __len__(self) -> int:
        return len(self._slot)

    def _new_slot(self, rank: int) -> int:
        slot = len(self._last_step)
        self._slot[rank] = slot
        self._last_step.append(None)
        self._pos.append(0)
        self._count.append(0)
        blank = array("f", [_NAN]) * self.capacity
        for ring in self._data.values():
            ring.extend(blank)
        return slot

    def update(self, ranks: Iterable[RankEntry]) -> None:
        """Fold one status document's ranks in (cheap when steps did not move)."""
        get_slot, last_step, cap = self._slot.get, self._last_step, self.capacity
        positions, counts = self._pos, self._count
        data = self._data
        st_ring, loss_ring, mem_ring = data["step_time"], data["loss"], data["mem"]
        nan = _NAN
        for row in ranks:
            step = row.step
            if step is None:
                continue
            rank = row.rank
            slot = get_slot(rank)
            if slot is None:
                slot = self._new_slot(rank)
            elif last_step[slot] == step:
                continue
            last_step[slot] = step
            pos = positions[slot]
            i = slot * cap + pos
            st = row.step_time_s
            loss = row.loss
            mem = row.mem_allocated_bytes
            st_ring[i] = nan if st is None else st
            loss_ring[i] = nan if loss is None else loss
            mem_ring[i] = nan if mem is None else mem
            positions[slot] = pos + 1 if pos + 1 < cap else 0
            if counts[slot] < cap:
                counts[slot] += 1

    def series(self, rank: int, metric: str) -> list[float | None]:
        """Oldest first; None where the value was unknown."""
        slot = self._slot.get(rank)
        if slot is None:
            return []
        cap, count, pos = self.capacity, self._count[slot], self._pos[slot]
        ring = self._data[metric]
        base = slot * cap
        order = range(pos - count, pos)
        return [_none(ring[base + (i % cap)]) for i in order]


def _none(value: float) -> float | None:
    return None if math.isnan(value) else value
