"""What the audit report shows, as plain data for its templates: counts, reasons, histograms, thumbnails."""

from __future__ import annotations

import base64
import http
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats import reasons
from tasks.formats.reasons import ERROR, OK, REASONS, REJECTED
from tasks.policies.sniff import sniff_format

# Histograms of accepted samples: (column, title, integer-valued).
HISTOGRAMS = (
    ("width", "Image width (px)", True),
    ("height", "Image height (px)", True),
    ("aspect", "Aspect ratio (width / height)", False),
    ("caption_chars", "Caption length (characters)", True),
    ("clip_s", "Clip length (s)", False),  # clips of videos (tasks/video/)
    # fine-tuning samples (tasks/finetune/samples.py); absent columns draw nothing
    ("tokens_text", "Text tokens per sample", True),
    ("tokens_image", "Image tokens per sample", True),
    ("tokens_total", "Tokens per sample (before the padding cut-off)", True),
    ("images", "Images per sample", True),
)
PERCENTILES = (5, 50, 95)
HIST_BINS = 20

PASSED, BLOCKED, IN_PROGRESS = "PASSED", "BLOCKED", "IN PROGRESS"

_STATUS_COLOURS = {OK: "#1a7f37", REJECTED: "#bf8700", ERROR: "#cf222e"}


# ----------------------------------------------------------------------------- reasons


# Control characters but tab and newline: text bound for a terminal can quote third parties'
# (a reason's detail, a caption, a manifest's column names), and an escape sequence there would
# drive the terminal.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_text(text: str) -> str:
    """``text`` for a terminal: its control characters but tab and newline shown as ``?``."""
    return _CONTROL.sub("?", text)


def reason_group(reason: str) -> str:
    """The group a reason is counted under: ``duplicate_of:<key>`` -> ``duplicate_of``.

    Reasons with a payload after a colon would otherwise give one table row per sample.
    """
    return reason.split(":", 1)[0]


def group_reasons(by_reason: dict[str, int] | None) -> dict[str, int]:
    """Counts per reason group, largest first, ties by name (deterministic)."""
    grouped: dict[str, int] = {}
    for reason, n in (by_reason or {}).items():
        g = reason_group(str(reason))
        grouped[g] = grouped.get(g, 0) + int(n)
    return dict(sorted(grouped.items(), key=lambda kv: (-kv[1], kv[0])))


def reason_info(group: str) -> tuple[str, str]:
    """(status, description) of a reason group; empty strings when it is not known."""
    if group in REASONS:
        return REASONS[group]
    m = re.fullmatch(r"http_(\d{3})", group)
    if m:
        code = int(m.group(1))
        try:
            phrase = f" ({http.HTTPStatus(code).phrase})"
        except ValueError:
            phrase = ""
        return ERROR, f"the server answered HTTP {code}{phrase}"
    # Families with a payload (``duplicate_of:<key>``), where tasks/formats/reasons.py declares them.
    for prefix, info in getattr(reasons, "FAMILIES", {}).items():
        if prefix.endswith(":") and group == prefix[:-1]:
            return info
    return "", ""


# ----------------------------------------------------------------------------- small helpers


def slug(value: Any) -> str:
    return re.sub(r"[^a-z0-9_-]+", "-", str(value).lower()).strip("-") or "x"


def as_int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def fmt_int(n: int) -> str:
    return f"{n:,}"


def fmt_num(x: Any) -> str:
    """A number for people: integers exact, others to about three significant digits."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return fmt_int(x)
    if isinstance(x, float):
        if not np.isfinite(x):
            return str(x)
        if x.is_integer() and abs(x) < 1e15:
            return fmt_int(int(x))
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return str(x)


def fmt_observed(x: Any) -> str:
    """A gate outcome's observed value as people read it: ``3 of 306 rows unexpected, e.g. ...``,
    a share or a count as a number; never the expectation's raw result."""
    from tasks.audit.gate_results import observed_text

    if isinstance(x, dict):
        return observed_text(x)
    if isinstance(x, (list, tuple)):
        text = ", ".join(fmt_num(v) for v in x)
        return text if len(text) <= 200 else text[:197] + "..."
    return fmt_num(x)


def _share(n: int, total: int) -> str:
    return f"{100.0 * n / total:.1f}%" if total else "n/a"


def _relative_href(link: Any) -> str | None:
    """``link`` if it is a plain relative path; ``None`` for anything a browser could fetch
    from elsewhere or run (schemes, ``//host``, absolute paths, backslashes, control chars)."""
    if not isinstance(link, str) or not link:
        return None
    if link[0] in "/\\" or "\\" in link or any(ord(c) <= 0x20 or ord(c) == 0x7F for c in link):
        return None
    if ":" in re.split(r"[/?#]", link, maxsplit=1)[0]:
        return None
    return link


def duration(started: Any, finished: Any) -> str | None:
    try:
        seconds = (datetime.fromisoformat(str(finished)) - datetime.fromisoformat(str(started))).total_seconds()
    except (TypeError, ValueError):
        return None
    if seconds < 0:
        return None
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{s}s"


def verdict(run: Mapping[str, Any]) -> str:
    """BLOCKED when the run carries a blocking message, IN PROGRESS until it has finished,
    PASSED otherwise (the flow decides blocking; the report only shows it)."""
    if run.get("blocked"):
        return BLOCKED
    if not run.get("finished"):
        return IN_PROGRESS
    return PASSED


def phases_of(run: Mapping[str, Any]) -> list[dict]:
    return [p for p in (run.get("phases") or []) if isinstance(p, dict)]


# ----------------------------------------------------------------------------- views (what the templates draw)


def status_bar(counts: dict[str, int], total: int, label: str = "rows by status") -> dict | None:
    if not total:
        return None
    width, x, parts = 600.0, 0.0, []
    for status in (OK, REJECTED, ERROR):
        n = counts.get(status, 0)
        if n:
            w = width * n / total
            parts.append(
                {
                    "status": status,
                    "n": n,
                    "share": _share(n, total),
                    "colour": _STATUS_COLOURS[status],
                    "x": f"{x:.2f}",
                    "w": f"{w:.2f}",
                }
            )
            x += w
    return {"width": int(width), "label": label, "parts": parts}


def phase_view(p: dict) -> dict:
    total = as_int(p.get("rows"))
    counts = {s: as_int(p.get(s)) for s in (OK, REJECTED, ERROR)}
    speed = []
    if p.get("seconds") is not None:
        speed.append(f"{fmt_num(p.get('seconds'))} s")
    skipped = p.get("skipped") is True  # every shard done before: no rate (runrecord.PhaseRecord)
    if skipped:
        speed.append("skipped")
    elif p.get("samples_per_s") is not None:
        speed.append(f"{fmt_num(p.get('samples_per_s'))} samples/s")
    reason_rows = []
    for g, n in group_reasons(p.get("by_reason")).items():
        status, desc = reason_info(g)
        reason_rows.append({"group": g, "n": n, "share": _share(n, total), "status": status, "desc": desc})
    by_source = p.get("by_source") if isinstance(p.get("by_source"), dict) else {}
    sources = []
    for src in sorted(by_source, key=str):
        c = by_source[src] if isinstance(by_source[src], dict) else {}
        row = {k: as_int(c.get(k)) for k in ("rows", "ok", "rejected", "error")}
        sources.append({"name": src, **row, "ok_share": _share(row["ok"], row["rows"])})
    by_license = p.get("by_license") if isinstance(p.get("by_license"), dict) else {}
    lic_total = sum(as_int(v) for v in by_license.values())
    licenses = [
        {"name": lic, "n": as_int(n), "share": _share(as_int(n), lic_total)}
        for lic, n in sorted(by_license.items(), key=lambda kv: (-as_int(kv[1]), str(kv[0])))
    ]
    gate = p.get("gate")
    gate_view = None
    if isinstance(gate, dict):
        outcomes = [
            {
                "ok": bool(o.get("success")),
                "name": o.get("name"),
                "expectation": o.get("expectation"),
                "column": o.get("column"),
                "threshold": o.get("threshold"),
                "observed": fmt_observed(o.get("observed")),
            }
            for o in (gate.get("outcomes") or [])
            if isinstance(o, dict)
        ]
        gate_view = {"ok": bool(gate.get("success")), "outcomes": outcomes}
    links = p.get("links") if isinstance(p.get("links"), dict) else {}
    name = str(p.get("phase", ""))
    return {
        "name": name,
        "slug": slug(name),
        "counts": {**counts, "rows": total},
        "shares": {**{s: _share(n, total) for s, n in counts.items()}, "rows": "100.0%" if total else "n/a"},
        "seconds": fmt_num(p.get("seconds")),
        "samples_per_s": "skipped" if skipped else fmt_num(p.get("samples_per_s")),
        "speed": ", ".join(speed),
        "bar": status_bar(counts, total),
        "reasons": reason_rows,
        "sources": sources,
        "licenses": licenses,
        "gate": gate_view,
        "links": [{"label": k, "target": links[k], "href": _relative_href(links[k])} for k in sorted(links, key=str)],
    }


def _column(samples: pa.Table, name: str) -> pa.ChunkedArray | None:
    return samples.column(name) if name in samples.column_names else None


# Thumbnails the report puts in a data: URI; anything else is left out.
_THUMB_MIMES = {"jpeg": "image/jpeg", "png": "image/png", "webp": "image/webp"}


def _image_mime(data: bytes) -> str | None:
    return _THUMB_MIMES.get(sniff_format(data) or "")


def image_uri(data: Any) -> str | None:
    """A thumbnail's bytes as a ``data:`` URI, or None when they are not a JPEG, PNG or WebP."""
    mime = _image_mime(bytes(data)) if isinstance(data, (bytes, bytearray)) and data else None
    return f"data:{mime};base64," + base64.b64encode(bytes(data)).decode("ascii") if mime else None


def _thumb_groups(samples: pa.Table, cap: int) -> list[dict] | None:
    """Rejected samples by reason group, up to ``cap`` thumbnails each; None without the columns."""
    status, reason = _column(samples, "status"), _column(samples, "reason")
    if status is None or reason is None:
        return None
    not_ok = samples.filter(pc.fill_null(pc.not_equal(status, OK), False))
    totals: dict[str, int] = {}
    for r in not_ok.column("reason").to_pylist():
        totals[reason_group(str(r))] = totals.get(reason_group(str(r)), 0) + 1
    by_group: dict[str, list[dict]] = {}
    thumbs = _column(not_ok, "thumbnail")
    if thumbs is not None:
        cols = [c for c in ("key", "reason", "source", "caption", "thumbnail") if c in not_ok.column_names]
        for row in not_ok.filter(pc.is_valid(thumbs)).select(cols).to_pylist():
            by_group.setdefault(reason_group(str(row["reason"])), []).append(row)
    groups = []
    for g, total in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])):
        figs: list[dict[str, Any]] = []
        for row in sorted(by_group.get(g, []), key=lambda r: (str(r.get("key")), str(r.get("reason")))):
            uri = image_uri(row["thumbnail"])
            if len(figs) >= cap or uri is None:
                continue
            caption = row.get("caption")
            caption = caption[:120] + ("..." if len(caption) > 120 else "") if isinstance(caption, str) else None
            figs.append({"key": row.get("key"), "reason": row.get("reason"), "caption": caption, "uri": uri})
        groups.append({"group": g, "total": total, "figs": figs})
    return groups


def _histogram(column: str, title: str, values: np.ndarray, integer: bool) -> dict:
    view: dict[str, Any] = {"column": column, "title": title, "n": int(values.size)}
    if values.size == 0:
        return view
    lo, hi = float(values.min()), float(values.max())
    if integer and hi - lo + 1 <= HIST_BINS:
        edges = np.arange(lo, hi + 2)  # one bin per integer value
    elif lo == hi:
        edges = np.array([lo - 0.5, hi + 0.5])
    else:
        edges = np.linspace(lo, hi, HIST_BINS + 1)
    counts, edges = np.histogram(values, bins=edges)
    pcts = [float(v) for v in np.percentile(values, PERCENTILES)]
    w, h, left, bottom, top = 360, 170, 40, 22, 8
    plot_w, plot_h = w - left - 8, h - bottom - top
    peak = int(counts.max()) or 1
    lo, hi = float(edges[0]), float(edges[-1])
    span = (hi - lo) or 1.0

    def x_of(v: float) -> float:
        return left + plot_w * (v - lo) / span

    bars = []
    for c, a, b in zip(counts.tolist(), edges[:-1].tolist(), edges[1:].tolist()):
        bh = plot_h * c / peak
        bars.append(
            {
                "count": c,
                "lo": f"{a:g}",
                "hi": f"{b:g}",
                "lo_text": fmt_num(a),
                "hi_text": fmt_num(b),
                "x": f"{x_of(a) + 0.5:.2f}",
                "y": f"{top + plot_h - bh:.2f}",
                "w": f"{max(x_of(b) - x_of(a) - 1, 0.5):.2f}",
                "h": f"{bh:.2f}",
            }
        )
    view.update(
        width=w,
        height=h,
        left=left,
        right=left + plot_w,
        top=top,
        axis_y=top + plot_h,
        peak=peak,
        lo_text=fmt_num(lo),
        hi_text=fmt_num(hi),
        bars=bars,
        pcts=[
            {"q": q, "x": f"{x_of(v):.2f}", "dash": "4 2" if q != 50 else "none", "text": fmt_num(v)}
            for q, v in zip(PERCENTILES, pcts)
        ],
        stats=[(q, repr(v), fmt_num(v)) for q, v in zip(PERCENTILES, pcts)],
    )
    return view


def _accepted_values(samples: pa.Table, column: str) -> np.ndarray | None:
    col, status = _column(samples, column), _column(samples, "status")
    if col is None or status is None:
        return None
    vals = pc.filter(col, pc.fill_null(pc.equal(status, OK), False)).drop_null()
    if not (pa.types.is_integer(vals.type) or pa.types.is_floating(vals.type)):
        return None
    arr = np.asarray(vals.to_numpy(), dtype=float)
    return arr[np.isfinite(arr)]  # an aspect of inf (height 0) would flatten every bin


def histograms(samples: pa.Table | None) -> list[dict]:
    if samples is None or samples.num_rows == 0:
        return []
    out = []
    for column, title, integer in HISTOGRAMS:
        vals = _accepted_values(samples, column)
        if vals is not None:
            out.append(_histogram(column, title, vals, integer))
    return out


def samples_view(samples: pa.Table | None, cap: int) -> dict | None:
    if samples is None or samples.num_rows == 0:
        return None
    status = _column(samples, "status")
    n_ok = int(pc.sum(pc.fill_null(pc.equal(status, OK), False)).as_py() or 0) if status is not None else 0
    return {
        "n": samples.num_rows,
        "n_ok": n_ok,
        "cap": cap,
        "hists": histograms(samples),
        "thumbs": _thumb_groups(samples, cap),
    }
