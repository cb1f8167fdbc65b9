"""The markdown summary of one phase of a run, posted as that phase's Prefect artifact."""

from __future__ import annotations

from typing import Any

from tasks.audit.gate_results import observed_text
from tasks.audit.report_markdown import md as _md
from tasks.audit.report_web import Link, link_markdown


def phase_markdown(run: dict[str, Any], phase: dict[str, Any], report: Link) -> str:
    """A phase's summary for its Prefect artifact: counts, gate checks, why blocked, the report link."""
    lines = [
        f"# {run['dataset']}: {phase['phase']} ({run['run']})",
        "",
        "| rows | ok | rejected | error | samples/s |",
        "|---:|---:|---:|---:|---:|",
        f"| {phase['rows']} | {phase['ok']} | {phase['rejected']} | {phase['error']} | {phase['samples_per_s']} |",
        "",
    ]
    gate = phase.get("gate")
    if gate:
        lines += ["| gate | threshold | observed | result |", "|---|---|---|---|"]
        for o in gate["outcomes"]:
            lines.append(
                f"| {_md(o['name'])} | {_md(o['threshold'])} | {_md(observed_text(o['observed']))} | {'PASS' if o['success'] else 'FAIL'} |"
            )
        lines.append("")
    if run.get("blocked"):
        lines += [f"**BLOCKED**: {_md(run['blocked'])}", ""]
    lines.append("Report: " + link_markdown(report, "audit report"))
    return "\n".join(lines) + "\n"
