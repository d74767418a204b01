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
  before its port opens. Checkpoints are pickles signed with HMAC-SHA256 under a key derived from
  the bearer token; without a token they are unsigned and the server says so at startup
  (``indexer_checkpoint_unsigned``): then anyone who can write to Valkey can run code in the
  replicas, so keep that Valkey private.
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
import hashlib
import hmac
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from mesh.errors import CheckpointError, ConfigError, MeshError
from mesh.logs import RateLimiter, get_logger
from mesh.retry import RetryPolicy

__all__ = ["ValkeyLog", "SharedState", "StoreUnavailable", "parse_valkey_url", "DEFAULT_PREFIX", "PASSWORD_ENV"]

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


class ValkeyLog:
    """The Valkey keys of one shared state (``prefix``) and the few commands used on them.

    Every failure is raised as :class:`StoreUnavailable` naming the command."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, *, mac_key: bytes | None = None,
                 timeout_s: float = 2.0) -> None:
        import redis.asyncio as aioredis

        url = parse_valkey_url(url)
        self.url = _redacted(url)  # for messages and logs: a password in the URL stays out of them
        self.prefix = prefix
        self.k_log = f"{prefix}:log"
        self.k_state = f"{prefix}:state"
        self.k_ckpt = f"{prefix}:checkpoint"
        self.k_lock = f"{prefix}:checkpoint-lock"
        self.mac_key = mac_key
        # Two clients: the tail's XREAD BLOCK holds its connection for up to _BLOCK_MS.
        # a password from the environment keeps it off the command line (ps, manifests)
        auth = {"password": os.environ[PASSWORD_ENV]} if os.environ.get(PASSWORD_ENV) else {}
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

    async def append(self, payloads: list[bytes]) -> list[bytes]:
        """XADD each payload (one round trip); their entry ids, in order."""
        pipe = self.r.pipeline(transaction=False)
        for p in payloads:
            pipe.xadd(self.k_log, {b"o": p})
        return await self._do("XADD", pipe.execute())

    async def read(self, after: bytes, *, block_ms: int | None) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """Entries after ``after`` (at most ``_READ_COUNT``), waiting up to ``block_ms`` for one, and
        the trim point read just after them (one round trip). Trims only move forward, so when
        ``after`` is not below that point no entry after ``after`` was trimmed before the read:
        XREAD itself would skip trimmed entries without a word."""
        pipe = self.tail.pipeline(transaction=False)
        pipe.xread({self.k_log: after}, count=_READ_COUNT, block=block_ms)
        pipe.hget(self.k_ckpt, b"trimmed")
        res, trimmed = await self._do("XREAD", pipe.execute())
        entries = [(eid, fields.get(b"o", b"")) for eid, fields in res[0][1]] if res else []
        return entries, trimmed or b"0-0"

    def _mac(self, entry_id: bytes, data: bytes) -> bytes:
        return hmac.new(self.mac_key or b"", entry_id + b"\0" + data, hashlib.sha256).digest()

    async def load_checkpoint(self) -> tuple[bytes, bytes] | None:
        """(id of the last entry it covers, state bytes); None when there is none. A checkpoint
        whose signature does not verify raises ConfigError (wrong token, or tampering)."""
        h = await self._do("HGETALL checkpoint", self.r.hgetall(self.k_ckpt))
        if not h or b"id" not in h or b"data" not in h:
            return None
        eid, data = h[b"id"], h[b"data"]
        if self.mac_key is not None and not hmac.compare_digest(h.get(b"mac", b""), self._mac(eid, data)):
            raise ConfigError(f"token_file: the checkpoint in {self.k_ckpt} is not signed with this indexer's "
                              "token (another token, or written by someone else)")
        return eid, data

    async def save_checkpoint(self, upto: bytes, data: bytes) -> bool:
        """Write a checkpoint covering entries up to ``upto``, then trim the log below the
        previous one. False when another replica holds the checkpoint lock."""
        if not await self._do("SET lock", self.r.set(self.k_lock, b"1", nx=True, px=_LOCK_TTL_MS)):
            return False
        try:
            prev = await self._do("HGET checkpoint", self.r.hget(self.k_ckpt, b"id"))
            if prev is not None and _id_key(prev) >= _id_key(upto):
                return False  # someone wrote a newer one meanwhile
            # trimmed: entries below it are gone; a replica whose tail is behind it reloads this checkpoint
            await self._do("HSET checkpoint", self.r.hset(self.k_ckpt, mapping={
                b"id": upto, b"data": data, b"mac": self._mac(upto, data), b"t": str(time.time()).encode(),
                b"trimmed": prev if prev is not None else b"0-0"}))
            if prev is not None:
                await self._do("XTRIM", self.r.xtrim(self.k_log, minid=prev, approximate=False))
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
    called when the tail is caught up / has lost Valkey.
    """

    def __init__(self, svc: Any, log: ValkeyLog, *, checkpoint_every: int = 20_000, worker_ttl_s: float = 0.0,
                 ghost_ttl_s: float = 0.0, on_ready: Callable[[bool], None] | None = None) -> None:
        self.svc = svc
        self.core = svc.core
        self.vlog = log
        self.checkpoint_every = checkpoint_every
        self.worker_ttl_s = worker_ttl_s
        self.ghost_ttl_s = ghost_ttl_s
        self.on_ready = on_ready
        self.origin = int.from_bytes(os.urandom(8), "little")
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

    # ------------------------------------------------------------------ writing
    async def submit(self, ops: list[tuple]) -> list[Any]:
        """Append ``ops`` (one round trip) and wait until this replica has applied them."""
        payloads = [msgpack.packb([self.origin, *op], use_bin_type=True) for op in ops]
        ids = await self.vlog.append(payloads)
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
        """Load the state: id, checkpoint, then the log to its end (raises StoreUnavailable)."""
        self.state_id = await self.vlog.state_id()
        self.core.instance = self.state_id
        ck = await self.vlog.load_checkpoint()
        if ck is not None and self._adopt_checkpoint(*ck):
            self.c["checkpoints_loaded"] += 1
            self.log.info("indexer_checkpoint_loaded", upto=ck[0].decode(), bytes=len(ck[1]))
        n = 0
        while True:
            batch, trimmed = await self.vlog.read(self.last_id, block_ms=None)
            if await self._behind_trim(trimmed):
                continue
            if not batch:
                break
            n += await self._apply_entries(batch)
        self.log.info("indexer_log_replayed", entries=n, upto=self.last_id.decode(), state_id=self.state_id)
        self._set_ready(True)

    async def run(self) -> None:
        """Tail the log until cancelled; on Valkey errors retry with the project's jittered
        back-off, without an attempt cap (a replica follows its store for as long as it lives,
        as a worker follows its brokers), not ready meanwhile."""
        failures = 0
        last_state_check = time.monotonic()
        while True:
            try:
                batch, trimmed = await self.vlog.read(self.last_id, block_ms=_BLOCK_MS)
                # Checked before the batch is applied: after a pause (SIGSTOP, a partition) the
                # batch may lie beyond a trim, or belong to a replaced state.
                if await self._behind_trim(trimmed):
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
            except StoreUnavailable as exc:
                self.c["log_read_errors"] += 1
                self._set_ready(False)
                failures += 1
                delay_s = _RECONNECT.delay_s(failures)
                if self._rl.allow("read"):
                    self.log.warning("indexer_valkey_unavailable", error=str(exc)[:300], retry_in_s=round(delay_s, 3))
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
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_result(StoreUnavailable("the shared state was replaced"))
        return True

    async def _behind_trim(self, trimmed: bytes) -> bool:
        """A tail behind the trim point (a replica paused, or cut off from Valkey, over two
        checkpoints) may have missed entries: reload the checkpoint and go on from there. True
        when it did."""
        if _id_key(self.last_id) >= _id_key(trimmed):
            return False
        ck = await self.vlog.load_checkpoint()
        if ck is None or _id_key(ck[0]) <= _id_key(self.last_id):
            return False
        self.c["checkpoint_reloads"] += 1
        self.log.warning("indexer_tail_behind_trim", last=self.last_id.decode(), checkpoint=ck[0].decode(),
                         note="entries this replica had not read were trimmed: reloading the checkpoint")
        async with self.svc.mutex:
            self._adopt_checkpoint(*ck)
        return True

    def _adopt_checkpoint(self, eid: bytes, blob: bytes) -> bool:
        """Load a checkpoint and follow the log from it. One another version wrote (a rolling
        upgrade) is not fatal: the index starts empty at that point and the streams it missed
        are resynced by their workers, as after any gap. True when the checkpoint was loaded."""
        self.last_id = eid
        try:
            self.core.load_state(blob)
            return True
        except CheckpointError as exc:
            self.core.reset_state()
            self.c["checkpoints_incompatible"] += 1
            self.log.warning("indexer_checkpoint_incompatible", upto=eid.decode(), error=str(exc),
                             note="starting from an empty index at the checkpoint; workers resync what it missed")
            return False

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            self.ready = ready
            if self.on_ready is not None:
                self.on_ready(ready)
            self.svc.update_health()

    async def _apply_entries(self, batch: list[tuple[bytes, bytes]]) -> int:
        svc = self.svc
        for eid, payload in batch:
            t = entry_time_s(eid)
            try:
                origin, kind, *args = msgpack.unpackb(payload, raw=False)
                async with svc.mutex:
                    res = await self._apply_one(kind, args, t)
            except Exception as exc:  # a bad entry (a foreign writer?) is skipped and counted, never fatal
                self.c["log_bad_entries"] += 1
                if self._rl.allow("bad"):
                    self.log.warning("indexer_log_bad_entry", id=eid.decode(), error=repr(exc)[:200])
                origin, res = None, StoreUnavailable(f"log entry {eid.decode()} could not be applied: {exc!r}")
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
            self._maybe_expire(t)
            self.since_checkpoint += 1
        if self.since_checkpoint >= self.checkpoint_every and (self._checkpointing is None or self._checkpointing.done()):
            self.since_checkpoint = 0
            blob = self.core.dump_state()  # on the loop, between entries: a consistent cut at last_id
            self._checkpointing = asyncio.create_task(self._save(self.last_id, blob))
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
        core = self.core
        if self.worker_ttl_s > 0:
            gone = core.expire_workers(t, self.worker_ttl_s)
            if gone:
                self.log.info("workers_expired", count=len(gone), first=gone[0], ttl_s=self.worker_ttl_s)
        if self.ghost_ttl_s > 0:
            core.expire_ghosts(t, self.ghost_ttl_s)

    async def _save(self, upto: bytes, blob: bytes) -> None:
        try:
            if await self.vlog.save_checkpoint(upto, blob):
                self.c["checkpoints_written"] += 1
                self.log.info("indexer_checkpoint_written", upto=upto.decode(), bytes=len(blob))
        except StoreUnavailable as exc:
            self.c["checkpoint_failed"] += 1
            self.log.warning("indexer_checkpoint_failed", error=str(exc)[:300])

    def stats(self) -> dict[str, Any]:
        return {"log_last_id": self.last_id.decode(), "ready": self.ready, "state_id": self.state_id,
                "waiting_submits": len(self.waiters)}


def mac_key_from_token(token: str | None) -> bytes | None:
    """The checkpoint signing key: derived from the bearer token (None without one)."""
    if not token:
        return None
    return hashlib.sha256(b"mesh-indexer-checkpoint\0" + token.encode()).digest()
