"""Fetching against a real loopback server: every outcome has its exact reason."""

from __future__ import annotations

import asyncio

import pytest

from tasks.formats.recipe_download import DownloadConfig, NetworkConfig
from tasks.policies.robots import x_robots_verdict
from tasks.stages.fetch import Fetcher, parse_retry_after
from tasks.stages.fetched import judge

# The session's image server listens on loopback at a random port.
LOOPBACK = NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True)


def cfg(**kw) -> DownloadConfig:
    base = dict(timeout_s=5, retries=2, backoff_s=0.01, max_backoff_s=0.05, network=LOOPBACK)
    base.update(kw)
    return DownloadConfig(**base)


def fetch_all(urls: list[str], config: DownloadConfig):
    async def go():
        async with Fetcher(config) as f:
            return await asyncio.gather(*(f.fetch(u) for u in urls))

    return asyncio.run(go())


def outcome(url: str, config: DownloadConfig | None = None):
    config = config or cfg()
    fetched = judge(fetch_all([url], config)[0], config.allowed_formats)
    return fetched.reason, fetched.format, fetched


@pytest.mark.parametrize(
    ("name", "fmt"), [("a.jpg", "jpeg"), ("b.png", "png"), ("c.webp", "webp"), ("d.gif", "gif"), ("e.bmp", "bmp")]
)
def test_good_images_are_sniffed_from_bytes(web, image_dir, name, fmt):
    reason, got, fetched = outcome(f"{web.base_url}/img/{name}")
    assert (reason, got) == (None, fmt)
    assert fetched.data == (image_dir / name).read_bytes()
    assert fetched.attempts == 1 and fetched.http_status == 200


def test_404_is_not_retried(web):
    web.reset_stats()
    reason, _, fetched = outcome(f"{web.base_url}/status/404")
    assert reason == "http_404"
    assert fetched.attempts == 1
    assert web.hits["/status/404"] == 1


def test_500_then_ok_is_retried(web):
    path = "/flaky/1/a.jpg"
    reason, fmt, fetched = outcome(web.base_url + path)
    assert (reason, fmt) == (None, "jpeg")
    assert fetched.attempts == 2
    assert web.hits[path] == 2


def test_500_forever_gives_up_after_retries(web):
    path = "/flaky/10/b.png"
    reason, _, fetched = outcome(web.base_url + path, cfg(retries=2))
    assert reason == "http_500"
    assert fetched.attempts == 3
    assert web.hits[path] == 3


def test_429_with_short_retry_after_is_retried(web):
    path = "/ratelimit/0/1/a.jpg"
    reason, _, fetched = outcome(web.base_url + path)
    assert reason is None
    assert fetched.attempts == 2


def test_429_with_retry_after_over_the_cap_gives_up_at_once(web):
    path = "/ratelimit/600/5/a.jpg"
    reason, _, fetched = outcome(web.base_url + path, cfg(max_retry_after_s=30))
    assert reason == "rate_limited"
    assert fetched.attempts == 1
    assert web.hits[path] == 1
    assert fetched.detail == "HTTP 429 Too Many Requests, Retry-After 600 s over download.max_retry_after_s"


def test_slow_drip_hits_the_deadline(web):
    reason, _, fetched = outcome(f"{web.base_url}/slow/a.jpg", cfg(timeout_s=1.0, retries=0))
    assert reason == "timeout"
    assert fetched.detail == "no complete response within download.timeout_s (1 s)"


def test_endless_body_hits_the_byte_cap(web):
    reason, _, fetched = outcome(f"{web.base_url}/endless", cfg(max_bytes=256 * 1024))
    assert reason == "too_large"
    assert fetched.data is None


def test_large_file_over_the_cap(web):
    reason, _, _ = outcome(f"{web.base_url}/img/big.png", cfg(max_bytes=1024))
    assert reason == "too_large"


def test_html_served_as_jpeg_is_not_an_image(web):
    assert outcome(f"{web.base_url}/html-as-jpeg")[0] == "not_an_image"


def test_truncated_jpeg(web):
    assert outcome(f"{web.base_url}/truncated/a.jpg")[0] == "truncated_image"


def test_opted_out_image(web):
    assert outcome(f"{web.base_url}/optout/a.jpg")[0] == "opted_out"


def test_opt_out_scoped_to_another_bot_does_not_apply(web):
    assert outcome(f"{web.base_url}/optout-other-bot/a.jpg")[0] is None


def test_format_not_on_the_allowlist(web):
    assert outcome(f"{web.base_url}/img/d.gif", cfg(allowed_formats=("jpeg", "png")))[:2] == (
        "format_not_allowed",
        "gif",
    )


def test_redirects_are_followed_and_capped(web):
    assert outcome(f"{web.base_url}/redirect-chain/3/a.jpg")[0] is None
    reason, _, fetched = outcome(f"{web.base_url}/redirect-chain/7/a.jpg", cfg(max_redirects=5))
    assert reason == "too_many_redirects"
    assert fetched.detail == f"more than download.max_redirects (5); the last to {web.base_url}/redirect-chain/1/a.jpg"


@pytest.mark.parametrize("target", ["http://127.0.0.2:{port}/img/a.jpg", "http://[::ffff:127.0.0.3]:{port}/img/a.jpg"])
def test_redirect_to_a_refused_address(web, target):
    web.reset_stats()
    url = f"{web.base_url}/redirect?to=" + target.format(port=web.port)
    reason, _, fetched = outcome(url)
    assert reason == "blocked_address"
    assert web.hits["/img/a.jpg"] == 0


def test_redirect_to_another_scheme_is_refused(web):
    assert outcome(f"{web.base_url}/redirect?to=file:///etc/passwd")[0] == "blocked_scheme"


def test_loopback_refused_without_the_recipe_flag(web):
    config = cfg(network=NetworkConfig(any_port=True))
    assert outcome(f"{web.base_url}/img/a.jpg", config)[0] == "blocked_address"
    assert outcome(f"http://localhost:{web.port}/img/a.jpg", config)[0] == "blocked_address"
    assert (
        outcome(f"{web.base_url}/img/a.jpg", cfg(network=NetworkConfig(allow_private_networks=True, any_port=True)))[0]
        is None
    )


def test_robots_txt_when_the_recipe_asks(web):
    config = cfg(respect_robots_txt=True)
    assert outcome(f"{web.base_url}/private/a.jpg", config)[0] == "robots_disallowed"
    assert outcome(f"{web.base_url}/img/a.jpg", config)[0] is None
    assert outcome(f"{web.base_url}/private/a.jpg", cfg())[0] is None


def test_connection_refused_is_an_error(web):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reason, _, fetched = outcome(f"http://127.0.0.1:{port}/a.jpg", cfg(retries=1))
    assert reason == "connection_error"
    assert fetched.attempts == 2


def test_user_agent_is_sent(web):
    outcome(f"{web.base_url}/img/a.jpg", cfg(user_agent="testbot/9.9"))
    assert "testbot/9.9" in web.user_agents


@pytest.fixture
def own_web(image_dir):
    """A web of the test's own: the session's may still be serving another test's slow requests,
    which would count towards the concurrency seen here."""
    from tasks.demo.webserver import ImageWeb

    server = ImageWeb(root=image_dir)
    server.start()
    yield server
    server.stop()


def test_inflight_requests_are_bounded(own_web):
    web = own_web
    urls = [f"{web.base_url}/delay/200/a.jpg?i={i}" for i in range(9)]
    results = fetch_all(urls, cfg(max_inflight=3, per_host=8))
    assert {r.reason for r in results} == {None}
    assert 2 <= web.max_concurrent <= 3


def test_per_host_limit(own_web):
    web = own_web
    urls = [f"{web.base_url}/delay/200/a.jpg?i={i}" for i in range(6)]
    results = fetch_all(urls, cfg(max_inflight=16, per_host=2))
    assert {r.reason for r in results} == {None}
    assert web.max_concurrent == 2


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["noai"], True),
        (["noindex, noimageai"], True),
        (["NoML"], True),
        (["otherbot: noai"], False),
        (["shardsmith: noai"], True),
        (["otherbot: noindex, shardsmith: noml"], True),
        (["*: noai"], True),
        (["noindex", "nofollow"], False),
        (["unavailable_after: 25 Jun 2010 15:00:00 PST"], False),
    ],
)
def test_x_robots_tag_parsing(values, expected):
    verdict = x_robots_verdict(values, frozenset({"noai", "noimageai", "noml"}), "shardsmith")
    assert verdict.reason == ("opted_out" if expected else None)
    assert verdict.detail == ("X-Robots-Tag: " + "; ".join(values) if expected else None)


def test_retry_after_forms():
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412400.0) == 80.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_file_urls_under_the_root(tmp_path, image_dir):
    config = cfg(network=NetworkConfig(file_root=str(image_dir), any_port=True))
    assert outcome(f"file://{image_dir}/a.jpg", config)[:2] == (None, "jpeg")
    assert outcome(f"file://{image_dir}/missing.jpg", config)[0] == "read_error"
    assert outcome(f"file://{tmp_path}/x.jpg", config)[0] == "blocked_scheme"
