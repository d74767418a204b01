"""Broker discovery by DNS: ``dns+tcp://NAME:PORT`` is every address NAME resolves to, followed.

A Kubernetes headless Service (or any DNS name with several A/AAAA records) names the set of
brokers; workers (``mesh worker-stub``, ``mesh attach``) given ``--broker dns+tcp://NAME:PORT``
connect to every address and re-resolve every ``refresh_s``, opening links to brokers that
appeared and closing links to those that went away, so brokers can be scaled or restarted
(with new pod addresses) without restarting a single worker. Plain ``tcp://``, ``ipc://`` and
``inproc://`` endpoints are used as they are.

Resolution goes through :class:`Resolver`: the system resolver (``getaddrinfo`` on the event
loop's executor, never blocking the loop), after an optional override file named by
``$MESH_RESOLVE_FILE`` (``NAME ADDRESS [ADDRESS ...]`` per line, re-read at each resolution) that
tests and operators can edit to steer discovery. A failed resolution keeps the last good set
(a DNS outage must not disconnect a fleet) and is counted. Followers take a ``resolver``
(anything with ``async resolve(name) -> list[str] | None``): tests inject one and drive the answers.

Bounds (issue 32: a name answering 300-400 addresses exhausted libzmq's 1,023 sockets per
context, 261 link tasks died and the real broker, sorting last, was never reached):

* at most :data:`MAX_FOLLOWED` addresses of one name are followed (:func:`choose_endpoints`):
  the answer de-duplicated, the ones already linked and healthy kept, the other slots a random
  sample of the rest, addresses not tried yet first, so a large answer is walked through a
  sample at a time until its live brokers are found;
* every follower on one ZeroMQ context shares its socket budget (:func:`link_budget`): a link
  that does not fit is not opened (counted, logged), it never dies trying;
* a broker that left the answer is not dropped: its link stays as it is, and if the broker is
  still missing after :data:`DRAIN_AFTER_REFRESHES` refreshes the link is drained (no new work,
  its streams finish); it closes only when it really fails (a name whose answer flaps loses no
  request, and does not drain a fleet at every flap).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import socket
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping

from mesh.errors import ConfigError

__all__ = ["DNS_SCHEME", "MAX_FOLLOWED", "DRAIN_AFTER_REFRESHES", "LINK_SOCKETS", "is_dns", "parse_dns", "endpoints_for", "Resolver",
           "check_endpoint", "choose_endpoints", "LinkBudget", "link_budget"]

DNS_SCHEME = "dns+tcp://"
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
MAX_FOLLOWED = 64  # addresses of one dns+tcp:// name followed at a time
DRAIN_AFTER_REFRESHES = 3  # a linked broker missing from this many answers in a row is drained
LINK_SOCKETS = 3  # ZeroMQ sockets one broker link holds (its DEALER, the monitor's pair)
_RESERVED_SOCKETS = 64  # of a context's MAX_SOCKETS, left to everything that is not a broker link


def is_dns(spec: str) -> bool:
    return spec.startswith(DNS_SCHEME)


def check_endpoint(spec: str, name: str = "brokers") -> None:
    """ConfigError naming ``name`` unless ``spec`` is a ZeroMQ endpoint or ``dns+tcp://NAME:PORT``."""
    if is_dns(spec):
        parse_dns(spec, name)
    elif not spec.startswith(_ZMQ_SCHEMES):
        raise ConfigError(f"{name}: {spec!r} must be a tcp://, ipc://, inproc:// or dns+tcp://NAME:PORT endpoint")


def parse_dns(spec: str, name: str = "brokers") -> tuple[str, int]:
    """(NAME, PORT) of ``dns+tcp://NAME:PORT``; ConfigError naming ``name`` otherwise."""
    rest = spec[len(DNS_SCHEME):]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "*" in host:
        raise ConfigError(f"{name}: {spec!r}: expected dns+tcp://NAME:PORT")
    return host.strip("[]"), int(port)


def endpoints_for(port: int, addresses: Iterable[str]) -> list[str]:
    """ZeroMQ endpoints for ``addresses`` at ``port``, sorted, IPv6 bracketed."""
    out = set()
    for a in addresses:
        ip = ipaddress.ip_address(a)
        out.add(f"tcp://[{ip}]:{port}" if ip.version == 6 else f"tcp://{ip}:{port}")
    return sorted(out)


class Resolver:
    """Addresses of a name: the override file first (``$MESH_RESOLVE_FILE``), else the system."""

    def __init__(self, override_file: str | None = None) -> None:
        self.override_file = override_file if override_file is not None else os.environ.get("MESH_RESOLVE_FILE") or None
        self.failures = 0

    def _override(self, name: str) -> list[str] | None:
        if not self.override_file:
            return None
        try:
            text = Path(self.override_file).read_text()
        except OSError:
            return None
        for line in text.splitlines():
            parts = line.split("#", 1)[0].split()
            if parts and parts[0] == name:
                return [p for p in parts[1:] if _is_ip(p)]
        return None

    async def resolve(self, name: str) -> list[str] | None:
        """Every address of ``name`` (possibly none), or None when resolution failed."""
        o = self._override(name)
        if o is not None:
            return o
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            self.failures += 1
            return None
        return sorted({info[4][0] for info in infos})


def _is_ip(s: str) -> bool:
    try:
        ipaddress.ip_address(s)
        return True
    except ValueError:
        return False


def choose_endpoints(answer: Iterable[str], linked: Mapping[str, bool], limit: int = MAX_FOLLOWED,
                     rng: random.Random | None = None) -> list[str]:
    """The endpoints of ``answer`` to follow, at most ``limit`` (de-duplicated, answer order
    otherwise): those ``linked`` and healthy (``linked[ep]`` True) first, then a random sample of
    the others, the ones never tried (not in ``linked``) before the ones tried and not healthy.
    With ``limit`` or fewer addresses every one is followed. Pure, apart from ``rng``."""
    eps = list(dict.fromkeys(answer))
    if len(eps) <= limit:
        return eps
    rng = rng or random.Random()
    keep = [e for e in eps if linked.get(e)][:limit]
    fresh = [e for e in eps if e not in linked]
    tried = [e for e in eps if e in linked and not linked[e]]
    rng.shuffle(fresh)
    rng.shuffle(tried)
    chosen = set(keep + (fresh + tried)[:limit - len(keep)])
    return [e for e in eps if e in chosen]


class LinkBudget:
    """Broker links one ZeroMQ context can still hold, shared by every follower on it (libzmq
    refuses sockets past the context's MAX_SOCKETS: a link task that hits it dies)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.used = 0
        self.refused = 0  # links not opened for want of room

    def take(self) -> bool:
        if self.used >= self.capacity:
            self.refused += 1
            return False
        self.used += 1
        return True

    def give(self) -> None:
        self.used = max(0, self.used - 1)


_BUDGETS: "weakref.WeakKeyDictionary[Any, LinkBudget]" = weakref.WeakKeyDictionary()


def link_budget(ctx: Any, max_sockets: int) -> LinkBudget:
    """The :class:`LinkBudget` of context ``ctx`` (whose MAX_SOCKETS is ``max_sockets``): one
    per context, made on first use."""
    b = _BUDGETS.get(ctx)
    if b is None:
        b = _BUDGETS[ctx] = LinkBudget((max_sockets - _RESERVED_SOCKETS) // LINK_SOCKETS)
    return b
