"""curate.compute_dtype on the demo: bf16 makes every decision fp32 makes, and the two never mix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo.yaml"


def _curate(dtype: str):
    from flows.pretraining import pretraining_flow

    return pretraining_flow(
        recipe_path=str(RECIPE),
        phases=["download", "validate", "curate"],
        workers=2,
        overrides={"curate.compute_dtype": dtype},
    )


def _fates(store: Path, cur) -> dict[str, dict]:
    """key -> the curation ledger's status and reason, and the fates table's scores."""
    from tasks.formats.storage import Storage

    st = Storage(str(store))
    out: dict[str, dict] = {}
    for ledger in cur.ledgers:
        for row in pq.read_table(st.path(ledger), columns=["key", "status", "reason"]).to_pylist():
            out[row["key"]] = dict(row)
    for path in (store / "demo" / "curate" / "fates").rglob("*.parquet"):
        for row in pq.read_table(path).to_pylist():
            if row["key"] in out:
                out[row["key"]].setdefault("scores", []).append(row.get("alignment"))
    return out


@pytest.mark.slow
def test_bf16_makes_the_demos_curation_decisions_that_fp32_makes(prefect_harness, shared_cluster, demo, monkeypatch):
    root, _, expected = demo
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    store = root / "store"
    fp32 = _curate("fp32")["curate"]
    bf16 = _curate("bf16")["curate"]
    assert (fp32.compute_dtype, bf16.compute_dtype) == ("fp32", "bf16")
    # Side shards are named by the dtype: the bf16 run embedded every sample again, reusing none.
    assert bf16.embedded == fp32.embedded > 0 and bf16.reused == 0
    assert set(fp32.side_shards.values()).isdisjoint(bf16.side_shards.values())
    assert all("-fp32/" in p for p in fp32.side_shards.values())
    assert all("-bf16/" in p for p in bf16.side_shards.values())
    # The same removals, for the same reasons (semantic duplicates name the same kept sample:
    # the same groups), and the same kept samples.
    a = {k: (v["status"], v["reason"]) for k, v in _fates(store, fp32).items()}
    b = {k: (v["status"], v["reason"]) for k, v in _fates(store, bf16).items()}
    assert a == b
    assert any(r and r.startswith("low_alignment") for _, r in a.values())
    assert any(r and r.startswith("semantic_duplicate_of:") for _, r in a.values())
    # Alignment within 0.01: the fates tables of both runs hold each key's score once per dtype.
    both = _fates(store, fp32)
    diffs = [abs(s[0] - s[1]) for s in (v.get("scores", []) for v in both.values()) if len(s) == 2 and None not in s]
    assert len(diffs) >= fp32.counts.rows * 0.9
    assert max(diffs) <= 0.01, max(diffs)
    assert np.mean(diffs) > 0  # two computations, not one read twice
