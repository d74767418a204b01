"""Who a request comes from: the peer address, or behind trusted reverse proxies the client they name.

Behind a reverse proxy on the same host every client's connection comes from loopback, and one
proxy address carries everyone. ``--http-trusted-proxies CIDR[,CIDR...]`` names the proxies whose
``X-Forwarded-For`` is believed: the client is the right-most address in that header that is not a
trusted proxy (what each proxy appended; entries to its left are the client's own word). A request
from a peer that is not a trusted proxy is that peer, whatever its headers say, and one that carries
forwarding headers (``X-Forwarded-For``, ``Forwarded``, ``X-Real-IP``) is never counted as a loopback
client: a proxy nobody declared must not make the whole internet loopback.

The client address keys the per-address bounds of the HTTP front door (brokers/ingress) (body bytes in flight, the broker's
in-flight quota, the tokenizer's fair share) and the loopback-only admin API without keys.
"""

from __future__ import annotations

import contextvars
import ipaddress
from collections.abc import Mapping

__all__ = ["CLIENT", "ClientAddress", "TrustedProxies", "is_loopback", "parse_trusted_proxies"]

_FORWARDING = ("X-Forwarded-For", "Forwarded", "X-Real-IP")
_MAX_HOPS = 32  # addresses of X-Forwarded-For looked at (a longer header is a client's own noise)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_trusted_proxies(spec: str) -> tuple[Network, ...]:
    """``"10.0.0.0/8, 127.0.0.1"`` -> networks; raises ValueError naming the bad entry."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            out.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"{part!r} is not an IP address or CIDR network") from None
    return tuple(out)


def _ip(host: str | None):
    if not host:
        return None
    try:
        return ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str | None) -> bool:
    """True for a loopback address (None, a unix socket, counts as not loopback)."""
    ip = _ip(host)
    return ip.is_loopback if ip is not None else host == "localhost"


class ClientAddress:
    __slots__ = ("address", "forwarded")

    def __init__(self, address: str, forwarded: bool) -> None:
        self.address = address  # the client as far as trusted proxies tell
        self.forwarded = forwarded  # the request carries forwarding headers (a proxy handled it)

    @property
    def loopback(self) -> bool:
        """A client on this host itself: loopback, and no proxy in between that was not believed."""
        return not self.forwarded and is_loopback(self.address)


#: The client of the HTTP request being handled (set by the ingress's middleware).
CLIENT: contextvars.ContextVar[ClientAddress] = contextvars.ContextVar("mesh_http_client", default=ClientAddress("?", True))


class TrustedProxies:
    def __init__(self, networks: tuple[Network, ...] = ()) -> None:
        self.networks = networks

    def trusted(self, host: str | None) -> bool:
        ip = _ip(host)
        return ip is not None and any(ip in n for n in self.networks)

    def client(self, peer: str | None, headers: Mapping[str, str]) -> ClientAddress:
        forwarded = any(h in headers for h in _FORWARDING)
        if not self.networks or not self.trusted(peer):
            return ClientAddress(peer or "?", forwarded)
        hops = [h.strip() for h in headers.get("X-Forwarded-For", "").split(",")][-_MAX_HOPS:]
        for hop in reversed(hops):
            if _ip(hop) is None:
                break  # not an address: the chain is broken here, believe no further
            if not self.trusted(hop):
                return ClientAddress(str(_ip(hop)), False)
        return ClientAddress(peer or "?", False)  # only trusted proxies (or none named): the proxy itself
