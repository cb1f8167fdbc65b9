"""Great Expectations suites that gate each phase, as code in one module."""

from __future__ import annotations

import datetime as dt
import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import pyarrow as pa

from tasks.reasons import OK, STATUSES, family
from tasks.recipe import DownloadGate, FinetuneGate, ImageRules, PackingConfig, PrecacheGate, ValidateGate

# Not a GE expectation type: the license review is a fact about the recipe, not about the data.
LICENSE_REVIEW = "shardsmith_license_review_recorded"

# GE 1.x keeps the current context in a process-wide singleton (ValidationDefinition.run reads
# its stores from there), so two gates running at once in threads would cross their results.
_GE_LOCK = threading.Lock()

_EXAMPLES = 5  # unexpected values kept per outcome


@dataclass
class ExpectationOutcome:
    """One checked expectation of a gate.

    Args:
        name: readable name, e.g. ``success rate >= 0.5``; unique within a gate.
        expectation: GE expectation type (``expect_column_values_to_be_in_set``), or
            ``shardsmith_license_review_recorded`` for the one check that is not on data.
        column: the column checked; ``None`` for table-level checks.
        threshold: the bound, for people (``>= 0.5``, ``== 100 rows``).
        observed: what was seen, JSON-able: a rate, a row count, or for per-row checks
            ``{"unexpected_count", "element_count", "examples"}``; ``None`` when there are no
            rows to measure.
        success: whether the expectation held.
    """

    name: str
    expectation: str
    column: str | None
    threshold: str
    observed: Any
    success: bool

    def describe(self) -> str:
        """``name (observed X)``, with the threshold added when the name does not carry it."""
        head = self.name if self.threshold in self.name else f"{self.name}, expected {self.threshold}"
        return f"{head} (observed {observed_text(self.observed)})"


@dataclass
class GateResult:
    """The verdict of one phase's gate.

    Args:
        phase: ``download``, ``validate``, ...
        success: every outcome succeeded.
        outcomes: one per check, in the gate's fixed order.
        statistics: ledger counts (rows, ok, rejected, error, by_reason, ...) and the number
            of expectations evaluated / successful / unsuccessful.
        ge_result: ``{"validations": [...]}``, the GE ``ExpectationSuiteValidationResult`` JSON
            of every table the gate validated (one suite per table).
    """

    phase: str
    success: bool
    outcomes: list[ExpectationOutcome]
    statistics: dict[str, Any]
    ge_result: dict[str, Any] = field(repr=False)

    @property
    def failed(self) -> list[ExpectationOutcome]:
        return [o for o in self.outcomes if not o.success]

    def failure_message(self) -> str:
        """Every failed check with its threshold and observed value; empty when the gate passed."""
        if self.success:
            return ""
        return f"{self.phase} gate failed: " + "; ".join(o.describe() for o in self.failed)

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "success": self.success,
            "message": self.failure_message(),
            "outcomes": [asdict(o) for o in self.outcomes],
            "statistics": self.statistics,
            "ge_result": self.ge_result,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "GateResult":
        return cls(
            phase=data["phase"],
            success=bool(data["success"]),
            outcomes=[ExpectationOutcome(**o) for o in data["outcomes"]],
            statistics=dict(data["statistics"]),
            ge_result=dict(data["ge_result"]),
        )


# --- checks -----------------------------------------------------------------------------------


@dataclass
class _Check:
    """A GE expectation with our readable name, threshold text and how to read its result."""

    name: str
    threshold: str
    expectation: str  # class name in gx.expectations
    kwargs: dict[str, Any]
    observe: Callable[[dict[str, Any]], Any]

    def build(self, gx: Any) -> Any:
        meta = {"gate_check": self.name, "threshold": self.threshold}
        # GE renders the description in Data Docs in place of its own sentence.
        return getattr(gx.expectations, self.expectation)(**self.kwargs, description=self.name, meta=meta)


def _count(result: dict[str, Any]) -> Any:
    return result.get("observed_value")


def _rows(result: dict[str, Any]) -> Any:
    if not result.get("element_count"):
        return None
    examples: list[Any] = []
    for value in result.get("partial_unexpected_list") or []:
        if value is not None and value not in examples and len(examples) < _EXAMPLES:
            examples.append(value)
    return {
        "unexpected_count": result.get("unexpected_count", 0),
        "element_count": result["element_count"],
        "examples": examples,
    }


def _share_unexpected(result: dict[str, Any]) -> Any:
    # unexpected_percent is over non-null values (GE skips nulls in map expectations).
    pct = result.get("unexpected_percent")
    return None if pct is None else round(pct / 100.0, 6)


def _share_expected(result: dict[str, Any]) -> Any:
    pct = result.get("unexpected_percent")
    return None if pct is None else round(1.0 - pct / 100.0, 6)


def _mostly(share: float) -> float:
    # 1 - 0.7 is 0.30000000000000004, which a rate of exactly 0.3 would miss.
    return min(1.0, max(0.0, round(share, 9)))


def _fmt(x: float) -> str:
    return f"{x:g}"


def observed_text(observed: Any) -> str:
    """An outcome's observed value for people: ``0.31``, ``2 of 10 rows, e.g. web-000000002``."""
    if observed is None:
        return "n/a, no rows"
    if isinstance(observed, dict) and "unexpected_count" in observed:
        text = f"{observed['unexpected_count']} of {observed['element_count']} rows"
        if observed.get("examples"):
            text += ", e.g. " + ", ".join(str(v) for v in observed["examples"])
        return text
    if isinstance(observed, dict) and "error" in observed:
        return f"error: {observed['error']}"
    if isinstance(observed, float):
        return _fmt(observed)
    return str(observed)


def _key_checks(prefix: str = "") -> list[_Check]:
    """The core ledger columns: at least one row, keys present and unique, statuses known."""
    statuses = ", ".join(STATUSES)
    return [
        _Check(f"{prefix}row count >= 1", ">= 1", "ExpectTableRowCountToBeBetween", {"min_value": 1}, _count),
        _Check(f"{prefix}key not null", "no nulls", "ExpectColumnValuesToNotBeNull", {"column": "key"}, _rows),
        _Check(f"{prefix}key unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, _rows),
        _Check(f"{prefix}status not null", "no nulls", "ExpectColumnValuesToNotBeNull", {"column": "status"}, _rows),
        _Check(
            f"{prefix}status in {statuses}",
            f"in {statuses}",
            "ExpectColumnValuesToBeInSet",
            {"column": "status", "value_set": list(STATUSES)},
            _rows,
        ),
    ]


def _download_checks(manifest_rows: int, cfg: DownloadGate) -> list[_Check]:
    rate = _fmt(cfg.min_success_rate)
    checks = _key_checks()
    checks.insert(
        1,
        _Check(
            "every manifest row accounted for",
            f"== {manifest_rows} rows",
            "ExpectTableRowCountToEqual",
            {"value": manifest_rows},
            _count,
        ),
    )
    checks.append(
        _Check(
            f"success rate >= {rate}",
            f">= {rate}",
            "ExpectColumnValuesToBeInSet",
            {"column": "status", "value_set": [OK], "mostly": _mostly(cfg.min_success_rate)},
            _share_expected,
        )
    )
    for reason, limit in sorted(cfg.max_reason_rate.items()):
        checks.append(
            _Check(
                f"{reason} rate <= {_fmt(limit)}",
                f"<= {_fmt(limit)}",
                "ExpectColumnValuesToNotBeInSet",
                {"column": "reason", "value_set": [reason], "mostly": _mostly(1.0 - limit)},
                _share_unexpected,
            )
        )
    return checks


def _validate_ledger_checks(cfg: ValidateGate) -> list[_Check]:
    rate = _fmt(cfg.max_reject_rate)
    # Named "ledger ..." beside the samples' own key checks: outcome names are unique per gate.
    return _key_checks("ledger ") + [
        _Check(
            f"reject rate <= {rate}",
            f"<= {rate}",
            "ExpectColumnValuesToBeInSet",
            {"column": "status", "value_set": [OK], "mostly": _mostly(1.0 - cfg.max_reject_rate)},
            _share_unexpected,
        )
    ]


def _min_side(image: ImageRules) -> int:
    if image.resize_mode == "no":
        return image.min_side
    # Resized outputs: the short side is at most image_size, and inputs below min_side
    # were rejected before resizing, so the output bound is the smaller of the two.
    return min(image.min_side, image.image_size)


def _samples_checks(cfg: ValidateGate, license_allow: list[str], image: ImageRules, accepted: int) -> list[_Check]:
    min_samples = max(cfg.min_samples, 1)
    side = _min_side(image)
    aspect = _fmt(image.max_aspect_ratio)
    allow = sorted(set(license_allow))
    between = "ExpectColumnValuesToBeBetween"
    checks = [
        _Check(
            f"accepted samples >= {min_samples}",
            f">= {min_samples}",
            "ExpectTableRowCountToBeBetween",
            {"min_value": min_samples},
            _count,
        ),
        _Check(
            "every accepted ledger row has a sample",
            f"== {accepted} rows",
            "ExpectTableRowCountToEqual",
            {"value": accepted},
            _count,
        ),
    ]
    for col in ("key", "license", "width", "height", "pixel_sha256"):
        checks.append(_Check(f"{col} not null", "no nulls", "ExpectColumnValuesToNotBeNull", {"column": col}, _rows))
    checks += [
        _Check(
            "license in allowlist",
            "in " + (", ".join(allow) or "(empty allowlist)"),
            "ExpectColumnValuesToBeInSet",
            {"column": "license", "value_set": allow},
            _rows,
        ),
        _Check(f"width >= {side}", f">= {side}", between, {"column": "width", "min_value": side}, _rows),
        _Check(f"height >= {side}", f">= {side}", between, {"column": "height", "min_value": side}, _rows),
        _Check(
            f"aspect <= {aspect}",
            f"<= {aspect}",
            between,
            {"column": "aspect", "max_value": image.max_aspect_ratio},
            _rows,
        ),
        _Check("key unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, _rows),
        _Check(
            "pixel_sha256 unique",
            "no duplicate pixel hashes",
            "ExpectColumnValuesToBeUnique",
            {"column": "pixel_sha256"},
            _rows,
        ),
    ]
    return checks


# --- running GE -------------------------------------------------------------------------------


def preload() -> None:
    """Import Great Expectations ahead of the first gate (the import takes seconds)."""
    _import_gx()


def _import_gx() -> Any:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    import great_expectations as gx

    return gx


def _context(gx: Any, docs_dir: str | None = None) -> Any:
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
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        }
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        data_docs_sites=sites,
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False, metric_calculations=False),
    )
    return gx.get_context(project_config=config, mode="ephemeral")


def _outcome_of(check: _Check, expectation_type: str, column: str | None, result: dict) -> ExpectationOutcome:
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


def _run_suites(
    gx: Any, phase: str, tables: list[tuple[str, Any, list[_Check]]]
) -> tuple[list[ExpectationOutcome], list[dict[str, Any]]]:
    """Validate each (table name, pandas frame, checks) with its own suite, in one context."""
    from great_expectations.core.run_identifier import RunIdentifier

    run_id = RunIdentifier(run_name=phase, run_time=dt.datetime.now(dt.timezone.utc))
    outcomes: list[ExpectationOutcome] = []
    validations: list[dict[str, Any]] = []
    names = [c.name for _, _, checks in tables for c in checks]
    if len(set(names)) != len(names):
        raise ValueError(f"{phase} gate: check names repeat: {names}")
    with _GE_LOCK:
        context = _context(gx)
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


_NUMERIC = {"width": pa.int64(), "height": pa.int64(), "aspect": pa.float64(), "row": pa.int64()}


def _frame(table: pa.Table, columns: list[str], what: str) -> Any:
    missing = [c for c in columns if c not in table.column_names]
    if missing and table.num_rows:
        raise ValueError(f"{what} lacks column(s) {', '.join(missing)}; has {', '.join(table.column_names)}")
    for col in missing:
        # Nothing came out of the phase (a table without a schema): the gate must fail on
        # its row count, not raise.
        table = table.append_column(col, pa.array([], _NUMERIC.get(col, pa.string())))
    # Only the checked columns: nested columns (members) convert slowly and are not gated here.
    return table.select(columns).to_pandas()


def _reason_families(reasons: Any) -> Any:
    """Reasons grouped by family (``duplicate_of:<key>`` -> ``duplicate_of``), nulls as "".

    GE map expectations skip nulls, and ok rows have no reason: "no reason" must be a value
    so that a reason's share is over all rows, not over the failed ones.
    """
    values = reasons.astype(object).where(reasons.notna(), None)
    return values.map(lambda r: "" if r is None else family(str(r)))


def _ledger_stats(frame: Any) -> dict[str, Any]:
    status = frame["status"]
    stats: dict[str, Any] = {"rows": int(len(frame))}
    for s in STATUSES:
        stats[s] = int((status == s).sum())
    if "reason" in frame:
        counts = frame["reason"][frame["reason"].notna() & (frame["reason"] != "")].value_counts()
        stats["by_reason"] = dict(sorted(((str(k), int(v)) for k, v in counts.items()), key=lambda kv: (-kv[1], kv[0])))
    return stats


def _expectation_stats(outcomes: list[ExpectationOutcome]) -> dict[str, int]:
    ok = sum(o.success for o in outcomes)
    return {"evaluated": len(outcomes), "successful": ok, "unsuccessful": len(outcomes) - ok}


# --- gates ------------------------------------------------------------------------------------


def download_gate(ledger: pa.Table, manifest_rows: int, cfg: DownloadGate) -> GateResult:
    """Gate the download phase on its concatenated ledgers.

    Checks: at least one row; one row per manifest row; keys present and unique; statuses
    known; ok share >= ``cfg.min_success_rate`` (over rows with a status: a null status
    fails its own check); each reason family's share of all rows <= its limit in
    ``cfg.max_reason_rate``.
    """
    gx = _import_gx()
    frame = _frame(ledger, ["key", "status", "reason"], "download ledger")
    frame["reason"] = _reason_families(frame["reason"])
    checks = _download_checks(manifest_rows, cfg)
    outcomes, validations = _run_suites(gx, "download", [("ledger", frame, checks)])
    stats = {"manifest_rows": int(manifest_rows), **_ledger_stats(frame), "expectations": _expectation_stats(outcomes)}
    return GateResult(
        phase="download",
        success=all(o.success for o in outcomes),
        outcomes=outcomes,
        statistics=stats,
        ge_result={"validations": validations},
    )


SAMPLE_COLUMNS = ["key", "license", "width", "height", "aspect", "pixel_sha256"]


def validate_gate(
    ledger: pa.Table,
    samples: pa.Table,
    cfg: ValidateGate,
    license_allow: list[str] | tuple[str, ...],
    image: ImageRules,
    review_present: bool,
) -> GateResult:
    """Gate the validation phase on its ledger and on one row per accepted sample.

    Ledger: at least one row; keys present and unique; statuses known; share of rows not ok
    <= ``cfg.max_reject_rate``. Samples: at least ``max(cfg.min_samples, 1)``; one per ok
    ledger row; no nulls in key, license, width, height, pixel_sha256; every license in
    ``license_allow``; width and height >= the minimum side; aspect <= the maximum; keys and
    pixel hashes unique. Beside the GE suites: the recipe's license review, when
    ``cfg.require_license_review``.
    """
    gx = _import_gx()
    ledger_frame = _frame(ledger, ["key", "status"], "validate ledger")
    if "reason" in ledger.column_names:  # for the statistics only
        ledger_frame["reason"] = _reason_families(ledger.column("reason").to_pandas())
    samples_frame = _frame(samples, SAMPLE_COLUMNS, "validate samples")
    accepted = int((ledger_frame["status"] == OK).sum())
    outcomes, validations = _run_suites(
        gx,
        "validate",
        [
            ("ledger", ledger_frame, _validate_ledger_checks(cfg)),
            ("samples", samples_frame, _samples_checks(cfg, list(license_allow), image, accepted)),
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
        **_ledger_stats(ledger_frame),
        "samples": int(len(samples_frame)),
        "expectations": _expectation_stats(outcomes),
    }
    return GateResult(
        phase="validate",
        success=all(o.success for o in outcomes),
        outcomes=outcomes,
        statistics=stats,
        ge_result={"validations": validations},
    )


# --- reports ----------------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


SHARD_COLUMNS = ["shard", "samples", "readable", "complete", "checksum_ok", "is_last"]


def _reshard_checks(samples_per_shard: int, expected_samples: int, shards: int) -> list[_Check]:
    n = samples_per_shard
    return [
        _Check("at least one shard", ">= 1 shard", "ExpectTableRowCountToBeBetween", {"min_value": 1}, _count),
        _Check("shard names unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "shard"}, _share_unexpected),
        _Check(
            "samples conserved",
            f"== {expected_samples} samples",
            "ExpectColumnSumToBeBetween",
            {"column": "samples", "min_value": expected_samples, "max_value": expected_samples},
            _count,
        ),
        _Check(
            f"every shard but the last holds exactly {n}",
            f"== {n}",
            "ExpectColumnValuesToBeInSet",
            {"column": "samples_unless_last", "value_set": [n]},
            _share_unexpected,
        ),
        _Check(
            f"the last shard holds 1..{n}",
            f"1..{n}",
            "ExpectColumnValuesToBeBetween",
            {"column": "samples", "min_value": 1, "max_value": n},
            _share_unexpected,
        ),
        _Check("every tar readable", "all", "ExpectColumnValuesToBeInSet", {"column": "readable", "value_set": [True]}, _share_unexpected),
        _Check("every sample complete", "all", "ExpectColumnValuesToBeInSet", {"column": "complete", "value_set": [True]}, _share_unexpected),
        _Check("checksums match the index", "all", "ExpectColumnValuesToBeInSet", {"column": "checksum_ok", "value_set": [True]}, _share_unexpected),
    ]


def reshard_gate(shards: pa.Table, samples_per_shard: int, expected_samples: int) -> GateResult:
    """Gate the reshard on one row per output shard, as checked by the task that wrote it.

    ``shards`` columns: shard, samples, readable, complete, checksum_ok, is_last. Checks:
    samples conserved (accepted in, minus incomplete ones accounted for, = samples out);
    every shard but the last holds exactly N; every tar readable; every sample complete;
    every shard's sha256 the one recorded for the release index. The pretraining reshard
    fills the rows from each output's header blocks and its writer's records
    (``tasks.reshard_check.check_row``: no output is read back whole); the fine-tuning packs
    from a full read-back (``tasks.release.verify_shard``).
    """
    gx = _import_gx()
    frame = _frame(shards, SHARD_COLUMNS, "reshard shards")
    # One column per rule keeps each rule a plain GE expectation: the last shard's count is
    # replaced by N here, and checked on its own range by the next expectation.
    frame["samples_unless_last"] = frame["samples"].where(~frame["is_last"].astype(bool), samples_per_shard)
    checks = _reshard_checks(samples_per_shard, expected_samples, len(frame))
    outcomes, validations = _run_suites(gx, "reshard", [("shards", frame, checks)])
    stats = {"shards": int(len(frame)), "samples": int(frame["samples"].sum()) if len(frame) else 0, "expected_samples": int(expected_samples)}
    return GateResult(phase="reshard", success=all(o.success for o in outcomes), outcomes=outcomes, statistics=stats, ge_result={"validations": validations})


def _precache_checks(expected_samples: int, cfg: PrecacheGate, latents: bool) -> dict[str, list[_Check]]:
    ledger = [
        _Check(
            "one encoding per released sample",
            f"== {expected_samples} rows",
            "ExpectTableRowCountToEqual",
            {"value": expected_samples},
            _count,
        ),
        _Check("precached key unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, _rows),
        _Check(
            "keys aligned with the image shards",
            "all",
            "ExpectColumnValuesToBeInSet",
            {"column": "aligned", "value_set": [True]},
            _rows,
        ),
        _Check("every stored value finite", "all", "ExpectColumnValuesToBeInSet", {"column": "finite", "value_set": [True]}, _rows),
    ]
    shards = [
        _Check("latent shard per image shard, same count", "all", "ExpectColumnValuesToBeInSet", {"column": "counts_match", "value_set": [True]}, _rows),
        _Check("shapes and dtypes as recorded", "all", "ExpectColumnValuesToBeInSet", {"column": "layout_match", "value_set": [True]}, _rows),
    ]
    out = {"ledger": ledger, "shards": shards}
    if latents:
        m = cfg.max_abs_channel_mean
        out["channels"] = [
            _Check(
                f"latent channel mean within +-{_fmt(m)}",
                f"-{_fmt(m)}..{_fmt(m)}",
                "ExpectColumnValuesToBeBetween",
                {"column": "mean", "min_value": -m, "max_value": m},
                _rows,
            ),
            _Check(
                f"latent channel std within {_fmt(cfg.min_channel_std)}..{_fmt(cfg.max_channel_std)}",
                f"{_fmt(cfg.min_channel_std)}..{_fmt(cfg.max_channel_std)}",
                "ExpectColumnValuesToBeBetween",
                {"column": "std", "min_value": cfg.min_channel_std, "max_value": cfg.max_channel_std},
                _rows,
            ),
        ]
    return out


def precache_gate(ledger: pa.Table, shards: pa.Table, channels: pa.Table, expected_samples: int, cfg: PrecacheGate) -> GateResult:
    """Gate the precache on its per-sample ledger, its shards and the latent channel statistics.

    Checks: one encoding per released sample (count conserved, keys unique and aligned with
    the image shards position by position), every stored value finite, one latent shard per
    image shard with the same count, shapes and dtypes equal across shards, and the scaled
    image latents' per-channel mean and std within the recipe's bounds (a wrong scaling factor
    or a broken VAE moves them far outside).
    """
    gx = _import_gx()
    latents = bool(channels.num_rows)
    checks = _precache_checks(expected_samples, cfg, latents)
    tables = [
        ("ledger", _frame(ledger, ["key", "status", "aligned", "finite"], "precache ledger"), checks["ledger"]),
        ("shards", _frame(shards, ["shard", "counts_match", "layout_match"], "precache shards"), checks["shards"]),
    ]
    if latents:
        import pyarrow.compute as pc

        channel_frame = channels.filter(pc.equal(channels["encoding"], "image_latents"))
        tables.append(("channels", _frame(channel_frame, ["encoding", "channel", "mean", "std"], "latent channels"), checks["channels"]))
    outcomes, validations = _run_suites(gx, "precache", tables)
    stats = _ledger_stats(_frame(ledger, ["key", "status", "reason"], "precache ledger"))
    stats["channels"] = channels.to_pylist()
    return GateResult(phase="precache", success=all(o.success for o in outcomes), outcomes=outcomes, statistics=stats, ge_result={"validations": validations})


# --- fine-tuning ------------------------------------------------------------------------------


def _finetune_checks(cfg: FinetuneGate, packing: PackingConfig, accepted: int, packed: int) -> tuple[list[_Check], list[_Check], list[_Check]]:
    ledger = [
        *_key_checks(),
        _Check(
            f"share not accepted <= {_fmt(cfg.max_reject_rate)}",
            f"<= {_fmt(cfg.max_reject_rate)}",
            "ExpectColumnValuesToBeInSet",
            {"column": "status", "value_set": [OK], "mostly": _mostly(1.0 - cfg.max_reject_rate)},
            _share_unexpected,
        ),
    ]
    samples = [
        _Check(f"accepted samples >= {cfg.min_samples}", f">= {cfg.min_samples}", "ExpectTableRowCountToBeBetween", {"min_value": cfg.min_samples}, _count),
        _Check("sample keys unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, _rows),
        _Check("schema: conversation json complete", "all", "ExpectColumnValuesToBeInSet", {"column": "schema_ok", "value_set": [True]}, _rows),
        _Check("tag groups equal images", "all", "ExpectColumnValuesToBeInSet", {"column": "tags_ok", "value_set": [True]}, _rows),
        _Check("every accepted sample in a pack", "no nulls", "ExpectColumnValuesToNotBeNull", {"column": "pack"}, _rows),
        _Check(
            f"text-only share in {_fmt(cfg.min_text_only_ratio)}..{_fmt(cfg.max_text_only_ratio)}",
            f"{_fmt(cfg.min_text_only_ratio)}..{_fmt(cfg.max_text_only_ratio)}",
            "ExpectColumnMeanToBeBetween",
            {"column": "text_only", "min_value": cfg.min_text_only_ratio, "max_value": cfg.max_text_only_ratio},
            _count,
        ),
    ]
    cap_tiles = packing.max_tiles if packing.max_tiles is not None else 1 << 40
    packs = [
        _Check("at least one pack", ">= 1", "ExpectTableRowCountToBeBetween", {"min_value": 1}, _count),
        _Check("pack keys unique", "no duplicates", "ExpectColumnValuesToBeUnique", {"column": "key"}, _rows),
        _Check(
            "every accepted sample in exactly one pack",
            f"== {accepted} samples",
            "ExpectColumnSumToBeBetween",
            {"column": "samples", "min_value": accepted, "max_value": accepted},
            _count,
        ),
    ]
    if packed:
        packs += [
            _Check(f"no pack over {packing.budget} tokens", f"<= {packing.budget}", "ExpectColumnValuesToBeBetween", {"column": "tokens", "min_value": 1, "max_value": packing.budget}, _rows),
            _Check(f"no pack over {packing.max_images} images", f"<= {packing.max_images}", "ExpectColumnValuesToBeBetween", {"column": "images", "min_value": 0, "max_value": packing.max_images}, _rows),
            _Check(f"no pack over {packing.max_tiles} tiles", f"<= {packing.max_tiles}", "ExpectColumnValuesToBeBetween", {"column": "tiles", "min_value": 0, "max_value": cap_tiles}, _rows),
            # The mean of tokens / budget over packs is the fill ratio itself.
            _Check(f"fill ratio >= {_fmt(cfg.min_fill_ratio)}", f">= {_fmt(cfg.min_fill_ratio)}", "ExpectColumnMeanToBeBetween", {"column": "fill", "min_value": cfg.min_fill_ratio}, _count),
        ]
    return ledger, samples, packs


def finetune_gate(ledger: pa.Table, samples: pa.Table, packs: pa.Table, cfg: FinetuneGate, packing: PackingConfig) -> GateResult:
    """Gate the fine-tuning dataset on its records, its accepted samples and its packs.

    Ledger (one row per input record): keys present and unique, statuses known, share not
    accepted <= ``cfg.max_reject_rate``. Samples (one per accepted record; columns key,
    schema_ok, tags_ok, pack, text_only): at least ``cfg.min_samples``; keys unique; every
    sample's json complete; as many tag groups as images; every sample in a pack; the
    text-only share within bounds. Packs (key, tokens, images, tiles, samples): pack sizes sum
    to the accepted samples (each in exactly one pack, keys unique); when packed, none over the
    budget, the image cap or the tile cap, and mean tokens / budget >= ``cfg.min_fill_ratio``.
    """
    gx = _import_gx()
    ledger_frame = _frame(ledger, ["key", "status", "reason"], "finetune ledger")
    ledger_frame["reason"] = _reason_families(ledger_frame["reason"])
    samples_frame = _frame(samples, ["key", "schema_ok", "tags_ok", "pack", "text_only"], "finetune samples")
    samples_frame["text_only"] = samples_frame["text_only"].astype(float)
    packs_frame = _frame(packs, ["key", "tokens", "images", "tiles", "samples"], "finetune packs")
    packs_frame["fill"] = packs_frame["tokens"].astype(float) / packing.budget
    accepted = int(len(samples_frame))
    ledger_checks, sample_checks, pack_checks = _finetune_checks(cfg, packing, accepted, packing.packed)
    outcomes, validations = _run_suites(
        gx, "finetune", [("ledger", ledger_frame, ledger_checks), ("samples", samples_frame, sample_checks), ("packs", packs_frame, pack_checks)]
    )
    stats = {
        **_ledger_stats(ledger_frame),
        "samples": accepted,
        "packs": int(len(packs_frame)),
        "fill_ratio": round(float(packs_frame["fill"].mean()), 6) if len(packs_frame) else None,
        "expectations": _expectation_stats(outcomes),
    }
    return GateResult(phase="finetune", success=all(o.success for o in outcomes), outcomes=outcomes, statistics=stats, ge_result={"validations": validations})


# --- reconciliation before a release ----------------------------------------------------------


class Reconciliation:
    """Streaming tallies that reconcile ledgers with the manifest and the released outputs.

    Args:
        rows_in: manifest rows (every input row must end as exactly one ledger row).

    Feed it ledgers (``add_ledger``: key, source, row, status) and the released samples
    (``add_outputs``: source, row), one table at a time. Memory is one bit-sized flag per
    row and source (a byte, in numpy), not a set of keys: a million rows take about 2 MB.
    Row ids are dense within blocks of 2**30 (a folder source's files each have one, see
    tasks.manifests.sample_key), so the flags are kept per source and block.
    """

    _EXAMPLES = 5

    def __init__(self, rows_in: int):
        import numpy as np

        self._np = np
        self.rows_in = int(rows_in)
        self.ledger_rows = 0
        self.status = {s: 0 for s in STATUSES}
        self.unknown_status = 0
        self.duplicates = 0
        self.outputs = 0
        self.duplicate_outputs = 0
        self.orphan_outputs = 0
        self._seen: dict[tuple[str, int], Any] = {}  # (source, block) -> uint8 per row: 0 none, 1 not ok, 2 ok, 3 ok and released
        self.examples: dict[str, list[str]] = {"duplicates": [], "unknown_status": [], "orphan_outputs": [], "unreleased_ok": [], "duplicate_outputs": []}

    def _flags(self, source: tuple[str, int], upto: int) -> Any:
        np = self._np
        flags = self._seen.get(source)
        if flags is None or len(flags) <= upto:
            grown = np.zeros(max(upto + 1, 2 * len(flags) if flags is not None else 1024), np.uint8)
            if flags is not None:
                grown[: len(flags)] = flags
            self._seen[source] = flags = grown
        return flags

    def _note(self, what: str, source: tuple[str, int], rows: Any) -> None:
        from tasks.manifests import sample_key

        room = self._EXAMPLES - len(self.examples[what])
        if room > 0:
            name, block = source
            self.examples[what].extend(sample_key(name, (block << _BLOCK_BITS) | int(r)) for r in rows[:room])

    def add_ledger(self, table: pa.Table) -> None:
        """Count one ledger's rows (columns source, row, status)."""
        import pyarrow.compute as pc

        np = self._np
        self.ledger_rows += table.num_rows
        for source in pc.unique(table.column("source")).to_pylist():
            part = table.filter(pc.equal(table.column("source"), source)) if source is not None else table.filter(pc.is_null(table.column("source")))
            source = source or ""
            # A row without a row id cannot be placed: counted as unaccounted, never indexed.
            nulls = pc.is_null(part.column("row"))
            if pc.any(nulls).as_py():
                self.unknown_status += int(pc.sum(nulls).as_py())
                part = part.filter(pc.invert(nulls))
            all_rows = part.column("row").to_numpy(zero_copy_only=False).astype(np.int64)
            all_status = part.column("status").to_numpy(zero_copy_only=False)
            for block, rows, pick in _blocks(np, all_rows):
                status = all_status[pick]
                flags = self._flags((source, block), int(rows.max()) if len(rows) else 0)
                repeat = _repeats(np, rows) | (flags[rows] != 0)  # within this table, or seen before
                self.duplicates += int(repeat.sum())
                self._note("duplicates", (source, block), rows[repeat])
                first = ~repeat
                known = np.isin(status, list(STATUSES))
                self.unknown_status += int((first & ~known).sum())
                self._note("unknown_status", (source, block), rows[first & ~known])
                for s in STATUSES:
                    self.status[s] += int((first & (status == s)).sum())
                flags[rows[first & known]] = np.where(status[first & known] == OK, 2, 1)

    def add_outputs(self, table: pa.Table) -> None:
        """Count released samples (columns source, row); each needs an ok ledger row."""
        import pyarrow.compute as pc

        np = self._np
        self.outputs += table.num_rows
        for source in pc.unique(table.column("source")).to_pylist():
            part = table.filter(pc.equal(table.column("source"), source))
            all_rows = part.column("row").to_numpy(zero_copy_only=False).astype(np.int64)
            for block, rows, _ in _blocks(np, all_rows):
                flags = self._flags((source, block), int(rows.max()) if len(rows) else 0)
                orphan = flags[rows] < 2
                again = (flags[rows] == 3) | _repeats(np, rows)
                self.orphan_outputs += int(orphan.sum())
                self.duplicate_outputs += int(again.sum())
                self._note("orphan_outputs", (source, block), rows[orphan])
                self._note("duplicate_outputs", (source, block), rows[again])
                flags[rows[~orphan]] = 3

    def summary(self) -> dict[str, Any]:
        """The tallies: rows in and accounted for, problems with up to five example keys each."""
        np = self._np
        unreleased = 0
        for source, flags in self._seen.items():
            lost = np.flatnonzero(flags == 2)
            unreleased += len(lost)
            self._note("unreleased_ok", source, lost)
        accounted = sum(self.status.values())
        return {
            "rows_in": self.rows_in,
            "ledger_rows": self.ledger_rows,
            "accounted": accounted,
            **self.status,
            "duplicates": self.duplicates,
            "unknown_status": self.unknown_status,
            "outputs": self.outputs,
            "orphan_outputs": self.orphan_outputs,
            "duplicate_outputs": self.duplicate_outputs,
            "unreleased_ok": unreleased if self.outputs or self.status[OK] else 0,
            "examples": {k: v for k, v in self.examples.items() if v},
        }


_BLOCK_BITS = 30


def _blocks(np: Any, rows: Any) -> Any:
    """(block, rows within the block, selection) per block of 2**30 row ids; one block for plain rows."""
    high = rows >> _BLOCK_BITS
    if not len(rows) or int(high.min()) == int(high.max()):
        yield (int(high[0]) if len(rows) else 0), rows & ((1 << _BLOCK_BITS) - 1), slice(None)
        return
    for block in np.unique(high):
        pick = high == block
        yield int(block), rows[pick] & ((1 << _BLOCK_BITS) - 1), pick


def _repeats(np: Any, rows: Any) -> Any:
    """True for every occurrence of a value after its first."""
    order = np.argsort(rows, kind="stable")
    repeat = np.zeros(len(rows), bool)
    repeat[order[1:]] = rows[order[1:]] == rows[order[:-1]]
    return repeat


def _tally(summary: dict[str, Any], name: str, of: str = "ledger_rows") -> Callable[[dict[str, Any]], Any]:
    """Observed value of a reconciliation check: the count, its base, and example keys."""
    return lambda _result: {"unexpected_count": summary[name], "element_count": summary[of], "examples": summary["examples"].get(name, [])}


def release_gate(rec: Reconciliation, check_outputs: bool = True) -> GateResult:
    """Reconcile before a release: rows in = ok + rejected + error, no duplicate rows, no
    output without an ok ledger row (and, with ``check_outputs``, no ok row without its output).

    The checks run as Great Expectations expectations on a one-row table of the tallies, so
    the gate costs the same for a thousand rows as for a million.
    """
    gx = _import_gx()
    s = rec.summary()
    import pandas as pd

    frame = pd.DataFrame([{k: v for k, v in s.items() if k != "examples"}])
    zero = {"min_value": 0, "max_value": 0}
    checks = [
        _Check(
            "rows in = ok + rejected + error",
            f"== {s['rows_in']} rows",
            "ExpectColumnValuesToBeBetween",
            {"column": "accounted", "min_value": s["rows_in"], "max_value": s["rows_in"]},
            lambda _r: s["accounted"],
        ),
        _Check("no duplicate ledger rows", "0", "ExpectColumnValuesToBeBetween", {"column": "duplicates", **zero}, _tally(s, "duplicates")),
        _Check("every status ok, rejected or error", "0 others", "ExpectColumnValuesToBeBetween", {"column": "unknown_status", **zero}, _tally(s, "unknown_status")),
        _Check("no output without a ledger row", "0", "ExpectColumnValuesToBeBetween", {"column": "orphan_outputs", **zero}, _tally(s, "orphan_outputs", "outputs")),
        _Check("no output twice", "0", "ExpectColumnValuesToBeBetween", {"column": "duplicate_outputs", **zero}, _tally(s, "duplicate_outputs", "outputs")),
    ]
    if check_outputs:
        checks.append(_Check("every ok row released", "0 missing", "ExpectColumnValuesToBeBetween", {"column": "unreleased_ok", **zero}, _tally(s, "unreleased_ok", "ok")))
    outcomes, validations = _run_suites(gx, "release", [("reconciliation", frame, checks)])
    stats = {**{k: v for k, v in s.items() if k != "examples"}, "examples": s["examples"], "expectations": _expectation_stats(outcomes)}
    return GateResult(phase="release", success=all(o.success for o in outcomes), outcomes=outcomes, statistics=stats, ge_result={"validations": validations})
