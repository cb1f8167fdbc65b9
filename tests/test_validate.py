"""The validation stage on real download shards: verdicts per sample, dedup, byte-range finalize."""

from __future__ import annotations

import io
import json

import pytest

from tasks.formats.ledger import read_ledger
from tasks.formats.manifests import plan_source
from tasks.formats.recipe_download import (
    DedupConfig,
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
from tasks.stages.validate import (
    DEDUP_COLUMNS,
    candidate_paths,
    final_paths,
    finalize_shard,
    find_duplicates,
    validate_shard,
)

DL = DownloadConfig(timeout_s=5, retries=0, network=NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True))
CFG = ValidateConfig(
    license=LicensePolicy(allow=("CC0-1.0", "CC-BY-4.0")),
    image=ImageRules(min_side=32),
    dedup=DedupConfig(hamming_threshold=6),
)

ROWS = [  # (image, caption, license, expected reason after validation)
    ("photo.jpg", "a photo", "cc0", None),
    ("a.jpg", "a red square", "CC BY 4.0", None),
    ("a.jpg?copy=1", "the same red square", "CC0-1.0", "duplicate_of:web-000000001"),
    ("photo_half.jpg", "the photo, smaller", "CC0-1.0", "duplicate_of:web-000000000"),
    ("b.png", "a green square", "All rights reserved", "license_not_allowed"),
    ("c.webp", "a blue square", "", "license_missing"),
    ("d.gif", "   ", "CC0-1.0", "caption_missing"),
    ("tiny.png", "a tiny image", "CC0-1.0", "image_too_small"),
    ("e.bmp", "a bmp", "CC-BY-4.0", None),
]


@pytest.fixture
def downloaded(tmp_path, web):
    import csv

    manifest = tmp_path / "m.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["url", "caption", "license"])
        for name, caption, lic, _ in ROWS:
            w.writerow([f"{web.base_url}/img/{name}", caption, lic])
    storage = Storage(str(tmp_path / "store"))
    plan = plan_source(SourceConfig(name="web", manifest=str(manifest)), storage, "ds")
    ref = plan.chunks[0]
    tar, ledger = shard_paths("ds", ref, "x")
    result = download_shard(ref, storage, DL, tar, ledger)
    assert result.counts.ok == len(ROWS)
    return storage, tar, ledger


def run_validation(storage, tar, ledger):
    cand_tar, cand_table = candidate_paths("ds", "web", 0, tar, "cfg")
    cand = validate_shard(storage, "web", 0, tar, ledger, CFG, cand_tar, cand_table)
    from tasks.formats.ledger import read_parquet

    dups = find_duplicates([read_parquet(storage, cand.table, DEDUP_COLUMNS)], CFG.dedup, {"web": 0})
    out_tar, out_ledger = final_paths("ds", "web", 0, cand, dups)
    return cand, dups, finalize_shard(storage, cand, dups, out_tar, out_ledger)


def test_every_sample_gets_its_exact_reason(downloaded):
    storage, tar, ledger = downloaded
    cand, dups, result = run_validation(storage, tar, ledger)
    rows = read_ledger(storage, result.ledger).to_pylist()
    assert [r["reason"] for r in rows] == [r[3] for r in ROWS]
    assert result.counts.rows == len(ROWS) == result.counts.ok + result.counts.rejected
    assert [r["license"] for r in rows][:2] == ["CC0-1.0", "CC-BY-4.0"]


def test_validated_shard_holds_exactly_the_ok_samples_reencoded(downloaded):
    storage, tar, ledger = downloaded
    _, _, result = run_validation(storage, tar, ledger)
    ledger_rows = read_ledger(storage, result.ledger).to_pylist()
    data = storage.read_bytes(result.tar)
    samples = {s.key: s for s in iter_samples(io.BytesIO(data))}
    # Exactly the ok samples (in the order they were judged; the ledger keeps row order).
    ok = [r for r in ledger_rows if r["status"] == "ok"]
    assert sorted(samples) == sorted(r["key"] for r in ok) and len(samples) == len(ok)
    for s, r in ((samples[r["key"]], r) for r in ok):
        assert set(s.members) == {"jpg", "json", "txt"}
        meta = json.loads(s.members["json"])
        assert meta["license"] == r["license"] and meta["width"] == r["width"]
        # The finalized ledger's offsets point into the finalized shard.
        jpg = next(m for m in r["members"] if m["name"].endswith(".jpg"))
        assert data[jpg["offset"] : jpg["offset"] + jpg["size"]] == s.members["jpg"]


def test_rerun_is_skipped(downloaded):
    storage, tar, ledger = downloaded
    cand, _, result = run_validation(storage, tar, ledger)
    again_cand, _, again = run_validation(storage, tar, ledger)
    assert again_cand.skipped and again.skipped
    assert again.counts == result.counts


def test_rejected_samples_carry_a_few_thumbnails(downloaded):
    from tasks.formats.ledger import read_parquet
    from tasks.stages.validate import thumbs_path

    storage, tar, ledger = downloaded
    cand, _, _ = run_validation(storage, tar, ledger)
    reasons = {r["key"]: r["reason"] for r in read_parquet(storage, cand.table).to_pylist()}
    table = read_parquet(storage, thumbs_path(cand.table)).to_pylist()
    thumbs = {reasons[r["key"]]: r["thumbnail"] for r in table}
    assert "license_not_allowed" in thumbs and thumbs["license_not_allowed"][:3] == b"\xff\xd8\xff"
    assert "image_too_small" in thumbs  # rejected by the image rules, decoded again for the report
    assert all(reasons[r["key"]] is not None for r in table)  # accepted samples carry none
