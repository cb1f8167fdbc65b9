"""The URL policy and SSRF guard: which URLs and addresses a download may reach."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import socket
from urllib.parse import unquote, urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from tasks.formats.recipe_download import NetworkConfig
from tasks.policies.ruling import Ruling

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_COMPATIBLE = ipaddress.ip_network("::/96")  # IPv4-compatible (deprecated, RFC 4291): ::127.0.0.1


class BlockedAddress(OSError):
    """A host that resolves only to addresses the policy refuses."""


class InvalidHost(OSError):
    """A host name the resolver cannot encode (IDNA: a label over 63 characters, an empty label)."""


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, compatible, 6to4, Teredo, NAT64), if any."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64 or (ip in _COMPATIBLE and int(ip) > 1):  # :: and ::1 are themselves
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


class AddressPolicy:
    """Decides whether an IP address may be connected to.

    Args:
        allow_private_networks: allow every address (tests, demos, trusted intranets).
        allowed_networks: CIDRs allowed although not global.

    Only globally routable addresses pass by default: loopback, private, link-local (and so
    cloud metadata at 169.254.169.254), CGNAT, multicast, reserved and unspecified addresses
    are refused, also when wrapped in IPv6 (``::ffff:127.0.0.1``, ``::127.0.0.1``, 6to4, Teredo, NAT64).
    """

    def __init__(self, allow_private_networks: bool = False, allowed_networks: tuple[str, ...] = ()):
        self.allow_all = allow_private_networks
        self.allowed = tuple(ipaddress.ip_network(c, strict=False) for c in allowed_networks)

    @classmethod
    def from_config(cls, cfg: NetworkConfig) -> AddressPolicy:
        return cls(cfg.allow_private_networks, cfg.allowed_networks)

    def allows(self, address: str | IPAddress) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0] if isinstance(address, str) else address)
        if self.allow_all:
            return True
        candidates = [ip]
        inner = embedded_ipv4(ip)
        if inner is not None:
            candidates.append(inner)
        if any(any(c.version == n.version and c in n for n in self.allowed) for c in candidates):
            return True
        return all(c.is_global and not c.is_multicast for c in candidates)


def literal_ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def address_kind(ip: IPAddress) -> str:
    """Why an address is not global, in words: ``loopback``, ``private``, ``link-local`` ..."""
    inner = embedded_ipv4(ip)
    if inner is not None and not (inner.is_global and not inner.is_multicast):
        return f"wraps {inner}, {address_kind(inner)}"
    for attr, kind in (
        ("is_unspecified", "unspecified"),
        ("is_loopback", "loopback"),
        ("is_link_local", "link-local"),
        ("is_multicast", "multicast"),
        ("is_private", "private"),
        ("is_reserved", "reserved"),
    ):
        if getattr(ip, attr):
            return kind
    return "not globally routable" if not ip.is_global else "global"


_DEFAULT_PORTS = {"http": 80, "https": 443}
_ALWAYS_ALLOWED_PORTS = frozenset(_DEFAULT_PORTS.values())
_HOST_LABEL = re.compile(r"[a-z0-9_-]+")  # after IDNA; "_" occurs in real host names


def host_problem(host: str) -> str | None:
    """What is wrong with an ASCII host name (as sent to the resolver), or None.

    getaddrinfo's IDNA codec raises ``UnicodeError`` on a label over 63 characters; checked
    here first, with the other limits of RFC 1035 and the characters a host can hold.
    """
    name = host[:-1] if host.endswith(".") else host
    if not name:
        return "empty host name"
    if len(name) > 253:
        return f"host name is {len(name)} characters, over 253"
    for label in name.split("."):
        if not label:
            return f"empty label in host name {_short(host)!r}"
        if len(label) > 63:
            return f"host label {_short(label)!r} is {len(label)} characters, over 63"
        if not _HOST_LABEL.fullmatch(label):
            bad = next(c for c in label if not _HOST_LABEL.fullmatch(c))
            return f"character {bad!r} is not valid in a host name ({_short(host)!r})"
        if label.startswith("xn--"):
            try:
                label[4:].encode("ascii").decode("punycode")
            except UnicodeError as err:
                return f"host label {_short(label)!r} is not valid IDNA ({err})"
    return None


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_url(url: str, network: NetworkConfig, policy: AddressPolicy) -> Ruling[str]:
    """Whether ``url`` may be fetched, judged before any connection; the verdict's value is ``url``.

    http(s) URLs are parsed by yarl, as aiohttp will request them, so the checks and the
    request agree on user info, host and port. Host names are checked again after
    resolution by :class:`GuardedResolver`; literal IPs never reach a resolver, so they are
    checked here.
    """
    if len(url) > network.max_url_chars:
        return Ruling(
            url,
            "url_too_long",
            f"URL is {len(url)} characters, over download.network.max_url_chars ({network.max_url_chars})",
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        return Ruling(url, "invalid_url", "control character in the URL")
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        return _check_web_url(url, network, policy)
    try:
        return _check_object_url(url, scheme, network)
    except ValueError as err:  # urlsplit: "Invalid IPv6 URL" and the like
        return Ruling(url, "invalid_url", f"cannot parse the URL: {err}")


def _check_object_url(url: str, scheme: str, network: NetworkConfig) -> Ruling[str]:
    if scheme == "file":
        if network.file_root is None:
            return Ruling(url, "blocked_scheme", "file:// URLs need download.network.file_root")
        if resolve_file_url(url, network.file_root) is None:
            return Ruling(
                url, "blocked_scheme", f"file:// URL outside download.network.file_root ({network.file_root})"
            )
        return Ruling(url)
    if scheme == "s3":
        bucket = urlsplit(url).netloc
        if bucket not in network.s3_buckets:
            return Ruling(url, "blocked_scheme", f"s3 bucket {_short(bucket)!r} is not in download.network.s3_buckets")
        return Ruling(url)
    return Ruling(
        url,
        "unsupported_scheme",
        f"scheme {_short(scheme)!r} is not http, https, file or s3" if scheme else "no scheme",
    )


def _check_web_url(url: str, network: NetworkConfig, policy: AddressPolicy) -> Ruling[str]:
    try:
        parsed = URL(url)
        port = parsed.port
        host = parsed.raw_host
    except (ValueError, UnicodeError) as err:
        # yarl encodes non-ASCII host names with IDNA here: a bad one is a UnicodeError.
        return Ruling(url, "invalid_url", f"cannot parse the URL: {type(err).__name__}: {err}")
    if parsed.user is not None or parsed.password is not None:
        return Ruling(
            url, "credentials_in_url", "the URL carries a user name or password before '@'; credentials are never sent"
        )
    if not host:
        return Ruling(url, "invalid_url", "the URL has no host")
    ip = literal_ip(host)
    if ip is None:
        if ":" in host:
            return Ruling(url, "invalid_url", f"{_short(host)!r} is not a valid IPv6 address")
        problem = host_problem(host)
        if problem is not None:
            return Ruling(url, "invalid_url", problem)
    elif not policy.allows(ip):
        return Ruling(
            url, "blocked_address", f"refused address {ip} ({address_kind(ip)}); download.network does not allow it"
        )
    if port is None or port == 0:
        return Ruling(url, "invalid_url", "port 0")
    if not network.any_port and port not in _ALWAYS_ALLOWED_PORTS and port not in network.allowed_ports:
        return Ruling(
            url, "port_not_allowed", f"port {port} is not allowed (80, 443 and download.network.allowed_ports)"
        )
    return Ruling(url)


def resolve_file_url(url: str, root: str) -> str | None:
    """Real local path of a file:// URL when it lies under ``root`` (links resolved), else None."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        return None
    real_root = os.path.realpath(root)
    path = os.path.realpath(unquote(parts.path))
    if os.path.commonpath([real_root, path]) != real_root:
        return None
    return path


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that resolves once and keeps only the addresses the policy allows.

    aiohttp connects to exactly the addresses a resolver returns, so a name cannot be
    re-resolved to a refused address between the check and the connection.
    """

    def __init__(self, policy: AddressPolicy):
        self.policy = policy
        self._inner: ThreadedResolver | None = None

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if self._inner is None:
            self._inner = ThreadedResolver(asyncio.get_running_loop())
        try:
            results = await self._inner.resolve(host, port, family)
        except UnicodeError as err:
            # getaddrinfo's IDNA codec; an OSError, so aiohttp reports it as a connector error.
            raise InvalidHost(f"host name {_short(host)!r} cannot be resolved: {type(err).__name__}: {err}") from err
        allowed = [r for r in results if self.policy.allows(r["host"])]
        if not allowed:
            refused = ", ".join(
                f"{r['host']} ({address_kind(ipaddress.ip_address(r['host'].split('%', 1)[0]))})" for r in results
            )
            raise BlockedAddress(f"{host} resolves only to refused addresses: {refused}")
        return allowed

    async def close(self) -> None:
        if self._inner is not None:
            await self._inner.close()
