"""The audit report: one self-contained HTML file per run, and the same summary as text."""

from __future__ import annotations

import base64
import html
import http
import io
import json
import re
from datetime import datetime
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks import reasons
from tasks.reasons import ERROR, OK, REASONS, REJECTED
from tasks.storage import Storage

REPORT_HTML = "report.html"
RUN_JSON = "run.json"
SAMPLES_PARQUET = "samples.parquet"

# Histograms of accepted samples: (column, title, integer-valued).
HISTOGRAMS = (
    ("width", "Image width (px)", True),
    ("height", "Image height (px)", True),
    ("aspect", "Aspect ratio (width / height)", False),
    ("caption_chars", "Caption length (characters)", True),
    # fine-tuning samples (tasks/finetune.py); absent columns draw nothing
    ("tokens_text", "Text tokens per sample", True),
    ("tokens_image", "Image tokens per sample", True),
    ("tokens_total", "Tokens per sample (before the padding cut-off)", True),
    ("images", "Images per sample", True),
)
PERCENTILES = (5, 50, 95)
HIST_BINS = 20

PASSED, BLOCKED, IN_PROGRESS = "PASSED", "BLOCKED", "IN PROGRESS"

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

_STATUS_COLOURS = {OK: "#1a7f37", REJECTED: "#bf8700", ERROR: "#cf222e"}

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1f2328;margin:0;background:#f6f8fa}
main{max-width:1100px;margin:0 auto;padding:16px 24px 48px;background:#fff}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
dl.meta{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:8px 0}dl.meta dt{color:#59636e}dl.meta dd{margin:0}
.banner{font-size:26px;font-weight:700;padding:14px 18px;border-radius:8px;margin:14px 0;letter-spacing:.04em}
.banner .msg{display:block;font-size:14px;font-weight:400;letter-spacing:0;margin-top:4px;white-space:pre-wrap}
.banner.passed{background:#dafbe1;color:#116329;border:1px solid #4ac26b}
.banner.blocked{background:#ffebe9;color:#a40e26;border:1px solid #ff8182}
.banner.in-progress{background:#ddf4ff;color:#0550ae;border:1px solid #54aeff}
table{border-collapse:collapse;margin:6px 0 12px;min-width:320px}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
thead th{background:#f6f8fa}td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
td.desc{color:#59636e;max-width:520px}
tr.pass td.result,td.pass,span.pass{background:#dafbe1;color:#116329;font-weight:600}
tr.fail td.result,td.fail,span.fail{background:#ffebe9;color:#a40e26;font-weight:600}
span.pass,span.fail{padding:1px 6px;border-radius:4px}
.status-ok{color:#1a7f37}.status-rejected{color:#9a6700}.status-error{color:#cf222e}
.grid{display:flex;flex-wrap:wrap;gap:8px 28px}
.thumbs{display:flex;flex-wrap:wrap;gap:8px}
figure.thumb{margin:0;width:132px;font-size:11px;color:#59636e;word-break:break-all}
figure.thumb img{width:128px;height:128px;object-fit:contain;background:#eaeef2;border:1px solid #d0d7de;display:block}
.hist{display:inline-block;margin:0 18px 12px 0;vertical-align:top}
.hist svg{display:block;background:#fff}
.muted{color:#59636e}
"""


# ----------------------------------------------------------------------------- reasons


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
    # Families with a payload (``duplicate_of:<key>``), where tasks/reasons.py declares them.
    for prefix, info in getattr(reasons, "FAMILIES", {}).items():
        if prefix.endswith(":") and group == prefix[:-1]:
            return info
    return "", ""


# ----------------------------------------------------------------------------- small helpers


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _slug(value: Any) -> str:
    return re.sub(r"[^a-z0-9_-]+", "-", str(value).lower()).strip("-") or "x"


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _fmt_num(x: Any) -> str:
    """A number for people: integers exact, others to about three significant digits."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return _fmt_int(x)
    if isinstance(x, float):
        if not np.isfinite(x):
            return str(x)
        if x.is_integer() and abs(x) < 1e15:
            return _fmt_int(int(x))
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return str(x)


def _fmt_observed(x: Any) -> str:
    if isinstance(x, (dict, list, tuple)):
        text = json.dumps(x, sort_keys=True, default=str)
        return text if len(text) <= 200 else text[:197] + "..."
    return _fmt_num(x)


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


def _duration(started: Any, finished: Any) -> str | None:
    try:
        seconds = (datetime.fromisoformat(str(finished)) - datetime.fromisoformat(str(started))).total_seconds()
    except (TypeError, ValueError):
        return None
    if seconds < 0:
        return None
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{s}s"


def verdict(run: dict) -> str:
    """BLOCKED when the run carries a blocking message, IN PROGRESS until it has finished,
    PASSED otherwise (the flow decides blocking; the report only shows it)."""
    if run.get("blocked"):
        return BLOCKED
    if not run.get("finished"):
        return IN_PROGRESS
    return PASSED


def _phases(run: dict) -> list[dict]:
    return [p for p in (run.get("phases") or []) if isinstance(p, dict)]


# ----------------------------------------------------------------------------- HTML pieces


def _table(
    table: str, phase: str, head: Iterable[tuple[str, bool]], rows: Iterable[str], caption: str | None = None
) -> str:
    """A table with stable hooks: ``data-table`` and ``data-phase`` on it, ``data-key`` on
    each row and ``data-col`` (with ``data-value`` for numbers) on each cell."""
    ths = "".join(f'<th class="num">{_e(h)}</th>' if num else f"<th>{_e(h)}</th>" for h, num in head)
    cap = f"<caption class=\"muted\">{_e(caption)}</caption>" if caption else ""
    return (
        f'<table class="{_e(table)}" data-table="{_e(table)}" data-phase="{_e(phase)}">{cap}'
        f"<thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _num_td(col: str, n: int, extra: str = "") -> str:
    return f'<td class="num{extra}" data-col="{col}" data-value="{n}">{_fmt_int(n)}</td>'


def _text_td(col: str, text: Any, cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f'<td{c} data-col="{col}">{_e(text)}</td>'


def _status_bar(counts: dict[str, int], total: int) -> str:
    if not total:
        return ""
    width, x, parts = 600.0, 0.0, []
    for status in (OK, REJECTED, ERROR):
        n = counts.get(status, 0)
        if not n:
            continue
        w = width * n / total
        parts.append(
            f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="16" fill="{_STATUS_COLOURS[status]}">'
            f"<title>{status}: {n} ({_share(n, total)})</title></rect>"
        )
        x += w
    return (
        f'<svg class="status-bar" width="{int(width)}" height="16" viewBox="0 0 {int(width)} 16" '
        f'role="img" aria-label="rows by status">{"".join(parts)}</svg>'
    )


def _phase_overview(phases: list[dict]) -> str:
    rows = []
    for p in phases:
        name = str(p.get("phase", ""))
        gate = p.get("gate")
        if isinstance(gate, dict):
            ok = bool(gate.get("success"))
            gate_td = f'<td class="{"pass" if ok else "fail"}" data-col="gate">{"PASS" if ok else "FAIL"}</td>'
        else:
            gate_td = '<td class="muted" data-col="gate">none</td>'
        rows.append(
            f'<tr data-key="{_e(name)}"><th><a href="#phase-{_e(_slug(name))}">{_e(name)}</a></th>'
            + "".join(_num_td(k, _int(p.get(k))) for k in ("rows", "ok", "rejected", "error"))
            + _text_td("seconds", _fmt_num(p.get("seconds")), "num")
            + _text_td("samples_per_s", _fmt_num(p.get("samples_per_s")), "num")
            + gate_td
            + "</tr>"
        )
    head = [("phase", False), ("rows", True), ("ok", True), ("rejected", True), ("error", True),
            ("seconds", True), ("samples/s", True), ("gate", False)]
    return _table("overview", "", head, rows)


def _phase_section(p: dict) -> str:
    name = str(p.get("phase", ""))
    total = _int(p.get("rows"))
    counts = {s: _int(p.get(s)) for s in (OK, REJECTED, ERROR)}
    out = [f'<section class="phase" id="phase-{_e(_slug(name))}" data-phase="{_e(name)}">', f"<h2>Phase: {_e(name)}</h2>"]
    speed = []
    if p.get("seconds") is not None:
        speed.append(f"{_fmt_num(p.get('seconds'))} s")
    if p.get("samples_per_s") is not None:
        speed.append(f"{_fmt_num(p.get('samples_per_s'))} samples/s")
    if speed:
        out.append(f'<p class="muted">{_e(", ".join(speed))}</p>')

    # counts by status
    rows = [
        f'<tr data-key="{s}"><th class="status-{s}">{s}</th>{_num_td("count", counts[s])}'
        f'{_text_td("share", _share(counts[s], total), "num")}</tr>'
        for s in (OK, REJECTED, ERROR)
    ]
    rows.append(f'<tr data-key="rows"><th>rows</th>{_num_td("count", total)}{_text_td("share", "100.0%" if total else "n/a", "num")}</tr>')
    out.append('<h3>By status</h3><div class="grid">')
    out.append(_table("status", name, [("status", False), ("rows", True), ("share", True)], rows))
    out.append(f"<div>{_status_bar(counts, total)}</div></div>")

    # by reason
    grouped = group_reasons(p.get("by_reason"))
    out.append("<h3>By reason</h3>")
    if grouped:
        rows = []
        for g, n in grouped.items():
            status, desc = reason_info(g)
            rows.append(
                f'<tr data-key="{_e(g)}"><th><code>{_e(g)}</code></th>{_num_td("count", n)}'
                f'{_text_td("share", _share(n, total), "num")}'
                f'{_text_td("status", status, f"status-{status}" if status else "")}'
                f'{_text_td("description", desc or "(no description)", "desc")}</tr>'
            )
        head = [("reason", False), ("rows", True), ("share", True), ("status", False), ("description", False)]
        out.append(_table("reasons", name, head, rows))
    else:
        out.append('<p class="muted">No rejected or failed rows.</p>')

    # by source
    by_source = p.get("by_source") or {}
    if isinstance(by_source, dict) and by_source:
        rows = []
        for src in sorted(by_source, key=str):
            c = by_source[src] if isinstance(by_source[src], dict) else {}
            rows.append(
                f'<tr data-key="{_e(src)}"><th>{_e(src)}</th>'
                + "".join(_num_td(k, _int(c.get(k))) for k in ("rows", "ok", "rejected", "error"))
                + _text_td("ok_share", _share(_int(c.get("ok")), _int(c.get("rows"))), "num")
                + "</tr>"
            )
        head = [("source", False), ("rows", True), ("ok", True), ("rejected", True), ("error", True), ("ok share", True)]
        out.append("<h3>By source</h3>" + _table("sources", name, head, rows))

    # by license
    by_license = p.get("by_license") or {}
    if isinstance(by_license, dict) and by_license:
        lic_total = sum(_int(v) for v in by_license.values())
        rows = [
            f'<tr data-key="{_e(lic)}"><th>{_e(lic)}</th>{_num_td("count", _int(n))}{_text_td("share", _share(_int(n), lic_total), "num")}</tr>'
            for lic, n in sorted(by_license.items(), key=lambda kv: (-_int(kv[1]), str(kv[0])))
        ]
        out.append("<h3>By license</h3>" + _table("licenses", name, [("license", False), ("rows", True), ("share", True)], rows))

    # gate
    gate = p.get("gate")
    out.append("<h3>Gate</h3>")
    if isinstance(gate, dict):
        ok = bool(gate.get("success"))
        out.append(
            f'<p>Gate result: <span class="{"pass" if ok else "fail"}" data-gate="{_e(name)}">{"PASS" if ok else "FAIL"}</span></p>'
        )
        rows = []
        for i, o in enumerate(x for x in (gate.get("outcomes") or []) if isinstance(x, dict)):
            good = bool(o.get("success"))
            rows.append(
                f'<tr class="{"pass" if good else "fail"}" data-key="{i}">'
                + _text_td("name", o.get("name"))
                + f'<td data-col="expectation"><code>{_e(o.get("expectation"))}</code></td>'
                + _text_td("column", o.get("column"))
                + _text_td("threshold", o.get("threshold"))
                + _text_td("observed", _fmt_observed(o.get("observed")), "num")
                + f'<td class="result" data-col="result">{"PASS" if good else "FAIL"}</td></tr>'
            )
        head = [("check", False), ("expectation", False), ("column", False), ("threshold", False), ("observed", True), ("result", False)]
        out.append(_table("gate", name, head, rows) if rows else '<p class="muted">The gate recorded no outcomes.</p>')
    else:
        out.append('<p class="muted">This phase has no gate.</p>')

    links = p.get("links") or {}
    if isinstance(links, dict) and links:
        items = []
        for label in sorted(links, key=str):
            target = links[label]
            href = _relative_href(target)
            if href is None:  # shown, not linked: the page must not reach outside its folder
                items.append(f'<li data-link="{_e(label)}">{_e(label)}: <code>{_e(target)}</code></li>')
            else:
                items.append(f'<li data-link="{_e(label)}"><a href="{_e(href)}">{_e(label)}</a> <code>{_e(href)}</code></li>')
        out.append(f'<ul class="links">{"".join(items)}</ul>')
    out.append("</section>")
    return "\n".join(out)


def _column(samples: pa.Table, name: str) -> pa.ChunkedArray | None:
    return samples.column(name) if name in samples.column_names else None


def _image_mime(data: bytes) -> str | None:
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None  # anything else is not put in a data: URI


def _thumbnails(samples: pa.Table, cap: int) -> str:
    status = _column(samples, "status")
    reason = _column(samples, "reason")
    if status is None or reason is None:
        return '<p class="muted">The samples table has no status or reason column.</p>'
    not_ok = samples.filter(pc.fill_null(pc.not_equal(status, OK), False))
    totals: dict[str, int] = {}
    for r in not_ok.column("reason").to_pylist():
        g = reason_group(str(r))
        totals[g] = totals.get(g, 0) + 1
    if not totals:
        return '<p class="muted">No rejected samples.</p>'
    thumbs = _column(not_ok, "thumbnail")
    by_group: dict[str, list[dict]] = {}
    if thumbs is not None:
        cols = [c for c in ("key", "reason", "source", "caption", "thumbnail") if c in not_ok.column_names]
        with_thumb = not_ok.filter(pc.is_valid(thumbs)).select(cols)
        for row in with_thumb.to_pylist():
            by_group.setdefault(reason_group(str(row["reason"])), []).append(row)
    out = []
    for g, total in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])):
        rows = sorted(by_group.get(g, []), key=lambda r: (str(r.get("key")), str(r.get("reason"))))
        figs = []
        for row in rows:
            if len(figs) >= cap:
                break
            data = row["thumbnail"]
            mime = _image_mime(data) if isinstance(data, (bytes, bytearray)) else None
            if mime is None:
                continue
            uri = f"data:{mime};base64," + base64.b64encode(bytes(data)).decode("ascii")
            label = row.get("key")
            caption = row.get("caption")
            cap_html = f"<br>{_e(caption[:120] + ('...' if len(caption) > 120 else ''))}" if isinstance(caption, str) and caption else ""
            figs.append(
                f'<figure class="thumb" data-reason="{_e(g)}" data-key="{_e(label)}">'
                f'<img src="{uri}" alt="{_e(label)}" title="{_e(row.get("reason"))}">'
                f"<figcaption><code>{_e(label)}</code>{cap_html}</figcaption></figure>"
            )
        out.append(
            f'<div class="thumb-group" data-reason="{_e(g)}" data-total="{total}" data-shown="{len(figs)}">'
            f"<h3><code>{_e(g)}</code> <span class=\"muted\">{len(figs)} shown of {_fmt_int(total)} rejected</span></h3>"
            f'<div class="thumbs">{"".join(figs) or "<span class=muted>no thumbnails kept</span>"}</div></div>'
        )
    return "\n".join(out)


def _hist_bins(values: np.ndarray, integer: bool) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = float(values.min()), float(values.max())
    if integer and hi - lo + 1 <= HIST_BINS:
        edges = np.arange(lo, hi + 2)  # one bin per integer value
    elif lo == hi:
        edges = np.array([lo - 0.5, hi + 0.5])
    else:
        edges = np.linspace(lo, hi, HIST_BINS + 1)
    counts, edges = np.histogram(values, bins=edges)
    return counts, edges


def _histogram(column: str, title: str, values: np.ndarray, integer: bool) -> str:
    n = int(values.size)
    head = f'<div class="hist" data-hist="{_e(column)}" data-n="{n}"><h3>{_e(title)}</h3>'
    if n == 0:
        return head + '<p class="muted">No values.</p></div>'
    counts, edges = _hist_bins(values, integer)
    pcts = [float(v) for v in np.percentile(values, PERCENTILES)]
    w, h, left, bottom, top = 360, 170, 40, 22, 8
    plot_w, plot_h = w - left - 8, h - bottom - top
    peak = int(counts.max()) or 1
    lo, hi = float(edges[0]), float(edges[-1])
    span = (hi - lo) or 1.0

    def x_of(v: float) -> float:
        return left + plot_w * (v - lo) / span

    parts = [
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#8c959f"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#8c959f"/>',
        f'<text x="{left - 4}" y="{top + 9}" font-size="10" text-anchor="end" fill="#59636e">{peak}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" font-size="10" text-anchor="end" fill="#59636e">0</text>',
        f'<text x="{left}" y="{h - 6}" font-size="10" fill="#59636e">{_e(_fmt_num(float(edges[0])))}</text>',
        f'<text x="{left + plot_w}" y="{h - 6}" font-size="10" text-anchor="end" fill="#59636e">{_e(_fmt_num(float(edges[-1])))}</text>',
    ]
    for c, a, b in zip(counts.tolist(), edges[:-1].tolist(), edges[1:].tolist()):
        x0, x1 = x_of(a), x_of(b)
        bh = plot_h * c / peak
        parts.append(
            f'<rect class="bar" data-count="{c}" data-lo="{a:g}" data-hi="{b:g}" x="{x0 + 0.5:.2f}" y="{top + plot_h - bh:.2f}" '
            f'width="{max(x1 - x0 - 1, 0.5):.2f}" height="{bh:.2f}" fill="#54aeff">'
            f"<title>{_e(_fmt_num(a))} to {_e(_fmt_num(b))}: {c}</title></rect>"
        )
    for q, v in zip(PERCENTILES, pcts):
        x = x_of(v)
        parts.append(
            f'<line class="pct" data-p="{q}" x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{top + plot_h}" '
            f'stroke="#cf222e" stroke-dasharray="{"4 2" if q != 50 else "none"}"><title>p{q} = {_e(_fmt_num(v))}</title></line>'
        )
    svg = (
        f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="{_e(title)} histogram">'
        + "".join(parts)
        + "</svg>"
    )
    stats = "".join(
        f'<td class="num" data-col="p{q}" data-value="{v!r}">{_e(_fmt_num(v))}</td>' for q, v in zip(PERCENTILES, pcts)
    )
    table = (
        f'<table class="hist-stats" data-table="hist-stats" data-hist="{_e(column)}"><thead><tr><th class="num">n</th>'
        + "".join(f'<th class="num">p{q}</th>' for q in PERCENTILES)
        + f'</tr></thead><tbody><tr data-key="{_e(column)}">{_num_td("n", n)}{stats}</tr></tbody></table>'
    )
    return head + svg + table + "</div>"


def _accepted_values(samples: pa.Table, column: str) -> np.ndarray | None:
    col = _column(samples, column)
    status = _column(samples, "status")
    if col is None or status is None:
        return None
    ok = pc.fill_null(pc.equal(status, OK), False)
    vals = pc.filter(col, ok).drop_null()
    if not (pa.types.is_integer(vals.type) or pa.types.is_floating(vals.type)):
        return None
    arr = np.asarray(vals.to_numpy(), dtype=float)
    return arr[np.isfinite(arr)]  # an aspect of inf (height 0) would flatten every bin


def _samples_section(samples: pa.Table | None, cap: int) -> str:
    out = ['<section id="samples"><h2>Samples</h2>']
    if samples is None or samples.num_rows == 0:
        out.append('<p class="muted">No per-sample table for this run (yet).</p></section>')
        return "\n".join(out)
    status = _column(samples, "status")
    n_ok = int(pc.sum(pc.fill_null(pc.equal(status, OK), False)).as_py() or 0) if status is not None else 0
    out.append(f'<p class="muted">{_fmt_int(samples.num_rows)} samples judged, {_fmt_int(n_ok)} accepted.</p>')
    out.append('<h3>Distributions over accepted samples</h3><div class="hists">')
    for column, title, integer in HISTOGRAMS:
        vals = _accepted_values(samples, column)
        if vals is not None:
            out.append(_histogram(column, title, vals, integer))
    out.append("</div>")
    out.append(f'<h2>Rejected samples <span class="muted">(at most {cap} per reason)</span></h2>')
    out.append(_thumbnails(samples, cap))
    out.append("</section>")
    return "\n".join(out)


# ----------------------------------------------------------------------------- public API


def render_html(run: dict, samples: pa.Table | None, *, max_thumbnails_per_reason: int = 8) -> str:
    """The run's audit report as one HTML page with everything inline (CSS, SVG, images).

    Args:
        run: the run record (see the module's callers): dataset, run, recipe_hash, started,
            finished, phases (counts, reasons, sources, licenses, gate, links), blocked.
        samples: one row per sample judged by validation, or ``None``.
        max_thumbnails_per_reason: thumbnails shown per reason group (default 8).

    The same input gives the same bytes. Links are only emitted for relative paths (taken
    relative to the report's folder); anything else is shown as text.
    """
    if max_thumbnails_per_reason < 0:
        raise ValueError("max_thumbnails_per_reason must be >= 0")
    v = verdict(run)
    phases = _phases(run)
    dataset, run_id = run.get("dataset", ""), run.get("run", "")
    meta = [("dataset", dataset), ("run", run_id), ("recipe hash", run.get("recipe_hash")),
            ("started", run.get("started")), ("finished", run.get("finished") or "not yet")]
    dur = _duration(run.get("started"), run.get("finished"))
    if dur:
        meta.append(("duration", dur))
    meta_html = "".join(f'<dt>{_e(k)}</dt><dd class="mono" data-meta="{_e(_slug(k))}">{_e(val)}</dd>' for k, val in meta)
    msg = run.get("blocked")
    banner_msg = f'<span class="msg" data-blocked-message>{_e(msg)}</span>' if msg else ""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # Defence in depth: even if something slipped through, the page can load nothing
        # from elsewhere and run no script.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; style-src 'unsafe-inline'\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>shardsmith report: {_e(dataset)} {_e(run_id)}</title>",
        f"<style>{_CSS}</style></head><body><main>",
        f"<h1>shardsmith audit report: {_e(dataset)}</h1>",
        f'<dl class="meta">{meta_html}</dl>',
        f'<div class="banner {_slug(v)}" data-verdict="{_e(v)}">{_e(v)}{banner_msg}</div>',
        "<h2>Phases</h2>",
        _phase_overview(phases) if phases else '<p class="muted">No phase has run yet.</p>',
        *[_phase_section(p) for p in phases],
        _samples_section(samples, max_thumbnails_per_reason),
        "</main></body></html>",
    ]
    return "\n".join(parts) + "\n"


def summary_text(run: dict) -> str:
    """The report's summary for a terminal: counts, reasons, gate outcomes, the verdict."""
    v = verdict(run)
    lines = [f"shardsmith report: {run.get('dataset', '')} / {run.get('run', '')}"]
    lines.append(f"recipe:   {run.get('recipe_hash', '')}")
    times = f"started:  {run.get('started', '')}   finished: {run.get('finished') or 'not yet'}"
    dur = _duration(run.get("started"), run.get("finished"))
    lines.append(times + (f"   ({dur})" if dur else ""))
    lines.append(f"status:   {v}" + (f": {run['blocked']}" if run.get("blocked") else ""))
    for p in _phases(run):
        name = p.get("phase", "")
        line = (
            f"{name}: {_int(p.get('rows'))} rows, {_int(p.get('ok'))} ok, "
            f"{_int(p.get('rejected'))} rejected, {_int(p.get('error'))} error"
        )
        speed = []
        if p.get("seconds") is not None:
            speed.append(f"{_fmt_num(p.get('seconds'))} s")
        if p.get("samples_per_s") is not None:
            speed.append(f"{_fmt_num(p.get('samples_per_s'))} samples/s")
        lines += ["", line + (f" ({', '.join(speed)})" if speed else "")]
        grouped = group_reasons(p.get("by_reason"))
        if grouped:
            lines.append("  reasons:")
            width = max(len(_fmt_int(n)) for n in grouped.values())
            lines += [f"    {_fmt_int(n):>{width}}  {g}" for g, n in grouped.items()]
        gate = p.get("gate")
        if isinstance(gate, dict):
            lines.append(f"  gate: {'PASS' if gate.get('success') else 'FAIL'}")
            for o in gate.get("outcomes") or []:
                if not isinstance(o, dict):
                    continue
                detail = ", ".join(
                    s for s in (
                        f"{o['column']}" if o.get("column") else "",
                        f"threshold {o['threshold']}" if o.get("threshold") is not None else "",
                        f"observed {_fmt_observed(o.get('observed'))}",
                    ) if s
                )
                lines.append(f"    {'PASS' if o.get('success') else 'FAIL'}  {o.get('name', '')} ({detail})")
        links = p.get("links") or {}
        if isinstance(links, dict) and links:
            lines.append("  links: " + ", ".join(f"{k}: {links[k]}" for k in sorted(links, key=str)))
    if run.get("blocked"):
        lines += ["", f"BLOCKED: {run['blocked']}"]
    # Data goes to a terminal: no escape sequences from a hostile reason or caption.
    return _CONTROL.sub("?", "\n".join(lines)) + "\n"


def write_report(storage: Storage, rel_dir: str, run: dict, samples: pa.Table | None) -> dict[str, str]:
    """Write ``report.html``, ``run.json`` and ``samples.parquet`` under ``rel_dir``.

    Returns ``{"html": ..., "json": ..., "samples": ...}`` (relative paths; ``samples`` only
    when a table was given). With ``samples=None`` an older ``samples.parquet`` is removed, so
    the folder always holds the inputs of the page beside them: a later phase that wants the
    validation samples in its report passes them again.
    """
    rel_dir = rel_dir.rstrip("/")
    paths = {"html": f"{rel_dir}/{REPORT_HTML}", "json": f"{rel_dir}/{RUN_JSON}"}
    samples_rel = f"{rel_dir}/{SAMPLES_PARQUET}"
    if samples is not None:
        buf = io.BytesIO()
        pq.write_table(samples, buf, compression="zstd")
        storage.write_bytes(samples_rel, buf.getvalue())
        paths["samples"] = samples_rel
    else:
        storage.rm(samples_rel)
    storage.write_bytes(paths["json"], (json.dumps(run, indent=2, sort_keys=True, default=str) + "\n").encode())
    # The page last: its presence means its inputs are in place.
    storage.write_bytes(paths["html"], render_html(run, samples).encode("utf-8"))
    return paths


def load_run(storage: Storage, rel_dir: str) -> tuple[dict, pa.Table | None]:
    """Read back what ``write_report`` wrote: the run record and the samples table (or None)."""
    rel_dir = rel_dir.rstrip("/")
    run = json.loads(storage.read_bytes(f"{rel_dir}/{RUN_JSON}"))
    samples_rel = f"{rel_dir}/{SAMPLES_PARQUET}"
    if not storage.exists(samples_rel):
        return run, None
    with storage.open(samples_rel, "rb") as fh:
        return run, pq.read_table(fh, use_threads=False)  # see tasks.ledger.read_parquet
