"""Inputs people have, through the real flow: a manifest with no rows, a folder of parquet part files."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.audit import GateFailed


def recipe(tmp_path: Path, manifest: Path, rows_per_shard: int = 1000) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(
        f"""dataset: inputs
storage: {tmp_path / "store"}
sources:
  - name: parts
    manifest: {manifest}
    rows_per_shard: {rows_per_shard}
download:
  timeout_s: 10
  retries: 0
  network:
    allowed_networks: ["127.0.0.1/32"]
    any_port: true
validate:
  license:
    review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}
  image: {{min_side: 8}}
execution:
  cluster: local
  workers: 2
"""
    )
    return path


def run(recipe_path: Path, phases: list[str]):
    from flows.pretraining import pretraining_flow

    return pretraining_flow(recipe_path=str(recipe_path), phases=phases, workers=2)


def test_a_manifest_with_no_rows_fails_the_download_gate_with_a_report(prefect_harness, shared_cluster, tmp_path):
    manifest = tmp_path / "empty.csv"
    manifest.write_text("url,caption,license\n")
    with pytest.raises(GateFailed) as err:
        run(recipe(tmp_path, manifest), ["download"])
    message = str(err.value)
    assert "download gate failed" in message and "row count >= 1" in message
    assert "no data rows" in message  # the plan's note says why
    reports = list((tmp_path / "store" / "inputs" / "reports").glob("*/report.html"))
    assert len(reports) == 1
    run_json = json.loads((reports[0].parent / "run.json").read_text())
    assert run_json["blocked"] and run_json["phases"][0]["rows"] == 0


@pytest.fixture
def web(tmp_path):
    """A loopback server of distinct pictures (random noise), so validation keeps every one."""
    import numpy as np
    from PIL import Image

    from tasks.demo.webserver import ImageWeb

    root = tmp_path / "pictures"
    root.mkdir()
    rng = np.random.default_rng(7)
    for i in range(12):
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(root / f"p{i}.png")
    server = ImageWeb(root=root)
    server.start()
    yield server
    server.stop()


def test_a_folder_of_parquet_part_files_is_one_source(prefect_harness, shared_cluster, tmp_path, web):
    # As Spark writes a manifest: part files, a _SUCCESS marker and .crc side files.
    folder = tmp_path / "manifest"
    folder.mkdir()
    sizes = [3, 5, 2]
    row = 0
    for part, n in enumerate(sizes):
        urls = [web.url(f"/img/p{row + i}.png") for i in range(n)]
        table = pa.table({"url": urls, "caption": [f"picture {row + i}" for i in range(n)], "license": ["CC0-1.0"] * n})
        pq.write_table(table, folder / f"part-{part:05d}-7f3a.snappy.parquet")
        (folder / f".part-{part:05d}-7f3a.snappy.parquet.crc").write_bytes(b"crc")
        row += n
    (folder / "_SUCCESS").write_bytes(b"")
    out = run(recipe(tmp_path, folder, rows_per_shard=2), ["download", "validate"])
    dl, val = out["download"], out["validate"]
    assert dl.counts.rows == sum(sizes) and dl.counts.ok == sum(sizes)
    # Chunks never span files: 2 + 3 + 1 shards for files of 3, 5 and 2 rows.
    assert dl.shards == 6
    keys = [r for p in dl.ledgers for r in pq.read_table(tmp_path / "store" / p, columns=["key", "origin"]).to_pylist()]
    assert len({k["key"] for k in keys}) == sum(sizes)
    # Keys carry the file's tag, origins name the part file and its row.
    assert all(k["key"].count("-") == 2 for k in keys)
    assert all(".snappy.parquet:" in k["origin"] for k in keys)
    assert val.counts.rows == sum(sizes) and val.counts.ok == sum(sizes)
    # A rerun with one more part file fetches only the new file's rows.
    web.reset_stats()
    extra = pa.table({"url": [web.url("/img/p11.png")], "caption": ["one more"], "license": ["CC0-1.0"]})
    pq.write_table(extra, folder / "part-00003-7f3a.snappy.parquet")
    again = run(recipe(tmp_path, folder, rows_per_shard=2), ["download"])["download"]
    assert again.counts.rows == sum(sizes) + 1 and again.shards_skipped == 6 and again.shards == 7
    # (and the origin's TDM-Rep policy, asked once per shard: download.respect_tdmrep)
    assert web.stats()["hits"] == {"/img/p11.png": 1, "/.well-known/tdmrep.json": 1}
