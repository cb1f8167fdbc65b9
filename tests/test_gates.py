"""Phase gates: real Great Expectations suites on small ledgers and sample tables."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pytest

from tasks.audit.data_docs import save_gate_report
from tasks.audit.gate_results import LICENSE_REVIEW, GateResult
from tasks.audit.gates import download_gate, validate_gate
from tasks.formats.ledger import LedgerRow, ledger_table
from tasks.formats.recipe_download import ImageRules
from tasks.formats.recipe_outputs import DownloadGate, ValidateGate
from tasks.formats.storage import Storage

ALLOW = ["CC0-1.0", "CC-BY-4.0", "MIT"]


@pytest.fixture(scope="module", autouse=True)
def gx():
    """Pay for the GE import (several seconds) once, in a fixture, not in the first test."""
    from tasks.audit.ge_runner import import_gx

    return import_gx()


def ledger(ok: int, reasons: dict[str, int] | None = None, source: str = "web") -> pa.Table:
    """A ledger with ``ok`` accepted rows, then rows for each reason, in the real schema."""
    rows = [LedgerRow(key=f"{source}-{i:09d}", source=source, row=i) for i in range(ok)]
    for reason, n in (reasons or {}).items():
        for _ in range(n):
            i = len(rows)
            rows.append(LedgerRow(key=f"{source}-{i:09d}", source=source, row=i, reason=reason))
    return ledger_table(rows)


def samples(n: int, **overrides) -> pa.Table:
    """One row per accepted sample, all good; ``overrides`` replace whole columns."""
    cols = {
        "key": [f"web-{i:09d}" for i in range(n)],
        "license": [ALLOW[i % len(ALLOW)] for i in range(n)],
        "width": [128] * n,
        "height": [96] * n,
        "aspect": [128 / 96] * n,
        "caption_chars": [24] * n,
        "pixel_sha256": [f"{i:064x}" for i in range(n)],
        "phash": list(range(n)),
        "bytes": [2048] * n,
    }
    cols.update(overrides)
    return pa.table(cols)


def failed_names(result: GateResult) -> set[str]:
    return {o.name for o in result.outcomes if not o.success}


def outcome(result: GateResult, name: str):
    (found,) = [o for o in result.outcomes if o.name == name]
    return found


# --- download gate ----------------------------------------------------------------------------


def test_download_gate_passes():
    table = ledger(8, {"not_an_image": 1, "timeout": 1})
    result = download_gate(table, 10, DownloadGate(min_success_rate=0.5, max_reason_rate={"timeout": 0.2}))
    assert result.success, result.failure_message()
    assert result.failure_message() == ""
    assert failed_names(result) == set()
    names = [o.name for o in result.outcomes]
    assert {"row count >= 1", "every manifest row accounted for", "key unique", "success rate >= 0.5"} <= set(names)
    assert "timeout rate <= 0.2" in names
    assert outcome(result, "success rate >= 0.5").observed == 0.8
    assert outcome(result, "success rate >= 0.5").expectation == "expect_column_values_to_be_in_set"
    assert result.statistics["rows"] == 10 and result.statistics["ok"] == 8
    assert result.statistics["by_reason"] == {"not_an_image": 1, "timeout": 1}
    (validation,) = result.ge_result["validations"]
    assert validation["success"] is True
    assert GateResult.from_json(json.loads(json.dumps(result.to_json()))).outcomes == result.outcomes


def test_download_gate_fails_below_success_rate():
    result = download_gate(ledger(3, {"http_404": 7}), 10, DownloadGate(min_success_rate=0.5))
    assert not result.success
    assert failed_names(result) == {"success rate >= 0.5"}
    assert outcome(result, "success rate >= 0.5").observed == 0.3
    assert result.failure_message() == "download gate failed: success rate >= 0.5 (observed 0.3)"
    assert result.ge_result["validations"][0]["success"] is False


def test_download_gate_reason_limit_counts_every_row():
    table = ledger(8, {"timeout": 2})
    # ok rows have no reason; GE skips nulls, so the share must still be 2 of 10, not 2 of 2.
    passing = download_gate(table, 10, DownloadGate(max_reason_rate={"timeout": 0.25}))
    assert passing.success, passing.failure_message()
    assert outcome(passing, "timeout rate <= 0.25").observed == 0.2

    failing = download_gate(table, 10, DownloadGate(max_reason_rate={"timeout": 0.1, "dns_error": 0.0}))
    assert failed_names(failing) == {"timeout rate <= 0.1"}
    assert "timeout rate <= 0.1 (observed 0.2)" in failing.failure_message()
    assert outcome(failing, "dns_error rate <= 0").success


def test_download_gate_reason_limit_applies_to_a_family():
    table = ledger(8, {"duplicate_of:web-000000001": 1, "duplicate_of:web-000000002": 1})
    result = download_gate(table, 10, DownloadGate(max_reason_rate={"duplicate_of": 0.1}))
    assert failed_names(result) == {"duplicate_of rate <= 0.1"}
    assert outcome(result, "duplicate_of rate <= 0.1").observed == 0.2
    assert result.statistics["by_reason"] == {"duplicate_of": 2}


def test_download_gate_rate_at_the_limit_passes():
    # 1 - 0.7 is 0.30000000000000004 in floating point; a share of exactly 0.7 is allowed.
    cfg = DownloadGate(min_success_rate=0.3, max_reason_rate={"timeout": 0.7})
    result = download_gate(ledger(3, {"timeout": 7}), 10, cfg)
    assert result.success, result.failure_message()


def test_download_gate_lost_row_fails_accounting():
    table = ledger(10).slice(0, 9)
    result = download_gate(table, 10, DownloadGate())
    assert failed_names(result) == {"every manifest row accounted for"}
    assert outcome(result, "every manifest row accounted for").observed == 9
    assert "every manifest row accounted for, expected == 10 rows (observed 9)" in result.failure_message()


def test_download_gate_empty_ledger_fails_row_count():
    result = download_gate(ledger(0), 0, DownloadGate(min_success_rate=0.9))
    # Every per-row expectation passes on no rows; only the row count catches it.
    assert failed_names(result) == {"row count >= 1"}
    assert outcome(result, "success rate >= 0.9").observed is None
    assert "row count >= 1 (observed 0)" in result.failure_message()


def test_download_gate_duplicate_keys_fail():
    table = pa.concat_tables([ledger(5), ledger(5).slice(2, 1)])
    result = download_gate(table, 6, DownloadGate())
    assert failed_names(result) == {"key unique"}
    assert outcome(result, "key unique").observed == {
        "unexpected_count": 2,
        "element_count": 6,
        "examples": ["web-000000002"],
    }
    assert (
        "key unique, expected no duplicates (observed 2 of 6 rows unexpected, e.g. web-000000002)"
        in result.failure_message()
    )


def test_download_gate_unknown_and_null_status_fail():
    table = ledger(4).set_column(3, "status", pa.array(["ok", "ok", "pending", None]))
    result = download_gate(table, 4, DownloadGate())
    assert failed_names(result) == {"status in ok, rejected, error", "status not null"}


def test_download_gate_missing_column_raises():
    with pytest.raises(ValueError, match="lacks column.*reason"):
        download_gate(ledger(2).drop_columns(["reason"]), 2, DownloadGate())
    # With no rows at all a table may come without a schema: that fails the gate instead.
    assert failed_names(download_gate(pa.table({}), 0, DownloadGate())) == {"row count >= 1"}


# --- validate gate ----------------------------------------------------------------------------


def run_validate(table=None, sample_table=None, cfg=None, image=None, review=True, allow=ALLOW):
    return validate_gate(
        ledger(8, {"truncated_image": 2}) if table is None else table,
        samples(8) if sample_table is None else sample_table,
        cfg or ValidateGate(),
        allow,
        image or ImageRules(),
        review,
    )


def test_validate_gate_passes_on_good_data():
    result = run_validate()
    assert result.success, result.failure_message()
    assert result.statistics["samples"] == 8 and result.statistics["rejected"] == 2
    assert [v["suite_name"] for v in result.ge_result["validations"]] == ["validate_ledger", "validate_samples"]
    names = [o.name for o in result.outcomes]
    assert len(names) == len(set(names)) and {"ledger key unique", "key unique"} <= set(names)
    review = outcome(result, "license review recorded")
    assert review.expectation == LICENSE_REVIEW and review.observed == "present"


@pytest.mark.parametrize(
    "overrides, failed, message",
    [
        (
            {"license": ["MIT"] * 7 + ["GPL-3.0"]},
            {"license in allowlist"},
            "license in allowlist, expected in CC-BY-4.0, CC0-1.0, MIT (observed 1 of 8 rows unexpected, e.g. GPL-3.0)",
        ),
        # In-set checks skip nulls: a null license is caught by its own check.
        (
            {"license": ["MIT"] * 7 + [None]},
            {"license not null"},
            "license not null, expected no nulls (observed 1 of 8 rows unexpected)",
        ),
        (
            {"pixel_sha256": ["a" * 64, "a" * 64] + [f"{i:064x}" for i in range(6)]},
            {"pixel_sha256 unique"},
            "pixel_sha256 unique, expected no duplicate pixel hashes (observed 2 of 8 rows unexpected, e.g. "
            + "a" * 64,
        ),
        ({"aspect": [1.0] * 7 + [4.5]}, {"aspect <= 4"}, "aspect <= 4 (observed 1 of 8 rows unexpected, e.g. 4.5)"),
        ({"width": [128] * 7 + [32]}, {"width >= 64"}, "width >= 64 (observed 1 of 8 rows unexpected, e.g. 32)"),
        (
            {"key": [f"web-{i:09d}" for i in range(7)] + ["web-000000000"]},
            {"key unique"},
            "key unique, expected no duplicates (observed 2 of 8 rows unexpected, e.g. web-000000000)",
        ),
    ],
    ids=["license-not-allowed", "license-null", "duplicate-pixels", "aspect", "too-narrow", "duplicate-keys"],
)
def test_validate_gate_sample_failures(overrides, failed, message):
    result = run_validate(sample_table=samples(8, **overrides))
    assert failed_names(result) == failed
    assert message in result.failure_message()
    assert result.failure_message().startswith("validate gate failed: ")


def test_samples_may_share_their_pixels_where_exact_dedup_is_off():
    """``validate.dedup.exact: false`` keeps exact copies on purpose: the gate then does not ask
    for unique pixel hashes (it did, and failed every such run)."""
    from tasks.audit.gates import validate_gate

    copies = samples(8, pixel_sha256=["a" * 64, "a" * 64] + [f"{i:064x}" for i in range(6)])
    args = (ledger(8, {"truncated_image": 2}), copies, ValidateGate(), ALLOW, ImageRules(), True)
    assert failed_names(validate_gate(*args)) == {"pixel_sha256 unique"}
    kept = validate_gate(*args, unique_pixels=False)
    assert kept.success and "pixel_sha256 unique" not in {o.name for o in kept.outcomes}


def test_validate_gate_reject_rate_over_threshold():
    table = ledger(7, {"not_an_image": 3})
    result = run_validate(table=table, sample_table=samples(7), cfg=ValidateGate(max_reject_rate=0.2))
    assert failed_names(result) == {"reject rate <= 0.2"}
    assert "reject rate <= 0.2 (observed 0.3)" in result.failure_message()


def test_validate_gate_fails_when_nothing_came_through():
    empty_samples = pa.table({"key": pa.array([], pa.string())})
    result = run_validate(table=pa.table({}), sample_table=empty_samples)
    assert failed_names(result) == {"ledger row count >= 1", "accepted samples >= 1"}


def test_validate_gate_too_few_and_unmatched_samples():
    result = run_validate(sample_table=samples(5), cfg=ValidateGate(min_samples=6))
    assert failed_names(result) == {"accepted samples >= 6", "every accepted ledger row has a sample"}
    assert "every accepted ledger row has a sample, expected == 8 rows (observed 5)" in result.failure_message()


def test_validate_gate_resized_outputs_use_the_smaller_side():
    small = samples(8, width=[48] * 8, height=[48] * 8, aspect=[1.0] * 8)
    assert run_validate(sample_table=small, image=ImageRules(resize_mode="center_crop", image_size=48)).success
    assert failed_names(run_validate(sample_table=small)) == {"width >= 64", "height >= 64"}


def test_validate_gate_requires_license_review():
    result = run_validate(review=False)
    assert failed_names(result) == {"license review recorded"}
    assert result.failure_message() == (
        "validate gate failed: license review recorded, expected validate.license.review set (observed missing)"
    )
    not_required = run_validate(review=False, cfg=ValidateGate(require_license_review=False))
    assert not_required.success, not_required.failure_message()
    assert outcome(not_required, "license review recorded").observed == "missing"


# --- reports ----------------------------------------------------------------------------------


def _linked_pages(index_html: str) -> list[str]:
    return sorted(set(re.findall(r'href="((?:validations|expectations)/[^"]+\.html)"', index_html)))


def test_save_gate_report_writes_json_and_data_docs(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    download = download_gate(ledger(8, {"timeout": 2}), 10, DownloadGate(min_success_rate=0.9))
    paths = save_gate_report(download, storage, "ds/reports/run-1")
    assert paths == {"json": "ds/reports/run-1/download.json", "data_docs": "ds/reports/run-1/data_docs/index.html"}
    saved = json.loads(storage.read_bytes(paths["json"]))
    assert saved["success"] is False and saved["message"] == download.failure_message()
    assert GateResult.from_json(saved).outcomes == download.outcomes
    assert saved["ge_result"]["validations"][0]["suite_name"] == "download_ledger"

    static = next(p for p in (tmp_path / "root").rglob("*.css"))
    static_mtime = static.stat().st_mtime_ns
    first_pages = {p: p.stat().st_mtime_ns for p in (tmp_path / "root").rglob("validations/**/*.html")}
    assert len(first_pages) == 1

    validate = run_validate(review=False)
    paths = save_gate_report(validate, storage, "ds/reports/run-1")
    index = storage.read_bytes(paths["data_docs"]).decode()
    # One site for the run: the index lists every phase's suites.
    for suite in ("download_ledger", "validate_ledger", "validate_samples"):
        assert suite in index
    pages = _linked_pages(index)
    validations = [p for p in pages if p.startswith("validations/")]
    assert len(validations) == 3 and all(storage.exists(f"ds/reports/run-1/data_docs/{p}") for p in pages)
    html = "".join(storage.read_bytes(f"ds/reports/run-1/data_docs/{p}").decode() for p in validations)
    names = ("success rate >= 0.9", "every manifest row accounted for", "license in allowlist", "pixel_sha256 unique")
    for name in names + ("reject rate <= 0.5", "ledger key unique"):
        assert name in html, name
    assert static.stat().st_mtime_ns == static_mtime  # static assets are not copied again
    # Each gate renders its own pages: the download's page is the first gate's, untouched.
    assert {p: p.stat().st_mtime_ns for p in first_pages} == first_pages
    assert storage.exists("ds/reports/run-1/validate.json")


def test_a_reused_gate_gets_its_pages_from_the_next_gate_that_renders(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    # A gate reused from an earlier run writes its JSON only; the run's site still links it.
    save_gate_report(download_gate(ledger(8), 8, DownloadGate()), storage, "ds/r", docs=False)
    paths = save_gate_report(run_validate(review=False), storage, "ds/r")
    index = storage.read_bytes(paths["data_docs"]).decode()
    pages = _linked_pages(index)
    assert "download_ledger" in index and len([p for p in pages if p.startswith("validations/")]) == 3
    assert all(storage.exists(f"ds/r/data_docs/{p}") for p in pages)


def test_save_gate_report_to_s3(s3_bucket):
    bucket, options = s3_bucket
    storage = Storage(f"s3://{bucket}/root", options)
    result = download_gate(ledger(4), 4, DownloadGate())
    paths = save_gate_report(result, storage, "reports/run-2")
    assert json.loads(storage.read_bytes(paths["json"]))["success"] is True
    assert "download_ledger" in storage.read_bytes(paths["data_docs"]).decode()
    # A second gate renders its own pages; the index still links the first gate's.
    paths = save_gate_report(run_validate(review=False), storage, "reports/run-2")
    index = storage.read_bytes(paths["data_docs"]).decode()
    pages = _linked_pages(index)
    assert "download_ledger" in index and len([p for p in pages if p.startswith("validations/")]) == 3
    assert all(storage.exists(f"reports/run-2/data_docs/{p}") for p in pages)


def test_importing_great_expectations_leaves_scipy_stats_for_its_first_use():
    import subprocess
    import sys

    # A fresh interpreter: this one may have loaded scipy.stats for another test already.
    code = """
import sys
from tasks.audit.ge_runner import import_gx
gx = import_gx()
loaded_with_gx = "scipy.stats._stats_py" in sys.modules
from scipy.stats import norm
assert abs(norm.cdf(0.0) - 0.5) < 1e-12
import scipy.stats
assert scipy.stats.norm is norm and "scipy.stats._stats_py" in sys.modules
print(loaded_with_gx, gx.__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["False", "great_expectations"]
