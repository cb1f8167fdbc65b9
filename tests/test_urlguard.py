"""The SSRF guard refuses non-global addresses in every disguise, and allows what the recipe says."""

import asyncio

import pytest

from tasks.recipe import NetworkConfig
from tasks.urlguard import AddressPolicy, BlockedAddress, GuardedResolver, check_url

REFUSED = [
    "127.0.0.1", "127.1.2.3", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254",
    "100.64.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fc00::1",
    "fd00:ec2::254", "::ffff:127.0.0.1", "::ffff:10.1.2.3", "2002:7f00:1::1", "64:ff9b::a9fe:a9fe",
    "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo wrapping 127.0.0.1 (obfuscated)
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("address", REFUSED)
def test_default_policy_refuses_non_global(address):
    assert not AddressPolicy().allows(address)


@pytest.mark.parametrize("address", ALLOWED)
def test_default_policy_allows_global(address):
    assert AddressPolicy().allows(address)


def test_allowed_networks_open_only_what_they_name():
    policy = AddressPolicy(allowed_networks=("127.0.0.1/32",))
    assert policy.allows("127.0.0.1")
    assert policy.allows("::ffff:127.0.0.1")  # the same host, wrapped
    assert not policy.allows("127.0.0.2")
    assert not policy.allows("10.0.0.1")


def test_allow_private_networks_allows_everything():
    assert AddressPolicy(allow_private_networks=True).allows("10.0.0.1")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1/x.jpg", "blocked_address"),
        ("http://[::1]:8080/x.jpg", "blocked_address"),
        ("http://[::ffff:169.254.169.254]/latest/meta-data", "blocked_address"),
        ("ftp://example.com/x.jpg", "unsupported_scheme"),
        ("gopher://example.com/", "unsupported_scheme"),
        ("javascript:alert(1)", "unsupported_scheme"),
        ("http:///x.jpg", "invalid_url"),
        ("http://example.com:99999/x.jpg", "invalid_url"),
        ("file:///etc/passwd", "blocked_scheme"),
        ("s3://someone-elses-bucket/x.jpg", "blocked_scheme"),
        ("https://example.com/x.jpg", None),
        ("http://8.8.8.8/x.jpg", None),
    ],
)
def test_check_url(url, reason):
    assert check_url(url, NetworkConfig(), AddressPolicy()) == reason


def test_file_urls_only_under_the_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.jpg").write_bytes(b"x")
    (tmp_path / "outside.jpg").write_bytes(b"x")
    (root / "link.jpg").symlink_to(tmp_path / "outside.jpg")
    net = NetworkConfig(file_root=str(root))
    policy = AddressPolicy()
    assert check_url(f"file://{root}/ok.jpg", net, policy) is None
    assert check_url(f"file://{root}/../outside.jpg", net, policy) == "blocked_scheme"
    assert check_url(f"file://{root}/link.jpg", net, policy) == "blocked_scheme"


def test_s3_only_for_listed_buckets():
    net = NetworkConfig(s3_buckets=("ours",))
    assert check_url("s3://ours/a.jpg", net, AddressPolicy()) is None
    assert check_url("s3://theirs/a.jpg", net, AddressPolicy()) == "blocked_scheme"


def test_resolver_refuses_names_that_resolve_to_loopback():
    async def go():
        resolver = GuardedResolver(AddressPolicy())
        try:
            with pytest.raises(BlockedAddress, match="localhost"):
                await resolver.resolve("localhost", 80)
        finally:
            await resolver.close()

    asyncio.run(go())


def test_resolver_numeric_host_forms_resolve_then_refused():
    # "2130706433" is 127.0.0.1 written as one integer; getaddrinfo accepts it.
    async def go():
        resolver = GuardedResolver(AddressPolicy())
        try:
            with pytest.raises(BlockedAddress):
                await resolver.resolve("2130706433", 80)
        finally:
            await resolver.close()

    asyncio.run(go())


def test_resolver_keeps_allowed_addresses():
    async def go():
        resolver = GuardedResolver(AddressPolicy(allowed_networks=("127.0.0.0/8",)))
        try:
            return await resolver.resolve("localhost", 80)
        finally:
            await resolver.close()

    hosts = {r["host"] for r in asyncio.run(go())}
    assert hosts and all(h.startswith("127.") for h in hosts)
