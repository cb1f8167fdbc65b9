"""Running gate checks as Great Expectations suites: the context, the run, ledger statistics."""

from __future__ import annotations

import datetime as dt
import os
import threading
from typing import Any

import pyarrow as pa

from tasks.audit.gate_checks import Check
from tasks.audit.gate_results import ExpectationOutcome
from tasks.formats.reasons import STATUSES, family

# GE 1.x keeps the current context in a process-wide singleton (ValidationDefinition.run reads
# its stores from there), so two gates running at once in threads would cross their results.
GE_LOCK = threading.Lock()


# --- running GE -------------------------------------------------------------------------------


def preload() -> None:
    """Import Great Expectations ahead of the first gate (the import takes seconds)."""
    import_gx()


# Imported by one expectation module GE loads at its own import (the KL-divergence one,
# ``from scipy import stats``) and used only when that expectation runs, which no gate here
# does: loaded on first use instead. It was 1.5-2.5 s of GE's 4-9 s import, on the critical
# path of every run's first gate. (altair, imported by the same module with ``import altair``,
# cannot wait: on Python 3.11 that statement itself runs a lazy module.)
LAZY_FOR_GX = ("scipy.stats",)
_LAZY_LOCK = threading.Lock()


def import_gx() -> Any:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    with _LAZY_LOCK:
        for name in LAZY_FOR_GX:
            import_lazily(name)
        import great_expectations as gx

    return gx


def import_lazily(name: str) -> None:
    """Put module ``name`` in ``sys.modules`` unexecuted; it runs on its first attribute access.

    The standard library's ``importlib.util.LazyLoader``, as scientific Python's lazy_loader
    uses it. Nothing happens when the module is imported already or is not installed.
    """
    import importlib.util
    import sys

    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def _view(name: str) -> dict[str, str]:
    return {"module_name": "tasks.audit.ge_views", "class_name": name}


def ge_context(gx: Any, docs_dir: str | None = None) -> Any:
    """An in-memory context: no analytics, no progress bars, no docs site unless asked for.

    ``get_context(mode="ephemeral")`` alone adds a default docs site in a fresh temp dir;
    an explicit config avoids that.
    """
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    sites = {}
    if docs_dir is not None:
        sites["gate"] = {
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": docs_dir},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder", "view": _view("CachedIndexPageView")},
            # merged with GE's defaults: only the page views change (tasks/audit/ge_views.py)
            "site_section_builders": {
                "expectations": {"view": _view("CachedPageView")},
                "validations": {"view": _view("CachedPageView")},
            },
        }
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        data_docs_sites=sites,
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False, metric_calculations=False),
    )
    return gx.get_context(project_config=config, mode="ephemeral")


def _outcome_of(check: Check, expectation_type: str, column: str | None, result: dict) -> ExpectationOutcome:
    exc = result.get("exception_info") or {}
    errors = [
        e.get("exception_message")
        for e in (exc.values() if "raised_exception" not in exc else [exc])
        if isinstance(e, dict) and e.get("raised_exception")
    ]
    observed = {"error": errors[0]} if errors else check.observe(result.get("result") or {})
    return ExpectationOutcome(
        name=check.name,
        expectation=expectation_type,
        column=column,
        threshold=check.threshold,
        observed=observed,
        success=bool(result["success"]) and not errors,
    )


def run_suites(
    gx: Any, phase: str, tables: list[tuple[str, Any, list[Check]]]
) -> tuple[list[ExpectationOutcome], list[dict[str, Any]]]:
    """Validate each (table name, pandas frame, checks) with its own suite, in one context."""
    from great_expectations.core.run_identifier import RunIdentifier

    run_id = RunIdentifier(run_name=phase, run_time=dt.datetime.now(dt.UTC))
    outcomes: list[ExpectationOutcome] = []
    validations: list[dict[str, Any]] = []
    names = [c.name for _, _, checks in tables for c in checks]
    if len(set(names)) != len(names):
        raise ValueError(f"{phase} gate: check names repeat: {names}")
    with GE_LOCK:
        context = ge_context(gx)
        source = context.data_sources.add_pandas(f"{phase}_gate")
        for table, frame, checks in tables:
            suite = gx.ExpectationSuite(name=f"{phase}_{table}")
            for check in checks:
                suite.add_expectation(check.build(gx))
            suite = context.suites.add(suite)
            batch = source.add_dataframe_asset(table).add_batch_definition_whole_dataframe("all")
            definition = context.validation_definitions.add(
                gx.ValidationDefinition(name=f"{phase}_{table}", data=batch, suite=suite)
            )
            result = definition.run(
                batch_parameters={"dataframe": frame}, result_format="SUMMARY", run_id=run_id
            ).to_json_dict()
            validations.append(result)
            # GE returns results in its own order; match them to the checks by their meta.
            by_name = {r["expectation_config"]["meta"]["gate_check"]: r for r in result["results"]}
            for check in checks:
                r = by_name[check.name]
                cfg = r["expectation_config"]
                outcomes.append(_outcome_of(check, cfg["type"], cfg["kwargs"].get("column"), r))
    return outcomes, validations


# The types of the columns an empty table (no schema) is given, so that a sum or a range over
# none of them is a number, not a string (GE compared '' with 0.0 and raised)
_NUMERIC = {
    "width": pa.int64(),
    "height": pa.int64(),
    "aspect": pa.float64(),
    "row": pa.int64(),
    "samples": pa.int64(),
    **dict.fromkeys(("readable", "complete", "checksum_ok", "is_last"), pa.bool_()),
}


def to_frame(table: pa.Table, columns: list[str], what: str) -> Any:
    missing = [c for c in columns if c not in table.column_names]
    if missing and table.num_rows:
        raise ValueError(f"{what} lacks column(s) {', '.join(missing)}; has {', '.join(table.column_names)}")
    for col in missing:
        # Nothing came out of the phase (a table without a schema): the gate must fail on
        # its row count, not raise.
        table = table.append_column(col, pa.array([], _NUMERIC.get(col, pa.string())))
    # Only the checked columns: nested columns (members) convert slowly and are not gated here.
    return table.select(columns).to_pandas()


def reason_families(reasons: Any) -> Any:
    """Reasons grouped by family (``duplicate_of:<key>`` -> ``duplicate_of``), nulls as "".

    GE map expectations skip nulls, and ok rows have no reason: "no reason" must be a value
    so that a reason's share is over all rows, not over the failed ones.
    """
    values = reasons.astype(object).where(reasons.notna(), None)
    return values.map(lambda r: "" if r is None else family(str(r)))


def ledger_stats(frame: Any) -> dict[str, Any]:
    status = frame["status"]
    stats: dict[str, Any] = {"rows": int(len(frame))}
    for s in STATUSES:
        stats[s] = int((status == s).sum())
    if "reason" in frame:
        counts = frame["reason"][frame["reason"].notna() & (frame["reason"] != "")].value_counts()
        stats["by_reason"] = dict(sorted(((str(k), int(v)) for k, v in counts.items()), key=lambda kv: (-kv[1], kv[0])))
    return stats


def expectation_stats(outcomes: list[ExpectationOutcome]) -> dict[str, int]:
    ok = sum(o.success for o in outcomes)
    return {"evaluated": len(outcomes), "successful": ok, "unsuccessful": len(outcomes) - ok}


# --- reports ----------------------------------------------------------------------------------


def json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)
