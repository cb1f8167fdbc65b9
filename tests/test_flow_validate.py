"""Download -> validate with both gates under Prefect's real engine; a stricter policy is blocked."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def run(name, **kw):
    from flows.pretraining import pretraining_flow

    return pretraining_flow(recipe_path=str(RECIPES / name), phases=["download", "validate"], workers=2, **kw)


def test_download_then_validate_with_gates_and_report(prefect_harness, shared_cluster, demo, monkeypatch):
    from tasks.formats.shards import iter_samples

    root, _, expected = demo
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    out = run("demo.yaml")
    val = out["validate"]
    # Every sample the download accepted has one validation ledger row.
    assert val.counts.rows == expected["ok"]
    assert val.counts.rows == val.counts.ok + val.counts.rejected + val.counts.error
    assert val.counts.ok > 0
    # Licenses the demo allows nothing else; those it does not are rejected with the stable reason.
    store = root / "store"
    rows = [r for p in val.ledgers for r in pq.read_table(store / p).to_pylist()]
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["license"] for r in ok} <= {"CC0-1.0", "CC-BY-4.0", "CC-BY-SA-4.0"}
    from tasks.policies.licenses import normalize_license

    allowed = {"CC0-1.0", "CC-BY-4.0", "CC-BY-SA-4.0"}
    not_allowed = sum(
        n for raw, n in expected["ok_by_license"].items() if raw and normalize_license(raw) not in allowed
    )
    assert sum(r["reason"] == "license_not_allowed" for r in rows) == not_allowed
    # The validated shards hold exactly the ok rows, re-encoded, with normalised metadata.
    keys = []
    for tar in val.tars:
        with open(store / tar, "rb") as fh:
            for s in iter_samples(fh):
                keys.append(s.key)
                meta = json.loads(s.members["json"])
                assert meta["license"] in {"CC0-1.0", "CC-BY-4.0", "CC-BY-SA-4.0"}
                assert "jpg" in s.members and s.members["jpg"][:3] == b"\xff\xd8\xff"
                assert meta["width"] >= 64 and meta["height"] >= 64
    assert sorted(keys) == sorted(r["key"] for r in ok)
    # Report, run record and both gates' results are under the run's report folder.
    report = store / "demo" / "reports" / out["run"]
    html = (report / "report.html").read_text()
    assert "PASSED" in html
    record = json.loads((report / "run.json").read_text())
    assert [p["phase"] for p in record["phases"]] == ["download", "validate"]
    assert all(p["gate"]["success"] for p in record["phases"])
    assert (report / "gates" / "download.json").is_file() and (report / "gates" / "validate.json").is_file()
    assert list((report / "gates").rglob("index.html"))


def test_strict_license_policy_is_blocked_by_the_gate(prefect_harness, shared_cluster, demo, monkeypatch):
    from flows.audit import GateFailed

    root, _, _ = demo
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    with pytest.raises(GateFailed, match="validate gate failed"):
        run("demo-strict.yaml")
    reports = sorted((root / "store" / "demo-strict" / "reports").iterdir())
    record = json.loads((reports[-1] / "run.json").read_text())
    assert record["blocked"] and "reject" in record["blocked"]
    assert "BLOCKED" in (reports[-1] / "report.html").read_text()
    # Nothing past the failed gate: no release was made.
    assert not (root / "store" / "demo-strict" / "releases").exists()
