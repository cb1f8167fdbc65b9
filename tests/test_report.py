"""The audit report: numbers in the right cells, escaped data, nothing external, a text twin."""

from __future__ import annotations

import io
import re
from html.parser import HTMLParser

import numpy as np
import pyarrow as pa
import pytest

from tasks.audit.report import load_run, render_html, summary_text, write_report
from tasks.audit.report_views import BLOCKED, IN_PROGRESS, PASSED, group_reasons, reason_group
from tasks.formats.reasons import REASONS
from tasks.formats.storage import Storage

HOSTILE = '<script>alert("x")</script>'


def jpeg(color=(200, 40, 40), size=(16, 12)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG", quality=70)
    return buf.getvalue()


def make_run(blocked: str | None = None) -> dict:
    return {
        "dataset": "demo",
        "run": "20261130T060139Z-050cd4ea",
        "recipe_hash": "3f9a0c1d",
        "started": "2026-11-30T06:01:39+00:00",
        "finished": "2026-11-30T06:03:04+00:00",
        "phases": [
            {
                "phase": "download",
                "rows": 306,
                "ok": 298,
                "rejected": 7,
                "error": 1,
                "by_reason": {"too_large": 4, "not_an_image": 3, "http_404": 1},
                "by_source": {
                    "photos": {"rows": 200, "ok": 196, "rejected": 4, "error": 0},
                    "art": {"rows": 106, "ok": 102, "rejected": 3, "error": 1},
                },
                "seconds": 12.3,
                "samples_per_s": 24.2,
                "gate": {
                    "phase": "download",
                    "success": True,
                    "outcomes": [
                        {
                            "name": "success rate >= 0.5",
                            "expectation": "expect_column_values_to_be_in_set",
                            "column": "status",
                            "threshold": ">= 0.5",
                            "observed": 0.97,
                            "success": True,
                        }
                    ],
                },
                "links": {"data_docs": "gates/data_docs/index.html", "json": "gates/download.json"},
            },
            {
                "phase": "validate",
                "rows": 298,
                "ok": 280,
                "rejected": 18,
                "error": 0,
                # duplicate_of:<key> carries a payload; it must be counted as one group (5 + 6).
                "by_reason": {
                    "duplicate_of:photos-000001": 5,
                    "duplicate_of:art-000007": 6,
                    "made_up_reason": 6,
                    HOSTILE: 1,
                },
                "by_license": {"CC-BY-4.0": 120, "CC0-1.0": 160},
                "seconds": 3.0,
                "samples_per_s": 93.3,
                "gate": {
                    "phase": "validate",
                    "success": False,
                    "outcomes": [
                        {
                            "name": "accept rate >= 0.99",
                            "expectation": "expect_column_values_to_be_in_set",
                            "column": "status",
                            "threshold": ">= 0.99",
                            "observed": 0.9396,
                            "success": False,
                        },
                        {
                            "name": "width >= 64",
                            "expectation": "expect_column_values_to_be_between",
                            "column": "width",
                            "threshold": "min 64",
                            "observed": 64,
                            "success": True,
                        },
                    ],
                },
                "links": {
                    "data_docs": "gates/data_docs/index.html",
                    "json": "gates/validate.json",
                    "evil": "javascript:alert(1)",
                },
            },
        ],
        "blocked": blocked,
    }


# ok samples: known widths (one null), heights, aspects, caption lengths.
OK_WIDTHS = [64, 128, 256, 256, 512, 640, 800, 1024, None, 2048]


def make_samples() -> pa.Table:
    rows = []
    for i, w in enumerate(OK_WIDTHS):
        h = 100 + 10 * i
        rows.append(
            {
                "key": f"photos-{i:06d}",
                "source": "photos",
                "status": "ok",
                "reason": None,
                "license": "CC0-1.0",
                "width": w,
                "height": h,
                "aspect": (w / h) if w else None,
                "caption_chars": 10 * i,
                "bytes": 1000 + i,
                "caption": f"a photo {i}",
                "thumbnail": None,
            }
        )
    # 5 duplicates with thumbnails (two different payloads), 1 low_resolution with one, 1 hostile without.
    for i in range(5):
        rows.append(
            {
                "key": f"art-{i:06d}",
                "source": "art",
                "status": "rejected",
                "reason": f"duplicate_of:photos-00000{i % 2}",
                "license": "CC-BY-4.0",
                "width": 99,
                "height": 99,
                "aspect": 1.0,
                "caption_chars": 3,
                "bytes": 50,
                "caption": HOSTILE if i == 0 else "dup",
                "thumbnail": jpeg((10 * i, 20, 30)),
            }
        )
    rows.append(
        {
            "key": "art-000100",
            "source": "art",
            "status": "rejected",
            "reason": "low_resolution",
            "license": "CC0-1.0",
            "width": 8,
            "height": 8,
            "aspect": 1.0,
            "caption_chars": 4,
            "bytes": 20,
            "caption": "tiny",
            "thumbnail": jpeg(),
        }
    )
    rows.append(
        {
            "key": HOSTILE,
            "source": "art",
            "status": "rejected",
            "reason": HOSTILE,
            "license": None,
            "width": None,
            "height": None,
            "aspect": None,
            "caption_chars": None,
            "bytes": None,
            "caption": None,
            "thumbnail": None,
        }
    )
    schema = pa.schema(
        [
            ("key", pa.string()),
            ("source", pa.string()),
            ("status", pa.string()),
            ("reason", pa.string()),
            ("license", pa.string()),
            ("width", pa.int32()),
            ("height", pa.int32()),
            ("aspect", pa.float64()),
            ("caption_chars", pa.int32()),
            ("bytes", pa.int64()),
            ("caption", pa.string()),
            ("thumbnail", pa.binary()),
        ]
    )
    return pa.Table.from_pylist(rows, schema=schema)


class Page(HTMLParser):
    """Collects table cells by (table, phase, row key, column), attributes, figures and bars."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.cells: dict[tuple[str, str, str, str], dict] = {}
        self.urls: list[str] = []
        self.tags: list[tuple[str, dict]] = []
        self._table = ("", "")
        self._row = ""
        self._cell: dict | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        for name in ("src", "href", "xlink:href", "action", "poster"):
            if name in a:
                self.urls.append(a[name])
        if tag == "table":
            self._table = (a.get("data-table", ""), a.get("data-phase", ""))
        elif tag == "tr":
            self._row = a.get("data-key", "")
        elif tag == "td" and "data-col" in a:
            self._cell = {"value": a.get("data-value"), "class": a.get("class", ""), "text": ""}
            self.cells[(*self._table, self._row, a["data-col"])] = self._cell

    def handle_endtag(self, tag):
        if tag == "td":
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data

    def find(self, tag: str, **attrs) -> list[dict]:
        want = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in want.items())]

    def cell(self, table, phase, row, col) -> dict:
        return self.cells[(table, phase, row, col)]


@pytest.fixture(scope="module")
def samples() -> pa.Table:
    return make_samples()


@pytest.fixture(scope="module")
def page_html(samples) -> str:
    return render_html(make_run(), samples, max_thumbnails_per_reason=3)


@pytest.fixture(scope="module")
def page(page_html) -> Page:
    return Page(page_html)


def test_status_counts_land_in_their_cells(page):
    assert page.cell("status", "download", "ok", "count")["value"] == "298"
    assert page.cell("status", "download", "rejected", "count")["value"] == "7"
    assert page.cell("status", "download", "error", "count")["value"] == "1"
    assert page.cell("status", "download", "rows", "count")["text"] == "306"
    assert page.cell("status", "download", "ok", "share")["text"] == "97.4%"
    assert page.cell("status", "validate", "rejected", "count")["value"] == "18"
    assert page.cell("overview", "", "validate", "ok")["value"] == "280"
    assert page.cell("overview", "", "download", "samples_per_s")["text"] == "24.2"


def test_reasons_are_grouped_described_and_sorted(page, page_html):
    assert page.cell("reasons", "download", "too_large", "count")["value"] == "4"
    assert page.cell("reasons", "download", "too_large", "description")["text"] == REASONS["too_large"][1]
    assert page.cell("reasons", "download", "too_large", "status")["text"] == "rejected"
    assert page.cell("reasons", "download", "http_404", "status")["text"] == "error"
    assert "HTTP 404 (Not Found)" in page.cell("reasons", "download", "http_404", "description")["text"]
    # duplicate_of:<key> rows collapse into one group; no per-key rows.
    assert page.cell("reasons", "validate", "duplicate_of", "count")["value"] == "11"
    assert not any(k[2].startswith("duplicate_of:") for k in page.cells)
    # an unknown reason gets a placeholder, not someone else's description
    assert page.cell("reasons", "validate", "made_up_reason", "description")["text"] == "(no description)"
    assert page.cell("reasons", "validate", "made_up_reason", "status")["text"] == ""
    order = [r["data-key"] for r in page.find("tr") if r.get("data-key") in ("too_large", "not_an_image", "http_404")]
    assert order == ["too_large", "not_an_image", "http_404"]
    assert group_reasons({"b": 1, "a": 1, "duplicate_of:x": 1, "duplicate_of:y": 2}) == {
        "duplicate_of": 3,
        "a": 1,
        "b": 1,
    }
    assert reason_group("duplicate_of:a:b") == "duplicate_of"


def test_sources_and_licenses(page):
    assert page.cell("sources", "download", "art", "error")["value"] == "1"
    assert page.cell("sources", "download", "photos", "rows")["value"] == "200"
    assert page.cell("sources", "download", "photos", "ok_share")["text"] == "98.0%"
    assert page.cell("licenses", "validate", "CC0-1.0", "count")["value"] == "160"
    assert page.cell("licenses", "validate", "CC-BY-4.0", "share")["text"] == "42.9%"
    assert ("licenses", "download", "CC0-1.0", "count") not in page.cells  # download has no license counts


def test_gate_outcomes_show_thresholds_and_colour(page):
    row = lambda phase, i, col: page.cell("gate", phase, str(i), col)  # noqa: E731
    assert row("validate", 0, "expectation")["text"] == "expect_column_values_to_be_in_set"
    assert row("validate", 0, "threshold")["text"] == ">= 0.99"
    assert row("validate", 0, "observed")["text"] == "0.94"
    assert row("validate", 0, "result")["text"] == "FAIL"
    assert row("validate", 1, "result")["text"] == "PASS"
    assert row("download", 0, "column")["text"] == "status"
    fail_rows = [a for a in page.find("tr", data_key="0") if a.get("class") == "fail"]
    assert len(fail_rows) == 1
    assert page.find("span", data_gate="validate")[0]["class"] == "fail"
    assert page.find("span", data_gate="download")[0]["class"] == "pass"
    hrefs = [a["href"] for a in page.find("a") if "href" in a and not a["href"].startswith("#")]
    assert hrefs == [
        "gates/data_docs/index.html",
        "gates/download.json",
        "gates/data_docs/index.html",
        "gates/validate.json",
    ]


def test_banner_passed_blocked_and_in_progress(page, samples):
    assert page.find("div", data_verdict=PASSED)
    blocked = render_html(make_run(blocked="validate gate failed: accept rate 0.94 < 0.99 <b>"), samples)
    p = Page(blocked)
    assert p.find("div", data_verdict=BLOCKED) and not p.find("div", data_verdict=PASSED)
    assert "validate gate failed: accept rate 0.94 &lt; 0.99 &lt;b&gt;" in blocked
    running = make_run()
    running["finished"] = None
    running["phases"] = running["phases"][:1]
    assert Page(render_html(running, None)).find("div", data_verdict=IN_PROGRESS)


def test_thumbnails_capped_per_reason(page, page_html):
    dup = page.find("figure", data_reason="duplicate_of")
    assert len(dup) == 3  # 5 carried a thumbnail; the cap is 3
    assert [f["data-key"] for f in dup] == ["art-000000", "art-000001", "art-000002"]
    assert len(page.find("figure", data_reason="low_resolution")) == 1
    group = page.find("div", data_reason="duplicate_of")[0]
    assert (group["data-total"], group["data-shown"]) == ("5", "3")
    imgs = [a["src"] for a in page.find("img")]
    assert len(imgs) == 4 and all(s.startswith("data:image/jpeg;base64,/9j/") for s in imgs)
    assert len(Page(render_html(make_run(), make_samples(), max_thumbnails_per_reason=0)).find("img")) == 0


def test_hostile_data_is_escaped(page_html, samples):
    assert "<script" not in page_html.lower()
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page_html  # reason, key and caption
    run = make_run(blocked=HOSTILE)
    run["dataset"] = HOSTILE
    run["phases"][0]["by_source"][HOSTILE] = {"rows": 1, "ok": 1}
    run["phases"][1]["gate"]["outcomes"][0]["name"] = HOSTILE
    run["phases"][1]["links"]["x" + HOSTILE] = '"><script>'
    out = render_html(run, samples)
    assert "<script" not in out.lower()
    assert "javascript:" not in " ".join(Page(out).urls)


def test_nothing_external(page_html, page):
    assert "http://" not in page_html and "https://" not in page_html
    assert "@import" not in page_html and "url(" not in page_html
    for url in page.urls:
        assert url.startswith(("data:image/", "#")) or re.fullmatch(r"[\w./-]+", url), url
    run = make_run()
    run["phases"] = run["phases"][:1]
    run["phases"][0]["links"] = {
        "a": "https://evil.example/x",
        "b": "//evil.example/x",
        "c": "/etc/passwd",
        "d": "\\\\evil\\x",
    }
    assert [u for u in Page(render_html(run, None)).urls if not u.startswith("#")] == []


def test_histograms_count_accepted_samples(page, samples):
    widths = [w for w in OK_WIDTHS if w is not None]
    hist = page.find("div", data_hist="width")
    assert hist and hist[0]["data-n"] == str(len(widths))
    # the bars of the width histogram (rects follow its div in document order)
    tags = page.tags
    start = tags.index(("div", hist[0]))
    end = tags.index(("div", page.find("div", data_hist="height")[0]))
    bars = [a for t, a in tags[start:end] if t == "rect" and a.get("class") == "bar"]
    assert sum(int(b["data-count"]) for b in bars) == len(widths)
    assert len(bars) == 20
    assert page.cell("hist-stats", "", "width", "p50")["value"] == repr(float(np.percentile(widths, 50)))
    assert page.cell("hist-stats", "", "width", "p5")["text"] == "89.6"  # 64 + 0.4 * (128 - 64)
    assert page.cell("hist-stats", "", "caption_chars", "n")["value"] == "10"
    assert page.find("div", data_hist="aspect")[0]["data-n"] == "9"
    # rejected samples (width 99 and 8) are not counted anywhere
    assert not any(float(b["data-lo"]) <= 8 < float(b["data-hi"]) and b["data-count"] != "0" for b in bars)
    assert len(page.find("line", data_p="50")) == 4  # one median marker per histogram
    for col in ("height", "aspect", "caption_chars"):
        assert page.find("table", data_hist=col)


def test_small_integer_ranges_get_a_bin_per_value():
    t = pa.table({"status": ["ok"] * 4, "reason": pa.array([None] * 4, pa.string()), "width": [3, 3, 5, 7]})
    p = Page(render_html({"dataset": "d", "run": "r", "phases": []}, t))
    bars = [a for t, a in p.tags if t == "rect" and a.get("class") == "bar"]
    assert [(b["data-lo"], b["data-count"]) for b in bars] == [
        ("3", "2"),
        ("4", "0"),
        ("5", "1"),
        ("6", "0"),
        ("7", "1"),
    ]


def test_deterministic(page_html, samples):
    assert render_html(make_run(), samples, max_thumbnails_per_reason=3) == page_html
    assert (
        render_html(make_run(), samples.take(list(range(samples.num_rows))[::-1]), max_thumbnails_per_reason=3)
        == page_html
    )


def test_empty_and_missing_samples_render():
    for s in (None, make_samples().slice(0, 0)):
        out = render_html(make_run(), s)
        assert "No per-sample table" in out and "<img" not in out
    out = render_html({"phases": [{"phase": "download"}]}, None)  # sparse input does not crash
    assert Page(out).cell("status", "download", "rows", "count")["value"] == "0"


def test_summary_text():
    text = summary_text(make_run(blocked="validate gate failed: accept rate 0.94 < 0.99"))
    assert "download: 306 rows, 298 ok, 7 rejected, 1 error (12.3 s, 24.2 samples/s, gate PASS)" in text
    assert "validate: 298 rows, 280 ok, 18 rejected, 0 error (3 s, 93.3 samples/s, gate FAIL)" in text
    lines = text.splitlines()
    reasons = [ln.split() for ln in lines[lines.index("  reasons:") + 1 :][:3]]
    assert reasons == [["4", "too_large"], ["3", "not_an_image"], ["1", "http_404"]]
    assert "    11  duplicate_of" in text
    assert "    PASS  success rate >= 0.5 (status, threshold >= 0.5, observed 0.97)" in lines
    assert "    FAIL  accept rate >= 0.99 (status, threshold >= 0.99, observed 0.94)" in lines
    assert lines.count("  checks:") == 2
    assert lines[-1] == "BLOCKED: validate gate failed: accept rate 0.94 < 0.99"
    assert "status:   BLOCKED: validate gate failed" in text
    assert not re.search(r"[\u2713\u2714\u2717\u2718\u274c\u2705]", text)
    assert "status:   PASSED" in summary_text(make_run())
    hostile = make_run(blocked="gate\x1b[2J failed")
    hostile["phases"][0]["by_reason"] = {"x\x1b]0;owned\x07": 1}
    assert "\x1b" not in summary_text(hostile) and "\x07" not in summary_text(hostile)


def test_write_and_load_round_trip(tmp_path, samples):
    storage = Storage(str(tmp_path))
    rel = "demo/reports/20261130T060139Z-050cd4ea"
    run = make_run(blocked="validate gate failed")
    paths = write_report(storage, rel, run, samples)
    assert paths == {"html": f"{rel}/report.html", "json": f"{rel}/run.json", "samples": f"{rel}/samples.parquet"}
    assert (tmp_path / rel / "report.html").read_text(encoding="utf-8") == render_html(run, samples)
    run2, samples2 = load_run(storage, rel)
    assert run2 == run
    assert samples2.equals(samples)
    assert render_html(run2, samples2) == render_html(run, samples)
    # A later phase writes without samples: the table stays and the page still draws it.
    later = make_run()
    later["phases"].append({"phase": "reshard", "rows": 280, "ok": 280})
    paths = write_report(storage, rel, later, None)
    assert paths["samples"] == f"{rel}/samples.parquet"
    run3, samples3 = load_run(storage, rel)
    assert run3 == later and samples3.equals(samples)
    page = Page((tmp_path / rel / "report.html").read_text(encoding="utf-8"))
    assert page.find("div", data_hist="width")[0]["data-n"] == "9"
    assert len(page.find("figure", data_reason="duplicate_of")) == 5
    assert page.find("section", data_phase="reshard")
    # A run folder without a table says so.
    write_report(storage, "demo/reports/other", make_run(), None)
    assert load_run(storage, "demo/reports/other") == (make_run(), None)


def test_plots_for_the_ui_are_standalone_svg_files(samples):
    import xml.etree.ElementTree as ET

    from tasks.audit.report import plot_svgs

    run = make_run()
    run["phases"][0]["phase"] = HOSTILE
    plots = plot_svgs(run, samples)
    assert list(plots) == [
        "status-script-alert-x-script",
        "status-validate",
        "hist-width",
        "hist-height",
        "hist-aspect",
        "hist-caption_chars",
    ]
    for name, svg in plots.items():
        root = ET.fromstring(svg)  # well-formed on its own: an <img> data: URI shows it
        assert root.tag == "{http://www.w3.org/2000/svg}svg", name
        assert "<script" not in svg
    width = ET.fromstring(plots["hist-width"])
    bars = [e for e in width.iter("{http://www.w3.org/2000/svg}rect") if e.get("class") == "bar"]
    assert sum(int(b.get("data-count")) for b in bars) == 9
    assert plot_svgs({"phases": []}, None) == {}


def test_the_download_summary_says_failed_shards_as_text():
    from tasks.audit.download_summary import DownloadSummary, summary_markdown
    from tasks.formats.ledger import Counts

    failed = ["a/000001: OSError: server said ![t](http://evil.example/t.png) <img src=x>"]
    summary = DownloadSummary("d", "r", "/s", 2, 0, failed, Counts(0, 0, 0, 0, {}, 0), 1.0, 1.0, 1.0)
    item = summary_markdown(summary).split("## Failed shards", 1)[1]
    assert "\\!\\[t\\](http://evil.example/t.png) \\<img src=x\\>" in item
    assert not re.search(r"(?<!\\)(!\[|<img)", item)


def test_run_summary_markdown_escapes_and_counts(samples):
    from tasks.audit.report_markdown import gate_rows, md, reason_rows, run_summary

    assert (
        md("a|b <img src=x onerror=y> [l](javascript:x) `c`\n#")
        == "a\\|b \\<img src=x onerror=y\\> \\[l\\](javascript:x) \\`c\\` \\#"
    )
    run = make_run(blocked="validate gate failed <b>")
    text = run_summary(run, samples, {"audit report": "[report.html](http://127.0.0.1:4280/r.html)"})
    assert "**BLOCKED**: validate gate failed \\<b\\>" in text
    assert "- audit report: [report.html](http://127.0.0.1:4280/r.html)" in text
    # The summary rows: shards are not in run.json, so a record read back says "-".
    assert (
        "| download | 306 | 298 | 7 | 1 | - | 12.3 | 24.2 | PASS |" in text
        and "| validate | 298 | 280 | 18 | 0 | - | 3 | 93.3 | **FAIL** |" in text
    )
    assert "2 of 3 checks passed." in text and "| validate | accept rate \\>= 0.99 | \\>= 0.99 | 0.9396 |" in text
    assert text.count("](data:image/svg+xml;base64,") == 6
    assert "\\<script\\>" in text and not re.search(r"(?<!\\)<script", text)  # the hostile reason, escaped
    assert [(r["phase"], r["reason"], r["rows"]) for r in reason_rows(run)][:4] == [
        ("download", "too_large", 4),
        ("download", "not_an_image", 3),
        ("download", "http_404", 1),
        ("validate", "duplicate_of", 11),
    ]
    assert [g["result"] for g in gate_rows(run)] == ["PASS", "FAIL", "PASS"]


def test_observed_values_read_as_sentences_and_numbers():
    """Great Expectations' raw result ({"element_count": ..., "unexpected_count": ...}) is never
    shown: the report and the terminal say "0 of 306 rows unexpected"."""
    run = make_run()
    run["phases"][0]["gate"]["outcomes"].append(
        {
            "name": "key unique",
            "expectation": "expect_column_values_to_be_unique",
            "column": "key",
            "threshold": "no duplicates",
            "observed": {"element_count": 306, "examples": [], "unexpected_count": 0},
            "success": True,
        }
    )
    html = render_html(run, None)
    text = summary_text(run)
    for out in (html, text):
        assert "0 of 306 rows unexpected" in out
        assert "element_count" not in out and "unexpected_count" not in out


def test_curation_section_shows_scores_deciles_and_duplicate_groups():
    """The curation section as a run with planted copies makes it: each duplicate group shows
    the kept sample first, then each copy with its similarity and its reason."""
    data = {
        "model": "ab" * 32,
        "samples": 3,
        "scores": [
            {
                "name": "alignment",
                "n": 3,
                "mean": 0.3,
                "values": [0.1, 0.3, 0.5],
                "low": 0.2,
                "high": None,
                "rule": "min 0.2",
                "removed": 1,
            },
        ],
        "deciles": {
            "alignment": [
                {"decile": 1, "lo": 0.1, "hi": 0.1, "samples": [{"key": "c", "value": 0.1, "reason": "low_alignment"}]}
            ]
        },
        "groups": [{"kept": "a", "members": [{"key": "b", "similarity": 0.97, "reason": "semantic_duplicate"}]}],
    }
    thumbs = pa.table({"key": ["a", "b"], "caption": ["<b>a red cat</b>", None], "thumbnail": [jpeg(), None]})
    page = render_html(make_run(), None, curation=(data, thumbs))
    group = re.search(r'<div class="dup-group" data-kept="a">(.*?)</div></div>', page, re.S).group(1)
    figs = re.findall(r'<figure class="thumb" data-key="(\w)"(?: data-reason="(\w+)")?', group)
    assert figs == [("a", ""), ("b", "semantic_duplicate")]
    assert "cos 0.97" in group and "&lt;b&gt;a red cat&lt;/b&gt;" in group and "no image" in group
    assert 'data-score="alignment" data-removed="1"' in page and 'data-reason="low_alignment"' in page


@pytest.mark.parametrize(
    ("low", "high"),
    [(0.1, 0.5), (0.45, None), (None, 0.1), (0.5, 0.1), (0.3, 0.31)],
    ids=["at-both-edges", "low-at-the-right-edge", "high-at-the-left-edge", "crossed", "close-together"],
)
def test_a_curation_plot_is_titled_once_and_keeps_its_cut_labels_inside(low, high):
    """The Prefect UI's score plots: "alignment (n=3)", never "(n=3) (n=3)", and each cut's
    label whole inside the SVG however near an edge its cut stands ("low cut 0.45", not "ow cut")."""
    import xml.etree.ElementTree as ET

    from tasks.audit.curation_views import CUT_CHAR_W
    from tasks.audit.report import plot_svgs

    svg_ns = "{http://www.w3.org/2000/svg}"
    score = {"name": "alignment", "n": 3, "mean": 0.3, "values": [0.1, 0.3, 0.5], "rule": "", "removed": 0}
    data = {
        "model": "ab" * 32,
        "samples": 3,
        "scores": [{**score, "low": low, "high": high}],
        "deciles": {},
        "groups": [],
    }
    thumbs = pa.table({"key": pa.array([], pa.string()), "caption": pa.array([], pa.string())})
    thumbs = thumbs.append_column("thumbnail", pa.array([], pa.binary()))
    svg = plot_svgs({"phases": []}, None, curation=(data, thumbs))["curation-alignment"]
    root = ET.fromstring(svg)
    texts = [e.text or "" for e in root.iter(f"{svg_ns}text")]
    assert "alignment (n=3)" in texts and "(n=3) (n=3)" not in svg
    width = float(root.get("width"))
    labels = [e for e in root.iter(f"{svg_ns}text") if e.get("class") == "cut-label"]
    wanted = [f"{side} cut {v:g}" for side, v in (("low", low), ("high", high)) if v is not None]
    assert [e.text for e in labels] == wanted
    spans = []
    for e in labels:
        x, w = float(e.get("x")), CUT_CHAR_W * len(e.text)
        start = x - w if e.get("text-anchor") == "end" else x
        assert 0 <= start and start + w <= width, (e.text, start, width)
        spans.append((float(e.get("y")), start, start + w))
    if len(spans) == 2:  # two labels never overwrite each other
        (y0, a0, b0), (y1, a1, b1) = spans
        assert y0 != y1 or b0 <= a1 or b1 <= a0


def test_privacy_section_counts_outcomes_and_shows_blurred_samples():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, "JPEG")
    thumb = buf.getvalue()
    rows = [  # key, status, reason, faces, personal_data, privacy, thumbnail
        ("a", "ok", None, 0, "", None, None),
        ("b", "ok", None, 2, "email", "blurred,redacted", thumb),
        ("c", "ok", None, 1, "", "blurred,metadata", thumb),
        ("d", "rejected", "face_present", 3, "", None, None),
        ("e", "rejected", "personal_data", 0, "card,phone", None, None),
        ("f", "rejected", "license_missing", None, None, None, None),
    ]
    cols = ["key", "status", "reason", "faces", "personal_data", "privacy", "thumbnail"]
    types = [pa.string(), pa.string(), pa.string(), pa.int32(), pa.string(), pa.string(), pa.binary()]
    table = pa.table({c: pa.array([r[i] for r in rows], t) for i, (c, t) in enumerate(zip(cols, types))})
    page = Page(render_html(make_run(), table, max_thumbnails_per_reason=1))
    got = {k[2]: int(v["value"]) for k, v in page.cells.items() if k[0] == "privacy-outcomes"}
    assert got == {
        "images looked at for faces": 5,
        "with a face": 3,
        "faces found": 6,
        "released blurred": 2,
        "refused: face_present": 1,
        "texts scanned for personal data": 5,
        "with personal data": 2,
        "released redacted": 1,
        "refused: personal_data": 1,
        "released with metadata removed from bytes kept as fetched": 1,
    }
    assert {k[2]: int(v["value"]) for k, v in page.cells.items() if k[0] == "privacy-kinds"} == {
        "card": 1,
        "email": 1,
        "phone": 1,
    }
    assert [f["data-key"] for f in page.find("figure", data_privacy="blurred")] == ["b"]  # capped at 1
    # Without the privacy columns (a run before them), no section.
    assert not Page(render_html(make_run(), table.select(cols[:3]))).find("section", id="privacy")


def test_the_report_shows_no_picture_of_what_upkeep_removed():
    """A sample taken down (or opted out) before the reshard keeps its row in the validation
    figures but loses its thumbnail and keyframe: the release ships the report."""
    from tasks.audit.validate_samples import without_pictures

    samples = pa.table(
        {
            "key": ["a", "b", "c"],
            "status": ["ok", "ok", "rejected"],
            "thumbnail": [b"A", b"B", b"C"],
            "keyframe": [b"a", None, b"c"],
        }
    )
    shown = without_pictures(samples, pa.array(["b", "c", "zz"]))
    assert shown.column("key").to_pylist() == ["a", "b", "c"] and shown.schema == samples.schema
    assert shown.column("thumbnail").to_pylist() == [b"A", None, None]
    assert shown.column("keyframe").to_pylist() == [b"a", None, None]
