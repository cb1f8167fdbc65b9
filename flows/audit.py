"""Gates and the audit trail of a run: gate reports, the HTML report, and Prefect artifacts."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from tasks.ledger import Counts
from tasks.reasons import family
from tasks.recipe import Recipe
from tasks.storage import Storage


class GateFailed(RuntimeError):
    """A phase's gate failed: nothing downstream runs; the report says why."""


def report_dir(recipe: Recipe, run: str) -> str:
    return f"{recipe.dataset}/reports/{run}"


def new_run(recipe: Recipe, run: str) -> dict[str, Any]:
    return {
        "dataset": recipe.dataset,
        "run": run,
        "recipe_hash": recipe.recipe_hash(),
        "storage": recipe.storage,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "finished": None,
        "phases": [],
        "blocked": None,
    }


def by_source(ledger: pa.Table) -> dict[str, dict[str, int]]:
    out: dict[str, Counter[str]] = {}
    for source, status in zip(ledger.column("source").to_pylist(), ledger.column("status").to_pylist()):
        c = out.setdefault(source, Counter())
        c["rows"] += 1
        c[status] += 1
    return {s: {k: c.get(k, 0) for k in ("rows", "ok", "rejected", "error")} for s, c in sorted(out.items())}


def by_license(ledger: pa.Table) -> dict[str, int]:
    if "license" not in ledger.column_names:
        return {}
    c = Counter(lic or "(none)" for lic, st in zip(ledger.column("license").to_pylist(), ledger.column("status").to_pylist()) if st == "ok")
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def phase_record(phase: str, counts: Counts, ledger: pa.Table, seconds: float, samples_per_s: float, gate: Any | None, links: dict[str, str]) -> dict[str, Any]:
    return {
        "phase": phase,
        "rows": counts.rows,
        "ok": counts.ok,
        "rejected": counts.rejected,
        "error": counts.error,
        "by_reason": counts.by_reason,
        "by_source": by_source(ledger),
        "by_license": by_license(ledger),
        "seconds": round(seconds, 3),
        "samples_per_s": samples_per_s,
        # The full Great Expectations result is in gates/{phase}.json; run.json keeps the outcomes.
        "gate": {k: v for k, v in gate.to_json().items() if k != "ge_result"} if gate is not None else None,
        "links": links,
    }


def run_gate(storage: Storage, recipe: Recipe, run: dict[str, Any], gate: Any) -> dict[str, str]:
    """Save a gate's JSON and Data Docs under the run's report folder; return relative links."""
    from tasks.data_docs import save_gate_report

    base = report_dir(recipe, run["run"])
    written = save_gate_report(gate, storage, f"{base}/gates")
    # Links in the HTML report are relative to the report's folder.
    return {name: path[len(base) + 1 :] if path.startswith(base + "/") else path for name, path in written.items()}


def publish(storage: Storage, recipe: Recipe, run: dict[str, Any], samples: pa.Table | None = None) -> str:
    """Write run.json and report.html for the run so far, and post the phase's artifacts."""
    from tasks.report import write_report

    base = report_dir(recipe, run["run"])
    run["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    written = write_report(storage, base, run, samples)
    report_url = storage.url(written.get("html", f"{base}/report.html"))
    phase = run["phases"][-1] if run["phases"] else None
    key = recipe.dataset
    if phase is not None:
        name = phase["phase"]
        create_markdown_artifact(_markdown(run, phase, report_url), key=f"{key}-{name}-summary", description=f"{key}: {name} summary")
        reasons = Counter()
        for reason, n in phase["by_reason"].items():
            reasons[family(reason)] += n
        table = [{"reason": r, "rows": n, "share": round(n / max(phase["rows"], 1), 4)} for r, n in reasons.most_common()]
        create_table_artifact(table or [{"reason": "(none)", "rows": 0, "share": 0.0}], key=f"{key}-{name}-reasons", description=f"{key}: {name} rows by reason")
    create_link_artifact(report_url, link_text=f"{key} audit report ({run['run']})", key=f"{key}-report", description="HTML audit report")
    docs = (phase or {}).get("links", {}).get("data_docs")
    if docs:
        # One Data Docs site per run lists every gate so far, so the latest link is enough.
        create_link_artifact(
            storage.url(f"{base}/{docs}"), link_text=f"{key} gate results, Data Docs ({run['run']})", key=f"{key}-data-docs", description="Great Expectations Data Docs"
        )
    return report_url


def check_gate(storage: Storage, recipe: Recipe, run: dict[str, Any], gate: Any, samples: pa.Table | None = None) -> str:
    """Publish the report; raise ``GateFailed`` if the gate failed (after the report is written)."""
    if not gate.success:
        run["blocked"] = gate.failure_message()
    url = publish(storage, recipe, run, samples)
    if not gate.success:
        raise GateFailed(f"{run['blocked']}\nreport: {url}")
    return url


def _markdown(run: dict[str, Any], phase: dict[str, Any], report_url: str) -> str:
    from tasks.gates import observed_text

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
            lines.append(f"| {o['name']} | {o['threshold']} | {observed_text(o['observed'])} | {'PASS' if o['success'] else 'FAIL'} |")
        lines.append("")
    if run.get("blocked"):
        lines += [f"**BLOCKED**: {run['blocked']}", ""]
    lines.append(f"Report: [{report_url}]({report_url})")
    return "\n".join(lines) + "\n"
