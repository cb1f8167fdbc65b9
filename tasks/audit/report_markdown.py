"""A run's summary as markdown and tables, for the Prefect UI (the artifacts of the run)."""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from tasks.audit.report import plot_svgs
from tasks.audit.report_views import reason_info, verdict
from tasks.audit.runrecord import SUMMARY_COLUMNS, RunView, SummaryRow, row_cells, run_json, summary_rows
from tasks.formats.reasons import family

_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]<>|#!])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def md(value: Any) -> str:
    """``value`` as literal markdown text in a table cell or a line: markdown and HTML
    characters escaped (the UI renders HTML in markdown), newlines and control chars gone."""
    return _MD_SPECIAL.sub(r"\\\1", _CONTROL.sub(" ", "" if value is None else str(value)))


def _phases(run: RunView) -> list[dict[str, Any]]:
    return [p for p in run_json(run).get("phases") or [] if isinstance(p, dict)]


def _observed(value: Any) -> str:
    from tasks.audit.gate_results import observed_text

    return observed_text(value)


def reason_rows(run: RunView) -> list[dict[str, Any]]:
    """One row per (phase, reason family): rows and share of the phase's rows, largest first."""
    out = []
    for p in _phases(run):
        counts: dict[str, int] = {}
        for reason, n in (p.get("by_reason") or {}).items():
            counts[family(str(reason))] = counts.get(family(str(reason)), 0) + int(n)
        total = max(int(p.get("rows") or 0), 1)
        for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(
                {
                    "phase": p.get("phase"),
                    "reason": reason,
                    "status": reason_info(reason)[0],
                    "rows": n,
                    "share": round(n / total, 4),
                }
            )
    return out


def gate_rows(run: RunView) -> list[dict[str, Any]]:
    """One row per expectation of every phase's gate: threshold, observed value, result."""
    out = []
    for p in _phases(run):
        gate = p.get("gate") if isinstance(p.get("gate"), dict) else None
        for o in (gate or {}).get("outcomes") or []:
            out.append(
                {
                    "phase": p.get("phase"),
                    "check": o.get("name"),
                    "threshold": o.get("threshold"),
                    "observed": _observed(o.get("observed")),
                    "result": "PASS" if o.get("success") else "FAIL",
                }
            )
    return out


def summary_table(rows: Sequence[SummaryRow], datasets: Sequence[str] | None = None) -> list[str]:
    """Summary rows as the lines of a markdown table (``datasets``: a first column naming each
    row's dataset, as the nightly's table has); a failed gate in bold."""
    lead = ["dataset"] if datasets is not None else []
    # Phase and gate left, the counts and rates between them right: one per column.
    align = ["---", *(["---:"] * (len(SUMMARY_COLUMNS) - 2)), "---"]
    lines = [
        "| " + " | ".join([*lead, *SUMMARY_COLUMNS]) + " |",
        "|" + "|".join(["---"] * len(lead) + align) + "|",
    ]
    for i, row in enumerate(rows):
        cells = [md(c) for c in row_cells(row)]
        cells[-1] = "**FAIL**" if row.gate == "FAIL" else cells[-1]
        first = [md(datasets[i])] if datasets is not None else []
        lines.append("| " + " | ".join([*first, *cells]) + " |")
    return lines


def changes_lines(data: Any) -> list[str]:
    """The counts of what the run's release changes since the last one (run.json's
    ``changes``) as a markdown section; none where the run compared no releases."""
    from tasks.audit.changes import changes_view

    view = changes_view(data)
    if view is None:
        return []
    since = md(view["since"] or "the last release")
    lines = ["", f"## Changes since {since}", ""]
    lines.append(f"{view['released_before']:,} rows released by {since}, {view['released_now']:,} now.")
    lines += ["", "| change | rows | share | kept | reasons |", "|---|---:|---:|---:|---|"]
    for c in view["rows"]:
        kept = "-" if c["kept"] is None else f"{c['kept']:,}"
        reasons = ", ".join(f"{md(r)} {n:,}" for r, n in c["reasons"][:5])
        lines.append(f"| {md(c['label'])} | {c['count']:,} | {c['share']} | {kept} | {reasons} |")
    return lines


def image(svg: str, alt: str) -> str:
    """A markdown image of an SVG held in the markdown itself (a data: URI), so the UI shows
    the plot without reaching any server."""
    alt = re.sub(r"[^\w .-]+", " ", alt).replace("_", " ")  # alt text is not unescaped by every renderer
    return f"![{alt}](data:image/svg+xml;base64,{base64.b64encode(svg.encode('utf-8')).decode('ascii')})"


def run_summary(run: RunView, samples: pa.Table | None, links: dict[str, str], curation: Any = None) -> str:
    """The run so far in one markdown page: verdict, links, every phase's summary row,
    reasons, failed checks, and the report's key plots as images.

    Args:
        run: the run record (tasks/audit/runrecord.py), or run.json read back.
        samples: the report's samples table (histograms), or None.
        links: label -> markdown of a link (tasks.audit.report_web.link_markdown), in order.
        curation: the run's curation views (its scores' histograms join the plots), or None.
    """
    rows = summary_rows(run)
    run = run_json(run)
    v = verdict(run)
    lines = [
        f"# {md(run.get('dataset'))}: run {md(run.get('run'))}",
        "",
        f"**{v}**" + (f": {md(run['blocked'])}" if run.get("blocked") else ""),
        "",
    ]
    lines += [f"- {md(label)}: {link}" for label, link in links.items()]
    release = run.get("release") if isinstance(run.get("release"), dict) else None
    if release:
        state = "new release" if release.get("created") else "unchanged, still"
        lines.append(
            f"- release: {state} {md(release.get('version'))}"
            + (f" at `{md(release['path'])}`" if release.get("path") else "")
        )
    lines += ["", *summary_table(rows)]
    lines += changes_lines(run.get("changes"))
    reasons = reason_rows(run)
    if reasons:
        lines += ["", "## Rows by reason", "", "| phase | reason | status | rows | share |", "|---|---|---|---:|---:|"]
        lines += [
            f"| {md(r['phase'])} | {md(r['reason'])} | {md(r['status'])} | {r['rows']} | {100 * r['share']:.1f}% |"
            for r in reasons
        ]
    failed = [g for g in gate_rows(run) if g["result"] == "FAIL"]
    checks = len(gate_rows(run))
    lines += ["", "## Gates", "", f"{checks - len(failed)} of {checks} checks passed."]
    if failed:
        lines += ["", "| phase | check | threshold | observed |", "|---|---|---|---|"]
        lines += [
            f"| {md(g['phase'])} | {md(g['check'])} | {md(g['threshold'])} | {md(g['observed'])} |" for g in failed
        ]
    plots = plot_svgs(run, samples, curation)
    if plots:
        lines += ["", "## Plots", ""]
        for name, svg in plots.items():
            lines += [image(svg, name.replace("-", " ")), ""]
    return "\n".join(lines).rstrip() + "\n"
