"""The run record: typed and frozen, written as run.json always was, and one set of summary rows for every renderer."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tasks.audit.report import load_run, summary_text, write_report
from tasks.audit.report_markdown import run_summary, summary_table
from tasks.audit.runrecord import (
    PhaseRecord,
    ReleaseRecord,
    RunRecord,
    SummaryRow,
    phase_records,
    row_text,
    summary_rows,
)
from tasks.formats.storage import Storage

GATE = {"phase": "download", "success": True, "message": "", "outcomes": [], "statistics": {}}


def download(**extra) -> PhaseRecord:
    return PhaseRecord(
        phase="download",
        rows=10,
        ok=7,
        rejected=2,
        error=1,
        by_reason={"too_large": 2, "http_404": 1},
        by_source={"a": {"rows": 10, "ok": 7, "rejected": 2, "error": 1}},
        by_license={"CC0-1.0": 7},
        seconds=1.5,
        samples_per_s=4.7,
        gate=GATE,
        links={"json": "gates/download.json"},
        shards=3,
        **extra,
    )


def record() -> RunRecord:
    return RunRecord(
        dataset="demo",
        run="20261201T000000Z-abc",
        recipe_hash="f00",
        storage="/data",
        started="2026-12-01T00:00:00+00:00",
        flow_run_id=None,
    )


def legacy_json(phases: list[dict], **top) -> bytes:
    """run.json as the dict-built record wrote it (the format releases already hold)."""
    run = {
        "dataset": "demo",
        "run": "20261201T000000Z-abc",
        "recipe_hash": "f00",
        "storage": "/data",
        "started": "2026-12-01T00:00:00+00:00",
        "finished": None,
        "phases": phases,
        "blocked": None,
        "flow_run_id": None,
        **top,
    }
    return json.dumps(run, indent=2, sort_keys=True, default=str).encode()


LEGACY_PHASE = {
    "phase": "download",
    "rows": 10,
    "ok": 7,
    "rejected": 2,
    "error": 1,
    "by_reason": {"too_large": 2, "http_404": 1},
    "by_source": {"a": {"rows": 10, "ok": 7, "rejected": 2, "error": 1}},
    "by_license": {"CC0-1.0": 7},
    "seconds": 1.5,
    "samples_per_s": 4.7,
    "gate": GATE,
    "links": {"json": "gates/download.json"},
}


def test_run_json_is_what_the_dict_record_wrote(tmp_path):
    storage = Storage(str(tmp_path))
    run = record()
    write_report(storage, "r", run, None)
    assert (tmp_path / "r" / "run.json").read_bytes() == legacy_json([]) + b"\n"
    # A phase (its shards stay in memory), a release, the packing statistics of fine-tuning.
    run = run.with_phase(download(packing={"fill_ratio": 0.9})).with_release(ReleaseRecord("v0001", created=False))
    write_report(storage, "r", run, None)
    expected = legacy_json(
        [{**LEGACY_PHASE, "packing": {"fill_ratio": 0.9}}], release={"version": "v0001", "created": False}
    )
    assert (tmp_path / "r" / "run.json").read_bytes() == expected + b"\n"
    new = ReleaseRecord("v0002", created=True, path="/data/demo/releases/v0002")
    assert new.to_json() == {"version": "v0002", "created": True, "path": "/data/demo/releases/v0002"}


def test_the_record_is_frozen_and_each_step_makes_a_new_one():
    first = record()
    second = first.with_phase(download()).blocked_by("download gate failed").finished_at("2026-12-01T00:01:00+00:00")
    assert first.phases == () and first.blocked is None and first.finished is None
    assert [p.phase for p in second.phases] == ["download"] and second.blocked == "download gate failed"
    with pytest.raises(dataclasses.FrozenInstanceError):
        second.blocked = None  # type: ignore[misc]


def test_summary_rows_are_the_same_from_the_record_and_from_its_json_but_for_shards(tmp_path):
    run = record().with_phase(download()).with_phase(dataclasses.replace(download(), phase="validate", gate=None))
    rows = summary_rows(run)
    assert rows[0] == SummaryRow("download", 3, 10, 7, 2, 1, 4.7, "PASS", 1.5)
    assert rows[1].gate == "none"
    write_report(Storage(str(tmp_path)), "r", run, None)
    back, _ = load_run(Storage(str(tmp_path)), "r")
    assert summary_rows(back) == [dataclasses.replace(r, shards=None) for r in rows]
    assert phase_records(back)[0] == dataclasses.replace(download(), shards=None)


def test_summary_rows_of_hostile_json_read_as_empty():
    rows = summary_rows({"phases": ["x", {"phase": "p", "rows": "many", "seconds": "slow", "gate": [1]}]})
    assert rows == [SummaryRow("p", None, 0, 0, 0, 0, None, "none", None)]


def test_text_and_markdown_format_the_same_rows():
    run = record().with_phase(download())
    line = "download: 10 rows, 7 ok, 2 rejected, 1 error (3 shards, 1.5 s, 4.7 samples/s, gate PASS)"
    assert row_text(summary_rows(run)[0]) == line
    assert line in summary_text(run).splitlines()
    table = "| download | 10 | 7 | 2 | 1 | 3 | 1.5 | 4.7 | PASS |"
    assert table in run_summary(run, None, {}).splitlines()
    failed = dataclasses.replace(summary_rows(run)[0], gate="FAIL", phase="a|b")
    assert summary_table([failed], ["ds"])[-1] == "| ds | a\\|b | 10 | 7 | 2 | 1 | 3 | 1.5 | 4.7 | **FAIL** |"


def test_a_phase_that_did_nothing_now_says_skipped_not_a_rate(tmp_path):
    """A rerun whose shards were all done before has no rate: every summary (the terminal, the
    run's markdown, the phase's Prefect artifact, the HTML report) says "skipped", not "0"."""
    from tasks.audit.phase_markdown import phase_markdown
    from tasks.audit.report import render_html
    from tasks.audit.report_web import Link

    skipped = dataclasses.replace(download(), samples_per_s=0.0, skipped=True)
    run = record().with_phase(skipped)
    (row,) = summary_rows(run)
    assert row.skipped
    assert row_text(row) == "download: 10 rows, 7 ok, 2 rejected, 1 error (3 shards, 1.5 s, skipped, gate PASS)"
    table = "| download | 10 | 7 | 2 | 1 | 3 | 1.5 | skipped | PASS |"
    assert table in run_summary(run, None, {}).splitlines()
    assert table in phase_markdown(run, skipped, Link("/r/report.html", False, "serve it")).splitlines()
    page = render_html(run, None)
    assert '<td class="num" data-col="samples_per_s">skipped</td>' in page
    assert "1.5 s, skipped" in page and "0 samples/s" not in page
    # run.json holds it only when true: a phase that did work is written as it always was.
    assert skipped.to_json()["skipped"] is True and "skipped" not in download().to_json()
    write_report(Storage(str(tmp_path)), "r", run, None)
    back, _ = load_run(Storage(str(tmp_path)), "r")
    assert phase_records(back)[0] == dataclasses.replace(skipped, shards=None)
    # The download phase's own summary, written before its gate.
    from tasks.audit.download_summary import DownloadSummary, summary_markdown
    from tasks.formats.ledger import Counts

    done = DownloadSummary("demo", "r", "/data", 2, 2, [], Counts.zero(), 0.2, 0.0, 0.0)
    assert done.skipped and "| download | 0 | 0 | 0 | 0 | 2 | 0.2 | skipped | not yet |" in summary_markdown(done)
    assert not dataclasses.replace(done, shards_skipped=1).skipped
    # A phase that did work at a rate that rounds to 0 still says 0.
    (slow,) = summary_rows(record().with_phase(dataclasses.replace(download(), samples_per_s=0.0)))
    assert "1.5 s, 0 samples/s" in row_text(slow)
