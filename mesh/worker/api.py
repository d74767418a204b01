"""The worker API on asyncio: one :class:`WorkerAPI` = one mesh worker connected to every broker.

Like the ZeroMQ guide's mdwrkapi, the API owns everything a worker says to brokers that is not
about a request: registration (READY with the worker id, role, epoch and capabilities), heartbeats
(each carrying the LoadStats a callback supplies), broker liveness and reconnects (one
:class:`~mesh.worker.link.BrokerLink` per broker, each driven by a pure
:class:`~mesh.worker.session.LinkSession`), the KV event fan-out to the brokers that registered the
worker, drain and goodbye. The engine side (the simulated worker, an adapter) gets the broker's
messages through ``on_message(link, msg)`` and answers on the link the request came from
(``link.send``); ``on_session_lost(link, why)`` tells it that a broker forgot the requests it
sent over that link (they are re-dispatched or failed there).

Used by :class:`workers_stub.worker.SimWorker` and :class:`mesh.adapters.base.Adapter`. The
benchmarks' instant workers (:mod:`workers_stub.instant`) run the same sessions from a
synchronous poller loop instead.

Every method but :meth:`run` and :meth:`aclose` is synchronous and never blocks: sends are
non-blocking, and the only waits are the links' receive loops and the heartbeat timer.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Callable, Iterable

import zmq.asyncio

from mesh import protocol as P
from mesh.discovery import DRAIN_AFTER_REFRESHES, MAX_FOLLOWED, Resolver, choose_endpoints, endpoints_for, is_dns, link_budget, parse_dns
from mesh.load import LoadStat
from mesh.logs import get_logger
from mesh.retry import RetryPolicy
from mesh.sockets import CurveKeys
from mesh.worker.link import BrokerLink
from mesh.worker.memory import MemoryPeer
from mesh.worker.session import Capabilities, make_epoch, ready_frames

__all__ = ["Capabilities", "WorkerAPI", "new_epoch"]


def new_epoch() -> int:
    """A fresh worker epoch (:func:`mesh.worker.session.make_epoch` on the wall clock)."""
    return make_epoch(time.time(), random.randrange(1000))


class WorkerAPI:
    """One worker's side of MESH/1 towards every broker in ``brokers``.

    ``capabilities`` is read each time READY goes out (an adapter knows them only after engine
    discovery); ``load`` each heartbeat (return ``[]`` for none). ``kv_events_to="one"`` sends
    each KV batch to the first registered broker that takes it instead of to all of them.
    A ``dns+tcp://NAME:PORT`` broker is every address NAME resolves to, re-resolved every
    ``discovery_refresh_s`` through ``resolver`` (:mod:`mesh.discovery`): links open to brokers
    that appear, at most ``max_followed`` per name and within the context's shared link budget;
    a broker that left the answer keeps its link as it is, and one still gone after
    ``DRAIN_AFTER_REFRESHES`` refreshes is drained (no new work, its streams finish); its link
    closes only when it really fails; one that comes back is undrained (READY again).
    ``discovery_stats`` counts ``links_refused`` (no room in the budget), ``drained``,
    ``undrained``, ``rotated_out``, ``retired`` and ``refresh_failed`` (an answer that is not
    addresses: the last set is kept). ``memory``: a broker in this process
    (:mod:`mesh.worker.memory`): the links exchange frames with it without ZeroMQ.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        brokers: Iterable[str],
        worker_id: str,
        capabilities: Callable[[], Capabilities],
        *,
        on_message: Callable[[BrokerLink, object], None],
        on_session_lost: Callable[[BrokerLink, str], None],
        load: Callable[[], list[LoadStat]],
        heartbeat_ms: int = 500,
        liveness: int = 3,
        reconnect_base_ms: float = 100.0,
        reconnect_cap_ms: float = 5000.0,
        curve: CurveKeys | None = None,
        kv_events_to: str = "all",
        epoch: int | None = None,
        discovery_refresh_s: float = 5.0,
        resolver: Resolver | None = None,
        max_followed: int = MAX_FOLLOWED,
        memory: MemoryPeer | None = None,
    ) -> None:
        self.ctx = ctx
        self.memory = memory  # a broker in this process (mesh.worker.memory): its links skip ZeroMQ
        self.brokers = tuple(dict.fromkeys(brokers))  # de-duplicated: one link per endpoint
        self.discovery_refresh_s = discovery_refresh_s
        self.resolver = resolver or Resolver()
        self.discovered: dict[str, list[str]] = {}  # dns+tcp spec -> the endpoints followed after its last answer
        self.max_followed = max_followed
        self.discovery_stats: Counter[str] = Counter()
        self._budget = link_budget(ctx, ctx.get(zmq.MAX_SOCKETS))
        self._retiring: set[str] = set()  # endpoints of links drained because their broker left the answer
        self._absent: dict[str, int] = {}  # linked endpoints gone from the answer -> refreshes since
        self._rng = random.Random()
        self._draining = False  # drain() was called: no broker is undrained any more
        self.worker_id = worker_id
        self.capabilities = capabilities
        self.on_message = on_message
        self.on_session_lost = on_session_lost
        self.load = load
        self.heartbeat_ms = heartbeat_ms
        self.liveness = liveness
        self.reconnect = RetryPolicy.forever(reconnect_base_ms, reconnect_cap_ms)
        self.curve = curve
        self.kv_events_to = kv_events_to
        self.epoch = new_epoch() if epoch is None else epoch
        self.log = get_logger(service="worker", worker_id=worker_id)
        self.links: list[BrokerLink] = []
        self._link_tasks: list[asyncio.Task] = []
        self._conn_no: dict[str, int] = {}  # endpoint -> last connection number used
        self._hb_task: asyncio.Task | None = None
        self._dns_task: asyncio.Task | None = None
        self._connected = False  # between connect() and disconnect(): discovery may open links
        self._kv_seq: dict[int, int] = {}  # dp rank -> next KV_EVENTS seq (publish_kv)

    # ------------------------------------------------------------------ registration

    def ready_frames(self) -> list[bytes]:
        return ready_frames(self.worker_id, self.epoch, self.heartbeat_ms, self.capabilities())

    def connect(self) -> None:
        """Open one link per broker and start registering (no-op while connected). Connection
        numbers continue across :meth:`disconnect`: a re-registration never reuses a routing id
        a broker may still hold for the previous connection."""
        if self.links:
            return
        self._connected = True
        for ep in self.brokers:
            if is_dns(ep):
                for e in self.discovered.get(ep, ()):  # reconnecting: the last resolution, refreshed below
                    self._open_link(e)
            else:
                self._open_link(ep)
        self.start()
        if any(is_dns(ep) for ep in self.brokers) and (self._dns_task is None or self._dns_task.done()):
            self._dns_task = self._task(self._discovery_loop(), f"discovery-{self.worker_id}")

    def _open_link(self, ep: str) -> None:
        if any(link.endpoint == ep for link in self.links):
            return
        if not self._budget.take():  # the context has no room for its sockets: not opened, never dies
            self.discovery_stats["links_refused"] += 1
            self.log.warning("broker_link_refused", broker=ep, reason="link budget of the context exhausted",
                             links=self._budget.used)
            return
        link = BrokerLink(self.ctx, ep, self.worker_id, self.epoch, self.ready_frames, self.on_message, self._session_lost,
                          heartbeat_ms=self.heartbeat_ms, liveness=self.liveness, reconnect=self.reconnect, curve=self.curve,
                          conn_no=self._conn_no.get(ep, 0), memory=self.memory)
        self.links.append(link)
        self._link_tasks.append(self._task(link.run(), f"link-{ep}"))

    def _close_link(self, ep: str) -> None:
        """Close the link to ``ep`` without a goodbye (it holds nothing, or its broker is gone)."""
        self._retiring.discard(ep)
        self._absent.pop(ep, None)
        for link in [lk for lk in self.links if lk.endpoint == ep]:
            self._conn_no[ep] = link.conn_no
            link.close(say_goodbye=False)
            self.links.remove(link)
            self._budget.give()

    def _session_lost(self, link: BrokerLink, why: str) -> None:
        """A link's broker forgot us; a drained link (its broker left the answer) has now really
        failed: it closes instead of reconnecting."""
        self.on_session_lost(link, why)
        if link.endpoint in self._retiring and link in self.links:
            self.discovery_stats["retired"] += 1
            self.log.info("broker_link_retired", broker=link.endpoint, reason=why)
            self._close_link(link.endpoint)

    def _drain_link(self, ep: str) -> None:
        """The broker at ``ep`` left the answer: a registered link is drained (no new work, its
        streams finish) and kept until it really fails; one never registered holds nothing and
        closes."""
        link = next((lk for lk in self.links if lk.endpoint == ep), None)
        if link is None or ep in self._retiring:
            return
        if not link.registered:
            self.discovery_stats["rotated_out"] += 1
            self._close_link(ep)
            return
        self._retiring.add(ep)
        self.discovery_stats["drained"] += 1
        link.send(P.encode_disconnect(P.DRAINING))

    def _follow(self, ep: str) -> None:
        """``ep`` is in the followed set: open its link, or undrain it (it came back)."""
        if ep in self._retiring:
            if self._draining:
                return  # leaving: stays drained
            self._retiring.discard(ep)
            self.discovery_stats["undrained"] += 1
            for link in self.links:
                if link.endpoint == ep:
                    link.send(self.ready_frames())  # the same registration again: the broker undrains it
        else:
            self._open_link(ep)

    async def refresh_discovery(self) -> None:
        """Resolve every ``dns+tcp://`` broker now; open and close links to match (a failed
        resolution keeps the last set: a DNS outage must not disconnect a fleet)."""
        answered = True
        for spec in self.brokers:
            if not is_dns(spec):
                continue
            name, port = parse_dns(spec)
            addrs = await self.resolver.resolve(name)
            if addrs is None:
                answered = False
                self.log.warning("discovery_failed", broker=spec, kept=len(self.discovered.get(spec, ())))
                continue
            answer = endpoints_for(port, addrs)
            linked = {lk.endpoint: lk.registered for lk in self.links if lk.endpoint not in self._retiring}
            new = choose_endpoints(answer, linked, self.max_followed, self._rng)
            old = self.discovered.get(spec, [])
            if new != old:
                self.log.info("discovery_changed", broker=spec, added=sorted(set(new) - set(old))[:16],
                              removed=sorted(set(old) - set(new))[:16], answer=len(answer), followed=len(new))
            self.discovered[spec] = new
            if not self._connected:
                continue  # disconnected on purpose: connect() opens them
            keep = self._followed()
            in_answer = set(answer)
            registered = {lk.endpoint for lk in self.links if lk.registered}
            for e in set(old) - keep:  # first: their room in the budget goes to the new ones
                if e in in_answer or e not in registered:
                    self._drain_link(e)  # rotated out of the sample, or never registered (holds nothing): closed
                else:
                    self._absent.setdefault(e, 0)  # gone from the answer: drained if it stays away
            for e in new:
                self._follow(e)
        if answered:  # (an outage is no answer: it counts nobody absent)
            self._count_absent()

    def _followed(self) -> set[str]:
        """Every endpoint followed now: the fixed ones and the last choice of each name."""
        return {e for s in self.brokers for e in (self.discovered.get(s, ()) if is_dns(s) else (s,))}

    def _count_absent(self) -> None:
        """Once per refresh: links whose broker is back forget their absence; one missing from
        ``DRAIN_AFTER_REFRESHES`` answers in a row is drained (a flapping answer drains nothing)."""
        keep = self._followed()
        for e in list(self._absent):
            if e in keep:
                del self._absent[e]
                continue
            self._absent[e] += 1
            if self._absent[e] >= DRAIN_AFTER_REFRESHES:
                del self._absent[e]
                self._drain_link(e)

    async def _discovery_loop(self) -> None:
        while True:
            try:
                await self.refresh_discovery()
            except Exception as exc:  # noqa: BLE001 - an odd answer (not an address) must not stop the following
                self.discovery_stats["refresh_failed"] += 1
                self.log.error("discovery_refresh_failed", error=repr(exc)[:300])
            await asyncio.sleep(self.discovery_refresh_s)

    def disconnect(self, *, say_goodbye: bool = True) -> None:
        """Close every link (a DISCONNECT first, unless ``say_goodbye`` is False): brokers forget
        this worker and retry what it held. :meth:`connect` registers again."""
        self._connected = False
        for link in self.links:
            self._conn_no[link.endpoint] = link.conn_no
            link.close(say_goodbye=say_goodbye)
            self._budget.give()
        self.links = []
        self._retiring.clear()
        self._absent.clear()
        self._link_tasks = [t for t in self._link_tasks if not t.done()]

    def drain(self) -> None:
        """Tell every broker this worker is draining: no new requests, in-flight ones finish
        (for good: a broker that comes back in a DNS answer is not undrained)."""
        self._draining = True
        self.broadcast(P.encode_disconnect(P.DRAINING))

    def broadcast(self, frames: list[bytes]) -> int:
        """Send ``frames`` on every link; returns how many took them."""
        return sum(1 for link in self.links if link.send(frames))

    # ------------------------------------------------------------------ heartbeats

    def start(self) -> None:
        """Start the heartbeat timer (idempotent; :meth:`connect` calls it)."""
        if self._hb_task is None or self._hb_task.done():
            self._hb_task = self._task(self._heartbeat_loop(), f"heartbeat-{self.worker_id}")

    def _task(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._log_crash)
        return task

    def _log_crash(self, task: asyncio.Task) -> None:
        """A link or the heartbeat timer must never die silently (the brokers would expire us)."""
        if not task.cancelled() and task.exception() is not None:
            self.log.error("worker_task_crashed", task=task.get_name(), error=repr(task.exception())[:500])

    async def _heartbeat_loop(self) -> None:
        hb_s = self.heartbeat_ms / 1000.0
        while True:
            await asyncio.sleep(hb_s)
            if not self.links:
                continue
            frames = P.encode_heartbeat(self.load())
            for link in self.links:
                if link.sock is not None:
                    link.send(frames)

    # ------------------------------------------------------------------ KV events

    def send_kv(self, frames: list[bytes]) -> int:
        """Fan one encoded KV_EVENTS batch out to every broker that registered this worker (or to
        the first that takes it, ``kv_events_to="one"``); returns how many took it."""
        one = self.kv_events_to == "one"
        n = 0
        for link in self.links:
            if link.registered and link.send(frames):
                n += 1
                if one:
                    break
        return n

    def publish_kv(self, events: list, *, dp_rank: int = 0, ts: float | None = None) -> int:
        """Encode wire-form KV events as the next batch of ``dp_rank``'s stream (this worker's
        epoch, one contiguous seq per rank whichever brokers take it) and :meth:`send_kv` it."""
        seq = self._kv_seq.get(dp_rank, 0)
        self._kv_seq[dp_rank] = seq + 1
        return self.send_kv(P.encode_kv_events(dp_rank, self.epoch, seq, time.time() if ts is None else ts, events))

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Connect and serve until cancelled; then close (with goodbyes)."""
        self.connect()
        try:
            await asyncio.gather(*self._link_tasks, self._hb_task)  # type: ignore[arg-type]
        finally:
            await self.aclose()

    async def aclose(self, *, say_goodbye: bool = True) -> None:
        """Close the links and stop the tasks. Idempotent."""
        self.disconnect(say_goodbye=say_goodbye)
        tasks = [t for t in (*self._link_tasks, self._hb_task, self._dns_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._link_tasks = []
        self._hb_task = None
        self._dns_task = None
