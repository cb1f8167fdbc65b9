"""`shardsmith demo --examples`: the example recipes, runnable by a newcomer, each to a release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_example_recipe_runs_to_a_release_on_inputs_made_from_the_demo(tmp_path, prefect_api_url):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_") or k == "SHARDSMITH_WARM"}
    env["PREFECT_API_URL"] = prefect_api_url
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "demo",
            "--examples",
            "--dir",
            str(tmp_path / "demo"),
            "--images",
            "60",
            "--workers",
            "1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    store = tmp_path / "demo" / "examples" / "store"
    recipes = sorted(p.stem for p in (ROOT / "recipes").glob("example-*.yaml"))
    assert recipes == ["example-parquet", "example-webdataset"]
    for name in recipes:
        base = store / name / "releases"
        version = (base / "LATEST").read_text().strip()
        index = json.loads((base / version / "index.json").read_text())
        assert index["totals"]["samples"] > 0 and index["shards"]
        assert f"{name}.yaml: {version} at {base / version}" in out.stdout
    # img2dataset's failed rows are ledger rows of their own.
    ledger = json.loads((store / "example-webdataset" / "releases" / "v0001" / "run.json").read_text())
    download = next(p for p in ledger["phases"] if p["phase"] == "download")
    assert download["by_reason"].get("upstream_failed") == 2
