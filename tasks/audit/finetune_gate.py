"""The fine-tuning gate: ledger, samples and packs suites."""

from __future__ import annotations

import pyarrow as pa

from tasks.audit.gate_checks import (
    Check,
    all_true,
    check_count,
    check_rows,
    key_checks,
    mostly_of,
    share_unexpected,
    shown_check,
)
from tasks.audit.gate_results import GateResult, fmt_number
from tasks.audit.ge_runner import expectation_stats, import_gx, ledger_stats, reason_families, run_suites, to_frame
from tasks.formats.reasons import OK
from tasks.formats.recipe_finetune import FinetuneGate, PackingConfig

# --- fine-tuning ------------------------------------------------------------------------------


def _finetune_checks(
    cfg: FinetuneGate, packing: PackingConfig, accepted: int, packed: int
) -> tuple[list[Check], list[Check], list[Check]]:
    ledger = [
        *key_checks(),
        Check(
            f"share not accepted <= {fmt_number(cfg.max_reject_rate)}",
            f"<= {fmt_number(cfg.max_reject_rate)}",
            "ExpectColumnValuesToBeInSet",
            {"column": "status", "value_set": [OK], "mostly": mostly_of(1.0 - cfg.max_reject_rate)},
            share_unexpected,
        ),
    ]
    samples = [
        Check(
            f"accepted samples >= {cfg.min_samples}",
            f">= {cfg.min_samples}",
            "ExpectTableRowCountToBeBetween",
            {"min_value": cfg.min_samples},
            check_count,
        ),
        Check("sample keys unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, check_rows),
        all_true("schema: conversation json complete", "schema_ok", check_rows),
        all_true("tag groups equal images", "tags_ok", check_rows),
        Check(
            "every accepted sample in a pack",
            "no nulls",
            "ExpectColumnValuesToNotBeNull",
            {"column": "pack"},
            check_rows,
        ),
        Check(
            f"text-only share in {fmt_number(cfg.min_text_only_ratio)}..{fmt_number(cfg.max_text_only_ratio)}",
            f"{fmt_number(cfg.min_text_only_ratio)}..{fmt_number(cfg.max_text_only_ratio)}",
            "ExpectColumnMeanToBeBetween",
            {"column": "text_only", "min_value": cfg.min_text_only_ratio, "max_value": cfg.max_text_only_ratio},
            check_count,
        ),
        # every turn of a record, text-only records included: validation's gate sees only the
        # text that speaks of each image
        shown_check("personal data shown", "personal_data_shown", cfg.max_personal_data_rate),
    ]
    cap_tiles = packing.max_tiles if packing.max_tiles is not None else 1 << 40
    packs = [
        Check("at least one pack", ">= 1", "ExpectTableRowCountToBeBetween", {"min_value": 1}, check_count),
        Check("pack keys unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, check_rows),
        Check(
            "every accepted sample in exactly one pack",
            f"== {accepted} samples",
            "ExpectColumnSumToBeBetween",
            {"column": "samples", "min_value": accepted, "max_value": accepted},
            check_count,
        ),
    ]
    if packed:
        packs += [
            Check(
                f"no pack over {packing.budget} tokens",
                f"<= {packing.budget}",
                "ExpectColumnValuesToBeBetween",
                {"column": "tokens", "min_value": 1, "max_value": packing.budget},
                check_rows,
            ),
            Check(
                f"no pack over {packing.max_images} images",
                f"<= {packing.max_images}",
                "ExpectColumnValuesToBeBetween",
                {"column": "images", "min_value": 0, "max_value": packing.max_images},
                check_rows,
            ),
            Check(
                f"no pack over {packing.max_tiles} tiles",
                f"<= {packing.max_tiles}",
                "ExpectColumnValuesToBeBetween",
                {"column": "tiles", "min_value": 0, "max_value": cap_tiles},
                check_rows,
            ),
            # The mean of tokens / budget over packs is the fill ratio itself.
            Check(
                f"fill ratio >= {fmt_number(cfg.min_fill_ratio)}",
                f">= {fmt_number(cfg.min_fill_ratio)}",
                "ExpectColumnMeanToBeBetween",
                {"column": "fill", "min_value": cfg.min_fill_ratio},
                check_count,
            ),
        ]
    return ledger, samples, packs


def finetune_gate(
    ledger: pa.Table, samples: pa.Table, packs: pa.Table, cfg: FinetuneGate, packing: PackingConfig
) -> GateResult:
    """Gate the fine-tuning dataset on its records, its accepted samples and its packs.

    Ledger (one row per input record): keys present and unique, statuses known, share not
    accepted <= ``cfg.max_reject_rate``. Samples (one per accepted record; columns key,
    schema_ok, tags_ok, pack, text_only, personal_data_shown): at least ``cfg.min_samples``;
    keys unique; every sample's json complete; as many tag groups as images; every sample in a
    pack; the text-only share within bounds; records released with personal data left in
    their turns (``privacy.text: record``) at most ``cfg.max_personal_data_rate``. Packs (key, tokens, images, tiles, samples): pack sizes sum
    to the accepted samples (each in exactly one pack, keys unique); when packed, none over the
    budget, the image cap or the tile cap, and mean tokens / budget >= ``cfg.min_fill_ratio``.
    """
    gx = import_gx()
    ledger_frame = to_frame(ledger, ["key", "status", "reason"], "finetune ledger")
    ledger_frame["reason"] = reason_families(ledger_frame["reason"])
    columns = ["key", "schema_ok", "tags_ok", "pack", "text_only", "personal_data_shown"]
    samples_frame = to_frame(samples, columns, "finetune samples")
    samples_frame["text_only"] = samples_frame["text_only"].astype(float)
    packs_frame = to_frame(packs, ["key", "tokens", "images", "tiles", "samples"], "finetune packs")
    packs_frame["fill"] = packs_frame["tokens"].astype(float) / packing.budget
    accepted = int(len(samples_frame))
    ledger_checks, sample_checks, pack_checks = _finetune_checks(cfg, packing, accepted, packing.packed)
    outcomes, validations = run_suites(
        gx,
        "finetune",
        [
            ("ledger", ledger_frame, ledger_checks),
            ("samples", samples_frame, sample_checks),
            ("packs", packs_frame, pack_checks),
        ],
    )
    stats = {
        **ledger_stats(ledger_frame),
        "samples": accepted,
        "packs": int(len(packs_frame)),
        "fill_ratio": round(float(packs_frame["fill"].mean()), 6) if len(packs_frame) else None,
        "expectations": expectation_stats(outcomes),
    }
    return GateResult.of_suites("finetune", outcomes, validations, stats)
