"""Python client for a mesh: async (:class:`Client`) and blocking (:class:`SyncClient`).

::

    async with Client(["tcp://127.0.0.1:5555"]) as c:
        stream = await c.submit(input_ids=[1, 2, 3], max_new_tokens=16)
        async for chunk in stream:          # token ids as they are generated
            ...
        result = await stream.result()      # finish reason, usage, worker, timings

    with SyncClient("tcp://127.0.0.1:5555") as c:
        result = c.generate(text="hello", max_new_tokens=8)

Errors (:mod:`mesh.errors`): a request that ends in an ERROR frame raises
:class:`~mesh.errors.RetryableError` (worker_lost, unavailable, overloaded, worker_error) or
:class:`~mesh.errors.FatalRequestError` (bad_request, deadline_exceeded, no_worker, ...). If the
broker never answers, the wait ends at the request deadline plus a grace period with
``deadline_exceeded``; nothing waits forever.

The client may use several brokers: it keeps one DEALER per broker, sends each request to the
next broker whose connection is up (round robin; when none is up, requests queue for whichever
comes back first), and remembers which broker holds which request. When a broker's connection
drops, its replies already received are delivered, and every request it still held ends with
``unavailable`` ("broker connection lost"): the request or its reply may be lost with that
broker, and :meth:`Client.generate` resubmits such requests to another broker (idempotent
requests with no output yet), so a broker restart or crash never leaves a request waiting for
its deadline. It also resubmits an idempotent request that ended with ``worker_lost`` before
any CHUNK reached the client: the broker ran out of attempts (``--max-attempts``) or retry
budget when its worker died, but nothing was generated for the client, so the request can
simply run again (on any broker).

A broker endpoint may also be ``dns+tcp://NAME:PORT`` (:mod:`mesh.discovery`, as for workers):
every address NAME resolves to is a broker, and the client follows the name, re-resolving every
``discovery_refresh_s``: links open to brokers that appear and close for brokers that left it,
without recreating the client. A closed link's requests end as a lost connection's do
(``unavailable``, resubmitted by :meth:`Client.generate`; the broker is sent a CANCEL for each);
a failed resolution keeps the last good set. Until some name has resolved to an address,
requests wait for a broker (bounded by their deadline) as they do when no connection is up.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.discovery import Resolver, check_endpoint, endpoints_for, is_dns, parse_dns
from mesh.errors import ClientStateError, ConfigError, ErrorCode, ProtocolError, RequestError, RetryableError, error_for
from mesh.logs import get_logger
from mesh.retry import RetryPolicy
from mesh.sockets import CLIENT_DEALER, CurveKeys, make_socket

__all__ = ["Client", "SyncClient", "Stream", "Result"]

_GRACE_S = 2.0
_DEFAULT_DEADLINE_MS = 30_000


@dataclass(slots=True)
class Result:
    """A finished request."""

    rid: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, Any]
    worker: str
    attempt: int
    reason: str  # routing decision reason of the final attempt
    ttft_s: float | None
    e2e_s: float


@dataclass(eq=False)
class Stream:
    """One in-flight request. Iterate for token-id chunks; ``await result()`` for the outcome."""

    rid: str
    deadline_s: float
    client: "Client"
    started_s: float = field(default_factory=time.monotonic)
    worker: str | None = None
    reason: str = ""
    attempt: int = 0
    first_token_s: float | None = None
    chunks: int = 0  # CHUNK frames received
    _link: Any = None  # the broker link this request was sent on
    _q: asyncio.Queue = field(default_factory=asyncio.Queue)
    _tokens: list[int] = field(default_factory=list)
    _result: Result | None = None
    _error: RequestError | None = None
    _done: bool = False

    def __aiter__(self) -> AsyncIterator[list[int]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[list[int]]:
        while True:
            item = await self._next()
            if item is None:
                return
            yield item

    async def _next(self) -> list[int] | None:
        if self._done and self._q.empty():
            if self._error is not None:
                raise self._error
            return None
        timeout = max(0.0, self.deadline_s + _GRACE_S - time.monotonic())
        try:
            kind, payload = await asyncio.wait_for(self._q.get(), timeout)
        except asyncio.TimeoutError:
            self._fail(error_for(ErrorCode.DEADLINE_EXCEEDED, "no reply from the broker before the deadline", self.rid))
            self.client._forget(self.rid)
            raise self._error  # type: ignore[misc]
        if kind == "chunk":
            return payload
        if kind == "error":
            raise payload
        return None  # final

    async def result(self) -> Result:
        """Wait for the terminal frame (consuming remaining chunks). Raises RequestError."""
        while not self._done or not self._q.empty():
            if await self._next() is None:
                break
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    async def cancel(self) -> None:
        """Ask the broker to cancel. The stream then ends with ``cancelled`` (unless it finished)."""
        if not self._done:
            await self.client._send(P.encode_cancel(self.rid), self._link)

    # called by the client's receive task
    def _on_accepted(self, m: P.Accepted) -> None:
        self.worker, self.reason, self.attempt = m.worker, m.reason, m.attempt

    def _on_chunk(self, m: P.ClientChunk) -> None:
        toks = m.data.get("token_ids") or []
        self.chunks += 1
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()
        self._tokens.extend(toks)
        self._q.put_nowait(("chunk", toks))

    def _on_final(self, m: P.ClientFinal) -> None:
        now = time.monotonic()
        toks = m.data.get("token_ids")
        if toks:  # a stream's last delta (adapters put the engine's last event here), or all tokens
            self._tokens.extend(toks)
            if self.first_token_s is None:
                self.first_token_s = now
            self._q.put_nowait(("chunk", toks))
        self._result = Result(self.rid, self._tokens, m.finish_reason, m.usage, m.worker, m.attempt, m.reason or self.reason,
                              None if self.first_token_s is None else self.first_token_s - self.started_s, now - self.started_s)
        self._done = True
        self._q.put_nowait(("final", None))

    def _fail(self, err: RequestError) -> None:
        if not self._done:
            self._error = err
            self._done = True
            self._q.put_nowait(("error", err))


# Monitor events that change a link's state (a ZMTP handshake follows every TCP connect).
_UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN_EVENTS = zmq.EVENT_DISCONNECTED
_LOST_DRAIN_S = 0.2  # on a drop, replies already queued are read for at most this long
# After a broker answers ``unavailable`` (typically: it is draining), a resubmission waits up to
# this long for another broker's connection to be up, rather than going back to the same one.
# It covers a restarted broker's reconnect (the DEALER retries at most every 2 s).
_OTHER_LINK_WAIT_S = 2.5
# A link closed because its broker left DNS: queued CANCELs for its requests get this long to go.
_RETIRE_LINGER_MS = 200
_RETIRE_POLL_S = 0.05  # a retiring link with streams under way: how often it looks whether they ended


@dataclass(eq=False)
class _Link:
    """One broker: its DEALER, the DEALER's monitor, whether a connection is up, and the rids
    of requests sent on it that have no terminal reply yet."""

    endpoint: str
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    up: bool = False
    pending: set[str] = field(default_factory=set)
    _tasks: list[asyncio.Task] = field(default_factory=list, repr=False)  # its receive and monitor tasks


class Client:
    """Async mesh client: one DEALER per broker, one receive task and one monitor task each.

    ``endpoints`` are ZeroMQ endpoints and/or ``dns+tcp://NAME:PORT`` specs (re-resolved every
    ``discovery_refresh_s`` through ``resolver``, default :class:`~mesh.discovery.Resolver`);
    an invalid one is a :class:`~mesh.errors.ConfigError` naming ``endpoints``.
    """

    def __init__(self, endpoints: str | list[str], *, ctx: zmq.asyncio.Context | None = None, curve: CurveKeys | None = None,
                 default_deadline_ms: int = _DEFAULT_DEADLINE_MS, discovery_refresh_s: float = 5.0,
                 resolver: Resolver | None = None) -> None:
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ValueError("at least one broker endpoint is required")
        for ep in self.endpoints:
            check_endpoint(ep, "endpoints")
        if not discovery_refresh_s > 0:
            raise ConfigError(f"discovery_refresh_s: {discovery_refresh_s!r} must be > 0")
        self._dns_specs = [ep for ep in dict.fromkeys(self.endpoints) if is_dns(ep)]
        self.discovery_refresh_s = discovery_refresh_s
        self.resolver = resolver or Resolver()
        self._discovered: dict[str, list[str]] = {}  # dns+tcp spec -> the endpoints it resolved to last
        self.discovery_failures = 0  # resolutions that failed (the last good set was kept)
        self._resolved_once = asyncio.Event()  # set after the first discovery pass, whatever its outcome
        self._links_changed = asyncio.Event()  # set when a link opens (and at close), for submits waiting for one
        self._retiring: set[_Link] = set()  # links being closed because their broker left DNS
        self.log = get_logger(service="client")
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.curve = curve
        self.default_deadline_ms = default_deadline_ms
        self._links: list[_Link] = []
        self._rr = 0
        self._streams: dict[str, Stream] = {}
        self._status_waiters: list[asyncio.Future] = []
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid()}-{id(self) & 0xFFFFFF:x}"
        self.rejected_replies = 0
        self.lost_requests = 0  # requests failed because their broker's connection dropped (or it left DNS)
        self._link_up = asyncio.Event()  # set whenever some link's connection comes up
        self._state = "unopened"

    @property
    def links(self) -> tuple["_Link", ...]:
        """One per broker (read-only view): its endpoint, whether a connection is up, and the rids
        of requests in flight on it (operators' tools and tests watch these)."""
        return tuple(self._links)

    @property
    def discovered(self) -> dict[str, list[str]]:
        """``dns+tcp://`` spec -> the broker endpoints it resolved to last (a copy; a spec that
        never resolved is absent)."""
        return {spec: list(eps) for spec, eps in self._discovered.items()}

    @property
    def open_streams(self) -> int:
        """Requests this client still waits on."""
        return len(self._streams)

    async def __aenter__(self) -> "Client":
        self.open()
        await self._first_resolution()
        return self

    async def _first_resolution(self) -> None:
        """With ``dns+tcp://`` brokers, wait for the first resolution (at most
        ``discovery_refresh_s``), so the links it finds exist when ``async with`` returns.
        A name that resolves to nothing (or late) is no error: requests wait for a broker."""
        if self._dns_specs and self._state == "open":
            try:
                await asyncio.wait_for(self._resolved_once.wait(), self.discovery_refresh_s)
            except asyncio.TimeoutError:
                pass

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def open(self) -> None:
        if self._state != "unopened":
            raise ClientStateError(f"client is {self._state}; create a new one")
        self._state = "open"
        for ep in self.endpoints:
            if not is_dns(ep):
                self._open_link(ep)
        if self._dns_specs:  # its first pass runs at once; links open as names resolve
            self._tasks.append(asyncio.create_task(self._discovery_loop(), name="mesh-client-discovery"))

    def _open_link(self, ep: str) -> None:
        if any(link.endpoint == ep for link in self._links):
            return
        # The monitor is attached before connect: a handshake that completes first (a busy
        # machine can deschedule this thread between the two calls) would otherwise never
        # be reported and the link would stay "down" for good.
        sock = make_socket(self.ctx, CLIENT_DEALER.with_curve(self.curve))
        mon = sock.get_monitor_socket(_UP_EVENTS | _DOWN_EVENTS)
        sock.connect(ep)
        link = _Link(ep, sock, mon)
        link._tasks = [asyncio.create_task(self._receive(link), name=f"mesh-client-rx-{ep}"),
                       asyncio.create_task(self._watch(link), name=f"mesh-client-monitor-{ep}")]
        self._links.append(link)
        self._tasks.extend(link._tasks)
        self._links_changed.set()

    async def refresh_discovery(self) -> None:
        """Resolve every ``dns+tcp://`` broker now; open and close links to match. A failed
        resolution keeps the last good set (a DNS outage must not disconnect the client) and
        counts in ``discovery_failures``."""
        gone: set[str] = set()
        for spec in self._dns_specs:
            name, port = parse_dns(spec, "endpoints")
            error = None
            try:
                addrs = await self.resolver.resolve(name)
                new = None if addrs is None else endpoints_for(port, addrs)
            except Exception as exc:  # noqa: BLE001 - an odd answer (a bad address) must not stop the following
                new, error = None, repr(exc)[:200]
            old = self._discovered.get(spec, [])
            if new is None:
                self.discovery_failures += 1
                self.log.warning("discovery_failed", broker=spec, kept=len(old), **({"error": error} if error else {}))
                continue
            if new != old:
                self.log.info("discovery_changed", broker=spec, added=sorted(set(new) - set(old)),
                              removed=sorted(set(old) - set(new)))
            self._discovered[spec] = new
            if self._state != "open":
                continue
            for e in new:
                self._open_link(e)
            gone |= set(old) - set(new)
        keep = {e for s in self.endpoints for e in (self._discovered.get(s, ()) if is_dns(s) else (s,))}
        for link in [link for link in self._links if link.endpoint in gone - keep]:
            self._links.remove(link)  # no new requests there from now on
            self._retiring.add(link)
            self._tasks.append(asyncio.create_task(self._retire(link), name=f"mesh-client-retire-{link.endpoint}"))

    async def _discovery_loop(self) -> None:
        while True:
            try:
                await self.refresh_discovery()
            except Exception as exc:  # noqa: BLE001 - following must not stop silently (say, EMFILE opening a link)
                self.log.error("discovery_refresh_crashed", error=repr(exc)[:500])
            self._resolved_once.set()
            await asyncio.sleep(self.discovery_refresh_s)

    async def _retire(self, link: _Link) -> None:
        """Close a link whose broker left DNS (already out of the links: new requests stop going
        there at once). Replies already queued are delivered; a request that has not streamed
        yet ends as on a lost connection (``unavailable``: :meth:`generate` resubmits it
        elsewhere) and the broker, which may well be alive (scaled down, draining), is sent a
        CANCEL for it; a stream under way finishes where it is (a flapping answer must not cut
        streams, issue 32) unless the connection drops or its deadline passes."""
        await self._drain_replies(link)
        why = f"broker {link.endpoint} left DNS before the reply"
        started = {rid for rid in link.pending if (st := self._streams.get(rid)) is not None and st.chunks}
        rids = self._fail_pending(link, why, keep=started)
        if started:
            t_end = max(self._streams[rid].deadline_s for rid in started) + _GRACE_S
            while link.pending and link.up and self._state == "open" and time.monotonic() < t_end:
                await asyncio.sleep(_RETIRE_POLL_S)
            rids += self._fail_pending(link, why)
        self._queue_cancels(link, rids)
        for t in link._tasks:
            t.cancel()
        await asyncio.gather(*link._tasks, return_exceptions=True)
        me = asyncio.current_task()
        self._tasks = [t for t in self._tasks if t not in link._tasks and t is not me]
        self._close_sockets(link, linger_ms=_RETIRE_LINGER_MS if rids else 0)
        self._retiring.discard(link)

    @staticmethod
    def _close_sockets(link: _Link, linger_ms: int = 0) -> None:
        link.sock.disable_monitor()
        link.monitor.close(linger=0)
        link.sock.close(linger=linger_ms)

    async def aclose(self) -> None:
        """Fail pending requests with ``cancelled``, stop the tasks, close the sockets. Idempotent."""
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closed"
        self._links_changed.set()  # submits waiting for a link give up
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for st in list(self._streams.values()):
            st._fail(error_for(ErrorCode.CANCELLED, "client closed", st.rid))
        self._streams.clear()
        for link in [*self._links, *self._retiring]:
            if not link.sock.closed:
                self._close_sockets(link)
        self._retiring.clear()

    def _next(self, pred) -> _Link | None:
        """The next link (round robin) that satisfies ``pred``, or None."""
        links = self._links
        n = len(links)
        for k in range(n):
            i = (self._rr + k) % n
            if pred(links[i]):
                self._rr = (i + 1) % n
                return links[i]
        return None

    def _pick(self, avoid: _Link | None = None) -> _Link:
        """The next broker whose connection is up, other than ``avoid`` if another is up; when
        none is up, any broker (``avoid`` last)."""
        return (self._next(lambda link: link.up and link is not avoid) or self._next(lambda link: link.up)
                or self._next(lambda link: link is not avoid) or self._links[0])

    async def _another_link_up(self, avoid: _Link | None, timeout_s: float) -> None:
        """Return once a link other than ``avoid`` is up, or after ``timeout_s``."""
        if avoid is None or len(self._links) < 2:
            return
        t_end = time.monotonic() + timeout_s
        while not any(link.up for link in self._links if link is not avoid):
            left = t_end - time.monotonic()
            if left <= 0:
                return
            self._link_up.clear()
            try:
                await asyncio.wait_for(self._link_up.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _some_link(self) -> None:
        """Return once the client has a link (with only ``dns+tcp://`` brokers it may have none
        yet). Unbounded: callers bound it. A client closed meanwhile: ClientStateError."""
        while not self._links:
            if self._state != "open":
                raise ClientStateError(f"client is {self._state}")
            self._links_changed.clear()
            await self._links_changed.wait()

    async def _send(self, frames: list[bytes], link: _Link | None = None) -> _Link:
        """The client's one send boundary: ZeroMQ and OS errors become the documented tree
        (``unavailable``, retryable elsewhere), a closed client a :class:`ClientStateError`."""
        if self._state != "open":
            raise ClientStateError("client is not open")
        if link is None:
            await self._some_link()
            link = self._pick()
        try:
            await link.sock.send_multipart(frames)
        except (zmq.ZMQError, OSError) as exc:
            raise error_for(ErrorCode.UNAVAILABLE, f"cannot send to {link.endpoint}: {exc}") from exc
        return link

    async def _send_registered(self, frames: list[bytes], link: _Link, rid: str) -> None:
        """Send a request registered on ``link``, unless the link's sweep (its retire or its
        loss) ended it first: the send runs as a task of its own, iterations after the
        registration, and a SUBMIT that went out after its CANCEL would run a copy at the broker
        that nobody reads while ``generate`` resubmits it elsewhere."""
        if rid in link.pending:
            await self._send(frames, link)

    def _forget(self, rid: str) -> None:
        st = self._streams.pop(rid, None)
        if st is not None and st._link is not None:
            st._link.pending.discard(rid)

    async def submit(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        max_new_tokens: int = 128,
        params: dict[str, Any] | None = None,
        deadline_ms: int | None = None,
        stream: bool = True,
        idempotent: bool = True,
        slo: dict[str, Any] | None = None,
        rid: str | None = None,
        model: str | None = None,
        priority: str | None = None,
        _avoid: _Link | None = None,
        session: str | None = None,
    ) -> Stream:
        """Send one request; returns its :class:`Stream` at once (before any reply). ``session``:
        a session key (1..256 bytes), the turns of one session stick to one worker.
        ``priority``: critical, high, normal or low (the broker clamps it to the tenant's ceiling).
        ``_avoid`` is internal (:meth:`generate`): a broker not to use if another is up."""
        if self._state != "open":  # before picking a link: an unopened client has none
            raise ClientStateError(f"client is {self._state}; use it inside 'async with Client(...)'")
        rid = rid or f"{self._prefix}-{next(self._ids)}"
        budget_ms = deadline_ms or self.default_deadline_ms
        st = Stream(rid, time.monotonic() + budget_ms / 1000.0, self)
        p = dict(params or {})
        p["max_new_tokens"] = max_new_tokens
        frames = P.encode_submit(rid, input_ids=input_ids, text=text, params=p, deadline_ms=budget_ms,
                                 stream=stream, idempotent=idempotent, slo=slo, model=model, session=session,
                                 priority=priority)
        # dns+tcp:// brokers only, none resolved yet: wait for one, as for a connection. Looked at
        # again on waking: this task resumes iterations after the link opened (wait_for runs the
        # wait as a task of its own), and a flapping answer may have retired it meanwhile.
        while not self._links:
            try:
                await asyncio.wait_for(self._some_link(), max(0.0, st.deadline_s - time.monotonic()))
            except asyncio.TimeoutError:
                raise error_for(ErrorCode.DEADLINE_EXCEEDED, f"no broker address for {', '.join(self._dns_specs)} "
                                "resolved before the deadline", rid) from None
            except ClientStateError:
                raise error_for(ErrorCode.CANCELLED, "client closed", rid) from None
        link = self._pick(_avoid)
        st._link = link
        self._streams[rid] = st
        link.pending.add(rid)
        try:
            # A DEALER with no usable connection (e.g. a refused handshake) blocks sends: the
            # request's deadline bounds that wait too.
            await asyncio.wait_for(self._send_registered(frames, link, rid), max(0.0, st.deadline_s - time.monotonic()))
        except asyncio.TimeoutError:
            self._forget(rid)
            raise error_for(ErrorCode.DEADLINE_EXCEEDED, f"could not send the request to {link.endpoint} before its deadline",
                            rid) from None
        except RequestError as exc:
            self._forget(rid)
            exc.link = link  # which broker refused the send (generate() resubmits elsewhere)
            raise
        except BaseException:
            self._forget(rid)
            raise
        return st

    async def generate(self, *, resubmit: int = 3, **kwargs) -> Result:
        """Submit and wait for the result (see :meth:`submit` for arguments).

        A request that ends with ``unavailable`` (a draining or restarting broker, a broker
        whose connection dropped while it held the request, or a send to a broker that failed)
        is resubmitted up to ``resubmit`` times after a jittered back-off, so broker restarts
        and crashes do not fail requests; the deadline still bounds the whole call. A
        resubmission goes to another broker: if none is connected yet (say the other one is
        itself restarting), it waits for one up to ``_OTHER_LINK_WAIT_S`` rather than going back
        to the broker that just refused. Partial output of the failed attempt is discarded
        (``generate`` only returns whole results), so this holds mid-stream too; requests
        submitted with ``idempotent=False`` are never resubmitted.

        A request that ends with ``worker_lost`` before any CHUNK arrived (its worker died and
        the broker had no attempt or retry budget left to re-dispatch it) is resubmitted too,
        within the same limits (``resubmit``, back-off, deadline), to any broker: the broker
        that answered is not at fault. One that streamed output first is not (it ran, at least
        partly, and the caller may have seen its chunks through :meth:`submit`).
        """
        budget_ms = kwargs.get("deadline_ms") or self.default_deadline_ms
        t_end = time.monotonic() + budget_ms / 1000.0
        policy = RetryPolicy(max_attempts=resubmit + 1, base_ms=50.0, cap_ms=500.0)
        attempt = 0
        refused_by = None
        while True:
            attempt += 1
            kwargs["deadline_ms"] = max(1, int((t_end - time.monotonic()) * 1000))
            kwargs.pop("rid", None) if attempt > 1 else None
            st = None
            try:
                # unavailable from submit() itself: the send to that broker failed, nothing ran
                st = await self.submit(**kwargs, _avoid=refused_by)
                return await st.result()
            except RetryableError as exc:
                remaining = t_end - time.monotonic()
                lost_unstarted = exc.code is ErrorCode.WORKER_LOST and st is not None and st.chunks == 0
                if ((exc.code is not ErrorCode.UNAVAILABLE and not lost_unstarted) or not kwargs.get("idempotent", True)
                        or not policy.should_retry(attempt, remaining)):
                    raise
                # unavailable: that broker refused or went away, prefer another; worker_lost: any
                if exc.code is ErrorCode.UNAVAILABLE:
                    refused_by = st._link if st is not None else getattr(exc, "link", None)
                else:
                    refused_by = None
                await asyncio.sleep(min(policy.delay_s(attempt), max(0.0, remaining)))
                await self._another_link_up(refused_by, min(_OTHER_LINK_WAIT_S, max(0.0, t_end - time.monotonic())))

    async def status(self, timeout_s: float = 5.0, *, full: bool = True, max_pages: int = 128) -> P.StatusReply:
        """Ask a broker for its view of the fleet: every worker's row, paged (a broker answers a
        client it does not authorise with a bounded summary: short rows, ``broker.truncated``;
        see :mod:`mesh.broker_core.status`), at most ``max_pages`` queries. ``full``: ask for
        whole rows (granted to authorised clients only). A rate-limited query raises
        ``rate_limited``; no answer within ``timeout_s``, ``unavailable``."""
        t_end = time.monotonic() + timeout_s
        first = await self._status_page(full, 0, t_end)
        rows = list(first.workers)
        for _ in range(max_pages - 1):
            total = first.broker.get("workers_total")
            if not first.broker.get("truncated") or not rows or type(total) is not int or len(rows) >= total:
                break
            page = await self._status_page(full, len(rows), t_end)
            if not page.workers:
                break
            rows += page.workers
        first.workers = rows
        return first

    async def _status_page(self, full: bool, offset: int, t_end: float) -> P.StatusReply:
        """One STATUS query; a rate-limited one is asked again after the broker's ``retry_after_s``
        while that fits before ``t_end`` (a polling client slows down), else ``rate_limited``."""
        while True:
            fut: asyncio.Future = asyncio.get_running_loop().create_future()
            self._status_waiters.append(fut)
            try:
                await asyncio.wait_for(self._send(P.encode_status_query(full, offset)), max(0.0, t_end - time.monotonic()))
                m = await asyncio.wait_for(fut, max(0.0, t_end - time.monotonic()))
            except asyncio.TimeoutError:
                raise error_for(ErrorCode.UNAVAILABLE, "no STATUS reply from the broker") from None
            finally:
                if fut in self._status_waiters:
                    self._status_waiters.remove(fut)
            if not m.broker.get("rate_limited"):
                return m
            wait_s = m.broker.get("retry_after_s")
            wait_s = min(float(wait_s), 60.0) if type(wait_s) in (int, float) and wait_s > 0 else 0.1
            if time.monotonic() + wait_s >= t_end:
                raise error_for(ErrorCode.RATE_LIMITED, f"STATUS rate-limited by the broker: retry after {wait_s} s")
            await asyncio.sleep(wait_s)

    async def _receive(self, link: _Link) -> None:
        sock = link.sock
        while True:
            self._on_reply(link, await sock.recv_multipart())

    def _on_reply(self, link: _Link, frames: list[bytes]) -> None:
        m = P.decode_client_reply(frames)
        if isinstance(m, ProtocolError):
            self.rejected_replies += 1
            return
        if isinstance(m, P.StatusReply):
            while self._status_waiters:
                f = self._status_waiters.pop(0)
                if not f.done():
                    f.set_result(m)
                    break
            return
        st = self._streams.get(m.rid) if m.rid is not None else None
        if st is None:
            self.rejected_replies += 1
            return
        if isinstance(m, P.ClientChunk):
            st._on_chunk(m)
        elif isinstance(m, P.Accepted):
            st._on_accepted(m)
        elif isinstance(m, P.ClientFinal):
            self._forget(m.rid)
            st._on_final(m)
        elif isinstance(m, P.ClientError):
            self._forget(m.rid)
            st._fail(error_for(m.code, m.message, m.rid))

    async def _watch(self, link: _Link) -> None:
        """Track the link's connection; when it drops, end the requests it still holds."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            ev = parse_monitor_message(await link.monitor.recv_multipart())
            event = ev.get("event", 0)
            if event & _UP_EVENTS:
                link.up = True
                self._link_up.set()
            elif event & _DOWN_EVENTS:
                link.up = False
                await self._on_link_lost(link)

    async def _on_link_lost(self, link: _Link) -> None:
        await self._drain_replies(link)
        rids = self._fail_pending(link, f"broker connection lost ({link.endpoint}) before the reply")
        # The DEALER keeps what it had not written when the connection dropped and sends it on
        # reconnect: a SUBMIT among that would run at the broker while generate() resubmits it
        # elsewhere. A CANCEL queued behind it ends it there (one from a new connection that
        # finds nothing is counted and dropped by the broker).
        self._queue_cancels(link, rids)

    @staticmethod
    def _queue_cancels(link: _Link, rids: list[str]) -> None:
        """Queue a CANCEL per rid on ``link``, behind anything still queued there, without
        waiting. Through the asyncio socket's own send: a raw send would read the socket's
        events and could swallow the receive task's wake-up (see :meth:`_drain_replies`)."""
        for rid in rids:
            if link.sock.closed:
                return
            try:
                fut = link.sock.send_multipart(P.encode_cancel(rid))
            except zmq.ZMQError:
                return  # best effort: the socket is gone
            fut.add_done_callback(_ignore_send_result)

    @staticmethod
    async def _drain_replies(link: _Link) -> None:
        # Replies that arrived before the drop are queued on the socket: let the receive task
        # take them first (bounded), so a broker that drained cleanly loses nothing here.
        # ZMQ_EVENTS through the asyncio socket's get(), never getsockopt() (pyzmq's raw call):
        # reading it processes the socket's mailbox and clears its descriptor, and only get()
        # then wakes the receive task's pending recv; after a raw read, a reply that had just
        # arrived was never read, nor any after it (a retiring link's streams hung to the deadline).
        t_end = time.monotonic() + _LOST_DRAIN_S
        while link.pending and link.sock.get(zmq.EVENTS) & zmq.POLLIN and time.monotonic() < t_end:
            await asyncio.sleep(0.001)

    def _fail_pending(self, link: _Link, why: str, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """End every request ``link`` still holds (but those in ``keep``) with ``unavailable``
        (resubmittable); their rids."""
        failed = []
        for rid in [r for r in link.pending if r not in keep]:
            st = self._streams.get(rid)
            self._forget(rid)
            if st is not None and not st._done:
                self.lost_requests += 1
                st._fail(error_for(ErrorCode.UNAVAILABLE, why, rid))
                failed.append(rid)
        link.pending.intersection_update(keep)
        return failed


def _ignore_send_result(fut: "asyncio.Future[Any]") -> None:
    """A best-effort send's outcome is not awaited: read it so that a failure (the socket closed
    first) is not reported as never retrieved."""
    if not fut.cancelled():
        fut.exception()


class SyncClient:
    """Blocking facade over :class:`Client`, running its own event loop in a daemon thread."""

    def __init__(self, endpoints: str | list[str], **kwargs) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mesh-sync-client", daemon=True)
        self._thread.start()
        self._ctx = zmq.asyncio.Context()
        kwargs.setdefault("ctx", self._ctx)

        async def _mk() -> Client:
            c = Client(endpoints, **kwargs)
            c.open()
            await c._first_resolution()
            return c

        self._client = self._call(_mk())

    def _call(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def generate(self, **kwargs) -> Result:
        return self._call(self._client.generate(**kwargs))

    def stream(self, **kwargs):
        """Yield token-id chunks of one request; returns the Result as the generator's value."""
        st = self._call(self._client.submit(**kwargs))
        while True:
            item = self._call(st._next())
            if item is None:
                return self._call(st.result())
            yield item

    def status(self) -> P.StatusReply:
        return self._call(self._client.status())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._ctx.term()
        self._loop.close()

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
