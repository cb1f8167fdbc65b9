"""The run a user starts carries the run's artifacts (summary, plots, reasons, gates, links), kept current."""

from __future__ import annotations

import base64
import json
import re

import pytest

from tasks.audit.runrecord import PhaseRecord, RunRecord


def phase(name: str, rows: int, ok: int, by_reason: dict[str, int], gate_ok: bool = True) -> PhaseRecord:
    return PhaseRecord(
        phase=name,
        rows=rows,
        ok=ok,
        rejected=rows - ok,
        error=0,
        by_reason=by_reason,
        seconds=1.0,
        samples_per_s=10.0,
        links={"data_docs": "gates/data_docs/index.html"},
        shards=2,
        gate={
            "phase": name,
            "success": gate_ok,
            "outcomes": [
                {
                    "name": f"{name} <b>check</b> | x",
                    "expectation": "e",
                    "column": "status",
                    "threshold": ">= 0.5",
                    "observed": 0.9,
                    "success": gate_ok,
                }
            ],
        },
    )


def samples():
    import pyarrow as pa

    return pa.table(
        {
            "key": ["a", "b", "c"],
            "status": ["ok", "ok", "rejected"],
            "reason": [None, None, "image_too_small"],
            "width": [64, 128, 8],
            "height": [64, 96, 8],
        }
    )


@pytest.fixture(scope="module")
def run_ids(prefect_harness, tmp_path_factory):
    """A top-level flow whose two phase subflows publish, as the end-to-end flows do."""
    from prefect import flow
    from prefect.context import FlowRunContext

    from flows.audit import new_run, publish
    from tasks.formats.recipe import load_recipe
    from tasks.formats.storage import Storage

    root = tmp_path_factory.mktemp("art")
    (root / "recipe.yaml").write_text(
        f"dataset: demo\nstorage: {root / 'store'}\nsources:\n  - name: a\n    manifest: {root / 'm.csv'}\n"
    )
    recipe = load_recipe(root / "recipe.yaml")
    storage = Storage(recipe.storage)
    ids: dict[str, str] = {}

    @flow(name="phase-one")
    def one(run: RunRecord) -> RunRecord:
        ids["one"] = str(FlowRunContext.get().flow_run.id)
        run = run.with_phase(phase("validate", 3, 2, {"image_too_small": 1, "duplicate_of:x-1": 0}))
        return publish(storage, recipe, run, samples())[0]

    @flow(name="phase-two")
    def two(run: RunRecord) -> RunRecord:
        ids["two"] = str(FlowRunContext.get().flow_run.id)
        run = run.with_phase(phase("reshard", 2, 2, {}, gate_ok=False)).blocked_by("reshard gate failed")
        return publish(storage, recipe, run)[0]  # no samples: the table of phase one is kept

    @flow(name="shardsmith-demo-test")
    def top() -> RunRecord:
        ids["top"] = str(FlowRunContext.get().flow_run.id)
        run = new_run(recipe, "20261201T000000Z-test")
        return two(one(run))

    record = top()
    return ids, record, storage


def artifacts(flow_run_id: str) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as c:
        found = c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in found}


def test_the_top_level_run_carries_one_current_set(run_ids, monkeypatch):
    ids, record, _ = run_ids
    assert record.flow_run_id == ids["top"] and record.finished and record.blocked == "reshard gate failed"
    top = artifacts(ids["top"])
    assert set(top) == {"demo-summary", "demo-reasons", "demo-gates", "demo-report", "demo-data-docs"}
    summary = top["demo-summary"].data
    # Updated in place after the second phase: both phases, the verdict, the failed check.
    assert "| validate | 3 | 2 | 1 | 0 | 2 | 1 | 10 | PASS |" in summary
    assert "| reshard | 2 | 2 | 0 | 0 | 2 | 1 | 10 | **FAIL** |" in summary
    assert "**BLOCKED**: reshard gate failed" in summary
    assert "1 of 2 checks passed." in summary
    # Hostile-looking text is escaped, not rendered as HTML or as table cells.
    assert "<b>" not in summary and "reshard \\<b\\>check\\</b\\> \\| x" in summary
    # The key plots are in the markdown itself, as SVG images.
    images = re.findall(r"!\[([^\]]*)\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", summary)
    names = [n for n, _ in images]
    assert names == ["status validate", "status reshard", "hist width", "hist height"]
    svg = base64.b64decode(images[2][1]).decode()
    assert svg.startswith("<svg") and 'xmlns="http://www.w3.org/2000/svg"' in svg and 'data-count="1"' in svg
    reasons = json.loads(top["demo-reasons"].data)
    assert reasons == [
        {"phase": "validate", "reason": "image_too_small", "status": "rejected", "rows": 1, "share": 0.3333},
        {"phase": "validate", "reason": "duplicate_of", "status": "rejected", "rows": 0, "share": 0.0},
    ]
    gates = json.loads(top["demo-gates"].data)
    assert [(g["phase"], g["result"]) for g in gates] == [("validate", "PASS"), ("reshard", "FAIL")]


def test_phase_runs_keep_their_own_summary(run_ids):
    ids, *_ = run_ids
    one, two = artifacts(ids["one"]), artifacts(ids["two"])
    assert set(one) == {"demo-validate-summary", "demo-validate-reasons"}
    assert set(two) == {"demo-reshard-summary", "demo-reshard-reasons"}


def test_links_say_how_to_open_the_report(run_ids):
    ids, record, storage = run_ids
    top = artifacts(ids["top"])
    # No report server configured: the path, and how to serve it.
    report = top["demo-report"].data
    assert storage.url(f"demo/reports/{record.run}/report.html") in report
    assert "shardsmith report --serve --storage" in report
    assert "gates/data_docs/index.html" in top["demo-data-docs"].data


def test_the_later_report_keeps_the_samples(run_ids):
    _, record, storage = run_ids
    html = storage.read_bytes(f"demo/reports/{record.run}/report.html").decode()
    assert 'data-hist="width"' in html and "No per-sample table" not in html
    assert 'data-phase="reshard"' in html


def _tables(markdown: str) -> list[list[list[str]]]:
    """Every table of the markdown as a UI renders it (GFM tables): rows of cell texts, header first."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    tables, row, rows = [], None, None
    for t in tokens:
        if t.type == "table_open":
            rows = []
        elif t.type == "tr_open":
            row = []
        elif t.type == "inline" and row is not None:
            row.append(t.content)
        elif t.type == "tr_close" and rows is not None:
            rows.append(row)
            row = None
        elif t.type == "table_close":
            tables.append(rows)
            rows = None
    return tables


def test_every_markdown_artifact_renders_its_tables(run_ids):
    """The summary's phase table had a separator of 10 columns under a header of 9: GFM then
    renders no table at all, only text. Each table must parse with every row as wide as its header."""
    ids, *_ = run_ids
    seen = 0
    for run in ids.values():
        for key, art in artifacts(run).items():
            if art.type != "markdown":
                continue
            lines = [line for line in art.data.splitlines() if line.startswith("|")]
            tables = _tables(art.data)
            assert bool(lines) == bool(tables), f"{key}: table lines that render as text"
            for table in tables:
                assert all(len(r) == len(table[0]) for r in table), f"{key}: ragged table"
                seen += 1
    summary = _tables(artifacts(ids["top"])["demo-summary"].data)[0]
    assert summary[0][:3] == ["phase", "rows", "ok"] and summary[0][-1] == "gate"
    assert [r[0] for r in summary[1:]] == ["validate", "reshard"]
    assert seen >= 3
