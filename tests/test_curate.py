"""Curation's stages on real shards: embeddings stored once, scores, cuts, fates, curated shards and their ledgers."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from curate_fixtures import make_clip, make_linear_head

from tasks.curate.decide import ShardInput, decide
from tasks.curate.embed import embed_shard, embeddings_path
from tasks.curate.finalize import curate_shard, curated_paths
from tasks.curate.scores import Cut, cuts, fate, score_shard, scores_path
from tasks.formats.recipe_curate import CurateConfig, HeadConfig, ScoreRule
from tasks.formats.storage import Storage
from tasks.stages.runner import Verdict, run_shard


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


CAPTIONS = ["a red circle above the sea", "two blue stars at night", "a green square", "a white star over hills"]


def _validated_shard(storage: Storage, broken: int | None = None) -> tuple[str, str]:
    """A validated shard as the validate phase writes it: jpg, json and txt per ok sample; one
    rejected row; ``broken``: the sample whose image bytes are cut in half."""
    items = list(range(len(CAPTIONS))) + [len(CAPTIONS)]

    def decide_one(i: int) -> Verdict:
        row = {"key": f"s-{i:09d}", "source": "s", "row": i}
        if i == len(CAPTIONS):
            return Verdict({**row, "status": "rejected", "reason": "license_missing"})
        data = _jpeg(i)
        if i == broken:
            data = data[: len(data) // 2]
        meta = {"caption": CAPTIONS[i], "license": "CC0-1.0"}
        members = {"jpg": data, "json": json.dumps(meta).encode(), "txt": CAPTIONS[i].encode()}
        return Verdict({**row, "status": "ok", "reason": None, "bytes": len(data)}, members=members)

    tar, ledger = "ds/validate/s/000000-abc.tar", "ds/validate/s/000000-abc.ledger.parquet"
    run_shard(storage, tar, ledger, lambda: items, decide_one, source="s", index=0)
    return tar, ledger


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_clip(tmp_path_factory.mktemp("clip") / "clip")


def _cfg(model, **kw) -> CurateConfig:
    return CurateConfig(model=str(model), decode="cpu", device="cpu", batch_size=2, **kw)


def test_embeddings_are_stored_once_and_scores_read_from_them(tmp_path, model):
    storage = Storage(str(tmp_path))
    tar, ledger = _validated_shard(storage)
    head = make_linear_head(tmp_path / "wm.pth", 16)
    cfg = _cfg(model, heads={"watermark": HeadConfig(path=str(head), output="sigmoid")})
    out = embeddings_path("ds", "f" * 64, ledger)
    first = embed_shard(storage, cfg, tar, ledger, out, "run-1")
    assert (first.samples, first.embedded, first.run) == (4, 4, "run-1")
    side = pq.read_table(tmp_path / out)
    assert side.column("key").to_pylist() == [f"s-{i:09d}" for i in range(4)]
    image = np.array(side.column("image").to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(np.linalg.norm(image, axis=1), 1.0, atol=2e-3)  # float16 storage
    # A second run reads the stored side shard: nothing embedded, the first run named.
    again = embed_shard(storage, cfg, tar, ledger, out, "run-2")
    assert (again.embedded, again.run) == (0, "run-1")
    # Deleted, it is made again: the storage decides, not a note.
    (tmp_path / out).unlink()
    assert embed_shard(storage, cfg, tar, ledger, out, "run-3").embedded == 4

    sc = score_shard(storage, cfg, out, scores_path("ds", out, [["watermark", "x", {}]]))
    scores = pq.read_table(tmp_path / sc)
    text = np.array(side.column("text").to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(scores.column("alignment").to_numpy(), (image * text).sum(axis=1), atol=2e-3)
    w = np.asarray(__import__("torch").load(head, weights_only=True)["weight"][0])
    np.testing.assert_allclose(scores.column("watermark").to_numpy(), 1 / (1 + np.exp(-(image @ w))), atol=5e-3)


def test_an_image_no_decoder_reads_is_its_own_row_and_the_shard_goes_on(tmp_path, model):
    storage = Storage(str(tmp_path))
    tar, ledger = _validated_shard(storage, broken=1)
    cfg = _cfg(model, alignment=ScoreRule(min=-1.0))
    out = embeddings_path("ds", "e" * 64, ledger)
    result = embed_shard(storage, cfg, tar, ledger, out, "run-1")
    assert result.samples == 4
    side = pq.read_table(tmp_path / out)
    errors = side.column("error").to_pylist()
    assert errors[1] is not None and all(e is None for i, e in enumerate(errors) if i != 1)
    assert side.column("image").is_null().to_pylist() == [False, True, False, False]
    sc = score_shard(storage, cfg, out, scores_path("ds", out, []))
    shard = ShardInput(tar, ledger, "s", 0, out, sc, "run-1")
    applied, decisions = decide(storage, "ds", cfg, [shard], {})
    tar_rel, ledger_rel = curated_paths("ds", decisions[0])
    res = curate_shard(storage, decisions[0], tar_rel, ledger_rel)
    rows = pq.read_table(tmp_path / ledger_rel).to_pylist()
    assert [r["reason"] for r in rows] == [None, "undecodable_image", None, None]
    assert "could not decode" in rows[1]["detail"]
    assert res.counts.ok == 3


def test_curated_shards_keep_what_the_filters_keep_and_carry_their_scores(tmp_path, model):
    from tasks.formats.shards import iter_samples

    storage = Storage(str(tmp_path))
    tar, ledger = _validated_shard(storage)
    cfg = _cfg(model, alignment=ScoreRule(keep_top=0.5))
    out = embeddings_path("ds", "d" * 64, ledger)
    embed_shard(storage, cfg, tar, ledger, out, "run-1")
    sc = score_shard(storage, cfg, out, scores_path("ds", out, []))
    shard = ShardInput(tar, ledger, "s", 0, out, sc, "run-1")
    dup_key = "s-000000003"
    applied, decisions = decide(storage, "ds", cfg, [shard], {dup_key: ("s-000000000", 0.97)})
    align = pq.read_table(tmp_path / sc).column("alignment").to_pylist()
    best = sorted(range(4), key=lambda i: -align[i])[:2]
    tar_rel, ledger_rel = curated_paths("ds", decisions[0])
    curate_shard(storage, decisions[0], tar_rel, ledger_rel)
    rows = {r["key"]: r for r in pq.read_table(tmp_path / ledger_rel).to_pylist()}
    # Four ok samples in, four rows out; the rejected row of the validated ledger is not curation's.
    assert len(rows) == 4
    for i in range(4):
        r = rows[f"s-{i:09d}"]
        assert r["alignment"] == pytest.approx(align[i])
        if i not in best:
            assert r["reason"] == "low_alignment" and "keep_top 0.5" in r["detail"]
        elif f"s-{i:09d}" == dup_key:
            assert r["reason"] == "semantic_duplicate_of:s-000000000" and r["similarity"] == pytest.approx(0.97)
        else:
            assert r["status"] == "ok" and r["shard"] == tar_rel and r["embedded_by"] == "run-1"
    kept = {r["key"] for r in rows.values() if r["status"] == "ok"}
    with open(tmp_path / tar_rel, "rb") as fh:
        samples = list(iter_samples(fh))
    assert {s.key for s in samples} == kept
    for s in samples:
        meta = json.loads(s.members["json"])
        assert meta["license"] == "CC0-1.0" and meta["scores"]["alignment"] == pytest.approx(
            rows[s.key]["alignment"], abs=1e-5
        )
        assert s.members["txt"].decode() in CAPTIONS


def test_a_fraction_cut_keeps_ties_and_the_first_failed_filter_names_the_reason():
    table = pa.table(
        {"alignment": pa.array([0.1, 0.2, 0.2, 0.3, None], pa.float32()), "nsfw": [0.9, 0.1, 0.2, 0.0, 0.5]}
    )
    cfg = CurateConfig(
        model="m",
        alignment=ScoreRule(keep_top=0.5),
        heads={"nsfw": HeadConfig(path="x", max=0.5)},
    )
    a, n = cuts(cfg, table)
    # Half of four scored values is two, and the second best (0.2) is tied: both 0.2 stay.
    assert a.low == pytest.approx(0.2) and a.high is None and n.high == 0.5
    assert fate({"alignment": 0.1, "nsfw": 0.9}, [a, n], None)[0] == "low_alignment"
    assert fate({"alignment": 0.3, "nsfw": 0.9}, [a, n], None)[0] == "unsafe_content"
    assert fate({"alignment": None, "nsfw": 0.1}, [a, n], None) == (None, None)  # no caption: not judged on alignment
    assert fate({"alignment": 0.3, "nsfw": 0.1}, [a, n], ("k", 0.99))[0] == "semantic_duplicate_of:k"
    custom = Cut("sharpness", 0.5, None, "min 0.5")
    assert fate({"sharpness": 0.1}, [custom], None)[0] == "low_score:sharpness"


def test_recipe_rules_are_checked_when_the_recipe_is_read():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="keep_top and min both set the low cut"):
        ScoreRule(min=0.2, keep_top=0.3)
    with pytest.raises(ValidationError, match="alignment keeps the best-matching"):
        CurateConfig(model="m", alignment=ScoreRule(max=0.9))
    with pytest.raises(ValidationError, match="head name"):
        CurateConfig(model="m", heads={"Bad Name": HeadConfig(path="x")})
    assert not CurateConfig().enabled
