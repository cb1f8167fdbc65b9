"""Property-based tests for the parts that read third-party input: the URL guard and the tar reader.

Any input ends as accepted or as a rejection with a stable reason and a detail: never an unhandled
exception, never a hang (hypothesis' deadline bounds every example). The manifest reader has its own
property test in test_manifests.py.
"""

from __future__ import annotations

import io
import ipaddress
import tarfile

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tasks.formats.reasons import REASONS
from tasks.formats.recipe_download import NetworkConfig
from tasks.formats.shards import ShardWriter, iter_samples
from tasks.formats.tar_format import SHARD_ERROR_REASONS
from tasks.formats.tar_reader import ShardError, iter_tar_members
from tasks.policies.urlguard import AddressPolicy, check_url

GUARD = NetworkConfig()
POLICY = AddressPolicy.from_config(GUARD)
FAST = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])

_URL_PIECES = [
    "http://",
    "https://",
    "file://",
    "s3://",
    "ftp://",
    "gopher://",
    "HTTP://",
    "//",
    "[",
    "]",
    "::1",
    "::ffff:",
    "127.0.0.1",
    "0x7f.1",
    "2130706433",
    "017700000001",
    "10.0.0.1",
    "169.254.169.254",
    "example.com",
    "@",
    ":",
    ":0",
    ":80",
    ":99999",
    "/",
    "..",
    "%2e%2e",
    "%00",
    "?",
    "#",
    "\\",
    " ",
    "\u2024",
    "xn--",
    "localhost",
    "fe80::1%eth0",
]


@FAST
@given(st.one_of(st.text(max_size=80), st.lists(st.sampled_from(_URL_PIECES), max_size=12).map("".join)))
def test_any_url_is_allowed_or_refused_with_a_known_reason(url):
    verdict = check_url(url, GUARD, POLICY)
    assert verdict.ok or (verdict.reason in REASONS and verdict.detail)


_LABELS = st.one_of(
    st.from_regex(r"[a-z0-9-]{1,70}", fullmatch=True),
    st.text(min_size=0, max_size=70),
    st.sampled_from(["xn--zz", "xn--bcher-kva", "b\u00fccher", "\u2603", "a" * 63, "a" * 64, "", "_dmarc", "%41"]),
)


@FAST
@given(st.lists(_LABELS, min_size=1, max_size=6).map(".".join))
def test_a_host_the_guard_accepts_never_breaks_name_resolution(host):
    """Whatever check_url lets through, getaddrinfo's IDNA codec can encode (no UnicodeError later)."""
    from yarl import URL

    url = f"http://{host}/a.jpg"
    verdict = check_url(url, GUARD, POLICY)
    if verdict.ok:
        URL(url).raw_host.encode("idna")  # what aiohttp hands to getaddrinfo
    else:
        assert verdict.reason in REASONS and verdict.detail


@FAST
@given(st.from_regex(r"[a-z0-9.:@-]{0,40}", fullmatch=True), st.integers(0, 3000))
def test_over_the_length_cap_is_always_url_too_long(host, pad):
    url = f"http://{host}/" + "a" * pad
    verdict = check_url(url, GUARD, POLICY)
    if len(url) > GUARD.max_url_chars:
        assert verdict.reason == "url_too_long"


@FAST
@given(
    st.from_regex(r"[a-z0-9]{1,10}", fullmatch=True),
    st.text(max_size=10).filter(lambda t: not set(t) & set("/?#@[]\\")),
)
def test_user_info_is_always_refused(user, secret):
    verdict = check_url(f"http://{user}:{secret}@example.com/a.jpg", GUARD, POLICY)
    assert verdict.reason in ("credentials_in_url", "invalid_url")


@FAST
@given(st.integers(1, 65535), st.sampled_from(["http", "https"]))
def test_only_allowlisted_ports_pass(port, scheme):
    verdict = check_url(f"{scheme}://example.com:{port}/a.jpg", GUARD, POLICY)
    if port in (80, 443):
        assert verdict.ok
    else:
        assert verdict.reason == "port_not_allowed"


@FAST
@given(st.ip_addresses())
def test_literal_addresses_pass_only_when_global(ip):
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    verdict = check_url(f"http://{host}/a.jpg", GUARD, POLICY)
    inner = None
    if ip.version == 6:
        inner = ip.ipv4_mapped or (ip.sixtofour if ip.sixtofour is not None else None)
    if not ip.is_global or ip.is_multicast or (inner is not None and (not inner.is_global or inner.is_multicast)):
        assert verdict.reason == "blocked_address"
        assert str(ip) in verdict.detail
    # A global address may still be refused when it wraps a non-global one (Teredo, NAT64):
    # never the other way round.


@FAST
@given(st.ip_addresses(v=4))
def test_ipv4_in_ipv6_wrappers_is_judged_by_the_inner_address(ip):
    mapped = ipaddress.IPv6Address(f"::ffff:{ip}")
    assert AddressPolicy().allows(mapped) == AddressPolicy().allows(ip)


def _valid_tar(samples: list[tuple[str, dict[str, bytes]]]) -> bytes:
    buf = io.BytesIO()
    w = ShardWriter(buf)
    for key, members in samples:
        w.write_sample(key, members)
    w.close()
    return buf.getvalue()


_SAMPLES = st.lists(
    st.tuples(
        st.from_regex(r"[a-z]{1,6}-[0-9]{1,4}", fullmatch=True),
        st.dictionaries(
            st.sampled_from(["jpg", "txt", "json", "png"]), st.binary(max_size=700), min_size=1, max_size=3
        ),
    ),
    min_size=1,
    max_size=5,
    unique_by=lambda s: s[0],
)


def _read_all(data: bytes) -> tuple[list, str | None]:
    try:
        return [(s.key, sorted(s.members)) for s in iter_samples(io.BytesIO(data), max_member_bytes=1 << 20)], None
    except ShardError as err:
        assert err.reason in SHARD_ERROR_REASONS
        return [], err.reason


@FAST
@given(st.binary(max_size=3000))
def test_any_bytes_read_as_samples_or_a_shard_error(data):
    _read_all(data)


@FAST
@given(_SAMPLES, st.data())
def test_a_mutated_shard_reads_or_fails_with_a_reason(samples, data):
    raw = bytearray(_valid_tar(samples))
    # Flip bytes anywhere: headers (names, sizes, types, checksums), data and padding.
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _read_all(bytes(raw[:cut]))


@FAST
@given(_SAMPLES)
def test_a_valid_shard_round_trips(samples):
    got, reason = _read_all(_valid_tar(samples))
    assert reason is None
    assert got == [(k, sorted(m)) for k, m in samples]


_HOSTILE_TYPES = {
    tarfile.SYMTYPE: "tar_symlink",
    tarfile.LNKTYPE: "tar_hardlink",
    tarfile.CHRTYPE: "tar_device",
    tarfile.BLKTYPE: "tar_device",
    tarfile.FIFOTYPE: "tar_device",
}


@FAST
@given(
    st.sampled_from(sorted(_HOSTILE_TYPES)),
    st.sampled_from(["a.jpg", "/etc/passwd", "../../x.jpg", "k/../../y.txt", "ok-1.txt"]),
    st.integers(0, 3),
)
def test_links_devices_and_escaping_names_are_refused(kind, name, position):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for i in range(4):
            if i == position:
                info = tarfile.TarInfo(name)
                info.type = kind
                info.linkname = "/etc/shadow"
                tf.addfile(info)
            else:
                payload = b"x" * (i + 1)
                info = tarfile.TarInfo(f"s-{i}.txt")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    try:
        list(iter_tar_members(io.BytesIO(buf.getvalue())))
    except ShardError as err:
        expected = {"tar_absolute_name", "tar_parent_reference", _HOSTILE_TYPES[kind]}
        assert err.reason in expected
    else:
        raise AssertionError(f"a {_HOSTILE_TYPES[kind]} member named {name!r} was accepted")


@FAST
@given(st.integers(1, 64), st.integers(0, 40))
def test_member_size_cap_is_enforced_from_the_header(cap_kb, extra):
    size = cap_kb * 1024 + extra + 1
    assume(size > cap_kb * 1024)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo("big-1.jpg")
        info.size = size
        tf.addfile(info, io.BytesIO(b"\0" * size))
    try:
        list(iter_tar_members(io.BytesIO(buf.getvalue()), max_member_bytes=cap_kb * 1024))
    except ShardError as err:
        assert err.reason == "tar_member_too_large"
    else:
        raise AssertionError("an over-cap member was read")
