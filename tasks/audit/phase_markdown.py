"""The markdown summary of one phase of a run, posted as that phase's Prefect artifact."""

from __future__ import annotations

from tasks.audit.gate_results import observed_text
from tasks.audit.report_markdown import md as _md
from tasks.audit.report_markdown import summary_table
from tasks.audit.report_web import Link, link_markdown
from tasks.audit.runrecord import PhaseRecord, RunRecord, summary_row


def phase_markdown(run: RunRecord, phase: PhaseRecord, report: Link) -> str:
    """A phase's summary for its Prefect artifact: its summary row, gate checks, why blocked, the report link."""
    lines = [f"# {_md(run.dataset)}: {_md(phase.phase)} ({_md(run.run)})", "", *summary_table([summary_row(phase)]), ""]
    gate = phase.gate
    if gate:
        lines += ["| gate | threshold | observed | result |", "|---|---|---|---|"]
        for o in gate["outcomes"]:
            lines.append(
                f"| {_md(o['name'])} | {_md(o['threshold'])} | {_md(observed_text(o['observed']))} | {'PASS' if o['success'] else 'FAIL'} |"
            )
        lines.append("")
    if run.blocked:
        lines += [f"**BLOCKED**: {_md(run.blocked)}", ""]
    lines.append("Report: " + link_markdown(report, "audit report"))
    return "\n".join(lines) + "\n"
