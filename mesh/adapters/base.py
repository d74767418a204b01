"""The adapter: one engine attached as one mesh worker (broker links, health gating, load).

One :class:`Adapter` = one inference server attached as one mesh worker. Engine specifics (how to
discover, which HTTP endpoint serves a request, how load is polled) live in a :class:`Backend`
(:mod:`mesh.adapters.sglang`, :mod:`mesh.adapters.vllm`).

The adapter is made of pieces, each in its own module: the KV relay (:mod:`mesh.adapters.kv_relay`,
the engine's KV event streams relayed to the brokers, with the block mirror for resyncs), the
request proxy (:mod:`mesh.adapters.proxy`, a REQUEST served over the engine's HTTP API), the
engine's description and interface (:mod:`mesh.adapters.backend`) and the engine HTTP client
(:mod:`mesh.adapters.engine_http`, :mod:`mesh.adapters.engine_client`: its error boundary,
:func:`~mesh.adapters.engine_client.engine_error`).

Load: the LoadStat PUB when the server has one (one SUB per rank, ``[b"load", seq8, LoadStat]``);
otherwise (or when it is stale) the backend polls HTTP. Every HEARTBEAT carries the fresh
LoadStats.

Health gating: ``GET <health_path>`` every ``health_interval_ms``. The adapter registers with the
brokers only while the server is healthy; after ``unhealthy_after`` failed checks it sends
DISCONNECT and closes its broker links (brokers stop offering work and retry what was in
flight), and registers again (READY, then a KV snapshot) when the server answers again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.adapters.backend import Backend, EngineInfo
from mesh.adapters.engine_client import engine_error
from mesh.adapters.engine_http import EngineHttp
from mesh.adapters.kv_relay import KvRelay, RankStream, log_crash
from mesh.adapters.proxy import RequestProxy
from mesh.adapters.settings import AttachSettings
from mesh.errors import ConfigError, ErrorCode, ProtocolError, RequestError, RetryableError
from mesh.load import LoadStat
from mesh.logs import announce, get_logger
from mesh.retry import RetryPolicy
from mesh.sockets import SocketSpec, make_socket
from mesh.worker import BrokerLink, Capabilities, WorkerAPI
from mesh.worker.memory import MemoryPeer

__all__ = ["Adapter", "LOAD_SUB"]

LOAD_SUB = SocketSpec(zmq.SUB, sndhwm=100, rcvhwm=1000, linger_ms=0, maxmsgsize=1024 * 1024)


class Adapter:
    """One attached server = one mesh worker. ``await run()`` until ``request_stop()``."""

    def __init__(self, s: AttachSettings, backend: Backend, *, ctx: zmq.asyncio.Context | None = None,
                 memory: MemoryPeer | None = None) -> None:
        s.validate()
        self.s = s
        self.backend = backend
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.worker_id = s.worker_id or f"{backend.kind}-{s.url_host}-{urlsplit(s.url).port or 80}"
        self.api = WorkerAPI(self.ctx, s.brokers, self.worker_id, self._capabilities, on_message=self._on_message,
                             on_session_lost=self._on_session_lost, load=lambda: self._fresh_loads(time.monotonic()),
                             heartbeat_ms=s.heartbeat_ms, liveness=s.liveness, reconnect_base_ms=s.reconnect_base_ms,
                             reconnect_cap_ms=s.reconnect_cap_ms, kv_events_to=s.kv_events_to, memory=memory)
        self.epoch = self.api.epoch
        self.log = get_logger(service="adapter", worker_id=self.worker_id)
        self.counters: Counter[str] = Counter()
        self.info: EngineInfo | None = None
        self.relay: KvRelay | None = None
        self.http: aiohttp.ClientSession | None = None  # discovery, health, load polls
        self.engine: EngineHttp | None = None  # the request path (see engine_http for why not aiohttp)
        self.proxy: RequestProxy | None = None  # serves REQUESTs once the engine is discovered
        self.healthy = False
        self._was_healthy = False
        self._need_snapshot: set[int] = set()
        self._serving: dict[tuple[int, int, int], asyncio.Task] = {}
        self._loads: list[tuple[LoadStat, float, str] | None] = []  # per rank: (stat, received at, source)
        self._tasks: list[asyncio.Task] = []
        self._load_tasks: dict[int, asyncio.Task] = {}  # rank -> its LoadStat SUB loop
        self._stop = asyncio.Event()
        self._force = asyncio.Event()  # a second stop signal: skip the drain
        self._force_stop = False
        self._health_kick = asyncio.Event()
        self._stopping = False

    @property
    def links(self) -> list[BrokerLink]:
        return self.api.links

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Discover the server, start the KV relay, load and health tasks (registration follows health)."""
        s = self.s
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024), read_bufsize=1 << 20,
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self.engine = EngineHttp.for_url(s.base_url)
        self.info = info = await self._discover()
        self.proxy = RequestProxy(self.backend, self.engine, info, url=s.url, base_url=s.base_url, worker_id=self.worker_id,
                                  counters=self.counters, log=self.log, on_unavailable=self._health_kick.set)
        ranks = []
        for r in range(info.dp_size):
            kv = info.kv_endpoints[r] if r < len(info.kv_endpoints) else None
            if kv is not None:
                rp = info.replay_endpoints[r] if r < len(info.replay_endpoints) else None
                ranks.append(RankStream(r, kv, rp, info.topic, info.block_size, self.epoch))
        self.relay = KvRelay(self.ctx, ranks, self._send_kv, counters=self.counters, replay_timeout_s=s.replay_timeout_ms / 1000,
                             max_batch_tokens=s.max_batch_tokens, log=self.log)
        self.relay.start()
        self._loads = [None] * info.dp_size
        for r, ep in enumerate(info.load_endpoints):
            if ep is not None and r < info.dp_size:
                self._start_load_sub(r, ep)
        self._tasks.append(asyncio.create_task(self._load_poll_loop(), name="load-poll"))
        self.api.start()  # heartbeats (they go out only while links are open: while the server is healthy)
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health"))
        self._tasks.append(asyncio.create_task(self._stats_loop(), name="stats"))
        if s.lora_refresh_ms > 0:
            self._tasks.append(asyncio.create_task(self._lora_loop(), name="lora-refresh"))
        for t in self._tasks:
            t.add_done_callback(lambda t: log_crash(self.log, t))
        announce("adapter_attached", worker_id=self.worker_id, engine=self.backend.kind, url=s.url, brokers=list(s.brokers),
                 **info.describe())

    async def run(self) -> None:
        """Start, serve until :meth:`request_stop`, drain, close. A stop requested while the
        adapter is still starting (e.g. waiting for an unreachable engine) ends it at once."""
        starting = asyncio.create_task(self.start(), name="adapter-start")
        stopped = asyncio.create_task(self._stop.wait(), name="adapter-stop")
        try:
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # stop requested first: give up starting
                starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            if starting.cancelled():
                self.log.info("adapter_stopped_before_attach", reason="stop requested while waiting for the engine",
                              url=self.s.url, discovery_failures=self.counters["discovery_failures"])
                await self.close()
                return
            if starting.exception() is not None:  # e.g. discovery gave up (ConfigError)
                await self.close()
                raise starting.exception()  # type: ignore[misc]
            await stopped
        finally:
            for t in (starting, stopped):
                t.cancel()
            await asyncio.gather(starting, stopped, return_exceptions=True)
        if self._force_stop:
            await self.close()
        else:
            await self.drain_and_stop()

    def request_stop(self, *, force: bool = False) -> None:
        """Ask :meth:`run` to finish: drain in-flight requests (bounded by ``drain_timeout_s``), or
        with ``force`` (a second signal) close at once."""
        if force:
            self._force_stop = True
            self._force.set()
        self._stop.set()

    async def drain_and_stop(self) -> None:
        """Graceful stop: DISCONNECT(draining), finish in-flight requests (bounded), close everything."""
        self._stopping = True
        self.api.drain()
        t_end = time.monotonic() + self.s.drain_timeout_s
        if self._serving:
            self.log.info("adapter_draining", inflight=len(self._serving), timeout_s=self.s.drain_timeout_s)
        force = asyncio.ensure_future(self._force.wait())
        try:
            while self._serving and time.monotonic() < t_end and not self._force.is_set():
                await asyncio.wait([*self._serving.values(), force], timeout=max(0.01, t_end - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            force.cancel()
        await self.close()

    async def _stats_loop(self, period_s: float = 30.0) -> None:
        last: dict[str, int] = {}
        while True:
            await asyncio.sleep(period_s)
            cur = dict(self.counters)
            if cur != last:
                self.log.info("adapter_stats", healthy=self.healthy, **cur)
                last = cur

    async def close(self) -> None:
        if self.info is not None:
            announce("adapter_stopped", worker_id=self.worker_id, counters=dict(self.counters))
        self._close_links()
        tasks = [*self._tasks, *self._load_tasks.values(), *self._serving.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, self.api.aclose(), return_exceptions=True)
        self._tasks.clear()
        self._load_tasks.clear()
        if self.relay is not None:
            await self.relay.stop()
        if self.http is not None:
            await self.http.close()
        if self.engine is not None:
            await self.engine.close()

    #: Discovery back-off: an engine loading its weights may take minutes, so by default (no
    #: ``discovery_timeout_s``) the adapter waits for it as a worker waits for its brokers.
    DISCOVERY_RETRY = RetryPolicy.forever(base_ms=100.0, cap_ms=2000.0)

    async def _discover(self) -> EngineInfo:
        """Ask the engine what it is, retrying (:attr:`DISCOVERY_RETRY`) what :func:`engine_error`
        calls retryable, until ``discovery_timeout_s`` (then a ConfigError naming the URL)."""
        assert self.http is not None
        s = self.s
        deadline = time.monotonic() + s.discovery_timeout_s if s.discovery_timeout_s else None
        try:
            async for attempt in self.DISCOVERY_RETRY.async_retrying((RetryableError,), deadline_s=deadline):
                with attempt:
                    try:
                        info = await self.backend.discover(self.http)
                    except ConfigError:
                        raise
                    except Exception as exc:
                        err = engine_error(exc, f"discovery at {s.url}")
                        if self.counters["discovery_failures"] == 0:
                            announce("adapter_waiting_for_engine", url=s.url, error=str(err)[:200])
                        if self.counters["discovery_failures"] % 20 == 0:
                            self.log.warning("discovery_retry", url=s.url, error=str(err)[:200])
                        self.counters["discovery_failures"] += 1
                        raise err from exc
        except RetryableError as err:
            raise ConfigError(f"url: no answer from {s.url} within {s.discovery_timeout_s}s ({err})") from None
        self.log.info("engine_discovered", **info.describe())
        return info

    # ------------------------------------------------------------------ broker links

    def _capabilities(self) -> Capabilities:
        info = self.info
        assert info is not None
        return Capabilities(model=info.model[:256], role=self.s.role, labels=dict(self.s.labels), block_size=info.block_size,
                            max_running_requests=max(1, info.max_running_requests),
                            max_total_num_tokens=max(1, info.max_total_num_tokens), dp_size=info.dp_size,
                            loras=list(info.loras) if info.loras is not None else None,
                            tokenizer=info.tokenizer[:P.MAX_TOKENIZER_ID_BYTES])

    def _open_links(self) -> None:
        """Register with every broker (the API continues the connection numbering)."""
        self.api.connect()
        self._need_snapshot.update(id(link) for link in self.api.links)

    def _close_links(self) -> None:
        self.api.disconnect()
        self._need_snapshot.clear()

    def _send_kv(self, rank: int, frames: list[bytes]) -> None:
        self.api.send_kv(frames)

    def _on_session_lost(self, link: BrokerLink, why: str) -> None:
        self._need_snapshot.add(id(link))
        for key, task in list(self._serving.items()):
            if key[0] == id(link):
                task.cancel()  # the broker already re-dispatched or failed it

    def _on_message(self, link: BrokerLink, msg: object) -> None:
        t = type(msg)
        if t is P.Request:
            self._on_request(link, msg)  # type: ignore[arg-type]
        elif t is P.WorkerCancel:
            task = self._serving.get((id(link), msg.rid, msg.attempt))  # type: ignore[union-attr]
            if task is not None:
                self.counters["requests_cancelled"] += 1
                task.cancel()
        elif t is P.Heartbeat:
            if id(link) in self._need_snapshot and link.registered:
                self._need_snapshot.discard(id(link))
                self.log.info("adapter_registered", broker=link.endpoint)
                if self.relay is not None:
                    for rs in self.relay.ranks:
                        self.relay.snapshot(rs.rank)  # this broker starts from the mirror (the others just re-sync)
        elif t is P.Resync:
            if self.relay is not None and self.relay.snapshot(msg.dp_rank):  # type: ignore[union-attr]
                self.counters["resyncs_answered"] += 1
        elif isinstance(msg, Exception):
            self.counters["broker_frames_rejected"] += 1

    # ------------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        s = self.s
        path = s.health_path or self.backend.default_health_path
        fails = 0
        while True:
            ok, why = await self._check_health(path)
            if ok:
                fails = 0
                if not self.healthy:
                    await self._become_healthy()
            else:
                fails += 1
                self.counters["health_failures"] += 1
                if self.healthy and fails >= s.unhealthy_after:
                    self._become_unhealthy(why)
                elif not self._was_healthy and fails == 1:
                    self.log.warning("engine_not_healthy_yet", reason=why)
            try:
                await asyncio.wait_for(self._health_kick.wait(), s.health_interval_ms / 1000)
            except asyncio.TimeoutError:
                pass
            self._health_kick.clear()

    async def _check_health(self, path: str) -> tuple[bool, str]:
        """(healthy, why): ``http_<status>``, or the mapped error's code and cause (``unavailable:
        ClientConnectorError``)."""
        assert self.http is not None
        try:
            status = await self.backend.get_status(self.http, path, self.s.health_timeout_ms / 1000)
        except RequestError as err:
            return False, f"{err.code.value}: {type(err.__cause__).__name__}"
        return status == 200, f"http_{status}"

    async def _become_healthy(self) -> None:
        if self._was_healthy and self.relay is not None and self.info is not None:
            try:
                restarted = await self.backend.restarted(self.http, self.info)  # type: ignore[arg-type]
            except Exception as exc:
                self.log.info("restart_check_failed", error=str(engine_error(exc, f"restart check at {self.s.url}"))[:200])
                restarted = False
            await self.relay.verify(restarted, skip=await self._follow_endpoints())
            if self.s.lora_refresh_ms > 0:
                await self.refresh_loras()  # a restarted engine may hold other adapters: READY tells the current ones
        self.healthy = True
        self._was_healthy = True
        self._open_links()
        announce("adapter_healthy", worker_id=self.worker_id)

    async def _follow_endpoints(self) -> frozenset[int]:
        """After an outage the engine may be back on other ZeroMQ ports (a restart picks free ones):
        discover again and move the KV and load subscriptions there. Returns the ranks moved."""
        info = self.info
        assert info is not None and self.relay is not None and self.http is not None
        try:
            now = await self.backend.discover(self.http)
        except Exception as exc:
            self.log.info("rediscovery_failed", error=str(engine_error(exc, f"discovery at {self.s.url}"))[:200])
            return frozenset()
        moved = set()
        for rs in self.relay.ranks:
            r = rs.rank
            kv = now.kv_endpoints[r] if r < len(now.kv_endpoints) else None
            rp = now.replay_endpoints[r] if r < len(now.replay_endpoints) else None
            if kv is not None and await self.relay.move(r, kv, rp):
                moved.add(r)
        for r, ep in enumerate(now.load_endpoints[:info.dp_size]):
            old = self._load_tasks.get(r)
            if ep is not None and r < len(info.load_endpoints) and ep != info.load_endpoints[r]:
                if old is not None:
                    old.cancel()
                self._start_load_sub(r, ep)
        info.kv_endpoints, info.replay_endpoints, info.load_endpoints = now.kv_endpoints, now.replay_endpoints, now.load_endpoints
        if moved:
            self.counters["engine_endpoints_moved"] += 1
        return frozenset(moved)

    def _become_unhealthy(self, why: str) -> None:
        self.healthy = False
        self.counters["unhealthy_episodes"] += 1
        self._close_links()
        for task in list(self._serving.values()):
            task.cancel()
        announce("adapter_unhealthy", worker_id=self.worker_id, reason=why)

    # ------------------------------------------------------------------ LoRA adapters

    async def _lora_loop(self) -> None:
        """Engines load and unload LoRA adapters at run time (SGLang ``/load_lora_adapter``, vLLM
        ``/v1/load_lora_adapter``): re-read them every ``lora_refresh_ms`` and tell the brokers in
        a HEARTBEAT ``loras`` (every time, so a lost one is repaired on the next tick; READY
        carries them on every new session)."""
        assert self.info is not None and self.http is not None
        period = self.s.lora_refresh_ms / 1000
        while True:
            await asyncio.sleep(period)
            if not self.healthy:
                continue
            await self.refresh_loras()

    async def refresh_loras(self) -> list[str] | None:
        """Read the engine's adapters once; announce them to every broker link. Never raises."""
        info = self.info
        assert info is not None and self.http is not None
        try:
            loras = await self.backend.loras(self.http)
        except Exception as exc:  # this loop must not die: count, say why, try again
            self.counters["lora_refresh_errors"] += 1
            self.log.debug("lora_refresh_failed", error=str(engine_error(exc, f"LoRA refresh at {self.s.url}"))[:200])
            return None
        if loras is None:
            return None
        if loras != info.loras:
            self.counters["lora_changes"] += 1
            self.log.info("engine_loras_changed", loras=loras[:16], n=len(loras),
                          added=sorted(set(loras) - set(info.loras or ()))[:16], removed=sorted(set(info.loras or ()) - set(loras))[:16])
            info.loras = loras
        frames = P.encode_heartbeat(self._fresh_loads(time.monotonic()), loras)
        for link in self.api.links:
            if link.registered:
                link.send(frames)
        return loras

    # ------------------------------------------------------------------ load

    def _start_load_sub(self, rank: int, endpoint: str) -> None:
        t = asyncio.create_task(self._load_sub_loop(rank, endpoint), name=f"load-{rank}")
        t.add_done_callback(lambda t: log_crash(self.log, t))
        self._load_tasks[rank] = t

    async def _load_sub_loop(self, rank: int, endpoint: str) -> None:
        sock = make_socket(self.ctx, LOAD_SUB, connect=endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"load")
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.counters["load_malformed"] += 1
                    continue
                try:
                    ls = LoadStat.from_wire(P.unpack(frames[2]))
                except ProtocolError:
                    self.counters["load_malformed"] += 1
                    continue
                ls.attn_dp_rank = rank
                self._loads[rank] = (ls, time.monotonic(), "zmq")
                self.counters["load_stream_samples"] += 1
        finally:
            sock.close(linger=0)

    def _fresh_loads(self, now: float) -> list[LoadStat]:
        max_age = self.s.load_stale_ms / 1000
        return [x[0] for x in self._loads if x is not None and now - x[1] <= max_age]

    async def _load_poll_loop(self) -> None:
        assert self.info is not None and self.http is not None
        period = self.s.load_poll_ms / 1000
        while True:
            now = time.monotonic()
            fresh_zmq = sum(1 for x in self._loads if x is not None and x[2] == "zmq" and now - x[1] <= self.s.load_stale_ms / 1000)
            if fresh_zmq < self.info.dp_size:
                try:
                    stats = await self.backend.poll_load(self.http, self.info)
                except Exception as exc:  # this loop must not die: count, say why, poll again
                    stats = None
                    self.counters["load_poll_errors"] += 1
                    self.log.debug("load_poll_failed", error=str(engine_error(exc, f"load poll at {self.s.url}"))[:200])
                if stats:
                    t = time.monotonic()
                    for ls in stats:
                        if 0 <= ls.attn_dp_rank < len(self._loads):
                            cur = self._loads[ls.attn_dp_rank]
                            # never overwrite a fresh sample of the (better) LoadStat stream
                            if cur is None or cur[2] == "http" or t - cur[1] > self.s.load_stale_ms / 1000:
                                self._loads[ls.attn_dp_rank] = (ls, t, "http")
                    self.counters["load_polls"] += 1
            await asyncio.sleep(period)

    # ------------------------------------------------------------------ requests

    def _on_request(self, link: BrokerLink, r: P.Request) -> None:
        if self._stopping or not self.healthy:
            link.send(P.encode_worker_error(r.rid, r.attempt, ErrorCode.UNAVAILABLE, "worker draining or unhealthy"))
            return
        key = (id(link), r.rid, r.attempt)
        if key in self._serving:
            return  # duplicate delivery
        self.counters["requests"] += 1
        task = self._serving[key] = asyncio.create_task(self._serve(link, r, key), name=f"req-{r.rid}")
        # (a CANCEL right behind its REQUEST cancels the task before it runs: its finally never does)
        task.add_done_callback(lambda t: self._serving.pop(key, None) if self._serving.get(key) is t else None)

    async def _serve(self, link: BrokerLink, r: P.Request, key: tuple[int, int, int]) -> None:
        """Serve one REQUEST (:meth:`RequestProxy.serve`); a cancel ends it silently."""
        try:
            assert self.proxy is not None
            await self.proxy.serve(link.replies, r)  # replies of one loop turn leave together
        except asyncio.CancelledError:
            pass
        finally:
            self._serving.pop(key, None)
