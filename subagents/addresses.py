"""Which IP addresses the fetcher may reach: public ones, and private ones only where `allow_private_cidrs`
opens them (a network on every port, or one address and port); cloud metadata endpoints never.

`check_address` judges one address; `allowed_network` reads one `allow_private_cidrs` entry. The fetcher
(fetch.py) resolves a host once and checks every address of every hop with them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from subagents.common import ToolFailure

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


# Instance metadata services hand out cloud credentials; refused even when their network is allowed: AWS/GCP/
# Azure IMDS, AWS IMDS over IPv6, AWS ECS credentials, Alibaba, Azure WireServer (public range: only this list
# catches it), Oracle Cloud.
_METADATA_IPS = "169.254.169.254 fd00:ec2::254 169.254.170.2 100.100.100.200 168.63.129.16 192.0.0.192"
_METADATA = frozenset(map(ipaddress.ip_address, _METADATA_IPS.split()))
# IPv6 prefixes that carry an IPv4 address to a gateway we cannot see; refused outright. The second group
# keeps the IPv4 address in the low 32 bits (IPv4-compatible, NAT64 well-known and local-use).
_EMBEDS_LOW_V4 = tuple(map(ipaddress.IPv6Network, ("::/96", "64:ff9b::/96", "64:ff9b:1::/48")))
_MAPPED_TEREDO = ("::ffff:0:0/96", "2001::/32")
_TRANSITION_V6 = (*map(ipaddress.IPv6Network, _MAPPED_TEREDO), *_EMBEDS_LOW_V4)
_SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")  # reaches the embedded IPv4 address: judged by that address


def check_address(ip: IPAddress, allow: Sequence[Network]) -> None:
    """Raise ToolFailure('blocked_url') unless `ip` is globally routable or in `allow` (metadata never is)."""
    if ip in _METADATA or _embedded_ipv4(ip) in _METADATA:
        raise ToolFailure("blocked_url", f"{ip} is a cloud metadata address")
    if any(ip.version == net.version and ip in net for net in allow):
        return
    # `::1` and `::` lie inside ::/96 (IPv4-compatible) but carry no IPv4 address: judged as what they are.
    if isinstance(ip, ipaddress.IPv6Address) and not (ip.is_loopback or ip.is_unspecified):
        if any(ip in net for net in _TRANSITION_V6):
            raise ToolFailure("blocked_url", f"{ip} embeds an IPv4 address behind a translation prefix")
        if ip in _SIX_TO_FOUR:
            ip = _embedded_ipv4(ip) or ip
    kind = _special_kind(ip)
    if kind is not None:
        raise ToolFailure("blocked_url", f"{ip} is not a public address ({kind})")


def allowed_network(entry: str) -> tuple[Network, int | None]:
    """An `allow_private_cidrs` entry: a network on every port ("10.0.0.0/8", "fd00::/8"), or one address and
    port ("10.0.0.5:8080", "[fd00::5]:8080"). ValueError for anything else."""
    bracketed = entry.startswith("[")
    host, colon, port = entry.removeprefix("[").rpartition("]:" if bracketed else ":")
    if not colon or (":" in host and not bracketed):  # no port: a network (an IPv6 one has colons of its own)
        return ipaddress.ip_network(entry), None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"allow_private_cidrs entry {entry!r}: expected a network, or address:port")
    return ipaddress.ip_network(host), int(port)


def _embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 transition address carries (mapped, 6to4, NAT64, compatible), if any."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped or ip.sixtofour:
        return ip.ipv4_mapped or ip.sixtofour
    if any(ip in net for net in _EMBEDS_LOW_V4):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _special_kind(ip: IPAddress) -> str | None:
    """What keeps `ip` off the public internet ('loopback', 'private' ...; most specific first, as 127.0.0.1
    is also `is_private`), or None. `is_global` alone admits multicast and, before 3.12.4, special ranges."""
    kinds = {
        "loopback": ip.is_loopback,
        "unspecified": ip.is_unspecified,
        "link-local": ip.is_link_local,
        "multicast": ip.is_multicast,
        "site-local": isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local,
        "private": ip.is_private,
        "reserved": ip.is_reserved,
        "special-purpose": not ip.is_global,
    }
    return next((kind for kind, applies in kinds.items() if applies), None)
