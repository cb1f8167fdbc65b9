"""The loopback image web: every route, the stats, port fallback, shutdown and the CLI."""

from __future__ import annotations

import http.client
import io
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from tasks.demo.webserver import DEFAULT_ROBOTS_TXT, ImageWeb

REPO = Path(__file__).resolve().parent.parent
SECRET = b"the secret outside the root\n"


def _image(fmt: str, mode: str = "RGB", size: tuple[int, int] = (96, 64)) -> bytes:
    img = Image.new(mode, size, (180, 60, 40) if mode == "RGB" else 90)
    for x in range(0, size[0], 6):  # some structure, so the files are not trivially small
        for y in range(size[1]):
            img.putpixel((x, y), (10, 10, 10) if mode == "RGB" else 10)
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A served folder of small images, a hidden file and a subfolder, with a secret beside it."""
    base = tmp_path_factory.mktemp("webserver")
    root = base / "root"
    root.mkdir()
    for name, body in {
        "a.jpg": _image("JPEG"),
        "b.png": _image("PNG"),
        "c.webp": _image("WEBP"),
        "d.gif": _image("GIF", "L"),
    }.items():
        (root / name).write_bytes(body)
    (root / ".hidden").write_bytes(SECRET)
    (root / "sub").mkdir()
    (base / "secret.txt").write_bytes(SECRET)
    return root


@pytest.fixture(scope="module")
def files(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and not p.name.startswith(".")}


@pytest.fixture(scope="module")
def server(root):
    # Our own server rather than the session-wide one in conftest: these tests reset its
    # stats and watch its in-flight count, which must not disturb other modules' tests.
    with ImageWeb(root=root) as web:
        yield web


@pytest.fixture
def web(server):
    server.reset_stats()
    return server


def get(
    web: ImageWeb, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request, no redirect following, no exception on 4xx/5xx; path is sent as written."""
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def wait_until(predicate, what: str, deadline_s: float = 15.0) -> None:
    """Poll for a condition the server reaches asynchronously (a handler noticing a disconnect)."""
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- static files


@pytest.mark.parametrize(
    ("name", "content_type"),
    [("a.jpg", "image/jpeg"), ("b.png", "image/png"), ("c.webp", "image/webp"), ("d.gif", "image/gif")],
)
def test_img_serves_the_file_with_type_and_length(web, files, name, content_type):
    status, headers, body = get(web, f"/img/{name}")
    assert status == 200
    assert body == files[name]
    assert headers["Content-Type"] == content_type
    assert int(headers["Content-Length"]) == len(files[name])
    assert "X-Robots-Tag" not in headers


def test_head_gives_headers_without_body(web, files):
    status, headers, body = get(web, "/img/a.jpg", method="HEAD")
    assert (status, body) == (200, b"")
    assert int(headers["Content-Length"]) == len(files["a.jpg"])


def test_missing_file_and_folder_are_404(web):
    assert get(web, "/img/nope.jpg")[0] == 404
    assert get(web, "/img/sub")[0] == 404
    assert get(web, "/nowhere")[0] == 404


def test_changed_file_is_served_fresh(web, root):
    path = root / "changing.bin"
    path.write_bytes(b"first version")
    assert get(web, "/img/changing.bin")[2] == b"first version"
    path.write_bytes(b"second, longer version")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # coarse mtime clocks
    assert get(web, "/img/changing.bin")[2] == b"second, longer version"
    path.unlink()
    assert get(web, "/img/changing.bin")[0] == 404


def test_no_root_serves_no_files():
    with ImageWeb(root=None) as web:
        assert get(web, "/img/a.jpg")[0] == 404
        assert get(web, "/robots.txt")[2].decode() == DEFAULT_ROBOTS_TXT


@pytest.mark.parametrize(
    "path",
    [
        "/img/..%2F..%2Fetc%2Fpasswd",
        "/img/..%2Fsecret.txt",
        "/img/%2e%2e%2fsecret.txt",
        "/img/..%5Csecret.txt",
        "/img/..",
        "/img/.hidden",
        "/truncated/..%2Fsecret.txt",
        "/slow/..%2Fsecret.txt",
        "/flaky/0/..%2Fsecret.txt",
        "/redirect-chain/0/..%2Fsecret.txt",
        "/drop/..%2Fsecret.txt?after=1",
        "/norange/..%2Fsecret.txt",
    ],
)
def test_path_traversal_is_refused(web, path):
    status, _, body = get(web, path)
    assert status in (403, 404)
    assert SECRET not in body
    assert b"root:" not in body


# --------------------------------------------------------------------------- stats


def test_hits_count_paths_with_and_without_query(web):
    for path in ("/img/a.jpg?i=1", "/img/a.jpg?i=2", "/img/a.jpg", "/status/404"):
        get(web, path)
    assert web.hits["/img/a.jpg"] == 3
    assert web.hits["/img/a.jpg?i=1"] == 1
    assert web.hits["/status/404"] == 1
    assert web.requests == 4
    stats = web.stats()
    assert stats["hits"]["/img/a.jpg"] == 3 and stats["requests"] == 4


def test_user_agents_are_recorded(web):
    get(web, "/img/a.jpg", headers={"User-Agent": "testbot/1.0 (+https://example.org)"})
    get(web, "/img/b.png", headers={"User-Agent": "otherbot/2"})
    assert {"testbot/1.0 (+https://example.org)", "otherbot/2"} <= web.user_agents


def test_authorization_headers_are_recorded(web):
    get(web, "/img/a.jpg")
    assert web.authorizations == set()
    get(web, "/img/a.jpg", headers={"Authorization": "Basic dXNlcjpzZWNyZXQ="})
    assert web.stats()["authorizations"] == {"Basic dXNlcjpzZWNyZXQ="}


def test_reset_stats_forgets_everything(web):
    get(web, "/img/a.jpg", headers={"User-Agent": "x/1", "Authorization": "Bearer x"})
    web.reset_stats()
    assert web.hits == {} and web.user_agents == set() and web.authorizations == set() and web.requests == 0
    assert web.max_concurrent == 0


# --------------------------------------------------------------------------- hostile routes


@pytest.mark.parametrize("code", [200, 204, 301, 403, 404, 410, 500, 503])
def test_status_route(web, code):
    status, _, body = get(web, f"/status/{code}")
    assert status == code
    if code not in (204, 301):
        assert str(code).encode() in body


@pytest.mark.parametrize("code", ["abc", "99", "600"])
def test_status_route_refuses_nonsense(web, code):
    assert get(web, f"/status/{code}")[0] == 400


def test_flaky_fails_n_times_per_exact_path(web, files):
    statuses = [get(web, "/flaky/2/a.jpg")[0] for _ in range(4)]
    assert statuses == [500, 500, 200, 200]
    assert get(web, "/flaky/2/a.jpg")[2] == files["a.jpg"]
    # Another path has its own count.
    assert get(web, "/flaky/2/b.png")[0] == 500
    assert get(web, "/flaky/0/b.png")[0] == 200
    assert web.hits["/flaky/2/a.jpg"] == 5


def test_reset_restarts_the_flaky_sequence(web):
    assert [get(web, "/flaky/1/a.jpg")[0] for _ in range(2)] == [500, 200]
    web.reset_stats()
    assert get(web, "/flaky/1/a.jpg")[0] == 500


def test_ratelimit_sends_retry_after_n_times(web, files):
    first, second, third = (get(web, "/ratelimit/7/2/b.png") for _ in range(3))
    assert first[0] == second[0] == 429
    assert first[1]["Retry-After"] == "7" and second[1]["Retry-After"] == "7"
    assert third[0] == 200 and third[2] == files["b.png"]
    assert "Retry-After" not in third[1]


def test_html_served_as_jpeg(web):
    status, headers, body = get(web, "/html-as-jpeg")
    assert status == 200
    assert headers["Content-Type"] == "image/jpeg"
    assert body.lstrip().lower().startswith(b"<!doctype html")
    assert not body.startswith(b"\xff\xd8")


def test_truncated_is_the_first_half_as_a_complete_response(web, files):
    status, headers, body = get(web, "/truncated/a.jpg")
    half = files["a.jpg"][: len(files["a.jpg"]) // 2]
    assert status == 200
    assert body == half
    assert int(headers["Content-Length"]) == len(half)
    assert headers["Content-Type"] == "image/jpeg"
    assert b"\xff\xd9" not in body[2:]  # no end-of-image marker


@pytest.mark.parametrize("name", ["a.jpg", "b.png", "c.webp"])
def test_corrupt_keeps_the_magic_then_garbage_no_decoder_reads(web, files, name):
    status, headers, body = get(web, f"/corrupt/{name}")
    real = files[name]
    assert status == 200
    assert headers["Content-Type"] == get(web, f"/img/{name}")[1]["Content-Type"]
    assert len(body) == len(real)
    assert body[:16] == real[:16]
    assert body[16:] != real[16:]
    assert get(web, f"/corrupt/{name}?u=2")[2] == body  # the same garbage every time
    with pytest.raises((OSError, SyntaxError, ValueError)):
        with Image.open(io.BytesIO(body)) as img:
            img.load()


def test_empty_is_a_200_with_no_body(web):
    status, headers, body = get(web, "/empty/b.png")
    assert (status, body) == (200, b"")
    assert headers["Content-Type"] == "image/png"
    assert int(headers["Content-Length"]) == 0
    assert get(web, "/empty/missing.png")[0] == 404


def test_short_declares_the_whole_file_and_sends_half(web, files):
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    try:
        conn.request("GET", "/short/b.png")
        resp = conn.getresponse()
        assert int(resp.headers["Content-Length"]) == len(files["b.png"])
        with pytest.raises(http.client.IncompleteRead) as cut:
            resp.read()
        assert cut.value.partial == files["b.png"][: len(files["b.png"]) // 2]
    finally:
        conn.close()


def test_optout_headers(web, files):
    status, headers, body = get(web, "/optout/a.jpg")
    assert (status, body) == (200, files["a.jpg"])
    assert headers["X-Robots-Tag"] == "noai, noimageai"
    status, headers, body = get(web, "/optout-other-bot/a.jpg")
    assert (status, body) == (200, files["a.jpg"])
    assert headers["X-Robots-Tag"] == "otherbot: noai"


def test_redirect_to_any_url(web, files):
    status, headers, _ = get(web, "/redirect?to=http://example.org/x.jpg")
    assert status == 302
    assert headers["Location"] == "http://example.org/x.jpg"
    assert get(web, "/redirect")[0] == 400
    # A real client follows it.
    with urllib.request.urlopen(web.url("/redirect?to=" + web.url("/img/b.png")), timeout=10) as resp:
        assert resp.read() == files["b.png"]


def test_redirect_chain_counts_down_to_the_file(web, files):
    path = "/redirect-chain/3/a.jpg"
    for expected_next in ("/redirect-chain/2/a.jpg", "/redirect-chain/1/a.jpg", "/redirect-chain/0/a.jpg"):
        status, headers, _ = get(web, path)
        assert status == 302
        assert headers["Location"] == web.url(expected_next)
        path = expected_next
    status, _, body = get(web, path)
    assert (status, body) == (200, files["a.jpg"])
    assert all(web.hits[f"/redirect-chain/{n}/a.jpg"] == 1 for n in range(4))
    assert get(web, "/redirect-chain/2/missing.jpg")[0] == 404


def test_private_is_served_but_robots_txt_disallows_it(web, files):
    assert get(web, "/private/a.jpg")[2] == files["a.jpg"]
    status, headers, body = get(web, "/robots.txt")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    assert body.decode() == DEFAULT_ROBOTS_TXT
    assert "Disallow: /private/" in body.decode()


def test_robots_txt_configurable_or_absent(root):
    with ImageWeb(root, robots_txt="User-agent: shardsmith\nDisallow: /\n") as web:
        assert get(web, "/robots.txt")[2] == b"User-agent: shardsmith\nDisallow: /\n"
    with ImageWeb(root, robots_txt=None) as web:
        assert get(web, "/robots.txt")[0] == 404
    with ImageWeb(root, robots_txt=503) as web:
        assert get(web, "/robots.txt")[0] == 503


# --------------------------------------------------------------------------- ranges and cut transfers


def cut(web: ImageWeb, path: str, headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    """A request whose body the server cuts short: (status, headers, the bytes that came)."""
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        with pytest.raises(http.client.IncompleteRead) as short:
            resp.read()
        return resp.status, resp.headers, short.value.partial
    finally:
        conn.close()


def test_img_sends_validators_that_follow_the_file(web, root):
    path = root / "versioned.bin"
    path.write_bytes(b"first version")
    _, first, _ = get(web, "/img/versioned.bin")
    assert first["ETag"].startswith('"') and first["Accept-Ranges"] == "bytes"
    assert first["Last-Modified"].endswith(" GMT")
    path.write_bytes(b"second, longer version")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    _, second, _ = get(web, "/img/versioned.bin")
    path.unlink()
    assert second["ETag"] != first["ETag"] and second["Last-Modified"] != first["Last-Modified"]


@pytest.mark.parametrize(
    ("asked", "part"),
    [
        ("bytes=10-19", slice(10, 20)),
        ("bytes=10-", slice(10, None)),
        ("bytes=-5", slice(-5, None)),
        ("bytes=0-99999999", slice(0, None)),
    ],
)
def test_img_answers_a_range_with_206(web, files, asked, part):
    body = files["a.jpg"]
    status, headers, got = get(web, "/img/a.jpg", headers={"Range": asked})
    start, end = part.indices(len(body))[:2]
    assert (status, got) == (206, body[part])
    assert headers["Content-Range"] == f"bytes {start}-{end - 1}/{len(body)}"
    assert int(headers["Content-Length"]) == end - start
    assert headers["Content-Type"] == "image/jpeg" and headers["ETag"]
    assert web.sent["/img/a.jpg"] == end - start
    assert web.ranges == [("/img/a.jpg", asked, None)]


def test_a_range_past_the_end_is_416(web, files):
    size = len(files["b.png"])
    status, headers, _ = get(web, "/img/b.png", headers={"Range": f"bytes={size}-"})
    assert status == 416
    assert headers["Content-Range"] == f"bytes */{size}"


@pytest.mark.parametrize("asked", ["items=0-1", "bytes=0-1,5-6", "bytes=9-2"])
def test_a_range_the_server_does_not_read_gets_the_whole_file(web, files, asked):
    assert get(web, "/img/b.png", headers={"Range": asked})[::2] == (200, files["b.png"])


def test_if_range_that_matches_gets_the_part_and_a_stale_one_the_whole_file(web, files):
    _, headers, _ = get(web, "/img/c.webp", method="HEAD")
    body = files["c.webp"]
    for validator in (headers["ETag"], headers["Last-Modified"]):
        assert get(web, "/img/c.webp", headers={"Range": "bytes=4-", "If-Range": validator})[::2] == (206, body[4:])
    for stale in ('"0-0"', "W/" + headers["ETag"], "Thu, 01 Jan 2015 00:00:00 GMT"):
        assert get(web, "/img/c.webp", headers={"Range": "bytes=4-", "If-Range": stale})[::2] == (200, body)
    assert web.ranges[-1] == ("/img/c.webp", "bytes=4-", "Thu, 01 Jan 2015 00:00:00 GMT")


def test_drop_cuts_the_first_requests_then_serves_the_file(web, files):
    path = "/drop/a.jpg?after=100&times=2"
    body = files["a.jpg"]
    for _ in range(2):
        status, headers, got = cut(web, path)
        assert (status, got) == (200, body[:100])
        assert int(headers["Content-Length"]) == len(body)
        assert headers["ETag"] and headers["Accept-Ranges"] == "bytes"
    assert get(web, path)[::2] == (200, body)
    assert web.hits[path] == 3
    assert web.sent[path] == 200 + len(body)


def test_drop_cuts_a_ranged_answer_and_resumes_it(web, files):
    path = "/drop/b.png?after=50"
    body = files["b.png"]
    status, headers, got = cut(web, path, {"Range": "bytes=10-"})
    assert (status, got) == (206, body[10:60])
    assert headers["Content-Range"] == f"bytes 10-{len(body) - 1}/{len(body)}"
    etag = headers["ETag"]
    assert get(web, path, headers={"Range": "bytes=60-", "If-Range": etag})[::2] == (206, body[60:])
    assert web.ranges == [(path, "bytes=10-", None), (path, "bytes=60-", etag)]


def test_drop_then_serves_another_file_as_if_it_changed(web, files):
    path = "/drop/a.jpg?after=10&then=b.png"
    status, headers, got = cut(web, path)
    assert got == files["a.jpg"][:10]
    again = get(web, path, headers={"Range": "bytes=10-", "If-Range": headers["ETag"]})
    assert again[::2] == (200, files["b.png"])  # the If-Range no longer matches
    assert get(web, "/drop/a.jpg?then=x.jpg")[0] == 200  # no after: nothing cut, the file itself


def test_drop_without_etag_sends_only_last_modified(web, files):
    status, headers, got = get(web, "/drop/d.gif?etag=0")
    assert (status, got) == (200, files["d.gif"])
    assert "ETag" not in headers and headers["Last-Modified"]


def test_norange_ignores_range_and_can_cut_too(web, files):
    body = files["c.webp"]
    status, headers, got = get(web, "/norange/c.webp", headers={"Range": "bytes=10-"})
    assert (status, got) == (200, body)
    assert headers["ETag"] and "Accept-Ranges" not in headers and "Content-Range" not in headers
    assert cut(web, "/norange/c.webp?after=20", {"Range": "bytes=10-"})[::2] == (200, body[:20])


def test_drop_with_stall_holds_the_connection_before_cutting_it(web, files):
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    try:
        conn.request("GET", "/drop/a.jpg?after=100&stall=1")
        resp = conn.getresponse()
        assert resp.read(100) == files["a.jpg"][:100]
        wait_until(lambda: web.in_flight == 1, "the handler to hold the connection")
        with pytest.raises(http.client.IncompleteRead):
            resp.read()
    finally:
        conn.close()
    wait_until(lambda: web.in_flight == 0, "the stalled handler to end")


@pytest.mark.parametrize("query", ["after=x", "times=-1", "stall=9999", "etag=2"])
def test_drop_refuses_nonsense(web, query):
    assert get(web, f"/drop/a.jpg?{query}")[0] == 400


# --------------------------------------------------------------------------- streams


def test_slow_drips_and_stops_when_the_client_leaves(web, files):
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    conn.request("GET", "/slow/a.jpg")
    resp = conn.getresponse()
    assert resp.status == 200
    assert int(resp.headers["Content-Length"]) == len(files["a.jpg"])
    assert resp.read(1) == files["a.jpg"][:1]
    assert web.in_flight == 1
    conn.close()
    wait_until(lambda: web.in_flight == 0, "the slow handler to notice the disconnect")


def test_two_slow_requests_overlap(web):
    conns = [http.client.HTTPConnection("127.0.0.1", web.port, timeout=10) for _ in range(2)]
    try:
        for i, conn in enumerate(conns):
            conn.request("GET", f"/slow/b.png?i={i}")
        for conn in conns:
            assert conn.getresponse().status == 200
        assert web.max_concurrent >= 2
        assert web.in_flight == 2
    finally:
        for conn in conns:
            conn.close()
    wait_until(lambda: web.in_flight == 0, "both slow handlers to end")


def test_trickle_sends_the_whole_file_over_the_given_time(web, files):
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    try:
        started = time.monotonic()
        conn.request("GET", "/trickle/800/a.jpg?u=1")
        resp = conn.getresponse()
        assert resp.status == 200
        assert int(resp.headers["Content-Length"]) == len(files["a.jpg"])
        assert resp.read() == files["a.jpg"]
        assert time.monotonic() - started >= 0.8  # the last piece waits the whole 800 ms
    finally:
        conn.close()
    assert get(web, "/trickle/0/b.png")[2] == files["b.png"]
    assert get(web, "/trickle/x/b.png")[0] == 400
    assert get(web, "/trickle/10/missing.png")[0] == 404


def test_trickle_stops_when_the_client_leaves(web):
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    conn.request("GET", "/trickle/60000/a.jpg")
    resp = conn.getresponse()
    assert resp.status == 200
    wait_until(lambda: web.in_flight == 1, "the trickle handler to start")
    conn.close()
    wait_until(lambda: web.in_flight == 0, "the trickle handler to notice the disconnect")


def test_endless_streams_until_the_client_leaves(web):
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    conn.request("GET", "/endless")
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "image/jpeg"
    assert resp.headers["Content-Length"] is None
    assert resp.headers["Transfer-Encoding"] == "chunked"
    data = resp.read(512 * 1024)  # bounded: the body never ends
    assert len(data) == 512 * 1024
    assert data.startswith(b"\xff\xd8\xff")
    assert data[64:] == bytes(len(data) - 64)
    conn.close()
    wait_until(lambda: web.in_flight == 0, "the endless handler to notice the disconnect")


def test_hang_sends_nothing_until_the_server_stops(root):
    web = ImageWeb(root).start()
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    try:
        conn.request("GET", "/hang")
        wait_until(lambda: web.in_flight == 1, "the hang handler to start")
        conn.sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            conn.getresponse()  # not even a status line
        web.stop()  # raises if the hanging handler keeps the serving thread alive
    finally:
        conn.close()


def test_stop_ends_open_streams(root):
    web = ImageWeb(root).start()
    conns = [http.client.HTTPConnection("127.0.0.1", web.port, timeout=10) for _ in range(2)]
    try:
        conns[0].request("GET", "/slow/a.jpg")
        conns[1].request("GET", "/endless")
        for conn in conns:
            conn.getresponse().read(1)
        conns.append(http.client.HTTPConnection("127.0.0.1", web.port, timeout=10))
        conns[2].request("GET", "/trickle/60000/b.png")
        assert conns[2].getresponse().status == 200  # its first piece is 7.5 s away
        web.stop()  # raises if the serving thread does not finish
    finally:
        for conn in conns:
            conn.close()


# --------------------------------------------------------------------------- lifecycle


def test_base_url_before_start_is_an_error():
    with pytest.raises(RuntimeError, match="start"):
        _ = ImageWeb().base_url


def test_context_manager_and_restart(root):
    web = ImageWeb(root)
    with web:
        assert web.base_url == f"http://127.0.0.1:{web.port}"
        assert get(web, "/img/a.jpg")[0] == 200
    with pytest.raises(OSError):
        get(web, "/img/a.jpg")
    web.start()
    try:
        assert get(web, "/img/a.jpg")[0] == 200
    finally:
        web.stop()
    web.stop()  # a second stop is a no-op


def test_free_preferred_port_is_used(root):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with ImageWeb(root, port=port) as web:
        assert web.port == port
        assert get(web, "/img/a.jpg")[0] == 200


def test_busy_preferred_port_falls_back_to_an_ephemeral_one(root, files):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with ImageWeb(root, port=port) as web:
            assert web.port not in (None, 0, port)
            assert web.base_url == f"http://127.0.0.1:{web.port}"
            assert get(web, "/img/a.jpg")[2] == files["a.jpg"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_serves_until_signalled(root, files, sig):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.demo.webserver", "--root", str(root), "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()  # the CLI prints this once it listens
        assert line.startswith("serving http://127.0.0.1:"), (
            line,
            proc.stderr.read() if proc.poll() is not None else "",
        )
        base = line.split(" ", 1)[1]
        with urllib.request.urlopen(base + "/img/a.jpg", timeout=10) as resp:
            assert resp.read() == files["a.jpg"]
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_cli_refuses_a_missing_root(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tasks.demo.webserver", "--root", str(tmp_path / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "not a directory" in result.stderr
