"""``download.keep_raw: false`` through the flows and the CLI: the download ledgers and the candidates, no
raw shards; new validation settings fetch again, except chunks that already have their raw shard
(tests/test_onepass.py has the chunk-level test)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "demo.yaml"
LEAN = {"download.keep_raw": False}


def run(store: Path, phases: list[str], **extra):
    from flows.pretraining import pretraining_flow

    return pretraining_flow(
        recipe_path=str(RECIPE), phases=phases, workers=2, storage=str(store), overrides={"extra": extra}
    )


def fetches(server) -> int:
    return sum(server.stats()["hits"].values())


def files(store: Path, pattern: str) -> list[Path]:
    return sorted((store / "demo" / "download").rglob(pattern))


def test_a_lean_dataset_keeps_no_raw_shard_and_fetches_again_only_for_new_settings(
    prefect_harness, shared_cluster, demo, monkeypatch, tmp_path
):
    root, server, expected = demo
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    store = tmp_path / "store"
    out = run(store, ["validate"], **LEAN)
    assert out["download"].counts.rows == expected["rows"] and out["download"].counts.ok == expected["ok"]
    assert out["validate"].counts.rows == expected["ok"] and out["validate"].counts.ok > 0
    # Ledgers for every chunk, no raw shard; the validated shards are there.
    assert files(store, "*.ledger.parquet") and not files(store, "*.tar")
    assert all((store / t).is_file() for t in out["validate"].tars)
    rows = [r for p in files(store, "*.ledger.parquet") for r in pq.read_table(p).to_pylist()]
    assert len(rows) == expected["rows"]
    assert all(r["shard"] is None for r in rows)

    # Nothing changed: nothing fetched.
    before = fetches(server)
    again = run(store, ["validate"], **LEAN)
    assert again["download"].shards_skipped == again["download"].shards
    assert fetches(server) == before
    # New validation settings: without raw shards the rows are fetched again, and judged anew.
    smaller = run(store, ["validate"], **LEAN, **{"validate.image.image_size": 128})
    assert fetches(server) >= before + expected["ok"]
    assert smaller["download"].shards_skipped == 0
    assert smaller["validate"].counts.ok == out["validate"].counts.ok
    assert not files(store, "*.tar")


def test_chunks_downloaded_with_their_raw_shard_are_validated_from_it(
    prefect_harness, shared_cluster, demo, monkeypatch, tmp_path
):
    root, server, _ = demo
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    store = tmp_path / "store"
    first = run(store, ["validate"])
    tars = files(store, "*.tar")
    assert tars
    # keep_raw switched off, with new validation settings: judged from the raw shards kept.
    before = fetches(server)
    lean = run(store, ["validate"], **LEAN, **{"validate.image.image_size": 128})
    assert fetches(server) == before
    assert lean["download"].shards_skipped == lean["download"].shards
    assert sorted(lean["download"].tars) == sorted(first["download"].tars)
    assert lean["validate"].counts.ok == first["validate"].counts.ok
    assert files(store, "*.tar") == tars


def test_the_download_phase_alone_is_refused_without_raw_shards(tmp_path, prefect_harness, monkeypatch):
    from flows.pretraining import pretraining_flow
    from tasks.formats.recipe_base import RecipeError

    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(tmp_path))
    with pytest.raises(RecipeError, match="download.keep_raw is false"):
        pretraining_flow(recipe_path=str(RECIPE), phases=["download"], storage=str(tmp_path), overrides={"extra": LEAN})
    # The CLI says so before it starts anything, and exits 2.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_") or k == "SHARDSMITH_WARM"}
    env["SHARDSMITH_DEMO_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "cli", "run", str(RECIPE), "--phase", "download", "--set", "download.keep_raw=false"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "download.keep_raw is false" in done.stderr and "--phase validate" in done.stderr
    assert not (tmp_path / "store").exists()
