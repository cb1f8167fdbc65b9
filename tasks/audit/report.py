"""The audit report: one self-contained HTML file per run, and the same summary as text."""

from __future__ import annotations

import io
import json
from functools import lru_cache
from typing import Any

import jinja2
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.audit.changes import changes_view
from tasks.audit.curation_views import curation_view, read_curation
from tasks.audit.privacy_views import privacy_view
from tasks.audit.report_views import (
    as_int,
    duration,
    fmt_int,
    fmt_observed,
    group_reasons,
    histograms,
    phase_view,
    phases_of,
    samples_view,
    slug,
    status_bar,
    terminal_text,
    verdict,
)
from tasks.audit.runrecord import RunView, row_text, run_json, summary_rows
from tasks.audit.video_views import video_view
from tasks.formats.ledger import read_parquet
from tasks.formats.reasons import ERROR, OK, REJECTED
from tasks.formats.storage import Storage

REPORT_HTML = "report.html"
RUN_JSON = "run.json"
SAMPLES_PARQUET = "samples.parquet"


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("tasks.audit", "templates"),
        autoescape=True,  # every value is data, some of it hostile (reasons, keys, captions)
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fmt_int"] = fmt_int
    return env


# ----------------------------------------------------------------------------- public API


def render_html(
    run: RunView, samples: pa.Table | None, *, max_thumbnails_per_reason: int = 8, curation: Any = None
) -> str:
    """The run's audit report as one HTML page with everything inline (CSS, SVG, images).

    Args:
        run: the run record (tasks/audit/runrecord.py), or run.json read back.
        samples: one row per sample judged by validation, or ``None``.
        max_thumbnails_per_reason: thumbnails shown per reason group (default 8).
        curation: the curation phase's views (``tasks.audit.curation_views.read_curation``), or ``None``.

    The same input gives the same bytes. Links are only emitted for relative paths (taken
    relative to the report's folder); anything else is shown as text.
    """
    if max_thumbnails_per_reason < 0:
        raise ValueError("max_thumbnails_per_reason must be >= 0")
    run = run_json(run)
    v = verdict(run)
    meta = [
        ("dataset", run.get("dataset", "")),
        ("run", run.get("run", "")),
        ("recipe hash", run.get("recipe_hash")),
        ("started", run.get("started")),
        ("finished", run.get("finished") or "not yet"),
    ]
    dur = duration(run.get("started"), run.get("finished"))
    if dur:
        meta.append(("duration", dur))
    page = (
        _env()
        .get_template("report.html.j2")
        .render(
            dataset=run.get("dataset", ""),
            run_id=run.get("run", ""),
            meta=[(k, slug(k), "" if val is None else val) for k, val in meta],
            verdict=v,
            verdict_slug=slug(v),
            blocked=run.get("blocked"),
            phases=[phase_view(p) for p in phases_of(run)],
            changes=changes_view(run.get("changes")),
            samples=samples_view(samples, max_thumbnails_per_reason),
            privacy=privacy_view(samples, max_thumbnails_per_reason),
            video=video_view(samples),
            curation=curation_view(curation),
        )
    )
    return page.strip() + "\n"


def plot_svgs(run: RunView, samples: pa.Table | None, curation: Any = None) -> dict[str, str]:
    """The report's key plots as standalone SVG files, for places that show images only (the
    Prefect UI): rows by status per phase, the histograms of accepted samples, those of source
    videos, then each curation score's histogram with its cut (``curation``: as ``render_html``
    takes it)."""
    plots: Any = _env().get_template("plots.svg.j2").module  # its macros are attributes
    out = {}
    for p in phases_of(run_json(run)):
        counts = {s: as_int(p.get(s)) for s in (OK, REJECTED, ERROR)}
        bar = status_bar(
            counts, as_int(p.get("rows")), f"{p.get('phase', '')}: {fmt_int(as_int(p.get('rows')))} rows by status"
        )
        if bar is not None:
            out[f"status-{slug(p.get('phase', ''))}"] = str(plots.status_bar(bar, standalone=True))
    for h in histograms(samples):
        if h["n"]:
            out[f"hist-{h['column']}"] = str(plots.histogram(h, standalone=True))
    videos = video_view(samples)
    for h in videos["hists"] if videos else []:
        if h["n"]:
            out[f"hist-{h['column']}"] = str(plots.histogram(h, standalone=True))
    view = curation_view(curation)
    for score in view["scores"] if view else []:
        if score["hist"]["n"]:
            out[f"curation-{score['name']}"] = str(plots.histogram(score["hist"], standalone=True))
    return out


def summary_text(run: RunView) -> str:
    """The report's summary for a terminal: each phase's summary row, its reasons, gate
    outcomes and links, and the verdict."""
    rows = summary_rows(run)
    run = run_json(run)
    v = verdict(run)
    lines = [f"shardsmith report: {run.get('dataset', '')} / {run.get('run', '')}"]
    lines.append(f"recipe:   {run.get('recipe_hash', '')}")
    times = f"started:  {run.get('started', '')}   finished: {run.get('finished') or 'not yet'}"
    dur = duration(run.get("started"), run.get("finished"))
    lines.append(times + (f"   ({dur})" if dur else ""))
    lines.append(f"status:   {v}" + (f": {run['blocked']}" if run.get("blocked") else ""))
    changed = changes_view(run.get("changes"))
    if changed is not None:
        lines.append(f"release:  {changed['text']}")
    for row, p in zip(rows, phases_of(run)):
        lines += ["", row_text(row)]
        grouped = group_reasons(p.get("by_reason"))
        if grouped:
            lines.append("  reasons:")
            width = max(len(fmt_int(n)) for n in grouped.values())
            lines += [f"    {fmt_int(n):>{width}}  {g}" for g, n in grouped.items()]
        gate = p.get("gate")
        if isinstance(gate, dict):
            lines.append("  checks:")
            for o in gate.get("outcomes") or []:
                if not isinstance(o, dict):
                    continue
                detail = ", ".join(
                    s
                    for s in (
                        f"{o['column']}" if o.get("column") else "",
                        f"threshold {o['threshold']}" if o.get("threshold") is not None else "",
                        f"observed {fmt_observed(o.get('observed'))}",
                    )
                    if s
                )
                lines.append(f"    {'PASS' if o.get('success') else 'FAIL'}  {o.get('name', '')} ({detail})")
        links = p.get("links") or {}
        if isinstance(links, dict) and links:
            lines.append("  links: " + ", ".join(f"{k}: {links[k]}" for k in sorted(links, key=str)))
    if run.get("blocked"):
        lines += ["", f"BLOCKED: {run['blocked']}"]
    # Data goes to a terminal: no escape sequences from a hostile reason or caption.
    return terminal_text("\n".join(lines)) + "\n"


def write_report(
    storage: Storage, rel_dir: str, run: RunView, samples: pa.Table | None, html: bool = True
) -> dict[str, str]:
    """Write ``report.html``, ``run.json`` and ``samples.parquet`` under ``rel_dir`` (the page
    only when ``html``: a phase that is not the run's last leaves it to the phase after it).

    Returns ``{"html": ..., "json": ..., "samples": ...}`` (relative paths; ``samples`` when the
    folder holds a table). With ``samples=None`` the table an earlier phase of the run wrote
    is kept and drawn again, so the report of a later phase (reshard, precache, release) still
    shows the histograms and thumbnails of validation.
    """
    rel_dir = rel_dir.rstrip("/")
    paths = {"html": f"{rel_dir}/{REPORT_HTML}", "json": f"{rel_dir}/{RUN_JSON}"}
    samples_rel = f"{rel_dir}/{SAMPLES_PARQUET}"
    if samples is not None:
        buf = io.BytesIO()
        pq.write_table(samples, buf, compression="zstd")
        storage.write_bytes(samples_rel, buf.getvalue())
    else:
        samples = read_samples(storage, samples_rel)
    if samples is not None:
        paths["samples"] = samples_rel
    data = run_json(run)
    storage.write_bytes(paths["json"], (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode())
    if not html:
        return paths
    # The page last: its presence means its inputs are in place.
    curation = read_curation(storage, rel_dir)
    storage.write_bytes(paths["html"], render_html(data, samples, curation=curation).encode("utf-8"))
    return paths


def read_samples(storage: Storage, rel: str) -> pa.Table | None:
    """The samples table at ``rel``, or None where there is none."""
    if not storage.exists(rel):
        return None
    return read_parquet(storage, rel)


def load_run(storage: Storage, rel_dir: str) -> tuple[dict, pa.Table | None]:
    """Read back what ``write_report`` wrote: the run record as run.json holds it (the renderers
    take it as it is) and the samples table (or None)."""
    rel_dir = rel_dir.rstrip("/")
    run = json.loads(storage.read_bytes(f"{rel_dir}/{RUN_JSON}"))
    return run, read_samples(storage, f"{rel_dir}/{SAMPLES_PARQUET}")
