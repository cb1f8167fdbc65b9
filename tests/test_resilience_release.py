"""Release safety: reconciliation as a gate with each violation planted, and readers that follow LATEST."""

from __future__ import annotations

import hashlib
import json
import threading

import pyarrow as pa
import pytest

from tasks.audit.reconcile import Reconciliation, release_gate


def ledger(rows: list[tuple[str, int, str]]) -> pa.Table:
    return pa.table(
        {
            "key": [f"{s}-{r:09d}" for s, r, _ in rows],
            "source": [s for s, _, _ in rows],
            "row": [r for _, r, _ in rows],
            "status": [st for _, _, st in rows],
            "reason": [None if st == "ok" else f"planted_{st}" for _, _, st in rows],
        }
    )


# Two sources, two ledgers each (as per-shard ledgers arrive), and the released samples.
CLEAN = [
    ledger([("a", 0, "ok"), ("a", 1, "rejected"), ("a", 2, "ok")]),
    ledger([("a", 3, "error"), ("a", 4, "ok")]),
    ledger([("b", 0, "ok"), ("b", 1, "rejected")]),
]
OUTPUTS = pa.table({"source": ["a", "a", "a", "b"], "row": [0, 2, 4, 0]})


def gate(ledgers: list[pa.Table], outputs: pa.Table = OUTPUTS, rows_in: int = 7):
    tally = Reconciliation(rows_in)
    for t in ledgers:
        tally.add_ledger(t)
    tally.add_outputs(outputs)
    return release_gate(tally)


def failed(result) -> dict[str, object]:
    return {o.name: o.observed for o in result.outcomes if not o.success}


def test_clean_ledgers_reconcile():
    result = gate(CLEAN)
    assert result.success, result.failure_message()
    s = result.statistics
    assert (s["rows_in"], s["ok"], s["rejected"], s["error"], s["outputs"]) == (7, 4, 2, 1, 4)


def test_a_lost_row_fails_rows_in_equals_ok_plus_rejected_plus_error():
    result = gate([CLEAN[0], CLEAN[1].slice(1), CLEAN[2]])  # a-3 (an error row) has no ledger row
    assert failed(result) == {"rows in = ok + rejected + error": 6}
    assert "expected == 7 rows (observed 6)" in result.failure_message()


def test_a_duplicate_row_fails_and_is_named():
    result = gate([*CLEAN, ledger([("b", 1, "error")])], rows_in=7)  # b-1 twice, across ledgers
    assert set(failed(result)) == {"no duplicate ledger rows"}
    assert failed(result)["no duplicate ledger rows"]["examples"] == ["b-000000001"]
    within = gate([CLEAN[0], ledger([("a", 3, "error"), ("a", 3, "error"), ("a", 4, "ok")]), CLEAN[2]])
    assert failed(within)["no duplicate ledger rows"]["examples"] == ["a-000000003"]


def test_an_output_without_a_ledger_row_fails_and_is_named():
    orphan = pa.concat_tables([OUTPUTS, pa.table({"source": ["b"], "row": [7]})])
    result = gate(CLEAN, orphan)
    assert failed(result)["no output without a ledger row"] == {
        "unexpected_count": 1,
        "element_count": 5,
        "examples": ["b-000000007"],
    }
    # Released although its ledger row says rejected: no ok row, so an orphan too.
    rejected = gate(CLEAN, pa.concat_tables([OUTPUTS, pa.table({"source": ["a"], "row": [1]})]))
    assert failed(rejected)["no output without a ledger row"]["examples"] == ["a-000000001"]


def test_an_ok_row_never_released_and_an_output_released_twice_fail():
    result = gate(CLEAN, OUTPUTS.slice(1))
    assert failed(result)["every ok row released"]["examples"] == ["a-000000000"]
    twice = gate(CLEAN, pa.concat_tables([OUTPUTS, OUTPUTS.slice(3)]))
    assert failed(twice)["no output twice"]["examples"] == ["b-000000000"]


def test_an_unknown_status_fails():
    result = gate([CLEAN[0], ledger([("a", 3, "skipped"), ("a", 4, "ok")]), CLEAN[2]])
    assert set(failed(result)) == {"every status ok, rejected or error", "rows in = ok + rejected + error"}


# reconcile is called here outside a flow run (the release flow calls it inside one), and it
# publishes the run's record as Prefect artifacts, which Prefect warns of outside a run.
@pytest.mark.filterwarnings("ignore:Artifact creation outside of a flow or task run:FutureWarning")
def test_a_failed_reconciliation_blocks_the_release_and_says_why(tmp_path, prefect_harness):
    from flows.audit import GateFailed, new_run
    from flows.release import Unreconciled, reconcile
    from tasks.formats.recipe import Recipe
    from tasks.formats.storage import Storage

    recipe = Recipe.model_validate(
        {"dataset": "ds", "storage": str(tmp_path), "sources": [{"name": "a", "manifest": str(tmp_path / "m.csv")}]}
    )
    run = new_run(recipe, "r1")
    storage = Storage(str(tmp_path))
    planted = pa.concat_tables([*CLEAN, ledger([("a", 1, "rejected")])])
    with pytest.raises(Unreconciled, match="no duplicate ledger rows.*a-000000001") as err:
        reconcile(storage, recipe, run, planted, OUTPUTS, 7)
    assert isinstance(err.value, GateFailed)  # the CLI reports it like any failed gate
    saved = json.loads((tmp_path / "ds" / "reports" / "r1" / "gates" / "release.json").read_text())
    assert saved["success"] is False and "no duplicate ledger rows" in saved["message"]
    assert (
        "no duplicate ledger rows"
        in json.loads((tmp_path / "ds" / "reports" / "r1" / "run.json").read_text())["blocked"]
    )
    entry, after = reconcile(storage, recipe, new_run(recipe, "r2"), pa.concat_tables(CLEAN), OUTPUTS, 7)
    assert entry["success"] is True
    # The run gains its release phase: the report's phase table ends with it.
    assert after.phases[-1].phase == "release" and after.phases[-1].rows == 7


def test_reconciliation_memory_is_flags_not_keys():
    tally = Reconciliation(1_000_000)
    rows = pa.array(range(1_000_000), pa.int64())
    tally.add_ledger(
        pa.table(
            {
                "key": pa.nulls(1_000_000, pa.string()),
                "source": pa.array(["a"] * 1_000_000),
                "row": rows,
                "status": pa.array(["ok"] * 1_000_000),
            }
        )
    )
    assert sum(f.nbytes for f in tally._seen.values()) <= 2 * 1_000_000  # a byte a row at most
    assert tally.summary()["accounted"] == 1_000_000 and tally.duplicates == 0


# --- readers following LATEST while releases are written ------------------------------------------


class LatestFollower(threading.Thread):
    """Polls LATEST as a training job would and checks that what it points at is whole."""

    def __init__(self, store):
        super().__init__(daemon=True)
        self.store = store
        self.stop = threading.Event()
        self.seen: dict[str, int] = {}
        self.problems: list[str] = []

    def run(self) -> None:
        import pyarrow.parquet as pq

        from tasks.formats.storage import Storage
        from tasks.stages.release import list_versions

        releases = self.store / "kills" / "releases"
        storage = Storage(str(self.store))
        while not self.stop.is_set():
            try:
                latest = (releases / "LATEST").read_text().strip()
            except FileNotFoundError:
                latest = None
            committed = list_versions(storage, "kills")
            if latest is None:
                self.stop.wait(0.05)
                continue
            base = releases / latest
            try:
                index = json.loads((base / "index.json").read_text())
                for s in index["shards"]:
                    if hashlib.sha256((base / s["name"]).read_bytes()).hexdigest() != s["sha256"]:
                        self.problems.append(f"{latest}/{s['name']}: sha256 differs from index.json")
                n = pq.read_table(base / "samples.parquet").num_rows
                if (
                    n != index["totals"]["samples"]
                    or pq.read_table(base / "ledger.parquet").num_rows != index["ledger"]["rows"]
                ):
                    self.problems.append(f"{latest}: tables disagree with index.json")
                if latest not in committed:
                    self.problems.append(f"LATEST names {latest}, which list_versions does not list")
            except (OSError, ValueError, KeyError) as err:
                self.problems.append(f"{latest}: {type(err).__name__}: {err}")
            self.seen[latest] = self.seen.get(latest, 0) + 1


@pytest.mark.slow
def test_a_reader_following_latest_never_sees_a_partial_release(tmp_path, prefect_harness, shared_cluster):
    from test_resilience_kill import write_corpus

    from flows.pretraining import pretraining_flow

    server, recipe = write_corpus(tmp_path / "corpus")
    store = tmp_path / "store"
    reader = LatestFollower(store)
    reader.start()
    try:
        pretraining_flow(recipe_path=str(recipe), storage=str(store))
        # A second release (other shard sizes) replaces the first while the reader reads.
        pretraining_flow(recipe_path=str(recipe), storage=str(store), overrides={"reshard.samples_per_shard": 2})
    finally:
        reader.stop.set()
        reader.join(timeout=30)
        server.stop()
    assert reader.problems == []
    assert set(reader.seen) == {"v0001", "v0002"} and min(reader.seen.values()) >= 1
    index = json.loads((store / "kills" / "releases" / "v0002" / "index.json").read_text())
    assert index["parent"] == "v0001" and index["gates"]["release"]["success"] is True
