"""The Great Expectations suite that gates the curation phase: what each filter removed, and what is kept."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from tasks.audit.gate_checks import Check, check_count, key_checks, mostly_of, reason_share_check, share_unexpected
from tasks.audit.gate_results import GateResult, fmt_number
from tasks.audit.ge_runner import expectation_stats, import_gx, ledger_stats, reason_families, run_suites, to_frame
from tasks.formats.reasons import OK
from tasks.formats.recipe_curate import CurateGate


def _ledger_checks(cfg: CurateGate, reasons: list[str]) -> list[Check]:
    rate = fmt_number(cfg.max_removed_rate)
    checks = key_checks("ledger ") + [
        Check(
            f"removed share <= {rate}",
            f"<= {rate}",
            "ExpectColumnValuesToBeInSet",
            {"column": "status", "value_set": [OK], "mostly": mostly_of(1.0 - cfg.max_removed_rate)},
            share_unexpected,
        )
    ]
    # One check per filter: its share of the samples in, against its own limit (the phase's
    # limit by default), so the report shows what each filter removed.
    checks += [reason_share_check(r, cfg.max_reason_rate.get(r, cfg.max_removed_rate)) for r in reasons]
    return checks


def _kept_checks(cfg: CurateGate, aligned: bool) -> list[Check]:
    checks = [
        Check(
            f"kept samples >= {cfg.min_samples}",
            f">= {cfg.min_samples}",
            "ExpectTableRowCountToBeBetween",
            {"min_value": cfg.min_samples},
            check_count,
        )
    ]
    if cfg.min_mean_alignment is not None and aligned:
        m = fmt_number(cfg.min_mean_alignment)
        checks.append(
            Check(
                f"mean alignment of kept samples >= {m}",
                f">= {m}",
                "ExpectColumnMeanToBeBetween",
                {"column": "alignment", "min_value": cfg.min_mean_alignment},
                check_count,
            )
        )
    return checks


def curate_gate(ledger: pa.Table, cfg: CurateGate, reasons: list[str]) -> GateResult:
    """Gate curation on its ledger (one row per sample in) and its kept samples.

    Checks: keys present and unique; statuses known; the share removed <= ``max_removed_rate``;
    per filter (``reasons``: the reason families the recipe's filters give) its share <= its
    limit in ``max_reason_rate`` (default ``max_removed_rate``); kept samples >= ``min_samples``;
    the mean alignment of the kept samples >= ``min_mean_alignment`` when set.
    """
    gx = import_gx()
    frame = to_frame(ledger, ["key", "status", "reason"], "curate ledger")
    frame["reason"] = reason_families(frame["reason"])
    kept = ledger.filter(pc.equal(ledger.column("status"), OK)) if ledger.num_rows else ledger
    aligned = "alignment" in kept.column_names and kept.column("alignment").null_count < kept.num_rows
    kept_cols = ["key", "alignment"] if aligned else ["key"]
    kept_frame = to_frame(kept, kept_cols, "curated samples")
    outcomes, validations = run_suites(
        gx,
        "curate",
        [("ledger", frame, _ledger_checks(cfg, reasons)), ("kept", kept_frame, _kept_checks(cfg, aligned))],
    )
    stats = {**ledger_stats(frame), "kept": int(len(kept_frame)), "expectations": expectation_stats(outcomes)}
    if aligned:
        stats["mean_alignment"] = round(float(kept_frame["alignment"].mean()), 6)
    return GateResult.of_suites("curate", outcomes, validations, stats)
