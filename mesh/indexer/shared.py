"""Valkey (or Redis) as the shared state of indexer replicas: one mutation log, checkpoints.

``mesh indexer --backend valkey --valkey-url redis://HOST:PORT/DB`` runs a replica whose state
lives in Valkey, so several replicas share one state and a replica that restarts (SIGKILL
included) comes back with it, without asking any broker for anything:

* **One log.** Every mutation a replica is asked for (ApplyKvBatch(es), RegisterWorker,
  ForgetWorker) is appended to one Valkey stream (``{prefix}:log``, XADD) *before* it is
  applied. Every replica tails that stream (XREAD BLOCK) and applies every entry, its own and the
  other replicas', in stream order, through the same :class:`~mesh.indexer.core.IndexerCore`
  the in-memory backend runs. The core is deterministic given its entries and their times, and
  an entry's time is its stream id (the Valkey server's clock, ms): all replicas reach the same
  verdicts and the same state. A caller gets the verdict of *its* entry as applied by the replica
  it called. Worker and ghost expiry run on entry times too, so replicas expire alike.
* **Queries stay local.** MatchPrefix reads the replica's own copy: no Valkey round trip per
  query. The copy lags the log by the tail latency (about a millisecond on one host).
* **Checkpoints.** After every ``checkpoint_every`` entries one replica (chosen by a lock key
  with a TTL) writes its whole state with the id of the last entry it covers to
  ``{prefix}:checkpoint`` and trims the log to the *previous* checkpoint (a replica a little
  behind can still read on). A starting replica loads the checkpoint and replays the log after it
  before its port opens. A checkpoint is an explicit msgpack record (:mod:`mesh.indexer.state`),
  never a pickle.
* **Signed.** Every entry and checkpoint is signed (HMAC-SHA256, :mod:`mesh.indexer.signing`)
  under a key derived from the bearer token, and checked before it is applied; a signed entry
  copied back into the log is refused too (the replay guard). Whatever does not verify (a writer
  of the store without the token) is skipped, counted (``log_bad_entries_<reason>``,
  ``checkpoints_rejected``), logged (``indexer_log_entry_rejected``,
  ``indexer_checkpoint_rejected``) and shown in Stats; it never stops a replica nor its start: a
  rejected checkpoint means a rebuild from the log. Without a token nothing can be checked, so
  the backend refuses to start unless ``--insecure-store`` says so (``indexer_store_unsigned``).
* **One state id.** ``{prefix}:state`` names the state (random, set by the first replica): it is
  every replica's ``server_instance``, before and after restarts, so brokers see no restart and
  resync nothing. If it changes (Valkey flushed or replaced), replicas drop their copy and follow
  the new state, and brokers, seeing a new ``server_instance``, resync every stream into it.

This is the design Dynamo's KV router replicas use with NATS JetStream (events replayed from
a durable stream, snapshots every so many events), here on Valkey, the store SGLang's indexer
and llm-d use. Costs (``mesh bench indexer`` runs both backends side by side): an apply waits
for XADD and for the tail to bring the entry back; a match costs what it does in memory.

Limits: replicas on one Valkey must run with the same ``--max-entries`` and limits (their
verdicts depend on them); LRU order follows each replica's own queries, so at the entry budget
replicas may evict differently. Valkey down: mutations fail with UNAVAILABLE (brokers retry and
resync later), queries go on from the local copy, health is NOT_SERVING until the tail is back.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from mesh.errors import ConfigError, MeshError
from mesh.indexer.signing import LogSigner, ReplayGuard
from mesh.logs import RateLimiter, get_logger
from mesh.retry import RetryPolicy

__all__ = ["ValkeyLog", "SharedState", "StoreUnavailable", "parse_valkey_url", "parse_id", "DEFAULT_PREFIX", "PASSWORD_ENV"]

DEFAULT_PREFIX = "mesh:indexer"
#: Environment variable holding the Valkey password (AUTH), instead of redis://:PASSWORD@HOST.
PASSWORD_ENV = "MESH_VALKEY_PASSWORD"
_READ_COUNT = 512  # entries per XREAD
_BLOCK_MS = 1000  # how long one XREAD waits for new entries
_SUBMIT_TIMEOUT_S = 5.0  # an appended entry not applied by then: the caller gets UNAVAILABLE
_LOCK_TTL_MS = 30_000
_EXPIRE_PERIOD_S = 5.0  # expiry pass at most this often, in log time
_RECONNECT = RetryPolicy.forever(base_ms=50.0, cap_ms=2000.0)  # the tail's reads of a store that is down


class StoreUnavailable(MeshError):
    """Valkey cannot be reached (or did not answer in time): the mutation was not applied."""


def parse_valkey_url(url: str, field: str = "valkey_url") -> str:
    if not url.startswith(("redis://", "rediss://", "valkey://", "valkeys://", "unix://")):
        raise ConfigError(f"{field}: {url!r} must be redis://HOST:PORT[/DB] (or rediss://, valkey://, unix://)")
    return url.replace("valkey", "redis", 1) if url.startswith("valkey") else url


def _redacted(url: str) -> str:
    """``url`` with any password replaced by ``***`` (redis://user:secret@host -> redis://user:***@host)."""
    from urllib.parse import urlsplit, urlunsplit

    u = urlsplit(url)
    if u.password is None:
        return url
    user = u.username or ""
    host = u.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def entry_time_s(entry_id: bytes) -> float:
    """An entry's time: the ms part of its stream id (the Valkey server's clock), in seconds."""
    return int(entry_id.split(b"-", 1)[0]) / 1000.0


def _id_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


def parse_id(entry_id: Any) -> tuple[int, int] | None:
    """A stream id read from a field anyone may have written: its sort key, None if not an id."""
    if not isinstance(entry_id, bytes) or len(entry_id) > 41:
        return None
    ms, sep, seq = entry_id.partition(b"-")
    if not ms.isdigit() or not seq.isdigit() or not sep:
        return None
    return int(ms), int(seq)


class ValkeyLog:
    """The Valkey keys of one shared state (``prefix``) and the few commands used on them.

    Every failure is raised as :class:`StoreUnavailable` naming the command."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, *, mac_key: bytes | None = None,
                 timeout_s: float = 2.0, password: str | None = None) -> None:
        import redis.asyncio as aioredis

        url = parse_valkey_url(url)
        self.url = _redacted(url)  # for messages and logs: a password in the URL stays out of them
        self.prefix = prefix
        self.k_log = f"{prefix}:log"
        self.k_state = f"{prefix}:state"
        self.k_ckpt = f"{prefix}:checkpoint"
        self.k_lock = f"{prefix}:checkpoint-lock"
        self.signer = LogSigner(mac_key)
        # Two clients: the tail's XREAD BLOCK holds its connection for up to _BLOCK_MS.
        # a password from a file or the environment keeps it off the command line (ps, manifests)
        password = password or os.environ.get(PASSWORD_ENV) or None
        auth = {"password": password} if password else {}
        self.r = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **auth)
        self.tail = aioredis.Redis.from_url(url, socket_timeout=timeout_s + _BLOCK_MS / 1000,
                                            socket_connect_timeout=timeout_s, **auth)

    async def _do(self, what: str, coro: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await coro
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise StoreUnavailable(f"valkey {self.url} {what}: {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        for c in (self.r, self.tail):
            try:
                await c.aclose()
            except Exception:  # closing a dead connection: nothing to do
                pass

    async def state_id(self) -> int:
        """The state's id, created (random, non-zero) by the first replica to ask."""
        await self._do("SET state", self.r.set(self.k_state, int.from_bytes(os.urandom(8), "little") | 1, nx=True))
        v = await self._do("GET state", self.r.get(self.k_state))
        if v is None:
            raise StoreUnavailable(f"valkey {self.url}: {self.k_state} vanished")
        return int(v)

    async def append(self, entries: list[tuple[bytes, bytes]]) -> list[bytes]:
        """XADD each (payload, signature) (one round trip); their entry ids, in order."""
        pipe = self.r.pipeline(transaction=False)
        for p, mac in entries:
            pipe.xadd(self.k_log, {b"o": p, b"m": mac} if mac else {b"o": p})
        return await self._do("XADD", pipe.execute())

    async def read(self, after: bytes, *, block_ms: int | None) -> tuple[list[tuple[bytes, bytes, bytes]], tuple]:
        """Entries ``(id, payload, signature)`` after ``after`` (at most ``_READ_COUNT``), waiting up
        to ``block_ms`` for one, and the checkpoint's mark ``(trim point, id, signature)`` read
        just after them (one round trip). Trims only move forward, so when ``after`` is not below
        that point no entry after ``after`` was trimmed before the read: XREAD itself would skip
        trimmed entries without a word. (The mark is as written: it may be forged.)"""
        pipe = self.tail.pipeline(transaction=False)
        pipe.xread({self.k_log: after}, count=_READ_COUNT, block=block_ms)
        pipe.hmget(self.k_ckpt, [b"trimmed", b"id", b"mac"])
        res, mark = await self._do("XREAD", pipe.execute())
        entries = [(eid, fields.get(b"o", b""), fields.get(b"m", b"")) for eid, fields in res[0][1]] if res else []
        return entries, (mark[0] or b"0-0", mark[1], mark[2])

    async def load_checkpoint(self) -> dict[bytes, bytes] | None:
        """The checkpoint's fields as written (unchecked); None when there is none."""
        h = await self._do("HGETALL checkpoint", self.r.hgetall(self.k_ckpt))
        return h or None

    async def last_log_id(self) -> bytes:
        """The id of the newest entry the log ever had (``0-0`` without a log)."""
        from redis.exceptions import ResponseError

        try:
            info = await self._do("XINFO", self.r.xinfo_stream(self.k_log))
        except StoreUnavailable as exc:
            if isinstance(exc.__cause__, ResponseError):  # no such key: nothing was ever appended
                return b"0-0"
            raise
        last = info.get("last-generated-id") or info.get(b"last-generated-id") or b"0-0"
        return last if isinstance(last, bytes) else str(last).encode()

    async def save_checkpoint(self, state_id: int, upto: bytes, data: bytes, guard: bytes) -> bool:
        """Write a checkpoint covering entries up to ``upto``, then trim the log below the
        previous one. False when another replica holds the checkpoint lock."""
        if not await self._do("SET lock", self.r.set(self.k_lock, b"1", nx=True, px=_LOCK_TTL_MS)):
            return False
        try:
            prev = await self._do("HGET checkpoint", self.r.hget(self.k_ckpt, b"id"))
            pk = parse_id(prev)
            if pk is not None and pk >= _id_key(upto) and pk <= _id_key(await self.last_log_id()):
                return False  # someone wrote a newer one meanwhile
            # trimmed: entries below it are gone; a replica whose tail is behind it reloads this
            # checkpoint. A previous id that is garbage or ahead of the log (forged) trims nothing.
            trimmed = prev if pk is not None and pk < _id_key(upto) else b"0-0"
            await self._do("HSET checkpoint", self.r.hset(self.k_ckpt, mapping={
                b"id": upto, b"data": data, b"guard": guard, b"trimmed": trimmed, b"t": str(time.time()).encode(),
                b"mac": self.signer.checkpoint_mac(state_id, upto, trimmed, data, guard)}))
            if trimmed != b"0-0":
                await self._do("XTRIM", self.r.xtrim(self.k_log, minid=trimmed, approximate=False))
            return True
        finally:
            await self._do("DEL lock", self.r.delete(self.k_lock))

    async def log_length(self) -> int:
        return int(await self._do("XLEN", self.r.xlen(self.k_log)))


@dataclass(slots=True)
class _Waiter:
    fut: asyncio.Future


class SharedState:
    """Follows one :class:`ValkeyLog` into an :class:`~mesh.indexer.server.IndexerService`'s core.

    ``submit(op)`` appends and returns what applying the entry gave (an ApplyOutcome, an int, or
    the exception the core raised, returned, not raised). ``start()`` loads the checkpoint and
    replays to the end of the log; ``run()`` tails it until cancelled. ``on_ready(bool)`` is
    called when the tail is caught up / has lost Valkey. Entries and checkpoints that do not
    verify are skipped, counted and logged (see the module docstring), never fatal.
    """

    def __init__(self, svc: Any, log: ValkeyLog, *, checkpoint_every: int = 20_000, worker_ttl_s: float = 0.0,
                 ghost_ttl_s: float = 0.0, on_ready: Callable[[bool], None] | None = None) -> None:
        self.svc = svc
        self.core = svc.core
        self.vlog = log
        self.signer = log.signer
        self.guard = ReplayGuard()
        self.checkpoint_every = checkpoint_every
        self.worker_ttl_s = worker_ttl_s
        self.ghost_ttl_s = ghost_ttl_s
        self.on_ready = on_ready
        self.origin = int.from_bytes(os.urandom(8), "little")
        self.next_n = 0  # this process's entry counter (the replay guard's per-origin sequence)
        self.last_id = b"0-0"
        self.state_id = 0
        self.ready = False
        self.since_checkpoint = 0
        self.last_expiry_s = 0.0
        self.results: dict[bytes, Any] = {}  # own entries applied before their submitter looked
        self.waiters: dict[bytes, asyncio.Future] = {}
        self.c = svc.core.c
        self.log = get_logger(service="indexer", backend="valkey")
        self._rl = RateLimiter(5.0)
        self._checkpointing: asyncio.Task | None = None
        self._rejected_mark: tuple | None = None  # the checkpoint mark last rejected (not reloaded again)
        self._mark: tuple | None = None  # the mark of the checkpoint last read
        self.last_rejection = ""  # what was last refused from the store (Stats, readiness log)

    # ------------------------------------------------------------------ writing
    async def submit(self, ops: list[tuple]) -> list[Any]:
        """Append ``ops`` (one round trip) and wait until this replica has applied them."""
        entries = []
        t_ms = int(time.time() * 1000)
        for op in ops:
            self.next_n += 1
            p = msgpack.packb([self.origin, self.next_n, t_ms, *op], use_bin_type=True)
            entries.append((p, self.signer.entry_mac(self.state_id, p)))
        ids = await self.vlog.append(entries)
        self.c["log_appended"] += len(ids)
        out: list[Any] = []
        for eid in ids:
            if eid in self.results:
                out.append(self.results.pop(eid))
                continue
            fut = asyncio.get_running_loop().create_future()
            self.waiters[eid] = fut
            try:
                out.append(await asyncio.wait_for(fut, _SUBMIT_TIMEOUT_S))
            except asyncio.TimeoutError:
                self.c["log_apply_timeouts"] += 1
                raise StoreUnavailable(f"valkey {self.vlog.url}: entry {eid.decode()} not read back within "
                                       f"{_SUBMIT_TIMEOUT_S:g} s (the log tail is stalled)") from None
            finally:
                self.waiters.pop(eid, None)
        return out

    # ------------------------------------------------------------------ following
    async def start(self) -> None:
        """Load the state: id, checkpoint, then the log to its end (raises StoreUnavailable only)."""
        self.state_id = await self.vlog.state_id()
        self.core.instance = self.state_id
        ck = await self._good_checkpoint()
        if ck is not None and self._adopt_checkpoint(*ck):
            self.c["checkpoints_loaded"] += 1
            self.log.info("indexer_checkpoint_loaded", upto=ck[0].decode(), bytes=len(ck[1]))
        n = 0
        while True:
            batch, mark = await self.vlog.read(self.last_id, block_ms=None)
            if await self._behind_trim(mark):
                continue
            if not batch:
                break
            n += await self._apply_entries(batch)
        self.log.info("indexer_log_replayed", entries=n, upto=self.last_id.decode(), state_id=self.state_id)
        self._set_ready(True)

    async def run(self) -> None:
        """Tail the log until cancelled; on Valkey errors retry with the project's jittered
        back-off, without an attempt cap (a replica follows its store for as long as it lives,
        as a worker follows its brokers), not ready meanwhile. Any other error is logged and
        retried the same way: the tail never ends silently."""
        failures = 0
        last_state_check = time.monotonic()
        while True:
            try:
                batch, mark = await self.vlog.read(self.last_id, block_ms=_BLOCK_MS)
                # Checked before the batch is applied: after a pause (SIGSTOP, a partition) the
                # batch may lie beyond a trim, or belong to a replaced state.
                if await self._behind_trim(mark):
                    continue  # read again from where the reload left the tail
                if time.monotonic() - last_state_check >= 1.0:
                    last_state_check = time.monotonic()
                    if await self._check_state_id():
                        continue
                if batch:
                    await self._apply_entries(batch)
                if not self.ready:
                    self._set_ready(True)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # StoreUnavailable, or a bug: either way the tail goes on
                self.c["log_read_errors" if isinstance(exc, StoreUnavailable) else "tail_errors"] += 1
                self._set_ready(False)
                failures += 1
                delay_s = _RECONNECT.delay_s(failures)
                if self._rl.allow(type(exc).__name__):
                    event = "indexer_valkey_unavailable" if isinstance(exc, StoreUnavailable) else "indexer_tail_error"
                    self.log.warning(event, error=str(exc)[:300] or repr(exc), retry_in_s=round(delay_s, 3))
                await asyncio.sleep(delay_s)  # the back-off before reading a store that is down again

    async def _check_state_id(self) -> bool:
        """True when the state was replaced (this replica starts over from the new one)."""
        sid = await self.vlog.state_id()
        if sid == self.state_id:
            return False
        self.log.warning("indexer_state_replaced", old=self.state_id, new=sid,
                         note="the Valkey state changed (flushed or replaced): starting over from it")
        self.c["state_replaced"] += 1
        async with self.svc.mutex:
            self.core.reset_state()
            self.core.instance = self.state_id = sid
            self.last_id = b"0-0"
            self.guard = ReplayGuard()
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_result(StoreUnavailable("the shared state was replaced"))
        return True

    async def _behind_trim(self, mark: tuple) -> bool:
        """A tail behind the trim point (a replica paused, or cut off from Valkey, over two
        checkpoints) may have missed entries: reload the checkpoint and go on from there. True
        when it did. A mark that does not verify (or the same one rejected before) changes nothing."""
        trimmed = parse_id(mark[0])
        if trimmed is None or _id_key(self.last_id) >= trimmed or mark == self._rejected_mark:
            return False
        ck = await self._good_checkpoint()
        if ck is None or _id_key(ck[0]) <= _id_key(self.last_id):
            self._rejected_mark = mark  # not reloaded on every read
            return False
        self.c["checkpoint_reloads"] += 1
        self.log.warning("indexer_tail_behind_trim", last=self.last_id.decode(), checkpoint=ck[0].decode(),
                         note="entries this replica had not read were trimmed: reloading the checkpoint")
        async with self.svc.mutex:
            self._adopt_checkpoint(*ck)  # not loadable: rebuilt from the log, and this mark is not retried
        return True

    async def _good_checkpoint(self) -> tuple[bytes, bytes, bytes] | None:
        """The checkpoint ``(id, state record, replay guard)`` if there is one and it verifies;
        else None, and a rejected one is counted, logged and reported."""
        h = await self.vlog.load_checkpoint()
        if h is None:
            return None
        eid, trimmed, data, guard = (h.get(k, b"") for k in (b"id", b"trimmed", b"data", b"guard"))
        self._mark = (h.get(b"trimmed") or b"0-0", h.get(b"id"), h.get(b"mac"))  # as read() shows it
        if b"guard" not in h:  # written before STATE_VERSION 4 (a pickle, signed the old way or not at all)
            self._rejected_mark = self._mark
            self._incompatible(eid, f"written by an indexer before state version {self.core.STATE_VERSION}")
            return None
        why = self.signer.check_checkpoint(self.state_id, eid, trimmed, data, guard, h.get(b"mac"))
        if not why:
            ek, tk = parse_id(eid), parse_id(trimmed or b"0-0")
            if ek is None or tk is None or tk > ek:
                why = "malformed_ids"
            elif ek > _id_key(await self.vlog.last_log_id()):
                why = "ahead_of_the_log"
        if why:
            self._rejected_mark = self._mark  # counted once, not reloaded on every read
            self.c["checkpoints_rejected"] += 1
            self.c[f"checkpoints_rejected_{why}"] += 1
            self.last_rejection = f"checkpoint: {why}"
            if self._rl.allow(("ckpt", why)):
                self.log.error("indexer_checkpoint_rejected", reason=why, upto=eid[:41].decode(errors="replace"),
                               note="not loaded: rebuilding from the log (another --token-file, or a writer of the "
                                    "store without the token)")
            return None
        return eid, data, guard

    def _adopt_checkpoint(self, eid: bytes, blob: bytes, guard: bytes) -> bool:
        """Load a verified checkpoint and follow the log from it. One another version wrote (a
        rolling upgrade) is skipped: the replica rebuilds from the start of the log, and the
        streams the trimmed part held are resynced by their workers, as after any gap. True when
        the checkpoint was loaded."""
        try:
            self.core.load_state(blob)
            self.guard.load(guard)
        except Exception as exc:  # CheckpointError, or a replay guard record that does not decode
            self.core.reset_state()
            self.guard = ReplayGuard()
            self.last_id = b"0-0"
            self._rejected_mark = self._mark  # rebuilt from the log: not reloaded again
            self._incompatible(eid, str(exc))
            return False
        self.last_id = eid
        return True

    def _incompatible(self, eid: bytes, error: str) -> None:
        self.c["checkpoints_incompatible"] += 1
        self.last_rejection = "checkpoint: incompatible"
        self.log.warning("indexer_checkpoint_incompatible", upto=eid[:41].decode(errors="replace"), error=error[:200],
                         note="skipped: rebuilding from the log; workers resync what its trimmed part held")

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            self.ready = ready
            if self.on_ready is not None:
                self.on_ready(ready)
            self.svc.update_health()

    def _verify(self, eid: bytes, payload: bytes, mac: bytes) -> tuple[str, list | None]:
        """("", decoded entry) when the entry is this indexer's own and new, else (reason, entry or None)."""
        why = self.signer.check_entry(self.state_id, payload, mac)
        if why:
            return why, None
        try:
            entry = msgpack.unpackb(payload, raw=False)
            origin, n, t_ms, kind = entry[:4]
            if not all(type(x) is int for x in (origin, n, t_ms)) or type(kind) is not str:
                raise TypeError("origin, n and t_ms must be ints, kind a string")
        except Exception:
            return "malformed", None
        if self.signer.key is not None:
            why = self.guard.check(origin, n, t_ms, _id_key(eid)[0])
        return why, entry

    def _reject(self, eid: bytes, why: str, entry: list | None) -> Any:
        self.c["log_bad_entries"] += 1
        self.c[f"log_bad_entries_{why}"] += 1
        self.last_rejection = f"log entry: {why}"
        if self._rl.allow(("bad", why)):
            skew = {"skew_ms": _id_key(eid)[0] - entry[2]} if why == "stale" and entry else {}
            self.log.warning("indexer_log_entry_rejected", id=eid.decode(), reason=why, **skew,
                             note="skipped: not signed with this indexer's token, or a replay")
        return StoreUnavailable(f"log entry {eid.decode()} was refused ({why})")

    async def _apply_entries(self, batch: list[tuple[bytes, bytes, bytes]]) -> int:
        svc = self.svc
        for eid, payload, mac in batch:
            why, entry = self._verify(eid, payload, mac)
            origin = entry[0] if entry is not None else None
            if why:
                res = self._reject(eid, why, entry)
            else:
                t = entry_time_s(eid)
                try:
                    async with svc.mutex:
                        res = await self._apply_one(entry[3], entry[4:], t)
                except Exception:  # a bad entry (a foreign writer?) is skipped and counted, never fatal
                    res = self._reject(eid, "malformed", entry)
                self._maybe_expire(t)  # on the times of entries that verified only
            self.last_id = eid
            self.c["log_applied"] += 1
            if origin == self.origin:
                fut = self.waiters.get(eid)
                if fut is not None:
                    if not fut.done():
                        fut.set_result(res)
                else:
                    if len(self.results) >= 10_000:  # submitters that timed out never collect theirs
                        self.results.clear()
                    self.results[eid] = res
            self.since_checkpoint += 1
        if self.since_checkpoint >= self.checkpoint_every and (self._checkpointing is None or self._checkpointing.done()):
            self.since_checkpoint = 0
            # on the loop, between entries: a consistent cut at last_id
            blob, guard = self.core.dump_state(), self.guard.dump()
            self._checkpointing = asyncio.create_task(self._save(self.last_id, blob, guard))
        svc.update_health()  # other replicas' entries change coverage too
        return len(batch)

    async def _apply_one(self, kind: str, args: list, t: float) -> Any:
        core = self.core
        if kind == "apply":
            wid, rank, epoch, seq, payload, owner = args
            return await self.svc._run(core.apply_steps(wid, rank, epoch, seq, payload, now_s=t, owner=owner))
        try:
            if kind == "register":
                wid, bs, owner, ranks = args
                core.register_worker(wid, bs, owner=owner, now_s=t, dp_ranks=ranks)
                return None
            if kind == "forget":
                wid, owner = args
                return core.forget_worker(wid, owner=owner, now_s=t)
        except Exception as exc:  # the core's refusals (ValueError, Refused) go back to the caller
            return exc
        raise ValueError(f"unknown log entry kind {kind!r}")

    def _maybe_expire(self, t: float) -> None:
        if t - self.last_expiry_s < _EXPIRE_PERIOD_S:
            return
        self.last_expiry_s = t
        self.guard.prune(int(t * 1000))
        core = self.core
        if self.worker_ttl_s > 0:
            gone = core.expire_workers(t, self.worker_ttl_s)
            if gone:
                self.log.info("workers_expired", count=len(gone), first=gone[0], ttl_s=self.worker_ttl_s)
        if self.ghost_ttl_s > 0:
            core.expire_ghosts(t, self.ghost_ttl_s)

    async def _save(self, upto: bytes, blob: bytes, guard: bytes) -> None:
        try:
            if await self.vlog.save_checkpoint(self.state_id, upto, blob, guard):
                self.c["checkpoints_written"] += 1
                self.log.info("indexer_checkpoint_written", upto=upto.decode(), bytes=len(blob))
        except StoreUnavailable as exc:
            self.c["checkpoint_failed"] += 1
            self.log.warning("indexer_checkpoint_failed", error=str(exc)[:300])

    def stats(self) -> dict[str, Any]:
        return {"log_last_id": self.last_id.decode(), "ready": self.ready, "state_id": self.state_id,
                "waiting_submits": len(self.waiters), "last_rejection": self.last_rejection}


