"""The report page of a run is written once its last phase ends, and also when a later phase stops it on an error."""

from __future__ import annotations

import json

import pytest

from tasks.formats.faults import FAULT_ENV


def _recipe(tmp_path, web):
    from tasks.formats.recipe import Recipe

    manifest = tmp_path / "m.csv"
    names = ["photo.jpg", "a.jpg", "b.png"]
    manifest.write_text(
        "url,caption,license\n" + "".join(f"{web.base_url}/img/{n},picture {i},CC0-1.0\n" for i, n in enumerate(names))
    )
    return Recipe.model_validate(
        {
            "dataset": "ds",
            "storage": str(tmp_path / "store"),
            "sources": [{"name": "web", "manifest": str(manifest)}],
            "download": {"retries": 0, "network": {"allowed_networks": ["127.0.0.1/32"], "any_port": True}},
            "validate": {
                "license": {"review": {"reviewed_by": "tests", "reviewed_on": "2026-12-01"}},
                "image": {"min_side": 8},
            },
            "execution": {"workers": 1, "task_retries": 0},
        }
    )


def _run_folder(tmp_path):
    (folder,) = (tmp_path / "store" / "ds" / "reports").iterdir()
    return folder


def test_the_page_shows_every_phase_of_a_finished_run(tmp_path, web, prefect_harness):
    from flows.pretraining import run_phases

    run_phases(_recipe(tmp_path, web), ["download", "validate", "reshard"])
    folder = _run_folder(tmp_path)
    run = json.loads((folder / "run.json").read_text())
    assert [p["phase"] for p in run["phases"]] == ["download", "validate", "reshard"]
    page = (folder / "report.html").read_text()
    assert all(f">{name}<" in page for name in ("download", "validate", "reshard"))


def test_a_run_stopped_by_an_error_after_intermediate_phases_still_leaves_its_page(
    tmp_path, web, prefect_harness, monkeypatch
):
    from flows.pretraining import run_phases

    monkeypatch.setenv(FAULT_ENV, "enospc:write:ds/reshard/*")  # the reshard's outputs: after validate
    with pytest.raises(Exception) as err:
        run_phases(_recipe(tmp_path, web), ["download", "validate", "reshard"])
    assert "GateFailed" not in type(err.value).__name__
    folder = _run_folder(tmp_path)
    run = json.loads((folder / "run.json").read_text())
    assert [p["phase"] for p in run["phases"]] == ["download", "validate"]
    page = (folder / "report.html").read_text()
    assert ">validate<" in page


def test_a_gate_that_fails_before_the_last_phase_publishes_the_whole_page(tmp_path, web, prefect_harness):
    from flows.audit import GateFailed
    from flows.pretraining import run_phases

    recipe = _recipe(tmp_path, web)
    strict = recipe.model_copy(
        update={
            "validate_": recipe.validate_.model_copy(
                update={"license": recipe.validate_.license.model_copy(update={"allow": ("MIT",)})}
            )
        }
    )
    with pytest.raises(GateFailed, match="validate gate failed"):
        run_phases(strict, ["download", "validate", "reshard"])
    folder = _run_folder(tmp_path)
    run = json.loads((folder / "run.json").read_text())
    assert run["blocked"] and [p["phase"] for p in run["phases"]] == ["download", "validate"]
    assert "BLOCKED" in (folder / "report.html").read_text()
