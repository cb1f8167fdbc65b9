"""The example recipes of the ingest sources, run by the `shardsmith` command to a release over data the tests write."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from byo_fixtures import distinct_image, images_parquet, img2dataset_shard

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, example_dir: Path, api_url: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PREFECT_API_URL=api_url)  # the session's server: no server start per command
    env["SHARDSMITH_EXAMPLE_DIR"] = str(example_dir)
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def phases(store: Path, dataset: str) -> dict[str, dict]:
    """The phases of the latest release's run (run.json), and its download summary as "summary"."""
    base = store / dataset / "releases"
    run = json.loads((base / (base / "LATEST").read_text().strip() / "run.json").read_text())
    out = {p["phase"]: p for p in run["phases"]}
    out["summary"] = json.loads((store / dataset / "reports" / run["run"] / "download.json").read_text())
    return out


def released_samples(store: Path, dataset: str, images: dict | None = None) -> tuple[dict, list[dict]]:
    """(index.json of the latest release, the json member of every released sample); ``images``,
    when given, is filled with each sample's jpg member by its json's origin key."""
    base = store / dataset / "releases"
    version = (base / "LATEST").read_text().strip()
    index = json.loads((base / version / "index.json").read_text())
    metas = []
    for shard in index["shards"]:
        data = (
            (base / version / shard["name"]).read_bytes()
            if (base / version / shard["name"]).exists()
            else (store / shard["path"]).read_bytes()
        )
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        for name, blob in members.items():
            if name.endswith(".json"):
                metas.append(json.loads(blob))
                if images is not None:
                    images[metas[-1]["origin"]["key"]] = members[name[: -len("json")] + "jpg"]
    return index, metas


def i2d_rows(shard: int, n: int) -> list[dict]:
    rows = [
        {
            "url": f"https://example.org/{shard}/{i}.jpg",
            "caption": f"picture {i} of shard {shard}",
            "license": "CC-BY-4.0",
        }
        for i in range(n)
    ]
    rows[1] = {"url": rows[1]["url"], "status": "failed_to_download", "error_message": "HTTP Error 404: Not Found"}
    return rows


@pytest.mark.slow
def test_example_webdataset_recipe_releases_img2dataset_output_and_ingests_new_shards(tmp_path, prefect_api_url):
    shards = tmp_path / "webdataset"
    shards.mkdir()
    for shard in range(2):
        img2dataset_shard(shards, shard, i2d_rows(shard, 10))
    recipe = ROOT / "recipes" / "example-webdataset.yaml"
    first = cli("run", str(recipe), example_dir=tmp_path, api_url=prefect_api_url)
    assert first.returncode == 0, first.stderr[-3000:]
    out = phases(tmp_path / "store", "example-webdataset")
    assert (out["download"]["rows"], out["download"]["ok"]) == (20, 18)
    assert out["download"]["by_reason"] == {"upstream_failed": 2} and out["download"]["gate"]["success"]
    images: dict = {}
    index, metas = released_samples(tmp_path / "store", "example-webdataset", images)
    assert sum(s["samples"] for s in index["shards"]) == 18 == len(metas)
    # validate.image.skip_reencode: the released images are img2dataset's bytes, not re-encoded.
    assert images["000010002"] == distinct_image(10_000 + 2) and images["000000000"] == distinct_image(0)
    # Every released sample says where it came from: the input shard and its member key.
    origins = sorted((Path(m["origin"]["shard"]).name, m["origin"]["key"]) for m in metas)
    assert origins[0] == ("00000.tar", "000000000") and len(set(origins)) == 18
    assert all(m["upstream_row"]["status"] == "success" and m["url"].startswith("https://example.org/") for m in metas)

    # A shard added later: ingested by the next run, the others skipped, a new release.
    img2dataset_shard(shards, 2, i2d_rows(2, 10))
    second = cli("run", str(recipe), example_dir=tmp_path, api_url=prefect_api_url)
    assert second.returncode == 0, second.stderr[-3000:]
    out = phases(tmp_path / "store", "example-webdataset")
    assert out["summary"]["shards"] == 3 and out["summary"]["shards_skipped"] == 2
    assert (out["download"]["rows"], out["download"]["ok"]) == (30, 27)
    index, metas = released_samples(tmp_path / "store", "example-webdataset")
    assert len(metas) == 27 and {Path(m["origin"]["shard"]).name for m in metas} == {
        "00000.tar",
        "00001.tar",
        "00002.tar",
    }


@pytest.mark.slow
def test_example_parquet_recipe_releases_embedded_images(tmp_path, prefect_api_url):
    folder = tmp_path / "parquet"
    folder.mkdir()
    bad = [
        {
            "id": "path-only",
            "image": {"bytes": None, "path": "x.jpg"},
            "caption": "an image kept elsewhere",
            "license": "CC0-1.0",
            "author": "z",
        }
    ]
    images_parquet(folder / "train-00000-of-00002.parquet", 10, struct=True, extra_rows=bad)
    images_parquet(folder / "train-00001-of-00002.parquet", 6, struct=True)
    run = cli("run", str(ROOT / "recipes" / "example-parquet.yaml"), example_dir=tmp_path, api_url=prefect_api_url)
    assert run.returncode == 0, run.stderr[-3000:]
    out = phases(tmp_path / "store", "example-parquet")
    assert out["download"]["rows"] == 17 and out["download"]["by_reason"] == {"incomplete_sample": 1}
    assert out["summary"]["shards"] == 3  # 11 rows in chunks of 8, and 6
    index, metas = released_samples(tmp_path / "store", "example-parquet")
    # Both files start from the same seeds: the second file's six are exact duplicates of the first's.
    assert out["validate"]["ok"] == 10 and len(out["validate"]["by_reason"]) == 6
    assert all(reason.startswith("duplicate_of:hf-") for reason in out["validate"]["by_reason"])
    assert len(metas) == sum(s["samples"] for s in index["shards"]) == 10
    for m in metas:
        assert Path(m["origin"]["file"]).name.startswith("train-0000") and isinstance(m["origin"]["row"], int)
        assert m["id"].startswith("img-") and m["author"].startswith("author ")
