"""Tenants: who a request belongs to, its priority band, its weight and its limits (pure: no I/O, no clock).

A keys file (TOML, like every mesh config; read by the shell, :mod:`brokers.keys_file`) maps API
keys to tenants::

    zmq_tenant = "internal"          # the tenant of ZeroMQ clients (they send no key); default "default"

    [[tenant]]
    name = "chat"
    priority = "high"                # its ceiling: critical | high | normal | low
    weight = 2.0                     # its share among the tenants of its band (fair queueing)
    max_inflight = 200               # requests in flight at once, over every connection (0 = no limit)
    tokens_per_min = 2_000_000       # prompt + max_new tokens per minute, a token bucket (0 = no limit)
    admin = false                    # may use the admin API (/workers actions, mesh ctl)
    keys = ["sha256:9f86d08...", "sk-plain-key"]   # sha256:HEX (preferred) or the key itself
    curve_keys = ["app-1"]           # ZeroMQ clients whose CURVE key is NAME.key in --curve-allow-clients

Only SHA-256 digests are kept in memory; a presented key is hashed and its digest looked up. Admin is a right of its own: an inference key never implies it.
Every error is a :class:`~mesh.errors.ConfigError` naming the entry (``tenant[2] 'chat'``) and
the field. Priorities are band numbers, 0 (critical) .. 3 (low); a client may ask for a lower
band than its tenant's, never a higher one (:meth:`Tenant.clamp`).

:class:`TokenBucket` and :class:`TenantLedger` count per tenant (in flight, tokens per minute),
with the time handed in.
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from mesh import protocol as P
from mesh.errors import ConfigError

__all__ = ["BANDS", "DEFAULT_TENANT", "MAX_KEYS_FILE_BYTES", "MAX_TENANTS", "KeyRing", "Tenant", "TenantLedger",
           "TokenBucket", "band_of", "key_digest", "parse_keys"]

#: Priority bands, highest first: a request's band is its index here.
BANDS = P.PRIORITIES
MAX_KEYS_FILE_BYTES = 1 << 20
MAX_TENANTS = 1024  # tenants name metric labels: bounded
MAX_KEYS_PER_TENANT = 1024
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
_TENANT_FIELDS = ("name", "priority", "weight", "max_inflight", "tokens_per_min", "admin", "keys", "curve_keys")
_TOP_FIELDS = ("zmq_tenant", "tenant")


def band_of(v: Any) -> int | None:
    """A band number from a band name or number (None: not a band)."""
    if type(v) is int and 0 <= v < len(BANDS):
        return v
    if isinstance(v, str) and v in BANDS:
        return BANDS.index(v)
    return None


def key_digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass") if isinstance(key, str) else key).digest()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: int = 2  # its ceiling band (0 critical .. 3 low)
    weight: float = 1.0
    max_inflight: int = 0  # 0: no limit of its own
    tokens_per_min: int = 0  # 0: no limit
    admin: bool = False

    def clamp(self, asked: int | None) -> int:
        """The band a request asking for ``asked`` gets: never above the tenant's ceiling."""
        return self.priority if asked is None else max(self.priority, asked)


DEFAULT_TENANT = Tenant("default")


@dataclass(slots=True)
class KeyRing:
    """Tenants by name, and key digests -> tenant name."""

    tenants: dict[str, Tenant] = field(default_factory=lambda: {DEFAULT_TENANT.name: DEFAULT_TENANT})
    digests: dict[bytes, str] = field(default_factory=dict)
    zmq_tenant: str = DEFAULT_TENANT.name
    curve_names: dict[str, str] = field(default_factory=dict)  # CURVE key name (NAME.key) -> tenant name

    def lookup(self, key: str | bytes) -> Tenant | None:
        """The tenant of an API key, or None. Only digests are stored and compared: a lookup's
        timing tells about the SHA-256 of the key presented, nothing about a stored key."""
        name = self.digests.get(key_digest(key))
        return None if name is None else self.tenants[name]

    def curve_tenants(self, key_names: dict[bytes, str], source: str = "keys_file") -> dict[bytes, str]:
        """CURVE public key -> tenant name, from the client allow-list's ``public key -> key name``;
        a ConfigError when a ``curve_keys`` name is not in the allow-list."""
        listed = set(key_names.values())
        for name, tenant in self.curve_names.items():
            if name not in listed:
                raise ConfigError(f"{source}: tenant {tenant!r}: curve_keys: no {name}.key in --curve-allow-clients")
        return {pub: self.curve_names[n] for pub, n in key_names.items() if n in self.curve_names}

    def get(self, name: str | None) -> Tenant:
        """A tenant by name; an unknown name (or None) is the ZeroMQ clients' tenant."""
        t = self.tenants.get(name or "")
        return t if t is not None else self.tenants[self.zmq_tenant]

    def add_key(self, key: str, tenant: Tenant) -> None:
        """Map one plain key to ``tenant`` (``--api-key``, ``--admin-key``); ConfigError if mapped already."""
        d = key_digest(key)
        if d in self.digests:
            raise ConfigError(f"the key of tenant {tenant.name!r} is also a key of tenant {self.digests[d]!r}")
        self.tenants.setdefault(tenant.name, tenant)
        self.digests[d] = tenant.name


def parse_keys(text: str | bytes, source: str = "keys file") -> KeyRing:
    """A keys file's text -> :class:`KeyRing`; a ConfigError names ``source``, the entry and the field."""
    if len(text) > MAX_KEYS_FILE_BYTES:
        raise ConfigError(f"{source}: {len(text)} bytes; the limit is {MAX_KEYS_FILE_BYTES}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: not UTF-8 ({exc})") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    _known(doc, _TOP_FIELDS, source)
    entries = _bounded_list(doc.get("tenant", []), dict, f"{source}: tenant", "an array of tables ([[tenant]])",
                            MAX_TENANTS, "tenants")
    ring = KeyRing(tenants={}, digests={})
    for i, e in enumerate(entries):
        t, digests, curve = _tenant(e, f"{source}: tenant[{i}]")
        where = f"{source}: tenant[{i}] {t.name!r}"
        if t.name in ring.tenants:
            raise ConfigError(f"{where}: name: duplicates another tenant's name")
        ring.tenants[t.name] = t
        for j, d in enumerate(digests):
            if d in ring.digests:
                raise ConfigError(f"{where}: keys[{j}]: duplicate key (also a key of tenant {ring.digests[d]!r})")
            ring.digests[d] = t.name
        for j, n in enumerate(curve):
            if n in ring.curve_names:
                raise ConfigError(f"{where}: curve_keys[{j}]: {n!r} is also a key of tenant {ring.curve_names[n]!r}")
            ring.curve_names[n] = t.name
    zt = doc.get("zmq_tenant", DEFAULT_TENANT.name)
    if not isinstance(zt, str) or not _NAME_RE.fullmatch(zt):
        raise ConfigError(f"{source}: zmq_tenant: must be a tenant name (1..64 of A-Z a-z 0-9 . _ -)")
    ring.zmq_tenant = zt
    if zt not in ring.tenants:
        if zt != DEFAULT_TENANT.name:
            raise ConfigError(f"{source}: zmq_tenant: no tenant is named {zt!r}")
        ring.tenants[zt] = DEFAULT_TENANT
    return ring


def _tenant(e: dict[str, Any], where: str) -> tuple[Tenant, list[bytes], list[str]]:
    name = e.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"{where}: name: required, 1..64 of A-Z a-z 0-9 . _ -")
    where = f"{where} {name!r}"
    _known(e, _TENANT_FIELDS, where)
    prio = band_of(e.get("priority", "normal"))
    if prio is None or type(e.get("priority", "normal")) is not str:
        raise ConfigError(f"{where}: priority: must be one of {', '.join(BANDS)}, got {e.get('priority')!r}")
    weight = e.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or not 0 < weight <= 1e6:
        raise ConfigError(f"{where}: weight: must be a number in (0, 1e6], got {weight!r}")
    limits = {}
    for k in ("max_inflight", "tokens_per_min"):
        v = e.get(k, 0)
        if type(v) is not int or not 0 <= v <= 10**12:
            raise ConfigError(f"{where}: {k}: must be an integer >= 0 (0 = no limit), got {v!r}")
        limits[k] = v
    admin = e.get("admin", False)
    if type(admin) is not bool:
        raise ConfigError(f"{where}: admin: must be true or false")
    keys = _bounded_list(e.get("keys", []), str, f"{where}: keys", "a list of strings", MAX_KEYS_PER_TENANT, "keys")
    digests = []
    for j, k in enumerate(keys):
        if k.startswith("sha256:"):
            if not _HASH_RE.fullmatch(k):
                raise ConfigError(f"{where}: keys[{j}]: sha256: must be followed by 64 lower-case hex digits")
            digests.append(bytes.fromhex(k[7:]))
        elif not 16 <= len(k) <= 512 or not k.isprintable() or k != k.strip():
            raise ConfigError(f"{where}: keys[{j}]: a key is 16..512 printable characters without surrounding spaces")
        else:
            digests.append(key_digest(k))
    curve = _bounded_list(e.get("curve_keys", []), str, f"{where}: curve_keys", "a list of key names", MAX_KEYS_PER_TENANT, "keys")
    for j, n in enumerate(curve):
        if not _NAME_RE.fullmatch(n):
            raise ConfigError(f"{where}: curve_keys[{j}]: a key name (NAME of NAME.key: 1..64 of A-Z a-z 0-9 . _ -)")
    return Tenant(name, prio, float(weight), limits["max_inflight"], limits["tokens_per_min"], admin), digests, curve


def _known(d: dict[str, Any], fields: tuple[str, ...], where: str) -> None:
    for k in d:
        if k not in fields:
            raise ConfigError(f"{where}: unknown field {k!r}; fields: {', '.join(fields)}")


def _bounded_list(v: Any, item: type, where: str, what: str, limit: int, noun: str) -> list:
    if not isinstance(v, list) or not all(isinstance(x, item) for x in v):
        raise ConfigError(f"{where}: must be {what}")
    if len(v) > limit:
        raise ConfigError(f"{where}: {len(v)} {noun}; the limit is {limit}")
    return v


class TokenBucket:
    """Tokens per minute: holds up to one minute's worth, refilled from the time passed in. A
    request larger than the bucket is let through when the bucket is full and leaves it in debt."""

    __slots__ = ("rate_per_s", "capacity", "level", "at_s")

    def __init__(self, tokens_per_min: int, now: float) -> None:
        self.capacity = float(tokens_per_min)
        self.rate_per_s = tokens_per_min / 60.0
        self.level = self.capacity
        self.at_s = now

    def _refill(self, now: float) -> None:
        if now > self.at_s:
            self.level = min(self.capacity, self.level + (now - self.at_s) * self.rate_per_s)
            self.at_s = now

    def take(self, n: int, now: float) -> float:
        """Take ``n`` tokens: 0.0 when taken, else the seconds until they could be."""
        self._refill(now)
        need = min(float(n), self.capacity)
        if self.level >= need:
            self.level -= n
            return 0.0
        return (need - self.level) / self.rate_per_s


class TenantLedger:
    """Per-tenant counts: requests in flight (over every connection) and the token buckets."""

    def __init__(self) -> None:
        self.inflight: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}

    def refusal(self, t: Tenant, tokens: int, now: float) -> tuple[str, float] | None:
        """Why ``t`` may not start a request of ``tokens`` now, and the seconds after which it
        may (None: it may; the tokens are then taken)."""
        if t.max_inflight and self.inflight.get(t.name, 0) >= t.max_inflight:
            return f"tenant {t.name!r} already has {t.max_inflight} requests in flight", 1.0
        if t.tokens_per_min:
            b = self._buckets.get(t.name)
            if b is None or b.capacity != t.tokens_per_min:  # new, or the keys file changed its limit
                b = self._buckets[t.name] = TokenBucket(t.tokens_per_min, now)
            wait_s = b.take(tokens, now)
            if wait_s:
                return f"tenant {t.name!r} is over its {t.tokens_per_min} tokens per minute", wait_s
        return None

    def admit(self, name: str) -> None:
        self.inflight[name] = self.inflight.get(name, 0) + 1

    def release(self, name: str) -> None:
        n = self.inflight.get(name, 0) - 1
        if n > 0:
            self.inflight[name] = n
        else:
            self.inflight.pop(name, None)
