"""The download phase end to end under Prefect's real engine on a real Dask LocalCluster."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import pyarrow.parquet as pq

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo.yaml"


def ledgers(root: Path):
    return sorted((root / "store" / "demo" / "download").rglob("*.ledger.parquet"))


def read_api():
    """The download task runs and the artifacts, newest first. The session's API holds every
    test's runs: unfiltered, the default page may end before this test's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
    from prefect.client.schemas.sorting import ArtifactSort, TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="download-")),
            sort=TaskRunSort.EXPECTED_START_TIME_DESC,
            limit=200,
        )
        return runs, client.read_artifacts(sort=ArtifactSort.CREATED_DESC)


def run(recipe_path, **kw):
    from flows.pretraining import pretraining_flow

    return pretraining_flow(recipe_path=str(recipe_path), phases=["download"], workers=2, **kw)


def test_demo_recipe_end_to_end_then_nothing_twice(prefect_harness, shared_cluster, demo, monkeypatch):
    root, server, expected = demo
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    server.reset_stats()
    # Other tests share the session's Prefect API: look only at task runs made from here on.
    started = dt.datetime.now(dt.UTC)

    first = run(RECIPE)["download"]
    c = first.counts
    assert c.rows == expected["rows"]
    assert c.ok == expected["ok"]
    assert c.by_reason == expected["by_reason"]
    assert c.rows == c.ok + c.rejected + c.error
    assert first.shards_failed == [] and first.shards_skipped == 0

    # Every manifest row is exactly one ledger row, keyed (source, row).
    rows = [r for p in ledgers(root) for r in pq.read_table(p).to_pylist()]
    assert len(rows) == expected["rows"]
    assert len({r["key"] for r in rows}) == len(rows)
    assert sum(r["status"] == "ok" for r in rows) == expected["ok"]

    # The report and summary exist where the summary says.
    assert Path(first.report).is_file()
    data = json.loads(Path(first.report).with_suffix(".json").read_text())
    assert data["counts"]["ok"] == expected["ok"]

    assert sum(server.hits.values()) >= expected["ok"]

    # Workers reported their task runs to the flow's API (not to servers of their own), and the
    # progress and summary artifacts are there.
    task_runs, artifacts = read_api()
    shard_runs = [t for t in task_runs if re.fullmatch(r"download-[a-z]+-\d{6}", t.name) and t.created >= started]
    assert len(shard_runs) == first.shards, [(t.name, t.flow_run_id, t.state_type) for t in shard_runs]
    assert {t.state_type.value for t in shard_runs} == {"COMPLETED"}
    # Newest first: other tests' runs of the demo dataset may share this API and these keys.
    by_key: dict = {}
    for a in artifacts:
        by_key.setdefault(a.key, a)
    assert by_key["demo-download-progress"].data == 100.0
    assert f"| {c.rows} | {c.ok} | {c.rejected} | {c.error} |" in by_key["demo-download-summary"].data

    # A rerun of the unchanged recipe downloads nothing.
    server.reset_stats()
    second = run(RECIPE)["download"]
    assert second.shards_skipped == second.shards == first.shards
    assert second.counts == first.counts
    assert sum(server.hits.values()) == 0


def test_appended_rows_download_only_the_new_chunks(prefect_harness, shared_cluster, demo, monkeypatch, tmp_path):
    root, server, expected = demo
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(root))
    run(RECIPE)  # make sure everything is committed first
    photos = root / "manifests" / "photos.csv"
    lines = photos.read_text().splitlines()
    url, rest = lines[1].split(",", 1)
    added = 3
    with photos.open("a") as fh:
        for i in range(added):
            fh.write(f"{url}?copy={i},{rest}\n")
    server.reset_stats()
    result = run(RECIPE)["download"]
    fresh = result.shards - result.shards_skipped
    assert 1 <= fresh <= 2  # the old partial chunk (now longer) and possibly one new chunk
    assert result.counts.rows == expected["rows"] + added
    image_hits = sum(n for path, n in server.hits.items() if path.startswith("/img/"))
    assert 0 < image_hits <= 50 + added  # at most one chunk of the demo recipe plus the new rows
