"""The SSRF guard refuses non-global addresses in every disguise, and allows what the recipe says."""

import asyncio

import pytest

from tasks.formats.recipe_download import NetworkConfig
from tasks.policies.urlguard import AddressPolicy, BlockedAddress, GuardedResolver, InvalidHost, check_url

LONG_LABEL = "a" * 64


def reason_of(url: str, net: NetworkConfig | None = None, policy: AddressPolicy | None = None) -> str | None:
    verdict = check_url(url, net or NetworkConfig(), policy or AddressPolicy())
    assert verdict.value == url
    if not verdict.ok:
        assert verdict.detail, f"{url}: {verdict.reason} without a detail"
    return verdict.reason


REFUSED = [
    "127.0.0.1",
    "127.1.2.3",
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "169.254.169.254",
    "100.64.0.1",
    "0.0.0.0",
    "224.0.0.1",
    "255.255.255.255",
    "::1",
    "::",
    "fe80::1",
    "fc00::1",
    "fd00:ec2::254",
    "::ffff:127.0.0.1",
    "::ffff:10.1.2.3",
    "::127.0.0.1",  # IPv4-compatible
    "::a9fe:a9fe",
    "2002:7f00:1::1",
    "64:ff9b::a9fe:a9fe",
    "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo wrapping 127.0.0.1 (obfuscated)
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "::8.8.8.8"]


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
        ("http://example.com:0/x.jpg", "invalid_url"),
        ("file:///etc/passwd", "blocked_scheme"),
        ("s3://someone-elses-bucket/x.jpg", "blocked_scheme"),
        ("https://example.com/x.jpg", None),
        ("http://8.8.8.8/x.jpg", None),
        # credentials: refused whatever else the URL says, so they are never sent
        ("http://user:secret@example.com/x.jpg", "credentials_in_url"),
        ("https://user@example.com/x.jpg", "credentials_in_url"),
        ("http://:secret@example.com/x.jpg", "credentials_in_url"),
        # ports: 80 and 443 for either scheme; no port means the scheme's default
        ("http://example.com:80/x.jpg", None),
        ("https://example.com:443/x.jpg", None),
        ("http://example.com:443/x.jpg", None),
        ("http://example.com:6379/x.jpg", "port_not_allowed"),
        ("https://example.com:8443/x.jpg", "port_not_allowed"),
        ("http://8.8.8.8:22/", "port_not_allowed"),
        # host names
        (f"http://{LONG_LABEL}.example.com/x.jpg", "invalid_url"),
        ("http://" + ".".join(["a" * 60] * 5) + "/x.jpg", "invalid_url"),  # 304 characters
        ("http://exa%41mple.com/x.jpg", "invalid_url"),
        ("http://ex ample.com/x.jpg", "invalid_url"),
        ("http://a..b.com/x.jpg", "invalid_url"),
        ("http://xn--zz.com/x.jpg", "invalid_url"),  # not valid punycode
        ("http://xn--bcher-kva.de/x.jpg", None),
        ("http://bücher.de/x.jpg", None),  # IDNA-encoded as aiohttp will send it
        ("http://example.com./x.jpg", None),  # a fully qualified name
        ("http://[::1/x.jpg", "invalid_url"),
        ("http://exa\tmple.com/x.jpg", "invalid_url"),
    ],
)
def test_check_url(url, reason):
    assert reason_of(url) == reason


def test_url_length_cap_is_configurable():
    url = "https://example.com/" + "a" * 2100
    assert reason_of(url) == "url_too_long"
    assert reason_of(url, NetworkConfig(max_url_chars=4096)) is None
    assert reason_of("https://example.com/" + "a" * 100_000, NetworkConfig(max_url_chars=4096)) == "url_too_long"
    refusal = check_url(url, NetworkConfig(), AddressPolicy())
    assert refusal.detail == f"URL is {len(url)} characters, over download.network.max_url_chars (2048)"


def test_ports_the_recipe_allows():
    assert reason_of("http://example.com:8080/x.jpg") == "port_not_allowed"
    assert reason_of("http://example.com:8080/x.jpg", NetworkConfig(allowed_ports=(8080,))) is None
    assert reason_of("http://example.com:8081/x.jpg", NetworkConfig(allowed_ports=(8080,))) == "port_not_allowed"
    assert reason_of("http://example.com/x.jpg", NetworkConfig(allowed_ports=(8080,))) is None  # 80 stays
    assert reason_of("http://example.com:6379/x.jpg", NetworkConfig(any_port=True)) is None
    assert reason_of("http://example.com:0/x.jpg", NetworkConfig(any_port=True)) == "invalid_url"


def test_allowed_ports_are_validated():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="1-65535"):
        NetworkConfig(allowed_ports=(0,))


@pytest.mark.parametrize(
    ("url", "detail"),
    [
        (f"http://{LONG_LABEL}.example.com/x.jpg", "is 64 characters, over 63"),
        ("http://" + ".".join(["a" * 60] * 5) + "/x.jpg", "host name is 304 characters, over 253"),
        ("http://exa%41mple.com/x.jpg", "character '%' is not valid in a host name"),
        ("http://xn--zz.com/x.jpg", "is not valid IDNA"),
        ("http://127.0.0.2/x.jpg", "refused address 127.0.0.2 (loopback)"),
        ("http://[::ffff:10.1.2.3]/x.jpg", "refused address ::ffff:a01:203 (wraps 10.1.2.3, private)"),
        ("http://169.254.169.254/latest", "refused address 169.254.169.254 (link-local)"),
        ("http://example.com:6379/x.jpg", "port 6379 is not allowed"),
        ("ftp://example.com/x.jpg", "scheme 'ftp' is not http, https, file or s3"),
    ],
)
def test_refusals_say_what_is_wrong(url, detail):
    assert detail in check_url(url, NetworkConfig(), AddressPolicy()).detail


def test_file_urls_only_under_the_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.jpg").write_bytes(b"x")
    (tmp_path / "outside.jpg").write_bytes(b"x")
    (root / "link.jpg").symlink_to(tmp_path / "outside.jpg")
    net = NetworkConfig(file_root=str(root))
    policy = AddressPolicy()
    assert check_url(f"file://{root}/ok.jpg", net, policy).ok
    assert reason_of(f"file://{root}/../outside.jpg", net, policy) == "blocked_scheme"
    assert reason_of(f"file://{root}/link.jpg", net, policy) == "blocked_scheme"


def test_s3_only_for_listed_buckets():
    net = NetworkConfig(s3_buckets=("ours",))
    assert check_url("s3://ours/a.jpg", net, AddressPolicy()).ok
    assert reason_of("s3://theirs/a.jpg", net) == "blocked_scheme"


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


def test_resolver_turns_an_idna_error_of_getaddrinfo_into_invalid_host():
    """getaddrinfo raises UnicodeError on a label over 63 characters: the real call, no mock."""

    async def go():
        resolver = GuardedResolver(AddressPolicy())
        try:
            with pytest.raises(InvalidHost, match="UnicodeError"):
                await resolver.resolve(f"{LONG_LABEL}.example.com", 80)
        finally:
            await resolver.close()

    asyncio.run(go())


def test_refused_resolution_names_the_addresses():
    async def go():
        resolver = GuardedResolver(AddressPolicy())
        try:
            with pytest.raises(BlockedAddress, match=r"127\.0\.0\.1 \(loopback\)"):
                await resolver.resolve("localhost", 80)
        finally:
            await resolver.close()

    asyncio.run(go())
