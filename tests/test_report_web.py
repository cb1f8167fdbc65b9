"""Report links a browser opens: the read-only report server, presigned S3 URLs, the CLI's --serve."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tasks.audit.report_web import REPORT_URL_ENV, ReportServer, report_link, safe_rel
from tasks.formats.storage import Storage

PROJECT = Path(__file__).resolve().parent.parent
PAGE = b"<!DOCTYPE html><title>report</title><p>ok</p>\n"


def request(url: str, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """One raw request: the path goes on the wire exactly as given (no client-side cleaning)."""
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest(method, path, skip_host=False, skip_accept_encoding=True)
    conn.endheaders()
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


@pytest.fixture
def store(tmp_path) -> Path:
    """A storage root with one run's reports, a shard that must stay private, and a secret
    next to the root."""
    root = tmp_path / "store"
    run = root / "demo" / "reports" / "20261201T000000Z-abc"
    (run / "gates" / "data_docs").mkdir(parents=True)
    (run / "report.html").write_bytes(PAGE)
    (run / "run.json").write_text('{"run": "x"}')
    (run / "gates" / "data_docs" / "index.html").write_text("<p>docs</p>")
    (root / "demo" / "download").mkdir(parents=True)
    (root / "demo" / "download" / "000000.tar").write_bytes(b"shard bytes")
    (tmp_path / "secret.txt").write_text("secret")
    os.symlink(tmp_path / "secret.txt", run / "leak.txt")
    return root


@pytest.fixture
def served(store):
    server = ReportServer(Storage(str(store))).start()
    yield server.url, store
    server.stop()


def test_safe_rel():
    assert safe_rel("/demo/reports/r/report.html") == "demo/reports/r/report.html"
    assert safe_rel("/demo/reports/r/report.html?x=1#y") == "demo/reports/r/report.html"
    assert safe_rel("/") == "" and safe_rel("/demo/") == "demo"
    for bad in (
        "/demo/reports/../download/000000.tar",
        "/%2e%2e/secret.txt",
        "/demo/reports/r/%2E%2E/%2E%2E/x",
        "/demo/download/000000.tar",
        "/demo/reports/r\\..\\..\\x",
        "/demo/reports/.git/config",
        "/demo/reports/a%00b",
        "/demo/releases/v0001/index.json",
    ):
        assert safe_rel(bad) is None, bad


def test_server_serves_reports_read_only(served):
    url, store = served
    status, headers, body = request(url, "/demo/reports/20261201T000000Z-abc/report.html")
    assert status == 200 and body == PAGE
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'none'" in headers["content-security-policy"] and headers["x-content-type-options"] == "nosniff"
    assert request(url, "/demo/reports/20261201T000000Z-abc/run.json")[1]["content-type"].startswith("application/json")
    # A folder: its index.html (Data Docs), else a listing whose links lead to each run's report.
    status, headers, body = request(url, "/demo/reports/20261201T000000Z-abc/gates/data_docs")
    assert status == 301 and headers["location"] == "/demo/reports/20261201T000000Z-abc/gates/data_docs/"
    assert request(url, "/demo/reports/20261201T000000Z-abc/gates/data_docs/")[2] == b"<p>docs</p>"
    assert b'href="20261201T000000Z-abc/report.html"' in request(url, "/demo/reports/")[2]
    assert b'href="demo/reports/"' in request(url, "/")[2]
    assert request(url, "/demo")[1]["location"] == "/demo/reports/"  # not the dataset's other folders
    status, headers, body = request(url, "/demo/reports/20261201T000000Z-abc/report.html", "HEAD")
    assert status == 200 and body == b"" and headers["content-length"] == str(len(PAGE))
    assert request(url, "/demo/reports/20261201T000000Z-abc/report.html", "POST")[0] == 501
    assert request(url, "/demo/reports/20261201T000000Z-abc/report.html", "PUT")[0] == 501
    assert (store / "demo" / "reports" / "20261201T000000Z-abc" / "report.html").read_bytes() == PAGE


@pytest.mark.parametrize(
    "path",
    [
        "/../secret.txt",
        "/demo/reports/../../secret.txt",
        "/%2e%2e/secret.txt",
        "/demo/reports/%2e%2e%2f%2e%2e%2fsecret.txt",
        "/demo/download/000000.tar",
        "/demo/reports/..%5c..%5csecret.txt",
        "/demo/reports/20261201T000000Z-abc/leak.txt",
        "//etc/passwd",
        "/demo/reports/nope/report.html",
        "/demo/reports/20261201T000000Z-abc/report.html%00.txt",
    ],
)
def test_server_refuses_what_is_not_a_report(served, path):
    url, _ = served
    status, _, body = request(url, path)
    assert status in (301, 404), (path, status)
    assert b"secret" not in body and b"shard bytes" not in body and b"root:" not in body


def test_links_base_url_presigned_or_path(tmp_path, s3_bucket, monkeypatch):
    monkeypatch.delenv(REPORT_URL_ENV, raising=False)
    local = Storage(str(tmp_path))
    link = report_link(local, "demo/reports/r/report.html")
    assert not link.browsable and link.url == str(tmp_path / "demo/reports/r/report.html")
    assert "shardsmith report --serve --storage" in link.note and REPORT_URL_ENV in link.note
    monkeypatch.setenv(REPORT_URL_ENV, "http://127.0.0.1:4280/")
    link = report_link(local, "demo/reports/r 1/report.html")
    assert link.browsable and link.url == "http://127.0.0.1:4280/demo/reports/r%201/report.html"

    # On S3 without a server: a presigned URL that a browser opens as a page, no credentials needed.
    monkeypatch.delenv(REPORT_URL_ENV)
    bucket, options = s3_bucket
    s3 = Storage(f"s3://{bucket}/root", options)
    s3.write_bytes("demo/reports/r/report.html", PAGE)
    link = report_link(s3, "demo/reports/r/report.html", expires_s=600)
    assert link.browsable and "X-Amz-Signature=" in link.url and "X-Amz-Expires=600" in link.url
    with urllib.request.urlopen(link.url, timeout=10) as r:
        assert r.read() == PAGE and r.headers["Content-Type"].startswith("text/html")
    unsigned = link.url.split("?", 1)[0]
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(unsigned.replace("report.html", "run.json"), timeout=10)


def test_cli_report_serve(store):
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "report", "--serve", "--storage", str(store), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=PROJECT,
    )
    try:
        first = proc.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/", first).group(1)
        assert f"{REPORT_URL_ENV}={url}" in proc.stdout.readline()
        with urllib.request.urlopen(f"{url}/demo/reports/20261201T000000Z-abc/report.html", timeout=10) as r:
            assert r.read() == PAGE
    finally:
        proc.terminate()
        proc.wait(timeout=10)
