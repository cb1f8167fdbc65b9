"""A passed gate is reused by a rerun over the same files and settings, and only then."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pytest

from flows.audit import judge_phase
from tasks.audit.gates import download_gate
from tasks.audit.runrecord import RunRecord
from tasks.formats.ledger import write_ledger
from tasks.formats.recipe import load_recipe
from tasks.formats.recipe_outputs import DownloadGate
from tasks.formats.storage import Storage


@pytest.fixture
def setup(tmp_path):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(f"dataset: gc\nstorage: {tmp_path / 'store'}\nsources:\n  - name: a\n    manifest: m.csv\n")
    recipe = load_recipe(recipe_file)
    storage = Storage(recipe.storage)
    ledger = pa.table(
        {
            "key": ["a-0", "a-1"],
            "source": ["a", "a"],
            "row": [0, 1],
            "status": ["ok", "ok"],
            "reason": pa.nulls(2, pa.string()),
        }
    )
    write_ledger(storage, "gc/download/a/000000-x.ledger.parquet", ledger)
    return recipe, storage, ledger


def run(recipe, storage, ledger, name, cfg=DownloadGate(), evaluated=None):
    record = RunRecord(dataset="gc", run=name, recipe_hash="", storage=storage.root, started="")

    def evaluate():
        evaluated.append(name)
        return download_gate(ledger, ledger.num_rows, cfg)

    return judge_phase(
        storage, recipe, record, "download", ["gc/download/a/000000-x.ledger.parquet"], (ledger.num_rows, cfg), evaluate
    )


def test_reused_only_while_files_and_settings_are_the_same(setup):
    recipe, storage, ledger = setup
    evaluated: list[str] = []
    gate, links = run(recipe, storage, ledger, "r1", evaluated=evaluated)
    assert gate.success and evaluated == ["r1"] and links["data_docs"] == "gates/data_docs/index.html"
    # Same files, same thresholds: the verdict of r1, with its Data Docs linked from r2's report.
    gate2, links2 = run(recipe, storage, ledger, "r2", evaluated=evaluated)
    assert evaluated == ["r1"] and gate2.success and gate2.statistics["reused_from"] == "r1"
    assert links2["data_docs"] == "../r1/gates/data_docs/index.html"
    assert os.path.exists(storage.path("gc/reports/r2/gates/download.json"))  # r2's report has the verdict
    assert not os.path.exists(storage.path("gc/reports/r2/gates/data_docs"))  # and points at r1's Data Docs
    # Another threshold: evaluated again.
    run(recipe, storage, ledger, "r3", cfg=DownloadGate(min_success_rate=0.9), evaluated=evaluated)
    assert evaluated == ["r1", "r3"]
    # The ledger committed again (a new file at the same path): evaluated again.
    time.sleep(0.01)
    write_ledger(storage, "gc/download/a/000000-x.ledger.parquet", ledger.slice(0, 1))
    run(recipe, storage, ledger.slice(0, 1), "r4", evaluated=evaluated)
    assert evaluated == ["r1", "r3", "r4"]


def test_failed_gates_are_never_reused(setup):
    recipe, storage, ledger = setup
    failing = ledger.set_column(3, "status", pa.array(["error", "error"]))
    evaluated: list[str] = []
    for name in ("r1", "r2"):
        gate, _ = run(recipe, storage, failing, name, evaluated=evaluated)
        assert not gate.success
    assert evaluated == ["r1", "r2"]
