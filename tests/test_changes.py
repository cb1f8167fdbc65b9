"""What changed since the last release: every kind of change on hand-made release ledgers, the
gate's bounds, the report's section, the run summary and `shardsmith diff`."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tasks.audit.changes import CATEGORIES, EXAMPLES, Changes, changes, changes_text
from tasks.formats.reasons import UPKEEP_REASONS
from tasks.formats.recipe_upkeep import UpkeepGate

HOSTILE = '<script>alert("x")</script>\x1b[2J'


def ledger(rows: list[tuple], upkeep: bool = False) -> pa.Table:
    """A release ledger in the contract's shape from (source, row, status, reason[, upkeep,
    detail]); keys as sample_key makes them. ``upkeep``: with the two columns a release that
    has upkeep rows has (a row upkeep removed is in phase "upkeep")."""
    cols = ["key", "source", "row", "status", "reason", "phase"] + (["upkeep", "detail"] if upkeep else [])
    data: dict[str, list] = {c: [] for c in cols}
    for source, row, status, reason, *extra in rows:
        data["key"].append(f"{source}-{row:09d}")
        data["source"].append(source)
        data["row"].append(row)
        data["status"].append(status)
        data["reason"].append(reason)
        data["phase"].append("release" if status == "ok" else "upkeep" if reason in UPKEEP_REASONS else "download")
        if upkeep:
            flag, detail = (*extra, None, None)[:2]
            data["upkeep"].append(flag)
            data["detail"].append(detail)
    return pa.table(data, schema=pa.schema([(c, pa.int64() if c == "row" else pa.string()) for c in cols]))


# The last release: 10 rows of source a (8 released), 2 of source b (released).
PREVIOUS = ledger(
    [
        ("a", 0, "ok", None),
        ("a", 1, "error", "http_503"),
        ("a", 2, "error", "timeout"),
        ("a", 3, "ok", None),
        ("a", 4, "ok", None),
        ("a", 5, "ok", None),
        ("a", 6, "ok", None),
        ("a", 7, "ok", None),
        ("a", 8, "ok", None),
        ("a", 9, "ok", None),
        ("b", 0, "ok", None),
        ("b", 1, "ok", None),
    ]
)
# Tonight's: in another order, one row of each kind of change.
CURRENT = ledger(
    [
        ("b", 1, "ok", None, "link_dead", "http_404 on recheck"),  # dead, kept
        ("a", 9, "ok", None, None, None),
        ("a", 1, "ok", None, None, None),  # recovered from http_503
        ("a", 2, "error", "timeout", None, None),  # still failing: no change
        ("a", 0, "rejected", "duplicate_of:b-000000000", None, None),  # newly failed
        ("a", 3, "rejected", "link_dead", None, "http_410"),  # dead, dropped
        ("a", 4, "ok", None, "content_changed", "etag changed"),  # changed, kept
        ("a", 5, "rejected", "opted_out", None, "tdm-reservation: 1"),  # opted out, dropped
        ("a", 6, "rejected", "taken_down", None, "lists/dmca.txt: sha256 ab12"),  # taken down
        # a 7 left the manifest: removed, not in the new ledger
        ("a", 8, "ok", None, None, None),
        ("b", 0, "ok", None, None, None),
        ("c", 0, "ok", None, None, None),  # added
        ("c", 1, "rejected", "http_404", None, None),  # a new row that failed: no change
    ],
    upkeep=True,
)


def keys(c: Changes, name: str) -> list[str]:
    return [e["key"] for e in c.categories[name].examples]


def test_every_kind_of_change_with_its_rows_reasons_and_rates():
    c = changes(PREVIOUS, CURRENT, since="v0003")
    assert list(c.categories) == list(CATEGORIES)
    assert c.since == "v0003" and c.released_before == 10 and c.released_now == 7
    assert c.counts == {
        "recovered": 1,
        "newly_failed": 1,
        "dead": 2,
        "changed": 1,
        "opted_out": 1,
        "taken_down": 1,
        "added": 1,
        "removed": 5,
    }
    assert keys(c, "recovered") == ["a-000000001"]
    # A recovered row's reason is the one it recovered from.
    assert c.categories["recovered"].by_reason == {"http_503": 1}
    assert c.categories["recovered"].examples[0]["reason"] == "http_503"
    # duplicate_of:<key> counts under its family; the example keeps the whole reason.
    assert c.categories["newly_failed"].by_reason == {"duplicate_of": 1}
    assert c.categories["newly_failed"].examples == [
        {"key": "a-000000000", "reason": "duplicate_of:b-000000000", "detail": None}
    ]
    # Dead: one dropped (reason link_dead), one kept (upkeep link_dead), in key order.
    dead = c.categories["dead"]
    assert dead.kept == 1 and dead.by_reason == {"link_dead": 2}
    assert dead.examples == [
        {"key": "a-000000003", "reason": "link_dead", "detail": "http_410"},
        {"key": "b-000000001", "reason": "link_dead", "detail": "http_404 on recheck", "kept": True},
    ]
    assert c.categories["changed"].kept == 1 and keys(c, "changed") == ["a-000000004"]
    assert c.categories["opted_out"].examples[0]["detail"] == "tdm-reservation: 1"
    assert c.categories["taken_down"].examples == [
        {"key": "a-000000006", "reason": "taken_down", "detail": "lists/dmca.txt: sha256 ab12"}
    ]
    assert keys(c, "added") == ["c-000000000"] and c.categories["added"].by_reason == {}
    # Removed: every row released before and not now, whatever the reason, as the new ledger says.
    removed = c.categories["removed"]
    assert removed.by_reason == {
        "duplicate_of": 1,
        "link_dead": 1,
        "not_in_manifest": 1,
        "opted_out": 1,
        "taken_down": 1,
    }
    assert {e["key"]: e["reason"] for e in removed.examples}["a-000000007"] == "not_in_manifest"
    # Rates are shares of the rows the last release released.
    assert c.rate("dead") == 0.2 and c.rate("removed") == 0.5 and c.rate("added") == 0.1
    assert c.text() == (
        "changes since v0003: 1 recovered, 1 newly failed, 2 dead (1 kept), 1 changed (1 kept), "
        "1 opted out, 1 taken down, 1 added, 5 removed"
    )
    # The JSON form is what run.json, the report and `shardsmith diff --json` carry.
    data = json.loads(json.dumps(c.to_json()))
    assert changes_text(data) == c.text()
    assert c.summary() == {"since": "v0003", "released_before": 10, **c.counts}


def test_rows_match_by_source_and_row_not_by_position_or_key():
    before = ledger([("a", 0, "ok", None), ("b", 0, "error", "timeout"), ("a", 1, "ok", None)])
    # The same (source, row) under another key still matches; b's row 0 is not a's row 0.
    after = before.set_column(0, "key", pa.array(["renamed-1", "renamed-2", "renamed-3"])).take([2, 1, 0])
    c = changes(before, after)
    assert not c.any
    swapped = ledger([("a", 0, "error", "timeout"), ("b", 0, "ok", None), ("a", 1, "ok", None)])
    c = changes(before, swapped)
    assert keys(c, "recovered") == ["b-000000000"] and keys(c, "newly_failed") == ["a-000000000"]
    assert c.counts["added"] == 0 and c.counts["removed"] == 1


def test_a_change_counts_once_the_night_it_happens():
    """A row kept with a recheck's flag is not newly dead the next night; dropping it later
    (the recipe's action changed to drop) removes it without counting it dead again; a row
    dropped the night before is not removed again."""
    night1 = ledger([("a", 0, "ok", None, "link_dead", "404"), ("a", 1, "rejected", "taken_down", None, "l: x")], True)
    night2 = ledger([("a", 0, "ok", None, "link_dead", "404"), ("a", 1, "rejected", "taken_down", None, "l: x")], True)
    assert not changes(night1, night2).any
    night3 = ledger(
        [("a", 0, "rejected", "link_dead", None, "404"), ("a", 1, "rejected", "taken_down", None, "l: x")], True
    )
    c = changes(night2, night3)
    assert c.counts["dead"] == 0 and keys(c, "removed") == ["a-000000000"]
    assert c.categories["removed"].by_reason == {"link_dead": 1}


def test_ledgers_without_upkeep_columns_and_a_first_release():
    """Releases made before upkeep have no upkeep or detail column; a first release has no
    earlier one: everything it releases is added, and there are no rates."""
    before = ledger([("a", 0, "ok", None), ("a", 1, "ok", None)])
    after = ledger([("a", 0, "ok", None), ("a", 1, "rejected", "opted_out"), ("a", 2, "ok", None)])
    c = changes(before, after, since="v0001")
    assert c.counts["opted_out"] == 1 and c.counts["added"] == 1 and c.counts["removed"] == 1
    assert c.categories["opted_out"].examples == [{"key": "a-000000001", "reason": "opted_out", "detail": None}]
    # A new row rejected as opted out at its first download is no change to the release.
    newly = ledger([("a", 0, "ok", None), ("a", 1, "ok", None), ("a", 2, "rejected", "opted_out")])
    assert changes(before, newly).counts["opted_out"] == 0
    first = changes(None, after)
    assert first.since is None and first.released_before == 0 and first.counts["added"] == 2
    assert first.rate("added") is None and sum(first.counts.values()) == 2
    empty = changes(before, before.slice(0, 0))
    assert empty.counts["removed"] == 2 and empty.categories["removed"].by_reason == {"not_in_manifest": 2}


def test_examples_are_capped_and_counts_are_whole():
    n = 5000
    before = pa.table(
        {
            "key": [f"a-{i:09d}" for i in range(n)],
            "source": ["a"] * n,
            "row": pa.array(range(n), pa.int64()),
            "status": ["ok"] * n,
            "reason": pa.nulls(n, pa.string()),
        }
    )
    after = before.set_column(3, "status", pa.array(["rejected"] * n)).set_column(
        4, "reason", pa.array([f"duplicate_of:a-{i + 1:09d}" for i in range(n)])
    )
    c = changes(before, after)
    assert c.counts["newly_failed"] == n and c.categories["newly_failed"].by_reason == {"duplicate_of": n}
    assert len(c.categories["newly_failed"].examples) == EXAMPLES
    assert keys(c, "newly_failed") == [f"a-{i:09d}" for i in range(EXAMPLES)]


# --- the gate -----------------------------------------------------------------------------------


def _tally(table: pa.Table):
    from tasks.audit.reconcile import Reconciliation

    tally = Reconciliation(table.num_rows)
    tally.add_ledger(table)
    return tally


def test_a_bound_exceeded_fails_the_release_gate_and_says_which_and_the_rate():
    from tasks.audit.reconcile import release_gate

    c = changes(PREVIOUS, CURRENT, since="v0003")
    bounds = UpkeepGate(max_dead_rate=0.05, max_removed_rate=0.5, max_taken_down_rate=None)
    gate = release_gate(_tally(CURRENT), check_outputs=False, changes=c, bounds=bounds)
    assert not gate.success
    by_name = {o.name: o for o in gate.outcomes}
    dead = by_name["dead rate <= 0.05 (gates.upkeep.max_dead_rate)"]
    assert not dead.success and dead.observed == 0.2 and dead.threshold == "<= 0.05"
    # At the bound passes; unset bounds add no check.
    assert by_name["removed rate <= 0.5 (gates.upkeep.max_removed_rate)"].success
    assert not [o for o in gate.outcomes if "taken down" in o.name]
    assert gate.failure_message() == (
        "release gate failed: dead rate <= 0.05 (gates.upkeep.max_dead_rate) (observed 0.2)"
    )
    assert gate.statistics["changes"]["dead"] == 2
    # Without bounds the gate is the reconciliation alone, as before upkeep came.
    plain = release_gate(_tally(CURRENT), check_outputs=False, changes=c, bounds=UpkeepGate())
    assert plain.success and len(plain.outcomes) == 5
    # A first release has nothing to compare with: a set bound passes, observing nothing.
    first = release_gate(_tally(CURRENT), check_outputs=False, changes=None, bounds=bounds)
    assert first.success and by_name.keys() == {o.name for o in first.outcomes}
    assert all(o.observed is None for o in first.outcomes if o.column and o.column.endswith("_rate"))


# reconcile is called here outside a flow run (the release flow calls it inside one), and it
# publishes the run's record as Prefect artifacts, which Prefect warns of outside a run.
@pytest.mark.filterwarnings("ignore:Artifact creation outside of a flow or task run:FutureWarning")
def test_a_bound_blocks_the_release_with_an_auditable_report(tmp_path, prefect_harness):
    from flows.audit import GateFailed, new_run
    from flows.release import Unreconciled, reconcile
    from tasks.formats.recipe import Recipe
    from tasks.formats.storage import Storage

    recipe = Recipe.model_validate(
        {
            "dataset": "ds",
            "storage": str(tmp_path),
            "sources": [{"name": "a", "manifest": str(tmp_path / "m.csv")}],
            "gates": {"upkeep": {"max_taken_down_rate": 0.0, "max_dead_rate": 0.5}},
        }
    )
    storage = Storage(str(tmp_path))
    c = changes(PREVIOUS, CURRENT, since="v0003")
    run = new_run(recipe, "r1").with_changes(c.to_json())
    with pytest.raises(Unreconciled) as err:
        reconcile(storage, recipe, run, CURRENT, None, CURRENT.num_rows, changes=c)
    assert isinstance(err.value, GateFailed)
    message = str(err.value)
    assert message.startswith("too much changed since the last release; nothing released")
    assert "taken down rate <= 0 (gates.upkeep.max_taken_down_rate) (observed 0.1)" in message
    # The failure message, which the failure alert carries, names the changes.
    assert "changes since v0003: 1 recovered, 1 newly failed, 2 dead (1 kept)" in message
    reports = tmp_path / "ds" / "reports" / "r1"
    saved = json.loads((reports / "gates" / "release.json").read_text())
    assert saved["success"] is False and "max_taken_down_rate" in saved["message"]
    record = json.loads((reports / "run.json").read_text())
    assert "max_taken_down_rate" in record["blocked"] and record["changes"]["categories"]["taken_down"]["count"] == 1
    page = Page((reports / "report.html").read_text())
    assert page.cell("changes", "", "taken_down", "count")["value"] == "1"
    assert page.cell("gate", "release", "6", "result")["text"] == "FAIL"  # after the five reconciliation checks
    assert page.cell("gate", "release", "6", "observed")["text"] == "0.1"


# --- the report, the run summary, the diff --------------------------------------------------------


class Page(HTMLParser):
    """Table cells by (table, phase, row key, column), as tests/test_report.py reads them."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.cells: dict[tuple[str, str, str, str], dict] = {}
        self.ids: list[str] = []
        self._table = ("", "")
        self._row = ""
        self._cell: dict | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "table":
            self._table = (a.get("data-table", ""), a.get("data-phase", ""))
        elif tag == "tr":
            self._row = a.get("data-key", "")
        elif tag == "td" and "data-col" in a:
            self._cell = {"value": a.get("data-value"), "text": ""}
            self.cells[(*self._table, self._row, a["data-col"])] = self._cell

    def handle_endtag(self, tag):
        if tag == "td":
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data

    def cell(self, table, phase, row, col) -> dict:
        return self.cells[(table, phase, row, col)]


def _hostile_changes() -> dict:
    current = CURRENT.set_column(
        CURRENT.column_names.index("detail"),
        "detail",
        pa.array([HOSTILE if r == 6 else d for r, d in zip(CURRENT["row"].to_pylist(), CURRENT["detail"].to_pylist())]),
    )
    current = current.set_column(
        0, "key", pa.array([HOSTILE if k == "c-000000000" else k for k in current["key"].to_pylist()])
    )
    return changes(PREVIOUS, current, since="v0003").to_json()


def test_the_report_has_a_changes_section_with_counts_examples_and_reasons():
    from tasks.audit.report import render_html, summary_text

    run = {"dataset": "ds", "run": "r1", "phases": [], "changes": _hostile_changes()}
    html = render_html(run, None)
    page = Page(html)
    assert "changes" in page.ids
    assert re.search(r"<h2>Changes since the last release \(v0003\)</h2>", html)
    for name, n in {"recovered": 1, "dead": 2, "taken_down": 1, "removed": 5, "changed": 1}.items():
        assert page.cell("changes", "", name, "count")["value"] == str(n)
    assert page.cell("changes", "", "dead", "share")["text"] == "20.00%"
    assert page.cell("changes", "", "dead", "kept")["value"] == "1"
    assert page.cell("changes", "", "recovered", "kept")["text"] == "-"
    assert page.cell("changes", "", "recovered", "reasons")["text"] == "http_503 1"
    assert page.cell("change-examples", "dead", "b-000000001", "detail")["text"] == "http_404 on recheck"
    assert "(kept)" in page.cell("change-examples", "dead", "b-000000001", "reason")["text"]
    assert page.cell("change-examples", "removed", "a-000000007", "reason")["text"] == "not_in_manifest"
    # Keys and details are data: escaped, never markup.
    assert "<script>" not in html
    assert page.cell("change-examples", "added", HOSTILE, "key")["text"] == HOSTILE
    assert page.cell("change-examples", "taken_down", "a-000000006", "detail")["text"] == HOSTILE
    # The terminal's summary (`shardsmith report`) has the line, with no escape sequence.
    text = summary_text(run)
    assert "release:  changes since v0003: 1 recovered" in text and "\x1b" not in text
    # No section for a run that compared no releases (a first release, or none made).
    assert 'id="changes"' not in render_html({"dataset": "ds", "run": "r1", "phases": []}, None)


def test_the_run_summary_in_the_prefect_ui_has_the_counts():
    from tasks.audit.report_markdown import run_summary

    run = {"dataset": "ds", "run": "r1", "phases": [], "changes": _hostile_changes()}
    text = run_summary(run, None, {})
    assert "## Changes since v0003" in text
    assert "| dead links | 2 | 20.00% | 1 | link\\_dead 2 |" in text
    assert "| removed | 5 | 50.00% | - |" in text
    assert "<script>" not in text
    assert "## Changes" not in run_summary({"dataset": "ds", "run": "r1", "phases": []}, None, {})


def _release(root, version: str, table: pa.Table) -> None:
    """A committed release as the diff reads one: index.json, samples.parquet, ledger.parquet."""
    base = root / "ds" / "releases" / version
    base.mkdir(parents=True)
    ok = table.filter(pc.equal(table["status"], "ok"))
    pq.write_table(ok.select(["key", "source", "row"]), base / "samples.parquet")
    pq.write_table(table, base / "ledger.parquet")
    (base / "index.json").write_text(json.dumps({"version": version, "kind": "pretraining"}))
    (root / "ds" / "releases" / "LATEST").write_text(version + "\n")


def test_diff_prints_every_kind_of_change_and_json(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    _release(tmp_path, "v0001", PREVIOUS)
    _release(tmp_path, "v0002", CURRENT)
    out = CliRunner().invoke(app, ["diff", "ds", "v0001", "--storage", str(tmp_path)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    # What it printed before stays: sample keys added and removed, and why.
    assert lines[0] == "ds v0001 -> v0002: samples +2 added, -5 removed, 5 kept"
    assert "  removed  upkeep: taken_down" in out.output
    assert "rows since v0001 (by source and row; shares of the 10 released by v0001):" in out.output
    for label, n in [("recovered", 1), ("newly failed", 1), ("dead links", 2), ("taken down", 1), ("removed", 5)]:
        assert re.search(rf"^  {label} +{n} +", out.output, re.M), label
    assert re.search(r"^  dead links +2 +20\.00%, 1 kept +\(link_dead 2\)$", out.output, re.M)
    assert "      b-000000001  link_dead (kept): http_404 on recheck" in lines
    assert "      a-000000007  not_in_manifest" in lines
    out = CliRunner().invoke(app, ["diff", "ds", "v0001", "v0002", "--storage", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["removed"] == 5 and data["changes"]["categories"]["dead"]["kept"] == 1
    assert {k: v["count"] for k, v in data["changes"]["categories"].items()} == changes(PREVIOUS, CURRENT).counts


# --- through the release flow --------------------------------------------------------------------

E2E_RECIPE = """\
dataset: changes
kind: pretraining
storage: {store}
sources:
  - name: pics
    manifest: {manifest}
    rows_per_shard: 4
download:
  timeout_s: 10
  retries: 0
  network:
    allowed_networks: ["127.0.0.1/32"]
    any_port: true
validate:
  license:
    allow: [CC0-1.0, CC-BY-4.0]
    review: {{reviewed_by: changes tests, reviewed_on: 2026-11-30}}
  image:
    min_side: 16
reshard:
  samples_per_shard: 4
  seed: 5
gates:
  validate: {{max_reject_rate: 0.9}}
"""


@pytest.mark.slow
def test_a_narrower_policy_is_gated_then_released_with_its_changes(tmp_path, prefect_harness, shared_cluster):
    """Three runs of the release flow: a first release (no changes); a narrower license policy
    under a bound on removed rows, blocked with the changes in its report and its message; the
    same policy without the bound, released with the changes in index.json and the report."""
    import csv

    from flows.audit import GateFailed
    from flows.pretraining import pretraining_flow
    from tasks.demo.images import render_image
    from tasks.demo.webserver import ImageWeb

    images = tmp_path / "images"
    images.mkdir()
    rows = []
    for i in range(8):
        name, data, _ = render_image(9, i)
        (images / name).write_bytes(data)
        rows.append((name, "CC0-1.0" if i % 2 else "CC-BY-4.0"))
    server = ImageWeb(images).start()
    manifest = tmp_path / "pics.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["url", "caption", "license"])
        w.writerows([f"{server.base_url}/img/{n}", f"generated picture {i}", lic] for i, (n, lic) in enumerate(rows))
    recipe = tmp_path / "recipe.yaml"
    store = tmp_path / "store"
    recipe.write_text(E2E_RECIPE.format(store=store, manifest=manifest))
    narrower = {"validate.license.allow": ["CC0-1.0"]}
    try:
        first = pretraining_flow(recipe_path=str(recipe))
        with pytest.raises(GateFailed) as blocked:
            pretraining_flow(recipe_path=str(recipe), overrides={**narrower, "gates.upkeep.max_removed_rate": 0.25})
        second = pretraining_flow(recipe_path=str(recipe), overrides=narrower)
    finally:
        server.stop()
    releases = store / "changes" / "releases"
    assert first["release"].version == "v0001" and second["release"].version == "v0002"
    assert "changes" not in json.loads((releases / "v0001" / "index.json").read_text())
    assert "changes" not in json.loads((releases / "v0001" / "run.json").read_text())
    message = str(blocked.value)
    assert "removed rate <= 0.25 (gates.upkeep.max_removed_rate) (observed 0.5)" in message
    assert "changes since v0001: 4 newly failed, 4 removed" in message
    blocked_run = blocked.value.run
    assert blocked_run is not None and blocked_run.changes["categories"]["removed"]["count"] == 4
    index = json.loads((releases / "v0002" / "index.json").read_text())
    assert index["changes"] == {
        "since": "v0001",
        "released_before": 8,
        **{name: 0 for name in CATEGORIES},
        "newly_failed": 4,
        "removed": 4,
    }
    assert index["gates"]["release"]["success"] is True
    page = Page((releases / "v0002" / "report.html").read_text())
    assert page.cell("changes", "", "newly_failed", "count")["value"] == "4"
    assert page.cell("changes", "", "newly_failed", "reasons")["text"] == "license_not_allowed 4"
    # `shardsmith diff` between them says the same.
    from typer.testing import CliRunner

    from cli.main import app

    out = CliRunner().invoke(app, ["diff", "changes", "v0001", "--storage", str(store), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["changes"]["categories"]["removed"]["by_reason"] == {"license_not_allowed": 4}
