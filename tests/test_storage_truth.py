"""Storage is the truth: outputs deleted behind the pipeline's back are made again, byte for byte, and
a deleted release is never reported as the latest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"


def _run(**overrides):
    from flows.pretraining import pretraining_flow

    return pretraining_flow(recipe_path=str(RECIPES / "demo.yaml"), workers=2, overrides=overrides or None)


def _digests(base: Path) -> dict[str, str]:
    """sha256 of every shard and latent shard a release's index.json lists, by name."""
    index = json.loads((base / "index.json").read_text())
    names = [s["name"] for s in index["shards"]] + [s["name"] for s in (index.get("precache") or {}).get("shards", [])]
    return {n: hashlib.sha256((base / n).read_bytes()).hexdigest() for n in names}


@pytest.fixture(scope="module")
def released(demo, prefect_harness, dask_address):
    """The demo recipe run to its first release; (demo folder, store, release folder, its digests)."""
    root, _, _ = demo
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDSMITH_DEMO_DIR", str(root))
        mp.setenv("SHARDSMITH_CLUSTER", dask_address)
        out = _run()
    base = Path(out["release"].path)
    return root, root / "store" / "demo", base, _digests(base)


@pytest.fixture
def env(released, dask_address, monkeypatch):
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(released[0]))
    monkeypatch.setenv("SHARDSMITH_CLUSTER", dask_address)
    return released


@pytest.mark.slow
def test_a_deleted_release_is_made_again_under_a_new_number(env):
    from tasks.formats.storage import Storage
    from tasks.stages.release import latest

    root, store, first, digests = env
    shutil.rmtree(first)
    # LATEST still names the deleted release; it is not the latest any more.
    assert (store / "releases" / "LATEST").read_text().strip() == first.name
    assert latest(Storage(str(root / "store")), "demo") is None
    out = _run()
    rel = out["release"]
    assert rel.created and rel.version > first.name  # never the deleted one's number again
    assert (store / "releases" / "LATEST").read_text().strip() == rel.version
    assert _digests(Path(rel.path)) == digests  # the same inputs: the same bytes


@pytest.mark.slow
def test_a_release_missing_a_shard_is_released_again_whole(env):
    _, store, _, digests = env
    head = store / "releases" / (store / "releases" / "LATEST").read_text().strip()
    (head / sorted(digests)[0]).unlink()
    out = _run()
    assert out["release"].created and out["release"].version != head.name
    assert _digests(Path(out["release"].path)) == digests


@pytest.mark.slow
def test_deleted_phase_outputs_are_made_again_and_the_release_stands(env):
    _, store, _, digests = env
    head = (store / "releases" / "LATEST").read_text().strip()
    # Every reshard output, every latent shard, one curated shard and its embeddings, and a
    # download ledger: each made again from what remains.
    reshard = sorted((store / "reshard").rglob("*.tar"))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in reshard}
    for p in reshard + sorted((store / "precache").rglob("*.tar")):
        p.unlink()
    curated = sorted((store / "curate").glob("*/*.tar"))[0]
    curated.unlink()
    # The side shard of the same validated shard: its embeddings are computed again, so the
    # curated shard is made again under a new name (its ledger names the run that embedded).
    source, chunk = curated.parent.name, curated.name.split("-")[0]
    (validated,) = (store / "validate" / source).glob(f"{chunk}-*.ledger.parquet")
    (side,) = (store / "curate" / "embeddings").rglob(validated.name.removesuffix(".ledger.parquet") + "-*.parquet")
    side.unlink()
    ledger = sorted((store / "download").rglob("*.ledger.parquet"))[0]
    ledger.unlink()
    out = _run()
    assert {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((store / "reshard").rglob("*.tar"))
    } == before
    assert side.exists() and ledger.exists()
    # Every curated shard the run names is stored, the deleted one's successor among them.
    assert out["curate"].tars and all((store.parent / t).is_file() for t in out["curate"].tars)
    assert [t for t in out["curate"].tars if t.startswith(f"demo/curate/{source}/{chunk}-")]
    # Only the deleted side shard was embedded again.
    assert 0 < out["curate"].embedded < out["curate"].counts.rows
    # The same content is the latest release already: nothing new is released.
    assert not out["release"].created and out["release"].version == head
    assert _digests(store / "releases" / head) == digests


@pytest.mark.slow
def test_the_cli_says_what_it_repairs_instead_of_up_to_date(env, prefect_api_url):
    root, store, _, _ = env
    cli_env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_") or k == "SHARDSMITH_WARM"}
    cli_env.update(PREFECT_API_URL=prefect_api_url, SHARDSMITH_DEMO_DIR=str(root))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "cli", "run", str(RECIPES / "demo.yaml"), *args],
            cwd=ROOT,
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=900,
        )

    first = cli()  # records what this run left (a run from the flows above recorded it too)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "up to date" in cli().stdout
    head = (store / "releases" / "LATEST").read_text().strip()
    shutil.rmtree(store / "releases" / head)
    again = cli()
    assert again.returncode == 0, again.stderr[-3000:]
    assert "up to date" not in again.stdout
    assert "not all stored" in again.stderr and f"{head}/index.json is missing" in again.stderr
    new = (store / "releases" / "LATEST").read_text().strip()
    assert new != head and (store / "releases" / new / "index.json").is_file()
    # Reshard outputs deleted after the run: `--phase reshard` makes them again.
    for p in (store / "reshard").rglob("*.tar"):
        p.unlink()
    part = cli("--phase", "reshard")
    assert part.returncode == 0 and "up to date" not in part.stdout and "is missing" in part.stderr
    assert list((store / "reshard").rglob("*.tar"))


@pytest.mark.slow
def test_on_s3_a_release_missing_a_shard_is_released_again_whole(
    demo, s3_bucket, prefect_harness, shared_cluster, monkeypatch
):
    import s3fs

    from flows.pretraining import pretraining_flow

    root, _, _ = demo
    bucket, options = s3_bucket
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    overrides = {
        "storage_options.client_kwargs": options["client_kwargs"],
        "storage_options.key": options["key"],
        "storage_options.secret": options["secret"],
        "curate.model": None,
        "precache.image_latents": None,
        "precache.text": None,
        "precache.image_embedding": None,
    }
    run = lambda: pretraining_flow(  # noqa: E731
        recipe_path=str(RECIPES / "demo.yaml"), storage=f"s3://{bucket}/store", workers=2, overrides=overrides
    )
    fs = s3fs.S3FileSystem(**options)
    first = run()["release"]
    base = f"{bucket}/store/demo/releases/{first.version}"
    index = json.loads(fs.cat(f"{base}/index.json"))
    before = {s["name"]: hashlib.sha256(fs.cat(f"{base}/{s['name']}")).hexdigest() for s in index["shards"]}
    fs.rm(f"{base}/{index['shards'][0]['name']}")
    second = run()["release"]
    assert second.created and second.version != first.version
    new = f"{bucket}/store/demo/releases/{second.version}"
    assert {n: hashlib.sha256(fs.cat(f"{new}/{n}")).hexdigest() for n in before} == before
    assert fs.cat(f"{bucket}/store/demo/releases/LATEST").decode().strip() == second.version
