"""Great Expectations Data Docs open offline: tables filled in the HTML, no script, no remote asset."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tasks.audit.data_docs import offline_page, save_gate_report
from tasks.audit.gates import download_gate
from tasks.audit.reconcile import Reconciliation, release_gate
from tasks.formats.ledger import LedgerRow, ledger_table
from tasks.formats.recipe_outputs import DownloadGate
from tasks.formats.storage import Storage

REMOTE = re.compile(r"^\s*(?:[a-z][a-z0-9+.-]*:)?//", re.I)  # http://, https://, //host (data: is fine)
CSS_URL = re.compile(r"url\(\s*['\"]?([^'\")]*)", re.I)


class Assets(HTMLParser):
    """Every URL a browser would fetch by itself (scripts, stylesheets, images, fonts, frames),
    every script, and the rows of each table by id."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.fetched: list[str] = []
        self.scripts = 0
        self.rows: dict[str, list[list[str]]] = {}
        self.links: list[str] = []
        self._table: str | None = None
        self._style = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if tag == "link":
            self.fetched.append(a.get("href") or "")
        for name in ("src", "srcset", "poster", "data", "background"):
            if a.get(name):
                self.fetched.append(a[name])
        self.fetched += CSS_URL.findall(a.get("style") or "")
        if tag == "style":
            self._style = True
        if tag == "table":
            self._table = a.get("id") or ""
            self.rows.setdefault(self._table, [])
        elif tag == "tr" and self._table is not None:
            self.rows[self._table].append([])
        elif tag == "a" and a.get("href"):
            self.links.append(a["href"])
            if self._table is not None and self.rows[self._table]:
                self.rows[self._table][-1].append(a["href"])

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None
        if tag == "style":
            self._style = False

    def handle_data(self, data):
        if self._style:
            self.fetched += CSS_URL.findall(data)
            self.fetched += re.findall(r"@import\s+['\"]([^'\"]+)", data)


def ledger(ok: int, failed: int) -> object:
    rows = [LedgerRow(key=f"web-{i:09d}", source="web", row=i) for i in range(ok)]
    rows += [LedgerRow(key=f"web-{i:09d}", source="web", row=i, reason="http_404") for i in range(ok, ok + failed)]
    return ledger_table(rows)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A run's Data Docs after two gates (one failed): the site lists both."""
    root = tmp_path_factory.mktemp("docs")
    storage = Storage(str(root))
    save_gate_report(
        download_gate(ledger(8, 2), 10, DownloadGate(min_success_rate=0.9)), storage, "ds/reports/r1/gates"
    )
    tally = Reconciliation(10)
    tally.add_ledger(ledger(8, 2))
    save_gate_report(release_gate(tally, check_outputs=False), storage, "ds/reports/r1/gates")
    return root / "ds" / "reports" / "r1" / "gates" / "data_docs"


def test_no_page_fetches_anything_remote_or_runs_a_script(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 5  # index, two validation results, their suites
    for page in pages:
        text = page.read_text(encoding="utf-8")
        found = Assets(text)
        assert found.scripts == 0, page
        remote = [u for u in found.fetched if REMOTE.match(u)]
        assert remote == [], (page, remote)
        assert not re.search(r"https?://[^\"'\s]*\.(?:css|js|woff2?|ttf|png|svg|gif)\b", text), page
        assert "Content-Security-Policy" in text and "script-src 'none'" in text
        assert "newsletter" not in text  # GE's marketing footers are gone
        # Relative links point at pages that exist.
        for href in found.links:
            if not REMOTE.match(href) and not href.startswith("#") and not href.startswith("mailto:"):
                assert (page.parent / href.split("#")[0]).resolve().is_file(), (page, href)


def test_index_tables_are_in_the_html(site):
    found = Assets((site / "index.html").read_text(encoding="utf-8"))
    results = next(rows for tid, rows in found.rows.items() if tid.endswith("-1-body-table"))
    suites = next(rows for tid, rows in found.rows.items() if tid.endswith("-2-body-table"))
    body = [r for r in results if r]  # the header row has no links
    assert len(body) == 2
    pages = {h for r in body for h in r if h.startswith("validations/")}
    assert len(pages) == 2 and all((site / p).is_file() for p in pages)
    text = (site / "index.html").read_text(encoding="utf-8")
    # One gate failed (download), one passed (the reconciliation), each shown in its row.
    assert (
        len(re.findall(r'<i class="[^"]*ge-failed-icon', text)) == 1
        and len(re.findall(r'<i class="[^"]*ge-success-icon', text)) == 1
    )
    assert sorted(h for r in suites for h in r) == [
        "expectations/download_ledger.html",
        "expectations/release_reconciliation.html",
    ]


def test_offline_page_leaves_a_page_without_tables_alone_but_strips_its_assets():
    page = (
        '<html><head><link rel="stylesheet" href="https://cdn.example/x.css"><style>a{background:url("//cdn.example/y.png")}</style>'
        '<script src="https://cdn.example/jquery.js"></script></head><body onload="x()"><img src="https://cdn.example/logo.png" alt="">'
        '<table id="t"><tr><td>kept</td></tr></table><script>$("#t").bootstrapTable()</script></body></html>'
    )
    out = offline_page(page, "td{color:red}")
    found = Assets(out)
    assert found.scripts == 0 and [u for u in found.fetched if REMOTE.match(u)] == []
    assert "<td>kept</td>" in out and "td{color:red}" in out and "onload" not in out


def test_a_second_gate_compiles_no_template_again(tmp_path, monkeypatch):
    # GE makes a new jinja environment for every page; its templates are compiled once
    # (tasks/audit/ge_views.py), not on every page of every gate.
    import jinja2

    gate = download_gate(ledger(8, 2), 10, DownloadGate(min_success_rate=0.9))
    save_gate_report(gate, Storage(str(tmp_path / "first")), "ds/reports/r1/gates")
    compiled = []
    compile_ = jinja2.Environment.compile

    def counting(self, source, name=None, filename=None, raw=False, defer_init=False):
        compiled.append(name)
        return compile_(self, source, name, filename, raw, defer_init)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)
    links = save_gate_report(gate, Storage(str(tmp_path / "second")), "ds/reports/r1/gates")
    index = tmp_path / "second" / links["data_docs"]
    assert "download" in index.read_text(encoding="utf-8")  # the pages are there
    assert compiled == []
