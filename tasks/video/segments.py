"""Captions with time spans (subtitles, per-segment captions) read from a row, for clips cut from the spans."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tasks.policies.ruling import Ruling

MAX_SEGMENTS = 10_000  # one row's spans; more is refused, not read


@dataclass(frozen=True, slots=True)
class Segment:
    """One caption's time span in its video, in seconds; ``caption`` None: the row's caption."""

    start: float
    end: float
    caption: str | None


def read_segments(value: Any) -> Ruling[list[Segment]]:
    """The spans of a row's segments field: a JSON list (or its text) of ``{"start", "end",
    "caption"}`` objects or ``[start, end, caption]`` lists, seconds from the video's start.

    Anything else is ``bad_segments``, the detail naming the first bad entry: a video whose
    spans cannot be read is refused, not cut some other way.
    """
    if value is None:
        return Ruling(reason="bad_segments", detail="the row has no segments")
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as err:
            return Ruling(reason="bad_segments", detail=f"not JSON: {err}")
    if not isinstance(value, list):
        return Ruling(reason="bad_segments", detail=f"a {type(value).__name__}, not a list of spans")
    if len(value) > MAX_SEGMENTS:
        return Ruling(reason="bad_segments", detail=f"{len(value)} spans (at most {MAX_SEGMENTS})")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            start, end, caption = item.get("start"), item.get("end"), item.get("caption")
        elif isinstance(item, list) and len(item) in (2, 3):
            start, end, caption = (*item, None)[:3]
        else:
            return Ruling(reason="bad_segments", detail=f"span {i}: {str(item)[:80]!r} is no span")
        lo, hi = _seconds(start), _seconds(end)
        if lo is None or hi is None or not 0 <= lo < hi:
            return Ruling(reason="bad_segments", detail=f"span {i}: start {start!r}, end {end!r} (0 <= start < end)")
        if caption is not None and not isinstance(caption, str):
            return Ruling(reason="bad_segments", detail=f"span {i}: caption is a {type(caption).__name__}")
        out.append(Segment(lo, hi, caption))
    return Ruling(out)


def _seconds(x: Any) -> float | None:
    """A finite number of seconds, or None (booleans and text are no seconds)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)
