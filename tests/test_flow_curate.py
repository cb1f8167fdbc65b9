"""Curation under Prefect's real engine on the demo corpus: ledgers, release, report, reuse of embeddings, the gate."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from curate_fixtures import make_clip, make_linear_head

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture(scope="module")
def curated_recipe(demo, tmp_path_factory):
    """The demo recipe with curation (a random tiny CLIP, a watermark head) and precache reusing
    the curation embeddings; returns (recipe path, demo folder, model folder)."""
    root, _, _ = demo
    models = tmp_path_factory.mktemp("curate-models")
    clip = make_clip(models / "clip")
    head = make_linear_head(models / "watermark.pth", 16)
    data = yaml.safe_load((RECIPES / "demo.yaml").read_text())
    data["curate"] = {
        "model": str(clip),
        "decode": "cpu",
        "alignment": {"keep_top": 0.8},
        "heads": {"watermark": {"path": str(head), "output": "sigmoid"}},
        # Only identical embeddings: the demo corpus of this module has no planted copies.
        "semdedup": {"threshold": 1.0},
    }
    data["precache"]["image_embedding"] = {"model": str(clip)}
    path = models / "curated.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, root, clip


def _run(recipe: Path, **overrides):
    from flows.pretraining import pretraining_flow

    return pretraining_flow(recipe_path=str(recipe), workers=2, overrides=overrides or None)


@pytest.mark.slow
def test_curation_to_a_release_then_a_new_threshold_embeds_nothing(
    prefect_harness, shared_cluster, curated_recipe, monkeypatch
):
    from tasks.formats.shards import iter_samples

    recipe, root, _ = curated_recipe
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    store = root / "store"
    out = _run(recipe)
    val, cur = out["validate"], out["curate"]
    # Every validated sample has one curation row; keep_top 0.8 keeps the ceiling of 80%.
    assert cur.counts.rows == val.counts.ok
    kept = math.ceil(0.8 * cur.counts.rows)
    assert cur.counts.ok == kept and cur.counts.by_reason == {"low_alignment": cur.counts.rows - kept}
    assert cur.embedded == cur.counts.rows and cur.reused == 0
    assert cur.semdedup == {
        "fitted": 1,
        "assigned": len(cur.ledgers),
        "compared": cur.semdedup["compared"],
        "incremental": 0,
    }
    rows = [r for p in cur.ledgers for r in pq.read_table(store / p).to_pylist()]
    low = [r for r in rows if r["reason"] == "low_alignment"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert max(r["alignment"] for r in low) <= min(r["alignment"] for r in ok)
    assert all("keep_top 0.8" in r["detail"] for r in low)
    assert {dict(r["scores"])["watermark"] is not None for r in rows} == {True}

    # The release holds the kept samples with their scores, and its ledger says why the others went.
    rel = out["release"]
    base = Path(rel.path)
    index = json.loads((base / "index.json").read_text())
    assert index["totals"]["samples"] == kept
    assert index["curation"]["model_sha256"] == cur.model and index["curation"]["cuts"][0]["name"] == "alignment"
    ledger = pq.read_table(base / "ledger.parquet").to_pylist()
    assert sum(r["phase"] == "curate" and r["reason"] == "low_alignment" for r in ledger) == len(low)
    released = {}
    for shard in index["shards"]:
        with open(base / shard["name"], "rb") as fh:
            for s in iter_samples(fh):
                released[s.key] = json.loads(s.members["json"])["scores"]
    assert set(released) == {r["key"] for r in ok}
    assert all(set(v) == {"alignment", "watermark"} for v in released.values())

    # Precache asked for the curation model's image embedding: read back, not encoded again.
    enc = index["precache"]["encodings"]["image_embedding"]
    assert enc["reused_from_curation"] is True and enc["shape"] == [16]

    # The report shows the scores with their cuts and the samples per decile.
    report = store / "demo" / "reports" / out["run"]
    html = (report / "report.html").read_text()
    assert 'id="curation"' in html and 'data-score="alignment"' in html and 'class="cut"' in html
    # Links that work: every relative link of the page names a stored file (gate pages, data docs).
    links = {h.split("#")[0] for h in re.findall(r'href="([^"#][^"]*)"', html)}
    assert links and all((report / h).resolve().is_file() for h in links if "://" not in h), links
    views = json.loads((report / "curation.json").read_text())
    assert [s["name"] for s in views["scores"]] == ["alignment", "watermark"]
    # Each decile's thumbnails start at its lowest value: the first is the lowest score of all.
    first = views["deciles"]["alignment"][0]["samples"]
    assert first[0]["value"] == pytest.approx(min(r["alignment"] for r in rows), abs=1e-4)
    assert [x["value"] for x in first] == sorted(x["value"] for x in first)
    # The run's summary in the Prefect UI carries the scores' histograms with their cuts.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as c:
        summary = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["demo-summary"])))
    assert any("![curation alignment](data:image/svg+xml;base64," in a.data for a in summary)

    # A new threshold: the stored embeddings decide again; nothing is embedded.
    again = _run(recipe, **{"curate.alignment.keep_top": 0.5})
    cur2 = again["curate"]
    assert cur2.embedded == 0 and cur2.reused == cur.counts.rows
    assert cur2.semdedup == {"fitted": 0, "assigned": 0, "compared": 0, "incremental": 1}
    assert cur2.counts.ok == math.ceil(0.5 * cur.counts.rows)
    rows2 = [r for p in cur2.ledgers for r in pq.read_table(store / p).to_pylist()]
    assert {r["embedded_by"] for r in rows2} == {out["run"]}
    assert np.isclose(sorted(r["alignment"] for r in rows2), sorted(r["alignment"] for r in rows)).all()
    assert again["release"].version != rel.version and again["release"].samples == cur2.counts.ok

    # Another fraction that keeps the same samples: the removed rows' details name it, so the
    # curated shards and the reshard plan are new, their content the same. The latents, named
    # by content, are read back (nothing encoded) for this run's inputs.
    # (ok - 0.25) / rows keeps ceil(0.5 * rows) samples and is never 0.5 itself (ok - 0.5 is, for odd rows).
    same = (cur2.counts.ok - 0.25) / cur.counts.rows
    third = _run(recipe, **{"curate.alignment.keep_top": same})
    assert third["curate"].counts.ok == cur2.counts.ok
    assert [r.image_shard for r in third["precache"].results] == [o.tar for o in third["reshard"].outputs]
    assert all(r.skipped for r in third["precache"].results)
    assert third["reshard"].outputs[0].tar != again["reshard"].outputs[0].tar


@pytest.mark.slow
def test_a_curation_that_removes_too_much_is_blocked_by_its_gate(
    prefect_harness, shared_cluster, curated_recipe, monkeypatch
):
    from flows.audit import GateFailed

    recipe, root, _ = curated_recipe
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    with pytest.raises(GateFailed, match="curate gate failed"):
        _run(recipe, **{"curate.alignment.keep_top": 0.3, "gates.curate.max_removed_rate": 0.5})
    reports = sorted((root / "store" / "demo" / "reports").iterdir(), key=lambda p: p.stat().st_mtime)
    record = json.loads((reports[-1] / "run.json").read_text())
    assert record["blocked"] and "removed share" in record["blocked"]
    assert [p["phase"] for p in record["phases"]][-1] == "curate"
