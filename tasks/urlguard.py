"""The SSRF guard: which URLs and addresses a download may reach."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from urllib.parse import unquote, urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from tasks.recipe import NetworkConfig

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class BlockedAddress(OSError):
    """A host that resolves only to addresses the policy refuses."""


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, Teredo, NAT64), if any."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


class AddressPolicy:
    """Decides whether an IP address may be connected to.

    Args:
        allow_private_networks: allow every address (tests, demos, trusted intranets).
        allowed_networks: CIDRs allowed although not global.

    Only globally routable addresses pass by default: loopback, private, link-local (and so
    cloud metadata at 169.254.169.254), CGNAT, multicast, reserved and unspecified addresses
    are refused, also when wrapped in IPv6 (``::ffff:127.0.0.1``, 6to4, Teredo, NAT64).
    """

    def __init__(self, allow_private_networks: bool = False, allowed_networks: tuple[str, ...] = ()):
        self.allow_all = allow_private_networks
        self.allowed = tuple(ipaddress.ip_network(c, strict=False) for c in allowed_networks)

    @classmethod
    def from_config(cls, cfg: NetworkConfig) -> "AddressPolicy":
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


def check_url(url: str, network: NetworkConfig, policy: AddressPolicy) -> str | None:
    """Reason to refuse ``url`` before any connection, or None.

    Host names are checked again after resolution by :class:`GuardedResolver`; literal IPs
    never reach a resolver, so they are checked here.
    """
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a malformed port
    except ValueError:
        return "invalid_url"
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        host = parts.hostname
        if not host:
            return "invalid_url"
        ip = literal_ip(host)
        if ip is not None and not policy.allows(ip):
            return "blocked_address"
        if port == 0:
            return "invalid_url"
        return None
    if scheme == "file":
        if network.file_root is None or resolve_file_url(url, network.file_root) is None:
            return "blocked_scheme"
        return None
    if scheme == "s3":
        if parts.netloc not in network.s3_buckets:
            return "blocked_scheme"
        return None
    return "unsupported_scheme"


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

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        if self._inner is None:
            self._inner = ThreadedResolver(asyncio.get_running_loop())
        results = await self._inner.resolve(host, port, family)
        allowed = [r for r in results if self.policy.allows(r["host"])]
        if not allowed:
            raise BlockedAddress(f"{host} resolves only to refused addresses: {', '.join(r['host'] for r in results)}")
        return allowed

    async def close(self) -> None:
        if self._inner is not None:
            await self._inner.close()
