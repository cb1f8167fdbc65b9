"""Bodies streamed to disk through the real Fetcher and loopback server: caps, resumed drops, restarts, bounded memory."""

from __future__ import annotations

import asyncio
import http.client
import io
import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from PIL import Image

from tasks.demo.webserver import ImageWeb
from tasks.formats.recipe_download import DownloadConfig, NetworkConfig
from tasks.stages.fetch import Fetcher
from tasks.stages.fetch_body import CHUNK
from tasks.stages.fetched import Fetched, judge, judge_file

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True)
CAP = 64 * 1024 * 1024
MTIME_NS = 1_700_000_000_000_000_000  # the same for every file: their Last-Modified dates are equal


def cfg(**kw) -> DownloadConfig:
    return DownloadConfig(
        **{"timeout_s": 5, "retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.05, "network": LOOPBACK, **kw}
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Video-sized stand-ins (random bytes of different lengths, one mtime), a noise PNG over the sniff prefix and a small JPEG."""
    root = tmp_path_factory.mktemp("files")
    rng = random.Random(34)
    (root / "v.bin").write_bytes(rng.randbytes(3 * CHUNK + 123))
    (root / "w.bin").write_bytes(rng.randbytes(2 * CHUNK + 7))
    (root / "tiny.bin").write_bytes(rng.randbytes(1000))
    noise = Image.frombytes("RGB", (200, 200), rng.randbytes(200 * 200 * 3))
    buf = io.BytesIO()
    noise.save(buf, format="PNG")
    (root / "noise.png").write_bytes(buf.getvalue())
    buf = io.BytesIO()
    noise.resize((32, 32)).save(buf, format="JPEG")
    (root / "a.jpg").write_bytes(buf.getvalue())
    for path in root.iterdir():
        os.utime(path, ns=(MTIME_NS, MTIME_NS))
    return root


@pytest.fixture(scope="module")
def server(root):
    # Our own: these tests read its stats, which other modules' requests must not disturb.
    with ImageWeb(root) as web:
        yield web


@pytest.fixture
def web(server):
    server.reset_stats()
    return server


def fetch_to(url: str, dest: Path, max_bytes: int = CAP, config: DownloadConfig | None = None, **kw) -> Fetched:
    async def go() -> Fetched:
        async with Fetcher(config or cfg()) as f:
            return await f.fetch_to(url, dest, max_bytes, **kw)

    return asyncio.run(go())


def head(web: ImageWeb, path: str) -> http.client.HTTPMessage:
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    try:
        conn.request("HEAD", path)
        return conn.getresponse().headers
    finally:
        conn.close()


def test_a_body_streamed_to_disk_equals_the_served_file(web, root, tmp_path):
    dest = tmp_path / "out"
    fetched = fetch_to(web.url("/img/v.bin"), dest)
    body = (root / "v.bin").read_bytes()
    assert (fetched.reason, fetched.data, fetched.path, fetched.size) == (None, None, str(dest), len(body))
    assert (fetched.http_status, fetched.attempts, fetched.resumed) == (200, 1, 0)
    assert fetched.content_type == "application/octet-stream"
    assert dest.read_bytes() == body
    assert web.ranges == [] and web.sent["/img/v.bin"] == len(body)


def test_over_the_cap_by_content_length_is_refused_and_leaves_no_file(web, root, tmp_path):
    dest = tmp_path / "out"
    dest.write_bytes(b"an older file at the same place")
    size = (root / "v.bin").stat().st_size
    fetched = fetch_to(web.url("/img/v.bin"), dest, max_bytes=size - 1, cap_name="video.max_bytes")
    assert fetched.reason == "too_large"
    assert fetched.detail == f"Content-Length {size} is over video.max_bytes ({size - 1})"
    assert not dest.exists()


def test_over_the_cap_without_content_length_is_refused_as_bytes_arrive(web, tmp_path):
    dest = tmp_path / "out"
    fetched = fetch_to(web.url("/endless"), dest, max_bytes=2 * CHUNK)
    assert fetched.reason == "too_large"
    assert fetched.detail == f"more than max_bytes ({2 * CHUNK}) received"
    assert not dest.exists()


@pytest.mark.parametrize(("times", "ranges"), [(1, ["bytes=1000000-"]), (2, ["bytes=1000000-", "bytes=2000000-"])])
def test_a_dropped_transfer_resumes_with_a_range_request(web, root, tmp_path, times, ranges):
    path = f"/drop/v.bin?after=1000000&times={times}"
    dest = tmp_path / "out"
    fetched = fetch_to(web.url(path), dest)
    body = (root / "v.bin").read_bytes()
    assert (fetched.reason, fetched.http_status, fetched.size) == (None, 206, len(body))
    assert (fetched.attempts, fetched.resumed) == (times + 1, times)
    assert dest.read_bytes() == body
    etag = head(web, "/img/v.bin")["ETag"]
    assert web.ranges[: len(ranges)] == [(path, r, etag) for r in ranges]
    assert web.sent[path] == len(body)  # no byte was sent twice


def test_without_an_etag_if_range_carries_the_last_modified_date(web, root, tmp_path):
    path = "/drop/v.bin?after=1000000&etag=0"
    fetched = fetch_to(web.url(path), tmp_path / "out")
    assert (fetched.reason, fetched.resumed) == (None, 1)
    assert (tmp_path / "out").read_bytes() == (root / "v.bin").read_bytes()
    assert web.ranges == [(path, "bytes=1000000-", head(web, "/img/v.bin")["Last-Modified"])]


def test_a_drop_before_any_byte_starts_over_without_range(web, root, tmp_path):
    path = "/drop/v.bin?after=0"
    fetched = fetch_to(web.url(path), tmp_path / "out")
    assert (fetched.reason, fetched.http_status, fetched.attempts, fetched.resumed) == (None, 200, 2, 0)
    assert (tmp_path / "out").read_bytes() == (root / "v.bin").read_bytes()
    assert web.ranges == []


def test_a_server_that_ignores_range_restarts_the_file(web, root, tmp_path):
    path = "/norange/v.bin?after=1000000"
    fetched = fetch_to(web.url(path), tmp_path / "out")
    body = (root / "v.bin").read_bytes()
    assert (fetched.reason, fetched.http_status, fetched.attempts, fetched.resumed) == (None, 200, 2, 0)
    assert (tmp_path / "out").read_bytes() == body
    assert [r[:2] for r in web.ranges] == [(path, "bytes=1000000-")]
    assert web.sent[path] == 1000000 + len(body)


def test_a_file_that_changed_between_attempts_restarts(web, root, tmp_path):
    """If-Range carries the first version's ETag; the server, holding another, answers 200 whole."""
    path = "/drop/v.bin?after=1000000&then=w.bin"
    fetched = fetch_to(web.url(path), tmp_path / "out")
    assert (fetched.reason, fetched.http_status, fetched.attempts, fetched.resumed) == (None, 200, 2, 0)
    assert (tmp_path / "out").read_bytes() == (root / "w.bin").read_bytes()
    assert web.ranges == [(path, "bytes=1000000-", head(web, "/img/v.bin")["ETag"])]


@pytest.mark.parametrize(
    ("then", "status"),
    [
        # Same Last-Modified date, so If-Range matches: the new version is shorter than the
        # bytes held (416), or its 206 declares another complete length than the first answer.
        ("tiny.bin", 416),
        ("w.bin", 206),
    ],
)
def test_a_416_or_a_range_of_another_length_starts_over_without_range(web, root, tmp_path, then, status):
    path = f"/drop/v.bin?after=1000000&etag=0&then={then}"
    fetched = fetch_to(web.url(path), tmp_path / "out")
    assert (fetched.reason, fetched.http_status, fetched.attempts, fetched.resumed) == (None, 200, 3, 0)
    assert (tmp_path / "out").read_bytes() == (root / then).read_bytes()
    assert [r[:2] for r in web.ranges] == [(path, "bytes=1000000-")]  # the third attempt asked for it whole


def test_the_restart_after_a_416_counts_against_the_retries(web, tmp_path):
    path = "/drop/v.bin?after=1000000&etag=0&then=tiny.bin"
    fetched = fetch_to(web.url(path), tmp_path / "out", config=cfg(retries=1))
    assert (fetched.reason, fetched.http_status, fetched.attempts) == ("http_416", 416, 2)
    assert fetched.detail == "HTTP 416 to Range bytes=1000000-: not the file whose first 1000000 bytes arrived"
    assert not (tmp_path / "out").exists()


def test_a_drop_on_every_attempt_gives_up_after_the_retries(web, root, tmp_path):
    path = "/drop/v.bin?after=100000&times=99"
    dest = tmp_path / "out"
    fetched = fetch_to(web.url(path), dest, config=cfg(retries=2))
    size = (root / "v.bin").stat().st_size
    assert (fetched.reason, fetched.attempts, fetched.resumed) == ("connection_error", 3, 2)
    assert fetched.detail.startswith(f"ClientPayloadError: received 300000 of {size} declared bytes")
    assert not dest.exists()
    assert [r[1] for r in web.ranges] == ["bytes=100000-", "bytes=200000-"]
    assert web.sent[path] == 300000


def test_a_stalled_transfer_resumes_like_a_dropped_one(web, root, tmp_path):
    """The server holds the connection open, silent, after 1 MB; the stall limit is 0.5 s of it."""
    path = "/drop/v.bin?after=1000000&stall=30"
    fetched = fetch_to(web.url(path), tmp_path / "out", config=cfg(timeout_s=0.5, retries=3))
    assert fetched.reason is None and fetched.resumed >= 1
    assert (tmp_path / "out").read_bytes() == (root / "v.bin").read_bytes()
    assert web.ranges[0][:2] == (path, "bytes=1000000-")


def test_retries_and_the_url_policy_apply_as_to_fetch(web, root, tmp_path):
    dest = tmp_path / "out"
    fetched = fetch_to(web.url("/flaky/1/v.bin"), dest)
    assert (fetched.reason, fetched.attempts, fetched.resumed) == (None, 2, 0)
    assert dest.read_bytes() == (root / "v.bin").read_bytes()
    refused = {
        "/status/404": "http_404",
        "/optout/v.bin": "opted_out",
        f"/redirect?to=http://127.0.0.2:{web.port}/img/v.bin": "blocked_address",
        "/private/v.bin": "robots_disallowed",
    }
    for path, reason in refused.items():
        assert fetch_to(web.url(path), dest, config=cfg(respect_robots_txt=True)).reason == reason, path
        assert not dest.exists()
    unguarded = cfg(network=NetworkConfig(any_port=True))
    assert fetch_to(web.url("/img/v.bin"), dest, config=unguarded).reason == "blocked_address"


def test_a_file_that_cannot_be_written_is_no_connection_error(web, tmp_path):
    dest = tmp_path / "missing-folder" / "out"
    fetched = fetch_to(web.url("/img/v.bin"), dest)
    assert (fetched.reason, fetched.attempts) == ("fetch_failed", 1)
    assert fetched.detail.startswith(f"writing {dest}: FileNotFoundError")


def test_a_cancelled_transfer_leaves_no_file(web, tmp_path):
    dest = tmp_path / "out"

    async def go() -> None:
        async with Fetcher(cfg()) as f:
            task = asyncio.create_task(f.fetch_to(web.url("/drop/v.bin?after=1000000&stall=30&c=1"), dest, CAP))
            while not (dest.exists() and dest.stat().st_size):
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(go(), 30))
    assert not dest.exists()


def test_file_and_s3_objects_stream_to_disk(root, tmp_path, s3_bucket):
    import s3fs

    body = (root / "v.bin").read_bytes()
    config = cfg(network=NetworkConfig(file_root=str(root), s3_buckets=(s3_bucket[0],)))
    dest = tmp_path / "out"
    fetched = fetch_to(f"file://{root}/v.bin", dest, config=config)
    assert (fetched.reason, fetched.size, fetched.attempts) == (None, len(body), 1)
    assert dest.read_bytes() == body
    fetched = fetch_to(f"file://{root}/v.bin", dest, max_bytes=len(body) - 1, config=config)
    assert (fetched.reason, fetched.detail) == ("too_large", f"more than max_bytes ({len(body) - 1})")
    assert not dest.exists()

    bucket, options = s3_bucket
    s3fs.S3FileSystem(**options).pipe(f"{bucket}/v.bin", body)

    async def go() -> Fetched:
        async with Fetcher(config, s3_options=options) as f:
            return await f.fetch_to(f"s3://{bucket}/v.bin", dest, CAP)

    fetched = asyncio.run(go())
    assert (fetched.reason, fetched.size) == (None, len(body))
    assert dest.read_bytes() == body


@pytest.mark.parametrize("path", ["/img/a.jpg", "/truncated/a.jpg", "/html-as-jpeg", "/empty/a.jpg"])
def test_judge_file_of_a_body_within_the_sniff_prefix_is_judge(web, tmp_path, path):
    """Small files get the very verdict of the in-memory path (truncation included)."""
    url = web.url(path)
    config = cfg(allowed_formats=("png", "jpeg"))

    async def both() -> tuple[Fetched, Fetched]:
        async with Fetcher(config) as f:
            return await f.fetch(url), await f.fetch_to(url, tmp_path / "out", CAP)

    in_memory, on_disk = asyncio.run(both())
    expected, got = judge(in_memory, config.allowed_formats), judge_file(on_disk, config.allowed_formats)
    assert (got.reason, got.format, got.detail) == (expected.reason, expected.format, expected.detail)
    assert (got.path is not None) == (got.reason is None) == (tmp_path / "out").exists()


def test_judge_file_of_a_large_file_sniffs_its_prefix(web, root, tmp_path):
    allowed = ("png", "jpeg")
    png = judge_file(fetch_to(web.url("/img/noise.png"), tmp_path / "p"), allowed)
    assert (png.reason, png.format, png.path) == (None, "png", str(tmp_path / "p"))
    assert (root / "noise.png").stat().st_size > 64 * 1024
    other = judge_file(fetch_to(web.url("/img/v.bin"), tmp_path / "v"), allowed)
    size = (root / "v.bin").stat().st_size
    assert (other.reason, other.path) == ("not_an_image", None)
    assert other.detail.endswith(f"({size} bytes, Content-Type application/octet-stream)")
    assert not (tmp_path / "v").exists()


def test_a_video_resumed_mid_transfer_sniffs_and_probes_as_the_original(web, root, tmp_path):
    from tasks.demo.videos import make_video
    from tasks.video.probe import VideoLimits, probe

    video = make_video(seconds=2.0, size=(160, 96))
    (root / "clip.mp4").write_bytes(video)
    containers = ("mp4", "webm", "mkv")
    path = f"/drop/clip.mp4?after={len(video) // 2}"
    fetched = judge_file(fetch_to(web.url(path), tmp_path / "clip"), containers)
    assert (fetched.reason, fetched.format, fetched.resumed) == (None, "mp4", 1)
    assert (tmp_path / "clip").read_bytes() == video
    probed = probe((tmp_path / "clip").read_bytes(), VideoLimits())
    assert probed.ok and probed == probe(video, VideoLimits())
    other = judge_file(fetch_to(web.url("/img/v.bin"), tmp_path / "v"), containers)
    size = (root / "v.bin").stat().st_size
    assert (other.reason, other.path) == ("not_a_video", None)
    assert other.detail.endswith(f"({size} bytes, Content-Type application/octet-stream)")


@pytest.fixture(scope="module")
def big_web(tmp_path_factory):
    """A server in its own process with a 32 MiB file: the peak traced here is the client's alone."""
    root = tmp_path_factory.mktemp("big")
    (root / "big.bin").write_bytes(random.Random(7).randbytes(32 * CHUNK))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.demo.webserver", "--root", str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("serving "), line
        yield line.split(" ", 1)[1], root / "big.bin"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        proc.stdout.close()


def traced_peak(make) -> tuple[int, Fetched]:
    async def go() -> Fetched:
        async with Fetcher(cfg(max_bytes=CAP)) as f:
            return await make(f)

    tracemalloc.start()
    try:
        fetched = asyncio.run(go())
        return tracemalloc.get_traced_memory()[1], fetched
    finally:
        tracemalloc.stop()


def test_memory_stays_bounded_while_streaming(big_web, tmp_path):
    base, big = big_web
    size = big.stat().st_size
    url = base + "/img/big.bin"
    traced_peak(lambda f: f.fetch(url))  # the server reads the file into its cache once
    in_memory_peak, in_memory = traced_peak(lambda f: f.fetch(url))
    assert in_memory.data is not None and in_memory_peak >= size  # the control: this holds the body
    dest = tmp_path / "out"
    peak, fetched = traced_peak(lambda f: f.fetch_to(url, dest, CAP))
    assert (fetched.reason, fetched.size) == (None, size)
    assert peak < size // 4, f"peak {peak} bytes traced while streaming {size}"
    assert dest.read_bytes() == big.read_bytes()


def test_a_body_that_trickles_under_the_minimum_rate_ends_as_timeout_and_a_fast_one_does_not(web, root, tmp_path):
    # A piece every 3 s stays inside each wait for bytes (timeout_s 5), so only the average rate
    # can end it: v.bin's 3 MB in 8 pieces over 24 s is about 130 KB/s, under a floor of 1 MB/s.
    floor = cfg(video_min_bytes_per_s=1 << 20, video_min_rate_after_s=1.0)
    dest = tmp_path / "slow"
    slow = fetch_to(web.url("/trickle/24000/v.bin"), dest, config=floor)
    assert slow.reason == "timeout" and "under download.video_min_bytes_per_s" in slow.detail
    assert slow.attempts == 1 and not dest.exists()  # slowness is not retried, and leaves no file
    fast = fetch_to(web.url("/img/v.bin"), tmp_path / "fast", config=floor)
    assert fast.reason is None and fast.size == (root / "v.bin").stat().st_size
    # Off (0), the same trickle is only bounded by the shard's deadline: it completes here.
    whole = fetch_to(web.url("/trickle/1500/w.bin"), tmp_path / "whole", config=cfg(video_min_bytes_per_s=0))
    assert whole.reason is None and (tmp_path / "whole").read_bytes() == (root / "w.bin").read_bytes()
