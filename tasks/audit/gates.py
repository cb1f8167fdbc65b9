"""Great Expectations suites that gate the download, validate, reshard and precache phases."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from tasks.audit.gate_checks import (
    Check,
    all_true,
    check_count,
    check_rows,
    key_checks,
    mostly_of,
    reason_share_check,
    share_expected,
    share_unexpected,
    shown_check,
)
from tasks.audit.gate_results import LICENSE_REVIEW, ExpectationOutcome, GateResult, fmt_number
from tasks.audit.ge_runner import expectation_stats, import_gx, ledger_stats, reason_families, run_suites, to_frame
from tasks.formats.reasons import DUPLICATE_OF, OK
from tasks.formats.recipe_download import ImageRules
from tasks.formats.recipe_outputs import DownloadGate, PrecacheGate, ValidateGate


def _download_checks(manifest_rows: int, cfg: DownloadGate) -> list[Check]:
    rate = fmt_number(cfg.min_success_rate)
    checks = key_checks()
    checks.insert(
        1,
        Check(
            "every manifest row accounted for",
            f"== {manifest_rows} rows",
            "ExpectTableRowCountToEqual",
            {"value": manifest_rows},
            check_count,
        ),
    )
    checks.append(
        Check(
            f"success rate >= {rate}",
            f">= {rate}",
            "ExpectColumnValuesToBeInSet",
            {"column": "status", "value_set": [OK], "mostly": mostly_of(cfg.min_success_rate)},
            share_expected,
        )
    )
    checks += [reason_share_check(reason, limit, "rate") for reason, limit in sorted(cfg.max_reason_rate.items())]
    return checks


def _validate_ledger_checks(cfg: ValidateGate) -> list[Check]:
    rate = fmt_number(cfg.max_reject_rate)
    # Named "ledger ..." beside the samples' own key checks: outcome names are unique per gate.
    return key_checks("ledger ") + [
        Check(
            f"reject rate <= {rate}",
            f"<= {rate}",
            "ExpectColumnValuesToBeInSet",
            {"column": "status", "value_set": [OK], "mostly": mostly_of(1.0 - cfg.max_reject_rate)},
            share_unexpected,
        )
    ]


def _min_side(image: ImageRules) -> int:
    if image.resize_mode == "no":
        return image.min_side
    # Resized outputs: the short side is at most image_size, and inputs below min_side
    # were rejected before resizing, so the output bound is the smaller of the two.
    return min(image.min_side, image.image_size)


def _samples_checks(
    cfg: ValidateGate, license_allow: list[str], image: ImageRules, accepted: int, unique_pixels: bool = True
) -> list[Check]:
    min_samples = max(cfg.min_samples, 1)
    side = _min_side(image)
    aspect = fmt_number(image.max_aspect_ratio)
    allow = sorted(set(license_allow))
    between = "ExpectColumnValuesToBeBetween"
    checks = [
        Check(
            f"accepted samples >= {min_samples}",
            f">= {min_samples}",
            "ExpectTableRowCountToBeBetween",
            {"min_value": min_samples},
            check_count,
        ),
        Check(
            "every accepted ledger row has a sample",
            f"== {accepted} rows",
            "ExpectTableRowCountToEqual",
            {"value": accepted},
            check_count,
        ),
    ]
    for col in ("key", "license", "width", "height", "pixel_sha256"):
        checks.append(
            Check(f"{col} not null", "no nulls", "ExpectColumnValuesToNotBeNull", {"column": col}, check_rows)
        )
    checks += [
        Check(
            "license in allowlist",
            "in " + (", ".join(allow) or "(empty allowlist)"),
            "ExpectColumnValuesToBeInSet",
            {"column": "license", "value_set": allow},
            check_rows,
        ),
        Check(f"width >= {side}", f">= {side}", between, {"column": "width", "min_value": side}, check_rows),
        Check(f"height >= {side}", f">= {side}", between, {"column": "height", "min_value": side}, check_rows),
        Check(
            f"aspect <= {aspect}",
            f"<= {aspect}",
            between,
            {"column": "aspect", "max_value": image.max_aspect_ratio},
            check_rows,
        ),
        Check("key unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, check_rows),
    ]
    if unique_pixels:  # exact dedup on (validate.dedup.exact): no two accepted samples share their pixels
        checks.append(
            Check(
                "pixel_sha256 unique",
                "no duplicate pixel hashes",
                "ExpectColumnValuesToBeUnique",
                {"column": "pixel_sha256"},
                check_rows,
            )
        )
    checks += [
        shown_check("faces shown", "faces_shown", cfg.max_face_rate),
        shown_check("personal data shown", "personal_data_shown", cfg.max_personal_data_rate),
    ]
    return checks


# --- gates ------------------------------------------------------------------------------------


def download_gate(ledger: pa.Table, manifest_rows: int, cfg: DownloadGate) -> GateResult:
    """Gate the download phase on its concatenated ledgers.

    Checks: at least one row; one row per manifest row; keys present and unique; statuses
    known; ok share >= ``cfg.min_success_rate`` (over rows with a status: a null status
    fails its own check); each reason family's share of all rows <= its limit in
    ``cfg.max_reason_rate``.
    """
    gx = import_gx()
    frame = to_frame(ledger, ["key", "status", "reason"], "download ledger")
    frame["reason"] = reason_families(frame["reason"])
    checks = _download_checks(manifest_rows, cfg)
    outcomes, validations = run_suites(gx, "download", [("ledger", frame, checks)])
    stats = {"manifest_rows": int(manifest_rows), **ledger_stats(frame), "expectations": expectation_stats(outcomes)}
    return GateResult.of_suites("download", outcomes, validations, stats)


SAMPLE_COLUMNS = ["key", "license", "width", "height", "aspect", "pixel_sha256", "faces_shown", "personal_data_shown"]


def validate_gate(
    ledger: pa.Table,
    samples: pa.Table,
    cfg: ValidateGate,
    license_allow: list[str] | tuple[str, ...],
    image: ImageRules,
    review_present: bool,
    shared_duplicates: bool = False,
    unique_pixels: bool = True,
) -> GateResult:
    """Gate the validation phase on its ledger and on one row per accepted sample.

    Ledger: at least one row; keys present and unique; statuses known; share of rows not ok
    <= ``cfg.max_reject_rate``. Samples: at least ``max(cfg.min_samples, 1)``; one per ok
    ledger row; no nulls in key, license, width, height, pixel_sha256; every license in
    ``license_allow``; width and height >= the minimum side; aspect <= the maximum; keys and
    pixel hashes unique (``unique_pixels``: where exact dedup is on). Beside the GE suites: the recipe's license review, when
    ``cfg.require_license_review``. ``shared_duplicates`` (fine-tuning's images): a
    ``duplicate_of`` row is judged with the records that show it, so it is left out of the
    ledger's checks: an exact duplicate is a picture they share (``tasks.finetune.samples.shared``),
    a near one refuses its record, which the fine-tuning gate counts.
    """
    gx = import_gx()
    if shared_duplicates and "reason" in ledger.column_names:
        dup = pc.starts_with(pc.fill_null(ledger.column("reason"), ""), DUPLICATE_OF)
        ledger = ledger.filter(pc.invert(dup))
    ledger_frame = to_frame(ledger, ["key", "status"], "validate ledger")
    if "reason" in ledger.column_names:  # for the statistics only
        ledger_frame["reason"] = reason_families(ledger.column("reason").to_pandas())
    for shown in ("faces_shown", "personal_data_shown"):  # a table made before the privacy checks
        if shown not in samples.column_names and samples.num_rows:
            samples = samples.append_column(shown, pa.array([False] * samples.num_rows, pa.bool_()))
    samples_frame = to_frame(samples, SAMPLE_COLUMNS, "validate samples")
    accepted = int((ledger_frame["status"] == OK).sum())
    outcomes, validations = run_suites(
        gx,
        "validate",
        [
            ("ledger", ledger_frame, _validate_ledger_checks(cfg)),
            ("samples", samples_frame, _samples_checks(cfg, list(license_allow), image, accepted, unique_pixels)),
        ],
    )
    outcomes.append(
        ExpectationOutcome(
            name="license review recorded",
            expectation=LICENSE_REVIEW,
            column=None,
            threshold="validate.license.review set" if cfg.require_license_review else "not required",
            observed="present" if review_present else "missing",
            success=review_present or not cfg.require_license_review,
        )
    )
    stats = {
        **ledger_stats(ledger_frame),
        "samples": int(len(samples_frame)),
        "expectations": expectation_stats(outcomes),
    }
    return GateResult.of_suites("validate", outcomes, validations, stats)


SHARD_COLUMNS = ["shard", "samples", "readable", "complete", "checksum_ok", "is_last"]


def _reshard_checks(samples_per_shard: int, expected_samples: int, shards: int) -> list[Check]:
    n = samples_per_shard
    return [
        Check(
            "at least one shard (a sample left to release)",
            ">= 1 shard",
            "ExpectTableRowCountToBeBetween",
            {"min_value": 1},
            check_count,
        ),
        Check(
            "shard names unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "shard"}, share_unexpected
        ),
        Check(
            "samples conserved",
            f"== {expected_samples} samples",
            "ExpectColumnSumToBeBetween",
            {"column": "samples", "min_value": expected_samples, "max_value": expected_samples},
            check_count,
        ),
        Check(
            f"every shard but the last holds exactly {n}",
            f"== {n}",
            "ExpectColumnValuesToBeInSet",
            {"column": "samples_unless_last", "value_set": [n]},
            share_unexpected,
        ),
        Check(
            f"the last shard holds 1..{n}",
            f"1..{n}",
            "ExpectColumnValuesToBeBetween",
            {"column": "samples", "min_value": 1, "max_value": n},
            share_unexpected,
        ),
        all_true("every tar readable", "readable", share_unexpected),
        all_true("every sample complete", "complete", share_unexpected),
        all_true("checksums match the index", "checksum_ok", share_unexpected),
    ]


def reshard_gate(shards: pa.Table, samples_per_shard: int, expected_samples: int) -> GateResult:
    """Gate the reshard on one row per output shard, as checked by the task that wrote it.

    ``shards`` columns: shard, samples, readable, complete, checksum_ok, is_last. Checks:
    samples conserved (accepted in, minus incomplete ones accounted for, = samples out);
    every shard but the last holds exactly N; every tar readable; every sample complete;
    every shard's sha256 the one recorded for the release index. The pretraining reshard
    fills the rows from each output's header blocks and its writer's records
    (``tasks.stages.reshard_check.check_row``: no output is read back whole); the fine-tuning packs
    from a full read-back (``tasks.stages.release.verify_shard``).
    """
    gx = import_gx()
    frame = to_frame(shards, SHARD_COLUMNS, "reshard shards")
    # One column per rule keeps each rule a plain GE expectation: the last shard's count is
    # replaced by N here, and checked on its own range by the next expectation.
    frame["samples_unless_last"] = frame["samples"].where(~frame["is_last"].astype(bool), samples_per_shard)
    checks = _reshard_checks(samples_per_shard, expected_samples, len(frame))
    outcomes, validations = run_suites(gx, "reshard", [("shards", frame, checks)])
    stats = {
        "shards": int(len(frame)),
        "samples": int(frame["samples"].sum()) if len(frame) else 0,
        "expected_samples": int(expected_samples),
    }
    return GateResult.of_suites("reshard", outcomes, validations, stats)


def _precache_checks(expected_samples: int, cfg: PrecacheGate, latents: bool) -> dict[str, list[Check]]:
    ledger = [
        Check(
            "one encoding per released sample",
            f"== {expected_samples} rows",
            "ExpectTableRowCountToEqual",
            {"value": expected_samples},
            check_count,
        ),
        Check("precached key unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, check_rows),
        all_true("keys aligned with the image shards", "aligned", check_rows),
        all_true("every stored value finite", "finite", check_rows),
    ]
    shards = [
        all_true("latent shard per image shard, same count", "counts_match", check_rows),
        all_true("shapes and dtypes as recorded", "layout_match", check_rows),
    ]
    out = {"ledger": ledger, "shards": shards}
    if latents:
        m = cfg.max_abs_channel_mean
        out["channels"] = [
            Check(
                f"latent channel mean within +-{fmt_number(m)}",
                f"-{fmt_number(m)}..{fmt_number(m)}",
                "ExpectColumnValuesToBeBetween",
                {"column": "mean", "min_value": -m, "max_value": m},
                check_rows,
            ),
            Check(
                f"latent channel std within {fmt_number(cfg.min_channel_std)}..{fmt_number(cfg.max_channel_std)}",
                f"{fmt_number(cfg.min_channel_std)}..{fmt_number(cfg.max_channel_std)}",
                "ExpectColumnValuesToBeBetween",
                {"column": "std", "min_value": cfg.min_channel_std, "max_value": cfg.max_channel_std},
                check_rows,
            ),
        ]
    return out


def precache_gate(
    ledger: pa.Table, shards: pa.Table, channels: pa.Table, expected_samples: int, cfg: PrecacheGate
) -> GateResult:
    """Gate the precache on its per-sample ledger, its shards and the latent channel statistics.

    Checks: one encoding per released sample (count conserved, keys unique and aligned with
    the image shards position by position), every stored value finite, one latent shard per
    image shard with the same count, shapes and dtypes equal across shards, and the scaled
    image latents' per-channel mean and std within the recipe's bounds (a wrong scaling factor
    or a broken VAE moves them far outside).
    """
    gx = import_gx()
    latents = bool(channels.num_rows)
    checks = _precache_checks(expected_samples, cfg, latents)
    tables = [
        ("ledger", to_frame(ledger, ["key", "status", "aligned", "finite"], "precache ledger"), checks["ledger"]),
        ("shards", to_frame(shards, ["shard", "counts_match", "layout_match"], "precache shards"), checks["shards"]),
    ]
    if latents:
        import pyarrow.compute as pc

        channel_frame = channels.filter(pc.equal(channels["encoding"], "image_latents"))
        tables.append(
            (
                "channels",
                to_frame(channel_frame, ["encoding", "channel", "mean", "std"], "latent channels"),
                checks["channels"],
            )
        )
    outcomes, validations = run_suites(gx, "precache", tables)
    stats = ledger_stats(to_frame(ledger, ["key", "status", "reason"], "precache ledger"))
    stats["channels"] = channels.to_pylist()
    return GateResult.of_suites("precache", outcomes, validations, stats)
