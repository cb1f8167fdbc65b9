"""The nightly rebuild: every recipe in a folder, failures isolated, one summary of the night."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def test_overrides_map_to_recipe_keys_with_the_recipe_bounds(monkeypatch):
    from pydantic import ValidationError

    from flows.params import RecipeOverrides, recipe_overrides

    monkeypatch.delenv("SHARDSMITH_CLUSTER", raising=False)
    o = RecipeOverrides(
        samples_per_shard=500,
        max_reject_rate=0.2,
        keep_raw=False,
        curate_compute_dtype="fp32",
        privacy_faces="blur",
        extra={"validate.image.min_side": 128},
    )
    assert o.dotted() == {
        "reshard.samples_per_shard": 500,
        "gates.validate.max_reject_rate": 0.2,
        "download.keep_raw": False,
        "curate.compute_dtype": "fp32",
        "privacy.faces.mode": "blur",
        "validate.image.min_side": 128,
    }
    # Dotted keys at the top level, as callers and --set pass them, land in extra.
    assert recipe_overrides({"reshard.seed": 3, "min_samples": 10}, workers=2) == {
        "reshard.seed": 3,
        "gates.validate.min_samples": 10,
        "execution.workers": 2,
    }
    for bad in (
        {"samples_per_shard": 0},
        {"max_reject_rate": 1.5},
        {"download_timeout_s": 0},
        {"curate_compute_dtype": "int8"},
        {"privacy_text": "hide"},
        {"extra": {"Not Dotted": 1}},
        {"unknown": 1},
    ):
        with pytest.raises(ValidationError):
            RecipeOverrides.model_validate(bad)
    # The stack's worker names its Dask scheduler; an explicit parameter still wins.
    monkeypatch.setenv("SHARDSMITH_CLUSTER", "tcp://dask-scheduler:8786")
    assert recipe_overrides(None)["execution.cluster"] == "tcp://dask-scheduler:8786"
    assert recipe_overrides(None, cluster="local")["execution.cluster"] == "local"


def test_unknown_kind_has_no_flow():
    from flows.nightly import dataset_flow
    from tasks.formats.recipe_base import RecipeError

    assert dataset_flow("pretraining").name == "pretraining"
    with pytest.raises(RecipeError):
        dataset_flow("audio")


@pytest.mark.slow
def test_the_nightly_summary_escapes_what_a_failure_quotes():
    """A failure's why can quote third parties' text (a manifest's column names): in the UI's
    markdown it is text, never an image, a link or HTML, and it stays in its cell."""
    from flows.nightly import summary_markdown

    why = "no column 'url' (columns: ![x](http://evil.example/t.png), <img src=x onerror=alert(1)>, a|b\nc)"
    row = {"dataset": "d", "kind": "pretraining", "status": "failed", "version": "", "why": why, "report": ""}
    line = next(x for x in summary_markdown([row]).splitlines() if x.startswith("| d "))
    assert re.search(r"(?<!\\)!\[", line) is None and re.search(r"(?<!\\)<img", line) is None
    assert len(re.split(r"(?<!\\)\|", line)) == 8  # six cells: the pipe in the why is escaped


def test_nightly_rebuild_runs_every_dataset_and_says_why(prefect_harness, shared_cluster, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    from flows.nightly import SUMMARY_KEY, nightly_rebuild
    from tasks.demo.corpus import prepare_demo

    web, expected = prepare_demo(tmp_path / "corpus", n=30, port=0)
    monkeypatch.setenv("SHARDSMITH_DEMO_DIR", str(tmp_path / "corpus"))
    folder = tmp_path / "recipes"
    folder.mkdir()
    demo = yaml.safe_load((RECIPES / "demo.yaml").read_text())
    (folder / "a-good.yaml").write_text(yaml.safe_dump(demo))
    # The demo has bad rows on purpose: a 100 % success threshold blocks this one.
    (folder / "b-blocked.yaml").write_text(
        yaml.safe_dump({**demo, "dataset": "demo-blocked", "gates": {"download": {"min_success_rate": 1.0}}})
    )
    (folder / "c-broken.yaml").write_text(yaml.safe_dump({**demo, "dataset": "demo-broken", "shards_per_night": 3}))
    (folder / "notes.txt").write_text("not a recipe")
    try:
        state = nightly_rebuild(
            recipes_dir=str(folder),
            phases=["download"],
            overrides={"task_retries": 0, "extra": {"execution.workers": 1}},
            return_state=True,
        )
    finally:
        web.stop()

    # Two datasets were not rebuilt, so the night is red; the good one still ran to the end.
    assert state.is_failed() and "2 of 3 datasets" in state.message
    assert list((tmp_path / "corpus" / "store" / "demo" / "download").rglob("*.ledger.parquet"))
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[SUMMARY_KEY, SUMMARY_KEY + "-table"])),
            sort=ArtifactSort.CREATED_DESC,
        )
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    table = json.loads(next(a for a in arts if a.key == SUMMARY_KEY + "-table").data)
    rows = {r["dataset"]: r for r in table}
    assert [r["dataset"] for r in table] == ["demo", "demo-blocked", "demo-broken"]
    assert (
        rows["demo"]["status"] == "done"
        and rows["demo"]["report"].endswith("report.html")
        and rows["demo"]["why"] == ""
    )
    assert rows["demo-blocked"]["status"] == "blocked"
    assert "min_success_rate" in rows["demo-blocked"]["why"] or "success" in rows["demo-blocked"]["why"]
    assert rows["demo-blocked"]["report"].endswith("report.html")
    assert rows["demo-broken"]["status"] == "failed" and "shards_per_night" in rows["demo-broken"]["why"]
    md = next(a for a in arts if a.key == SUMMARY_KEY).data
    assert "1 done, 1 blocked, 1 failed" in md and "**blocked**" in md
    # Every dataset's phases as summary rows, the blocked one's from the record its report shows.
    phases = [line for line in md.splitlines() if line.startswith("| demo")][len(table) :]
    assert [line.split(" | ")[:2] for line in phases] == [["| demo", "download"], ["| demo-blocked", "download"]]
    assert phases[0].endswith(" | PASS |") and phases[1].endswith(" | **FAIL** |")
    # Each dataset that could start ran as its own subflow, named after it.
    assert {r.name for r in subflows} >= {"demo-nightly", "demo-blocked-nightly"}
