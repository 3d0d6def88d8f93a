"""``CUDA_VISIBLE_DEVICES`` read exactly as the CUDA runtime reads it, for both sides.

The agent maps a CUDA ordinal to an NVML device with it, ``ddpwatch doctor`` checks it before a
launch, and the device rules (``diagnosis/rules/devices.py``) use it to tell which physical GPU
a rank is on: one parser, so the three never disagree about a list. Pure Python: no torch, no
pynvml.
"""

from __future__ import annotations

import re

_ORDINAL = re.compile(r"^\+?0*([0-9]+)")
_ULONG_MAX = (1 << 64) - 1  # what strtoul gives for a number too long for it


def parse_cuda_visible_devices(value: str | None) -> list[int] | list[str] | None:
    """Parse ``CUDA_VISIBLE_DEVICES`` the way the CUDA runtime does; ``None`` means unset (all).

    Integers are read like ``strtoul`` (``"1gpu"`` is 1; past ``2**64 - 1`` it saturates, so no
    entry can make ``int()`` raise); a negative or non-numeric entry ends the list; a repeated
    entry makes the whole list empty (CUDA then sees no device). ``GPU-`` and ``MIG-`` lists
    (possibly abbreviated UUIDs) are returned as strings. Never raises on a string.
    """
    if value is None:
        return None
    entries = [item.strip() for item in value.split(",")]
    if entries and entries[0][:4] in ("GPU-", "MIG-"):
        prefix = entries[0][:4]
        names: list[str] = []
        for item in entries:
            if not item.startswith(prefix):
                break
            names.append(item)
        return names if len(set(names)) == len(names) else []
    indices: list[int] = []
    for item in entries:
        digits = _ORDINAL.match(item)
        if digits is None:
            break
        number = digits.group(1)
        indices.append(min(int(number), _ULONG_MAX) if len(number) <= 20 else _ULONG_MAX)
    # a set, not a scan per entry: the server parses lists that arrive over the network
    return indices if len(set(indices)) == len(indices) else []
