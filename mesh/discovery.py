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
(a DNS outage must not disconnect a fleet) and is counted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from pathlib import Path
from typing import Iterable

from mesh.errors import ConfigError

__all__ = ["DNS_SCHEME", "is_dns", "parse_dns", "endpoints_for", "Resolver", "check_endpoint"]

DNS_SCHEME = "dns+tcp://"
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


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
