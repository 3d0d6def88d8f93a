"""Text formatting shared by the widgets: human units, durations, rank ranges.

Unknown values (None in the status document) always format as ``—``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ddpwatch.core.ranges import rank_ranges as rank_ranges  # the dashboard writes "0-3,7,9-10"

NA = "—"
DASH = "\u2013"
"""En dash, for ranges of steps."""
TIMES = "\u00d7"
"""Multiplication sign, for terminal sizes."""

_BYTE_UNITS = ("B", "K", "M", "G", "T", "P")


def human_bytes(value: float | None) -> str:
    """1536 -> "1.5K", 12.4e9 -> "11.5G" (binary units, at most 4 characters plus unit)."""
    if value is None:
        return NA
    size = float(value)
    for unit in _BYTE_UNITS:
        if abs(size) < 1024 or unit == _BYTE_UNITS[-1]:
            if unit == "B":
                return f"{int(size)}B"
            return f"{size:.1f}{unit}" if abs(size) < 100 else f"{size:.0f}{unit}"
        size /= 1024
    return NA  # pragma: no cover


def seconds(value: float | None) -> str:
    """A duration in at most 5 cells: 0.0123 -> "12ms", 2.5 -> "2.50s", 4000 -> "1h06m"."""
    if value is None or not math.isfinite(value):
        return NA
    if value < 0.001:
        return f"{value * 1e6:.0f}µs"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 10:
        return f"{value:.2f}s"
    if value < 60:
        return f"{value:.1f}s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 10:
        return f"{minutes}m{secs:02d}s"
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 10:
        return f"{hours}h{minutes:02d}m"
    if hours < 24:
        return f"{hours}h"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h" if days < 10 else f"{days}d"


def uptime(value: float | None) -> str:
    """Uptime: "42s", "5m12s", "1h02m05s", "3d04h"."""
    if value is None or value < 0:
        return NA
    total = int(value)
    minutes, secs = divmod(total, 60)
    hours, minutes = divmod(minutes, 60)
    if hours >= 24:
        return f"{hours // 24}d{hours % 24:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def number(value: float | None, spec: str = ".4g") -> str:
    if value is None:
        return NA
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf"
    return format(value, spec)


def loss_text(value: float | None) -> str:
    """A loss in at most 7 cells with 4 decimals where they fit: 1.98 -> "1.9800"."""
    if value is None:
        return NA
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf"
    if value == 0 or 0.001 <= abs(value) < 100:
        return f"{value:.4f}"
    if abs(value) < 10000:
        return f"{value:.1f}"
    return f"{value:.1e}"


def bar(fraction: float | None, width: int) -> str:
    """A horizontal bar of ``width`` cells with eighth-block resolution."""
    if fraction is None or width <= 0:
        return " " * max(0, width)
    fraction = min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part and full < width else "")
    return text.ljust(width, "·")


_SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Iterable[float | None], width: int) -> str:
    """The last ``width`` values as block characters, scaled between their min and max."""
    points = list(values)[-width:] if width > 0 else []
    finite = [v for v in points if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    span = high - low
    out = []
    for v in points:
        if v is None or not math.isfinite(v):
            out.append(" ")
        elif span <= 0:
            out.append(_SPARKS[3])
        else:
            out.append(_SPARKS[min(7, int((v - low) / span * 7.999))])
    return "".join(out)
