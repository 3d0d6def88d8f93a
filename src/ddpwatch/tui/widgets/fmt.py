"""Text the widgets share beyond sizes and durations (``status.fmt``): numbers, losses, bars,
sparklines, and the dashes and signs they are drawn with.

Unknown values (None in the status document) always format as ``NA``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ddpwatch.status.fmt import NA

DASH = "\u2013"
"""En dash, for ranges of steps."""
TIMES = "\u00d7"
"""Multiplication sign, for terminal sizes."""

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
