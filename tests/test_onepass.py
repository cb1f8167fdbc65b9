"""Download and validation in one pass give what the two phases give one after the other."""

from __future__ import annotations

import csv
import io

import pytest

from tasks.formats.ledger import read_ledger
from tasks.formats.manifests import plan_source
from tasks.formats.recipe_download import (
    DownloadConfig,
    ImageRules,
    LicensePolicy,
    NetworkConfig,
    SourceConfig,
    ValidateConfig,
)
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.stages.download import download_shard, shard_paths
from tasks.stages.onepass import download_and_validate
from tasks.stages.validate import candidate_paths, validate_shard

DL = DownloadConfig(timeout_s=5, retries=0, network=NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True))
CFG = ValidateConfig(
    license=LicensePolicy(allow=("CC0-1.0", "CC-BY-4.0")),
    image=ImageRules(min_side=32, resize_mode="border", image_size=64),
)

ROWS = [  # (path, caption, license): accepted, rejected by each stage, failed fetches
    ("/img/photo.jpg", "a photo", "cc0"),
    ("/img/a.jpg", "a red square", "CC BY 4.0"),
    ("/img/b.png", "a green square", "All rights reserved"),
    ("/img/c.webp", "a blue square", "CC0-1.0"),
    ("/img/d.gif", "   ", "CC0-1.0"),
    ("/img/tiny.png", "a tiny image", "CC0-1.0"),
    ("/status/404", "gone", "CC0-1.0"),
    ("/html-as-jpeg", "a page", "CC0-1.0"),
    ("/truncated/photo.jpg", "half a photo", "CC0-1.0"),
    ("/img/e.bmp", "a bmp", "CC-BY-4.0"),
    ("/img/photo_half.jpg", "the photo, smaller", "CC0-1.0"),
] * 3


@pytest.fixture
def chunk(tmp_path, web):
    manifest = tmp_path / "m.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["url", "caption", "license"])
        for i, (path, caption, lic) in enumerate(ROWS):
            w.writerow([f"{web.url(path)}?i={i}", caption, lic])
    plan = plan_source(SourceConfig(name="web", manifest=str(manifest)), Storage(str(tmp_path / "plan")), "ds")
    return plan.chunks[0], tmp_path


def _comparable(storage, rel, drop=("shard", "offset", "length", "members", "fetched_at")):
    return [{k: v for k, v in r.items() if k not in drop} for r in read_ledger(storage, rel).to_pylist()]


def _samples(storage, tar):
    return {s.key: s.members for s in iter_samples(io.BytesIO(storage.read_bytes(tar)))}


def test_one_pass_equals_download_then_validate(chunk):
    ref, tmp = chunk
    a, b = Storage(str(tmp / "plan")), Storage(str(tmp / "plan"))
    # Two phases, one after the other.
    dl_a = shard_paths("ds", ref, "two")
    download_shard(ref, a, DL, *dl_a)
    cand_a = candidate_paths("ds", "web", 0, dl_a[0], "two")
    validate_shard(a, "web", 0, *dl_a, CFG, *cand_a)
    # One pass.
    dl_b = shard_paths("ds", ref, "one")
    cand_b = candidate_paths("ds", "web", 0, dl_b[0], "one")
    got_dl, got_cand = download_and_validate(ref, b, DL, CFG, dl_b, cand_b)
    assert not got_dl.skipped and not got_cand.skipped
    # Every manifest row has one download ledger row, every downloaded sample one candidate row.
    assert _comparable(a, dl_a[1]) == _comparable(b, dl_b[1])
    assert len(_comparable(b, dl_b[1])) == len(ROWS)
    assert _comparable(a, cand_a[1]) == _comparable(b, cand_b[1])
    assert got_cand.counts.rows == got_dl.counts.ok
    reasons = {r["reason"] for r in _comparable(b, cand_b[1])}
    assert {None, "license_not_allowed", "caption_missing", "image_too_small"} <= reasons
    # The same samples, byte for byte (tar order may differ: samples are written as judged).
    assert _samples(a, dl_a[0]) == _samples(b, dl_b[0])
    assert _samples(a, cand_a[0]) == _samples(b, cand_b[0])
    # Offsets in the candidate ledger point at the candidate shard's bytes.
    data = b.read_bytes(cand_b[0])
    for r in read_ledger(b, cand_b[1]).to_pylist():
        if r["status"] == "ok":
            jpg = next(m for m in r["members"] if m["name"].endswith(".jpg"))
            assert data[jpg["offset"] : jpg["offset"] + jpg["size"]][:3] == b"\xff\xd8\xff"


def test_rerun_skips_and_a_new_policy_revalidates_without_fetching(chunk, web):
    ref, tmp = chunk
    storage = Storage(str(tmp / "plan"))
    dl = shard_paths("ds", ref, "one")
    cand = candidate_paths("ds", "web", 0, dl[0], "one")
    download_and_validate(ref, storage, DL, CFG, dl, cand)
    hits = web.stats()["hits"].get("/img/photo.jpg", 0)
    again_dl, again_cand = download_and_validate(ref, storage, DL, CFG, dl, cand)
    assert again_dl.skipped and again_cand.skipped
    # Another validation config: candidates again, from the raw shard, nothing fetched.
    strict = CFG.model_copy(update={"license": LicensePolicy(allow=("CC0-1.0",))})
    cand2 = candidate_paths("ds", "web", 0, dl[0], "strict")
    got_dl, got_cand = download_and_validate(ref, storage, DL, strict, dl, cand2)
    assert got_dl.skipped and not got_cand.skipped
    assert web.stats()["hits"].get("/img/photo.jpg", 0) == hits
    assert got_cand.counts.by_reason["license_not_allowed"] > again_cand.counts.by_reason.get("license_not_allowed", 0)


def test_without_raw_shards_a_chunk_keeps_its_ledger_and_the_same_candidates(chunk):
    ref, tmp = chunk
    a = b = Storage(str(tmp / "plan"))
    dl_a, dl_b = shard_paths("ds", ref, "kept"), shard_paths("ds", ref, "lean")
    cand_a, cand_b = (candidate_paths("ds", "web", 0, dl[0], "x") for dl in (dl_a, dl_b))
    download_and_validate(ref, a, DL, CFG, dl_a, cand_a)
    got_dl, got_cand = download_and_validate(ref, b, DL.model_copy(update={"keep_raw": False}), CFG, dl_b, cand_b)
    # No raw shard; the ledger has every manifest row, as with one, less where the samples sat.
    assert a.exists(dl_a[0]) and not b.exists(dl_b[0])
    assert _comparable(a, dl_a[1]) == _comparable(b, dl_b[1])
    rows = read_ledger(b, dl_b[1]).to_pylist()
    assert len(rows) == len(ROWS) == got_dl.counts.rows
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(r["shard"] is None and r["offset"] is None and r["members"] is None for r in ok)
    assert all(r["bytes"] > 0 and len(r["sha256"]) == 64 for r in ok)
    # The same candidates, byte for byte.
    assert _comparable(a, cand_a[1]) == _comparable(b, cand_b[1])
    assert _samples(a, cand_a[0]) == _samples(b, cand_b[0])
    assert got_cand.counts.rows == got_dl.counts.ok
    # Its candidates deleted by hand: with no raw shard to judge again from, the chunk is fetched
    # again, and the same candidates come back.
    b.rm(cand_b[1])
    b.rm(cand_b[0])
    again_dl, again_cand = download_and_validate(ref, b, DL.model_copy(update={"keep_raw": False}), CFG, dl_b, cand_b)
    assert again_cand.counts == got_cand.counts and again_dl.counts == got_dl.counts
    assert _comparable(a, cand_a[1]) == _comparable(b, cand_b[1])
    assert _samples(a, cand_a[0]) == _samples(b, cand_b[0])
