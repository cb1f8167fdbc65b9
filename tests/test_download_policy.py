"""The URL policy through the real fetch path (loopback server, real aiohttp): refused before any socket opens, on every redirect too, and every reject with a detail a person can act on."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import quote

import pytest

from tasks.demo.webserver import ImageWeb
from tasks.formats.recipe_download import DownloadConfig, NetworkConfig
from tasks.policies.robots import RobotsRules
from tasks.policies.ruling import Ruling
from tasks.stages.fetch import Fetcher
from tasks.stages.fetched import judge

LOOPBACK = dict(allowed_networks=("127.0.0.1/32",), any_port=True)


def cfg(**kw) -> DownloadConfig:
    base = dict(timeout_s=5, retries=0, backoff_s=0.01, network=NetworkConfig(**LOOPBACK))
    base.update(kw)
    return DownloadConfig(**base)


def fetch(url: str, config: DownloadConfig | None = None):
    config = config or cfg()

    async def go():
        async with Fetcher(config) as f:
            return judge(await f.fetch(url), config.allowed_formats)

    return asyncio.run(go())


@pytest.fixture
def listener():
    """A listening TCP socket on loopback that nobody should ever connect to."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        yield sock


def connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


# --------------------------------------------------------------------------- credentials


def test_credentials_are_refused_and_never_sent(web):
    web.reset_stats()
    got = fetch(f"http://user:secret@127.0.0.1:{web.port}/img/a.jpg?creds")
    assert got.reason == "credentials_in_url"
    assert "secret" not in got.detail
    assert web.hits["/img/a.jpg?creds"] == 0
    assert web.authorizations == set()


def test_credentials_in_a_redirect_target_are_refused_and_never_sent(web):
    web.reset_stats()
    target = f"http://user:secret@127.0.0.1:{web.port}/img/a.jpg?creds-redirect"
    got = fetch(f"{web.base_url}/redirect?to={quote(target, safe='')}")
    assert got.reason == "credentials_in_url"
    assert got.http_status == 302
    assert got.detail.startswith(f"redirect to http://***@127.0.0.1:{web.port}/img/a.jpg")
    assert "secret" not in got.detail
    assert web.hits["/img/a.jpg?creds-redirect"] == 0
    assert web.authorizations == set()


# --------------------------------------------------------------------------- ports


def test_a_port_outside_the_allowlist_is_never_connected(listener):
    port = listener.getsockname()[1]
    got = fetch(f"http://127.0.0.1:{port}/x.jpg", cfg(network=NetworkConfig(allowed_networks=("127.0.0.1/32",))))
    assert got.reason == "port_not_allowed"
    assert got.detail == f"port {port} is not allowed (80, 443 and download.network.allowed_ports)"
    assert not connected(listener)


def test_ports_listed_in_the_recipe_are_allowed(web):
    network = NetworkConfig(allowed_networks=("127.0.0.1/32",), allowed_ports=(web.port,))
    assert fetch(f"{web.base_url}/img/a.jpg", cfg(network=network)).reason is None


def test_a_redirect_to_a_port_outside_the_allowlist_is_never_connected(web, listener):
    port = listener.getsockname()[1]
    network = NetworkConfig(allowed_networks=("127.0.0.1/32",), allowed_ports=(web.port,))
    got = fetch(f"{web.base_url}/redirect?to=http://127.0.0.1:{port}/x.jpg", cfg(network=network))
    assert got.reason == "port_not_allowed"
    assert got.detail.startswith(f"redirect to http://127.0.0.1:{port}/x.jpg: port {port} is not allowed")
    assert not connected(listener)


# --------------------------------------------------------------------------- length and host names


def test_a_url_over_the_length_cap_is_never_requested(web):
    web.reset_stats()
    got = fetch(f"{web.base_url}/img/a.jpg?" + "q" * 100_000)
    assert got.reason == "url_too_long"
    assert "over download.network.max_url_chars (2048)" in got.detail
    assert web.requests == 0
    assert (
        fetch(
            f"{web.base_url}/img/a.jpg?" + "q" * 3000, cfg(network=NetworkConfig(**LOOPBACK, max_url_chars=4096))
        ).reason
        is None
    )


def test_a_host_label_over_63_characters_is_invalid_url():
    """The real fetch, real name resolution: no UnicodeError escapes, the row says why."""
    got = fetch(f"http://{'a' * 64}.example.com/x.jpg", cfg(network=NetworkConfig()))
    assert got.reason == "invalid_url"
    assert got.detail == f"host label {'a' * 37 + '...'!r} is 64 characters, over 63"


def test_a_redirect_to_a_malformed_host_is_invalid_url(web):
    got = fetch(f"{web.base_url}/redirect?to=http://{'b' * 70}.example.com/x.jpg")
    assert got.reason == "invalid_url"
    assert "is 70 characters, over 63" in got.detail


def test_a_literal_address_says_which_and_why(web):
    got = fetch(f"http://127.0.0.2:{web.port}/img/a.jpg")
    assert (got.reason, got.detail) == (
        "blocked_address",
        "refused address 127.0.0.2 (loopback); download.network does not allow it",
    )


def test_a_name_that_resolves_to_a_refused_address_says_which(web):
    got = fetch(f"http://localhost:{web.port}/img/a.jpg", cfg(network=NetworkConfig(any_port=True)))
    assert got.reason == "blocked_address"
    assert "127.0.0.1 (loopback)" in got.detail


# --------------------------------------------------------------------------- details of every reject


def test_http_errors_carry_status_and_reason_phrase(web):
    got = fetch(f"{web.base_url}/status/404")
    assert (got.reason, got.http_status, got.detail) == ("http_404", 404, "HTTP 404 Not Found")
    got = fetch(f"{web.base_url}/status/503", cfg(retries=1))
    assert (got.reason, got.attempts, got.detail) == ("http_503", 2, "HTTP 503 Service Unavailable")


def test_not_an_image_says_what_came_instead(web):
    got = fetch(f"{web.base_url}/html-as-jpeg")
    assert got.reason == "not_an_image"
    assert got.detail.startswith("HTML, starts with '<!DOCTYPE html>")
    assert got.detail.endswith("bytes, Content-Type image/jpeg)")


def test_format_not_allowed_names_format_and_allowlist(web):
    got = fetch(f"{web.base_url}/img/d.gif", cfg(allowed_formats=("jpeg", "png")))
    assert (got.reason, got.format) == ("format_not_allowed", "gif")
    assert got.detail == "gif is not in allowed_formats (jpeg, png; Content-Type image/gif)"


def test_truncated_image_says_what_is_missing(web, image_dir):
    got = fetch(f"{web.base_url}/truncated/a.jpg")
    half = len((image_dir / "a.jpg").read_bytes()) // 2
    assert got.reason == "truncated_image"
    assert got.detail == f"jpeg without its end marker (EOI) in {half} bytes (Content-Type image/jpeg)"
    got = fetch(f"{web.base_url}/truncated/c.webp")
    size = len((image_dir / "c.webp").read_bytes())
    assert (
        got.detail
        == f"webp: received {size // 2} of the {size} bytes its RIFF header declares (Content-Type image/webp)"
    )


def test_a_body_cut_off_in_transit_says_received_versus_declared(web, image_dir):
    size = len((image_dir / "b.png").read_bytes())
    got = fetch(f"{web.base_url}/short/b.png", cfg(retries=1))
    assert (got.reason, got.attempts) == ("connection_error", 2)
    assert f"received {size // 2} of {size} declared bytes" in got.detail


def test_an_empty_body_says_zero_bytes(web, image_dir):
    (image_dir / "empty.jpg").write_bytes(b"")
    got = fetch(f"{web.base_url}/img/empty.jpg")
    assert (got.reason, got.detail) == ("empty_body", "0 bytes (Content-Type image/jpeg)")


def test_too_large_and_opted_out_say_why(web):
    got = fetch(f"{web.base_url}/img/big.png", cfg(max_bytes=1024))
    assert (
        got.reason == "too_large"
        and got.detail.startswith("Content-Length ")
        and "over download.max_bytes (1024)" in got.detail
    )
    got = fetch(f"{web.base_url}/endless", cfg(max_bytes=256 * 1024))
    assert got.reason == "too_large" and got.detail == f"more than download.max_bytes ({256 * 1024}) received"
    got = fetch(f"{web.base_url}/optout/a.jpg")
    assert (got.reason, got.detail) == ("opted_out", "X-Robots-Tag: noai, noimageai")


def test_connection_refused_names_the_exception():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = fetch(f"http://127.0.0.1:{port}/a.jpg")
    assert got.reason == "connection_error"
    assert got.detail.startswith("ClientConnectorError (ConnectionRefusedError): Cannot connect to host 127.0.0.1")


def test_an_unresolvable_name_is_dns_error():
    got = fetch("http://no-such-host.invalid/a.jpg", cfg(network=NetworkConfig()))
    assert got.reason == "dns_error"
    assert got.detail.startswith("ClientConnectorDNSError")


# --------------------------------------------------------------------------- robots.txt, RFC 9309


def test_robots_longest_match_wins():
    rules = RobotsRules.parse(b"User-agent: *\nDisallow: /img/\nAllow: /img/public/\n", "http://h/robots.txt")
    assert rules.verdict("http://h/img/public/a.jpg", "shardsmith").ok
    assert rules.verdict("http://h/img/private/a.jpg", "shardsmith") == Ruling(
        "http://h/img/private/a.jpg",
        "robots_disallowed",
        "http://h/robots.txt disallows /img/private/a.jpg for shardsmith",
    )


def test_robots_wildcards_and_end_anchor():
    # protego: "*" matches any characters; a trailing "$" anchors the end of path and query.
    rules = RobotsRules.parse(b"User-agent: *\nDisallow: /*.jpg$\n", "http://h/robots.txt")
    assert rules.verdict("http://h/x.jpg", "shardsmith").reason == "robots_disallowed"
    assert rules.verdict("http://h/deep/er/x.jpg", "shardsmith").reason == "robots_disallowed"
    assert rules.verdict("http://h/x.jpg?y", "shardsmith").ok
    assert rules.verdict("http://h/x.jpgz", "shardsmith").ok


def test_robots_group_for_our_agent_beats_the_star_group():
    body = b"User-agent: *\nDisallow: /\n\nUser-agent: shardsmith\nAllow: /\n"
    rules = RobotsRules.parse(body, "http://h/robots.txt")
    assert rules.verdict("http://h/a.jpg", "shardsmith").ok
    assert rules.verdict("http://h/a.jpg", "otherbot").reason == "robots_disallowed"


def test_robots_rules_through_the_real_fetch(image_dir):
    robots = "User-agent: *\nDisallow: /img/\nAllow: /img/a\nDisallow: /*.jpg$\n"
    with ImageWeb(image_dir, robots_txt=robots) as site:
        config = cfg(respect_robots_txt=True)
        got = fetch(f"{site.base_url}/img/a.jpg", config)  # /*.jpg$ is the longest match
        assert (got.reason, got.detail) == (
            "robots_disallowed",
            f"{site.base_url}/robots.txt disallows /img/a.jpg for shardsmith",
        )
        assert fetch(f"{site.base_url}/img/a.jpg?v=2", config).reason is None  # Allow /img/a beats Disallow /img/
        assert fetch(f"{site.base_url}/img/b.png", config).reason == "robots_disallowed"
        assert site.hits["/img/a.jpg"] == 1 and site.hits["/img/b.png"] == 0


def test_robots_4xx_allows_and_5xx_disallows(image_dir):
    with ImageWeb(image_dir, robots_txt=None) as site:
        assert fetch(f"{site.base_url}/img/a.jpg", cfg(respect_robots_txt=True)).reason is None
    with ImageWeb(image_dir, robots_txt=503) as site:
        got = fetch(f"{site.base_url}/img/a.jpg", cfg(respect_robots_txt=True))
        # Not fetched, as RFC 9309 asks; but an outage, which a later run retries, not a refusal.
        assert got.reason == "http_503"
        assert (
            got.detail == f"{site.base_url}/robots.txt answered HTTP 503 Service Unavailable: disallow all (RFC 9309)"
        )
        assert site.hits["/img/a.jpg"] == 0


def test_robots_is_fetched_once_per_origin(image_dir):
    with ImageWeb(image_dir) as site:
        config = cfg(respect_robots_txt=True)

        async def go():
            async with Fetcher(config) as f:
                return await asyncio.gather(*(f.fetch(f"{site.base_url}/img/a.jpg?i={i}") for i in range(12)))

        assert {r.reason for r in asyncio.run(go())} == {None}
        assert site.hits["/robots.txt"] == 1


def test_site_files_sent_gzipped_are_read_and_nothing_is_asked_compressed(image_dir):
    # A server that compresses text by its type (nginx's gzip_types) sends robots.txt and
    # tdmrep.json gzipped: their opt-outs hold (they were read as binary and ignored)
    tdm = '[{"location": "/img/*", "tdm-reservation": 1}]'
    with ImageWeb(image_dir, robots_txt="User-agent: *\nDisallow: /img/b\n", tdmrep_json=tdm) as site:
        site.gzip_site_files = True
        got = fetch(f"{site.base_url}/img/b.png", cfg(respect_robots_txt=True, respect_tdmrep=False))
        assert got.reason == "robots_disallowed"
        got = fetch(f"{site.base_url}/img/a.jpg", cfg(respect_robots_txt=False, respect_tdmrep=True))
        assert got.reason == "opted_out" and "reserves TDM rights" in got.detail
        assert site.site_file_encodings == ["identity", "identity"]
        assert site.hits["/img/b.png"] == 0  # robots.txt is read before the image is asked for


def test_a_site_file_inflates_only_to_its_cap():
    import gzip
    import zlib

    from tasks.stages.fetch import _inflated

    bomb = gzip.compress(b"Disallow: /\n" * 100_000)  # 1.2 MB from a few KB
    assert _inflated(bomb, 1000, False) == ((b"Disallow: /\n" * 100)[:1001], True)
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    deflated = raw.compress(b"User-agent: *\n") + raw.flush()
    assert _inflated(deflated, 1000, False) == (b"User-agent: *\n", False)
    assert _inflated(b"not compressed", 1000, False) == (b"not compressed", False)
    # plain text labelled compressed: raw deflate "reads" some of it, but no stream ends there
    for plain in (b"Sitemap: x", b"c", b"User-agent: *\nDisallow: /\n"):
        assert _inflated(plain, 1000, False) == (plain, False)
