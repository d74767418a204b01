"""What makes a Valkey log entry or checkpoint the indexer's own: HMAC-SHA256 signatures and a
replay guard (pure: no I/O, no clock; the times come in).

Whoever can write to the store (its password, a neighbour on its network) can append entries,
rewrite the checkpoint and move the trim mark. Without the indexer token they cannot *sign*:

* every log entry is ``msgpack([origin, n, t_ms, kind, *args])`` with a signature over the
  state id and those bytes (:meth:`LogSigner.entry_mac`). ``origin`` is a replica process's
  random id, ``n`` its entry counter, ``t_ms`` its wall clock when it signed;
* a checkpoint's signature covers the state id, the entry id it covers, the trim mark, the
  state record and the replay guard's record (:meth:`LogSigner.checkpoint_mac`);
* a signed entry copied back into the log (a replay) is refused by :class:`ReplayGuard`: its
  ``(origin, n)`` was applied already, or it was signed more than ``max_skew_ms`` before the time
  the store gave it. That store time is believed only up to ``max_skew_ms`` past the newest
  signing time applied so far: a forged entry with a far-future stream id (every later id then
  carries that time) makes no genuine entry after it stale. The guard's state goes into every
  checkpoint, so every replica, running or starting, refuses the same entries.

The key is derived from the token (:func:`mac_key_from_token`); without a token nothing is
signed (``--insecure-store``: anyone who can write the store can forge anything).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgpack

__all__ = ["LogSigner", "ReplayGuard", "mac_key_from_token", "MAX_SKEW_MS"]

#: An entry signed further than this from the store's clock (its stream id) is refused: a replay
#: of an old entry, or a replica host whose clock is off by minutes.
MAX_SKEW_MS = 300_000
_WINDOW = 4096  # per origin: counters this far below the highest seen are refused outright


def mac_key_from_token(token: str | None) -> bytes | None:
    """The signing key: derived from the bearer token (None without one)."""
    if not token:
        return None
    return hashlib.sha256(b"mesh-indexer-checkpoint\0" + token.encode()).digest()


class LogSigner:
    """Signs and checks entries and checkpoints under one key (None: signs nothing, checks nothing)."""

    def __init__(self, key: bytes | None) -> None:
        self.key = key

    def _mac(self, *parts: bytes) -> bytes:
        h = hmac.new(self.key or b"", digestmod=hashlib.sha256)
        for p in parts:  # length-prefixed: no two part lists give the same bytes
            h.update(len(p).to_bytes(8, "big"))
            h.update(p)
        return h.digest()

    def entry_mac(self, state_id: int, payload: bytes) -> bytes:
        return self._mac(b"entry", state_id.to_bytes(8, "big"), payload) if self.key else b""

    def checkpoint_mac(self, state_id: int, upto: bytes, trimmed: bytes, data: bytes, guard: bytes) -> bytes:
        return self._mac(b"checkpoint", state_id.to_bytes(8, "big"), upto, trimmed, data, guard) if self.key else b""

    def check_entry(self, state_id: int, payload: bytes, mac: bytes | None) -> str:
        """"" when the entry may be decoded, else why not (``unsigned``, ``bad_signature``)."""
        if self.key is None:
            return ""
        if not mac:
            return "unsigned"
        return "" if hmac.compare_digest(mac, self.entry_mac(state_id, payload)) else "bad_signature"

    def check_checkpoint(self, state_id: int, upto: bytes, trimmed: bytes, data: bytes, guard: bytes,
                         mac: bytes | None) -> str:
        if self.key is None:
            return ""
        if not mac:
            return "unsigned"
        ok = hmac.compare_digest(mac, self.checkpoint_mac(state_id, upto, trimmed, data, guard))
        return "" if ok else "bad_signature"


class ReplayGuard:
    """Which signed entries were applied: per origin the highest counter and the recent ones.

    Deterministic given the entries and their store times, so replicas agree; bounded: origins
    silent for ``2 * max_skew_ms`` of store time are forgotten (an entry of theirs replayed later
    is refused as stale anyway), and at most ``2 * _WINDOW`` counters are kept per origin."""

    def __init__(self, max_skew_ms: int = MAX_SKEW_MS) -> None:
        self.max_skew_ms = max_skew_ms
        self.origins: dict[int, list[Any]] = {}  # origin -> [last store time ms, highest n, set of recent n]
        self.newest_ms = 0  # the latest signing time of an applied entry (caps what a store time may claim)

    def check(self, origin: int, n: int, signed_ms: int, store_ms: int) -> str:
        """"" and remember the entry when it is new, else why not (``stale``, ``replayed``)."""
        if self.newest_ms:  # a store time beyond what any signer has reached is a forged stream id's
            store_ms = min(store_ms, self.newest_ms + self.max_skew_ms)
        if abs(store_ms - signed_ms) > self.max_skew_ms:
            return "stale"
        o = self.origins.get(origin)
        if o is None:
            o = self.origins[origin] = [store_ms, n, set()]
        last_ms, hi, seen = o
        if n in seen or n <= hi - _WINDOW:
            return "replayed"
        seen.add(n)
        self.newest_ms = max(self.newest_ms, signed_ms)
        o[0] = max(last_ms, store_ms)
        if n > hi:
            o[1] = n
            if len(seen) > 2 * _WINDOW:
                o[2] = {x for x in seen if x > n - _WINDOW}
        return ""

    def prune(self, store_ms: int) -> None:
        cut = store_ms - 2 * self.max_skew_ms
        for origin in [k for k, v in self.origins.items() if v[0] < cut]:
            del self.origins[origin]

    def dump(self) -> bytes:
        return msgpack.packb([self.newest_ms, [[k, t, hi, sorted(seen)] for k, (t, hi, seen) in self.origins.items()]])

    def load(self, blob: bytes) -> None:
        """Replace the guard's state (ValueError/TypeError on a malformed record: nothing changed)."""
        origins: dict[int, list[Any]] = {}
        newest, rows = msgpack.unpackb(blob) if blob else (0, ())
        if type(newest) is not int:
            raise TypeError("replay guard: ints expected")
        for k, t, hi, seen in rows:
            if not all(type(x) is int for x in (k, t, hi, *seen)):
                raise TypeError("replay guard: ints expected")
            origins[k] = [t, hi, set(seen)]
        self.origins, self.newest_ms = origins, newest
