"""One manifest chunk into one shard and its ledger, on local disk and on S3 (moto server)."""

from __future__ import annotations

import io
import json

import pytest

from tasks.formats.ledger import read_ledger
from tasks.formats.manifests import plan_source
from tasks.formats.recipe_download import DownloadConfig, NetworkConfig, SourceConfig
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.stages.download import download_shard, shard_paths

CFG = DownloadConfig(
    timeout_s=5, retries=1, backoff_s=0.01, network=NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True)
)


def manifest_rows(base: str) -> list[tuple[str, str, str]]:
    return [
        (f"{base}/img/a.jpg", "a red square", "CC0-1.0"),
        (f"{base}/status/404", "gone", "CC0-1.0"),
        ("", "no url", "CC0-1.0"),
        (f"{base}/img/b.png", "a green square", "CC-BY-4.0"),
        ("ftp://example.com/x.jpg", "ftp", ""),
        (f"{base}/optout/c.webp", "opted out", "CC0-1.0"),
        (f"{base}/html-as-jpeg", "html", "CC0-1.0"),
        (f"{base}/img/c.webp", "a blue square", "CC-BY-SA-4.0"),
    ]


EXPECTED = [None, "http_404", "missing_url", None, "unsupported_scheme", "opted_out", "not_an_image", None]


def write_manifest(path, base):
    import csv

    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["url", "caption", "license", "author"])
        for i, (url, caption, lic) in enumerate(manifest_rows(base)):
            w.writerow([url, caption, lic, f"author{i}"])


def run_shard(storage: Storage, tmp_path, web, storage_options=None):
    manifest = tmp_path / "m.csv"
    write_manifest(manifest, web.base_url)
    source = SourceConfig(name="web", manifest=str(manifest), extra_columns=("author",), rows_per_shard=100)
    plan = plan_source(source, storage, "ds")
    assert len(plan.chunks) == 1
    ref = plan.chunks[0]
    tar_rel, ledger_rel = shard_paths("ds", ref, "cfg")
    return ref, tar_rel, ledger_rel, download_shard(ref, storage, CFG, tar_rel, ledger_rel, storage_options)


def check_outputs(storage: Storage, tar_rel: str, ledger_rel: str, web, image_dir):
    ledger = read_ledger(storage, ledger_rel).to_pylist()
    assert [r["reason"] for r in ledger] == EXPECTED
    assert [r["row"] for r in ledger] == list(range(8))
    assert [r["key"] for r in ledger] == [f"web-{i:09d}" for i in range(8)]
    assert [r["status"] for r in ledger] == ["ok", "error", "rejected", "ok", "rejected", "rejected", "rejected", "ok"]
    assert [r["detail"] for r in ledger if r["reason"] in ("http_404", "not_an_image")] == [
        "HTTP 404 Not Found",
        "HTML, starts with '<!DOCTYPE html>\\n' (146 bytes, Content-Type image/jpeg)",
    ]
    tar_bytes = storage.read_bytes(tar_rel)
    # Samples are in the order their fetches completed; the ledger gives row order.
    samples = {s.key: s for s in iter_samples(io.BytesIO(tar_bytes))}
    assert sorted(samples) == ["web-000000000", "web-000000003", "web-000000007"]
    assert samples["web-000000000"].members["jpg"] == (image_dir / "a.jpg").read_bytes()
    assert samples["web-000000003"].members["png"] == (image_dir / "b.png").read_bytes()
    assert samples["web-000000007"].members["txt"] == b"a blue square"
    meta = json.loads(samples["web-000000007"].members["json"])
    assert meta["author"] == "author7" and meta["license"] == "CC-BY-SA-4.0" and meta["row"] == 7
    # The ledger's byte ranges point at the right bytes of the tar.
    for row in (r for r in ledger if r["status"] == "ok"):
        assert row["shard"] == tar_rel
        chunk = tar_bytes[row["offset"] : row["offset"] + row["length"]]
        assert list(iter_samples(io.BytesIO(chunk + b"\0" * 1024)))[0].key == row["key"]
        for m in row["members"]:
            if m["name"].endswith((".jpg", ".png", ".webp")):
                import hashlib

                assert hashlib.sha256(tar_bytes[m["offset"] : m["offset"] + m["size"]]).hexdigest() == row["sha256"]


def test_shard_and_ledger_on_local_disk(tmp_path, web, image_dir):
    storage = Storage(str(tmp_path / "store"))
    ref, tar_rel, ledger_rel, result = run_shard(storage, tmp_path, web)
    assert (result.counts.rows, result.counts.ok, result.counts.rejected, result.counts.error) == (8, 3, 4, 1)
    check_outputs(storage, tar_rel, ledger_rel, web, image_dir)
    # No temp files are left beside the outputs.
    leftovers = [
        p.name for p in (tmp_path / "store" / "ds" / "download" / "web").iterdir() if p.name.startswith(".tmp")
    ]
    assert leftovers == []
    # Committed means skipped: a second call fetches nothing.
    web.reset_stats()
    again = download_shard(ref, storage, CFG, tar_rel, ledger_rel)
    assert again.skipped and again.counts == result.counts
    assert sum(web.hits.values()) == 0


def test_same_inputs_give_the_same_ledger_and_samples(tmp_path, web, monkeypatch):
    """Samples land in completion order, so tar bytes may differ; what they hold may not.

    Later phases read through the ledger (row order) and its byte ranges, so releases built
    from either shard are identical.
    """
    monkeypatch.setenv("SHARDSMITH_NOW", "2026-12-05T02:00:00Z")  # the run's time, each row's fetched_at
    a = Storage(str(tmp_path / "a"))
    b = Storage(str(tmp_path / "b"))
    (tmp_path / "m").mkdir()
    _, tar_a, led_a, _ = run_shard(a, tmp_path / "m", web)
    _, tar_b, led_b, _ = run_shard(b, tmp_path / "m", web)
    placement = ("offset", "members")  # where in the tar, which follows completion order
    rows_a = [{k: v for k, v in r.items() if k not in placement} for r in read_ledger(a, led_a).to_pylist()]
    rows_b = [{k: v for k, v in r.items() if k not in placement} for r in read_ledger(b, led_b).to_pylist()]
    assert rows_a == rows_b
    samples_a = {s.key: s.members for s in iter_samples(io.BytesIO(a.read_bytes(tar_a)))}
    samples_b = {s.key: s.members for s in iter_samples(io.BytesIO(b.read_bytes(tar_b)))}
    assert samples_a == samples_b


def test_shard_and_ledger_on_s3(tmp_path, web, image_dir, s3_bucket):
    bucket, options = s3_bucket
    storage = Storage(f"s3://{bucket}/prefix", options)
    ref, tar_rel, ledger_rel, result = run_shard(storage, tmp_path, web, options)
    assert result.counts.ok == 3
    check_outputs(storage, tar_rel, ledger_rel, web, image_dir)
    names = storage.listdir("ds/download/web")
    assert sorted(n.rsplit(".", 1)[-1] for n in names) == ["parquet", "tar"]
    # Chunks live in the storage too, so remote workers can read them.
    assert storage.exists(ref.path)


def test_manifest_on_s3_with_s3_images(tmp_path, s3_bucket, image_dir):
    """s3:// image URLs work for allowlisted buckets and are refused for others."""
    import s3fs

    bucket, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    fs.pipe(f"{bucket}/img/a.jpg", (image_dir / "a.jpg").read_bytes())
    fs.pipe(
        f"{bucket}/m.jsonl",
        (
            json.dumps({"url": f"s3://{bucket}/img/a.jpg", "caption": "x"})
            + "\n"
            + json.dumps({"url": "s3://elsewhere/img/a.jpg", "caption": "y"})
            + "\n"
            + json.dumps({"url": f"s3://{bucket}/img/missing.jpg", "caption": "z"})
            + "\n"
        ).encode(),
    )
    storage = Storage(str(tmp_path / "store"))
    source = SourceConfig(name="s3src", manifest=f"s3://{bucket}/m.jsonl")
    plan = plan_source(source, storage, "ds", options)
    cfg = DownloadConfig(network=NetworkConfig(s3_buckets=(bucket,)))
    tar_rel, ledger_rel = shard_paths("ds", plan.chunks[0], "c")
    download_shard(plan.chunks[0], storage, cfg, tar_rel, ledger_rel, options)
    ledger = read_ledger(storage, ledger_rel).to_pylist()
    assert [r["reason"] for r in ledger] == [None, "blocked_scheme", "read_error"]
    assert ledger[1]["detail"] == "s3 bucket 'elsewhere' is not in download.network.s3_buckets"
    assert ledger[2]["detail"].startswith("FileNotFoundError")


def test_a_shard_that_cannot_be_written_raises(tmp_path, web):
    """A per-shard problem raises (Prefect retries it); nothing is committed."""
    store = tmp_path / "store"
    storage = Storage(str(store))
    manifest = tmp_path / "m.csv"
    write_manifest(manifest, web.base_url)
    plan = plan_source(SourceConfig(name="web", manifest=str(manifest)), storage, "ds")
    tar_rel, ledger_rel = shard_paths("ds", plan.chunks[0], "cfg")
    (store / "ds" / "download").mkdir(parents=True)
    (store / "ds" / "download" / "web").write_text("a file where the folder should be")
    with pytest.raises(OSError):
        download_shard(plan.chunks[0], storage, CFG, tar_rel, ledger_rel)
    assert not storage.exists(ledger_rel)
