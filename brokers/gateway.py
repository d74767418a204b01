"""``mesh gateway``: the HTTP API in its own process, in front of one or more brokers.

The same ingress as ``mesh broker --http`` (:class:`brokers.ingress.HttpIngress`: OpenAI and
SGLang endpoints, tokenizer and chat template off the loop, connection limits, timeouts), but it
submits over the client protocol (one DEALER per broker) instead of a broker's mailbox. HTTP front
ends then scale on their own, tokenisation runs beside no broker, and an HTTP flood exhausts the
gateway's descriptors and CPU, never a broker's sockets.

:class:`BrokerPool` implements :class:`brokers.ingress.backend.IngressBackend`, what the ingress
needs from "a broker": ``submit`` / ``cancel`` / ``forget`` (replies, found by their rid, land in
the request's queue as the frames a broker sends a client), ``stats`` (counters),
``routable_workers`` and ``model_catalog`` (from the brokers' STATUS) and ``state``; it has no
admin API. Requests go round robin over the brokers whose connection is up. A request whose broker
connection drops (or that its broker answers ``unavailable``, or ``worker_lost`` before any output)
moves to another broker as :class:`mesh.client.Client` resubmits it; one that streamed output
continues there from the tokens so far (:mod:`brokers.relay`); it gets ``unavailable`` only when
it cannot move (no other broker up, not idempotent, resubmissions or deadline spent; counted).
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
import time
from typing import Any

import zmq
import zmq.asyncio

from brokers.relay import Relay
from mesh import protocol as P
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.status import announced_by_model
from mesh.errors import ErrorCode
from mesh.logs import add_log_level_arg, announce, get_logger
from mesh.sockets import CLIENT_DEALER, make_socket, recv_frames, send_frames, socket_readable

__all__ = ["BrokerPool", "serve_gateway"]

_STATUS_PERIOD_S = 1.0
# Replies one request may have waiting for its HTTP client (as the broker's in-process bound): past it
# the client has stopped reading; its stream is cancelled rather than buffered without bound.
_REPLY_QUEUE_MAX = 4096
_MAX_STATUS_ROWS = 100_000  # worker rows read from one broker's STATUS pages


class _Link:
    __slots__ = ("endpoint", "sock", "sync", "fd", "monitor", "up", "pending", "workers", "catalog", "rows", "paging",
                 "outbox", "recheck")

    def __init__(self, endpoint: str, sock, monitor) -> None:
        self.endpoint = endpoint
        self.sock = sock
        # the same libzmq socket without pyzmq's asyncio layer (a Future, and a timer when a receive is
        # pending, per message): read by a reader callback on its FD, written in one burst per loop turn
        self.sync = zmq.Socket.shadow(sock.underlying)
        self.fd = self.sync.getsockopt(zmq.FD)
        self.outbox: list[tuple[str, list]] = []  # (rid, SUBMIT frames) to send at the end of this loop turn
        self.recheck = False  # a readiness check is scheduled (a send may consume the FD's edge)
        self.monitor = monitor
        self.up = False
        self.pending: set[str] = set()  # rids in flight on this link
        self.workers: list[dict] = []  # the routable workers of the latest STATUS
        self.catalog: dict = {}  # its models, aliases and model_name (STATUS ``broker``)
        self.rows: list[dict] = []  # the STATUS pages read so far (a broker pages its worker rows)
        self.paging = False  # a round of pages is under way (a rate-limited page is asked again next period)


class BrokerPool:
    """Remote brokers, seen through the interface the HTTP ingress uses (see the module docstring)."""

    admin = None  # the admin API (/workers) is the brokers' own
    default_deadline_ms = 30_000  # a request without a deadline: the brokers' default (--default-deadline-ms)

    def __init__(self, endpoints: list[str], ctx: zmq.asyncio.Context | None = None, curve=None) -> None:
        if not endpoints:
            raise ValueError("at least one broker endpoint is required")
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.endpoints = list(endpoints)
        self.curve = curve  # mesh.security.CurveKeys: CURVE to the brokers (--curve-secret, --curve-server-key)
        self.stats = BrokerStats()  # requests, dropped and the latency histograms (brokers.stats.GatewayCollector)
        # rid -> [accepted at (monotonic s), model, worker, first output at, last chunk at]: the
        # latencies the gateway observes on the replies it relays
        self._timing: dict[str, list] = {}
        self._links: list[_Link] = []
        self._rr = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}  # rid -> the request's reply queue
        self._by_ident: dict[bytes, tuple[str, _Link]] = {}
        self._relays: dict[str, Relay] = {}  # rid -> what it takes to move it to another broker
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.log = get_logger(service="gateway")

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        for ep in self.endpoints:
            sock = make_socket(self.ctx, CLIENT_DEALER.with_curve(self.curve))
            mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)  # before connect
            sock.connect(ep)
            link = _Link(ep, sock, mon)
            self._links.append(link)
            loop.add_reader(link.fd, self._drain, link)
            loop.call_soon(self._drain, link)  # what arrived before the FD was watched
            self._tasks += [asyncio.create_task(self._watch(link), name=f"gw-mon-{ep}"),
                            asyncio.create_task(self._status_loop(link), name=f"gw-status-{ep}")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for link in self._links:
            if self._loop is not None:
                self._loop.remove_reader(link.fd)
            link.outbox.clear()
            link.sock.disable_monitor()
            link.monitor.close(linger=0)
            link.sock.close(linger=0)

    @property
    def state(self) -> str:
        return "serving" if any(link.up for link in self._links) else "connecting"

    def pool(self) -> list[dict]:
        """Routable workers over every connected broker (by worker id)."""
        seen: dict[str, dict] = {}
        for link in self._links:
            if link.up:
                for w in link.workers:
                    seen.setdefault(str(w.get("worker_id")), w)
        return list(seen.values())

    def routable_workers(self) -> int:
        return len(self.pool())

    def prompt_token_cap(self) -> int:
        caps = [w.get("kv_capacity_tokens") for w in self.pool()]
        return max((c for c in caps if type(c) is int and c > 0), default=0)

    def model_catalog(self) -> tuple[dict[str, int], dict[str, str], str]:
        """Served models (routable workers each, over the connected brokers), aliases and the
        fleet's name, as the brokers report them (see ``Broker.model_catalog``)."""
        served: dict[str, int] = {}
        aliases: dict[str, str] = {}
        name = "mesh"
        for w in self.pool():
            if isinstance(w.get("model"), str):
                served[w["model"]] = served.get(w["model"], 0) + 1
        for link in self._links:
            if link.up and link.catalog:
                a = link.catalog.get("aliases")
                if isinstance(a, dict):
                    aliases.update({k: v for k, v in a.items() if isinstance(k, str) and isinstance(v, str)})
                if isinstance(link.catalog.get("model_name"), str):
                    name = link.catalog["model_name"]
        return served, aliases, name

    def lora_catalog(self) -> dict[str, dict]:
        """LoRA adapters of the routable workers (their STATUS ``loras``), as ``Broker.lora_catalog``."""
        out: dict[str, dict] = {}
        for w in self.pool():
            loras, model = w.get("loras"), w.get("model")
            for a in loras if isinstance(loras, list) and isinstance(model, str) else ():
                if isinstance(a, str):
                    e = out.setdefault(a, {"parent": model, "workers": 0})
                    e["workers"] += e["parent"] == model
        return out

    def announced_tokenizers(self) -> dict[str, str]:
        """Model -> the tokenizer its engines announced (the ``tokenizer`` of the brokers' STATUS workers)."""
        return announced_by_model((w.get("model"), w.get("tokenizer")) for w in self.pool()
                                  if isinstance(w.get("model"), str) and isinstance(w.get("tokenizer"), str))

    # ------------------------------------------------------------------ IngressBackend (brokers.ingress.backend)
    def submit(self, identity: bytes, sub: P.Submit, replies: asyncio.Queue, *, quota_key: bytes | None = None) -> None:
        rid = sub.rid
        up = [link for link in self._links if link.up]
        if not up:
            replies.put_nowait(P.encode_client_error(rid, ErrorCode.UNAVAILABLE, "no broker connection is up"))
            self.stats.requests[ErrorCode.UNAVAILABLE.value] += 1
            return
        link = up[next(self._rr) % len(up)]
        self._queues[rid] = replies
        self._timing[rid] = [time.monotonic(), sub.model or "", "", 0.0, 0.0]
        self._by_ident[identity] = (rid, link)
        self._relays[rid] = Relay.of(identity, sub, link, time.monotonic(), self.default_deadline_ms)
        link.pending.add(rid)
        link.outbox.append((rid, P.submit_frames(sub)))
        if len(link.outbox) == 1:  # the SUBMITs of this loop turn go in one burst (libzmq's I/O thread woken once)
            self._loop.call_soon(self._flush, link)  # type: ignore[union-attr]

    def _flush(self, link: _Link) -> None:
        """Send the SUBMITs :meth:`submit` queued on ``link``; one that does not go (the pipe is full, HWM,
        or gone) is answered ``overloaded`` (counted). Then the input check every send needs."""
        out, link.outbox = link.outbox, []
        for rid, frames in out:
            try:
                send_frames(link.sync, frames)
            except zmq.ZMQError:
                q = self._queues.get(rid)
                self._drop(rid, link)
                self.stats.dropped["gateway_send_failed"] += 1
                if q is not None:
                    q.put_nowait(P.encode_client_error(rid, ErrorCode.OVERLOADED, "broker connection is saturated"))
        if out:
            self._recheck(link)

    def _send(self, link: _Link, frames: list) -> bool:
        """Send now (after what :meth:`submit` queued, to keep the order); False when it does not go."""
        if link.outbox:
            self._flush(link)
        try:
            send_frames(link.sync, frames)
            ok = True
        except zmq.ZMQError:
            ok = False
        if not link.recheck and self._loop is not None:
            link.recheck = True
            self._loop.call_soon(self._recheck, link)
        return ok

    def _recheck(self, link: _Link) -> None:
        """A send processes the socket's pending commands and may consume the FD signal of a reply that
        arrived meanwhile: read what is waiting before the loop sleeps on that FD again."""
        link.recheck = False
        try:
            readable = socket_readable(link.sync)
        except zmq.ZMQError:  # closed under us (close())
            return
        if readable:
            self._drain(link)

    def cancel(self, identity: bytes) -> None:
        entry = self._by_ident.get(identity)
        if entry is not None and entry[1].up and not self._send(entry[1], P.encode_cancel(entry[0])):
            self.stats.dropped["gateway_cancel_failed"] += 1

    def forget(self, identity: bytes) -> None:
        entry = self._by_ident.pop(identity, None)
        if entry is not None:
            self._drop(*entry)

    def _abandon(self, rid: str, link: _Link) -> None:
        """A stream whose HTTP client stopped reading: cancel it on its broker and read no more of it,
        so one slow client costs the broker connection and the others nothing more (counted)."""
        self.stats.dropped["gateway_client_slow"] += 1
        self.stats.requests["client_slow"] += 1
        relay = self._relays.get(rid)
        owner = relay.link if relay is not None else link
        if not self._send(owner, P.encode_cancel(rid)):
            self.stats.dropped["gateway_cancel_failed"] += 1
        self._drop(rid, link)

    def _drop(self, rid: str, link: _Link) -> None:
        self._queues.pop(rid, None)
        self._timing.pop(rid, None)
        relay = self._relays.pop(rid, None)
        link.pending.discard(rid)
        if relay is not None:
            relay.link.pending.discard(rid)

    def _move(self, rid: str, why: str) -> bool:
        """Resubmit (or continue) request ``rid`` on another broker that is up (see
        :mod:`brokers.relay`); False when it cannot move (counted ``migration_refused``)."""
        relay = self._relays.get(rid)
        if relay is None:
            return False
        others = [link for link in self._links if link.up and link is not relay.link]
        r = relay.resubmission(time.monotonic()) if others else "no_other_broker"
        if isinstance(r, str):
            self.stats.migration_refused[r] += 1
            return False
        sub, continued = r
        old, link = relay.link, others[next(self._rr) % len(others)]
        old.pending.discard(rid)
        relay.link = link
        link.pending.add(rid)
        self._by_ident[relay.ident] = (rid, link)
        if not self._send(link, P.submit_frames(sub)):
            self.stats.dropped["gateway_send_failed"] += 1
            return False
        self.stats.migrations["gateway_continued" if continued else "gateway_resubmitted"] += 1
        self.log.info("gateway_request_moved", request_id=rid, why=why, continued=continued, from_broker=old.endpoint,
                      to_broker=link.endpoint, produced_tokens=relay.produced)
        return True

    # ------------------------------------------------------------------ links
    def _drain(self, link: _Link) -> None:
        """Read what ``link``'s broker sent (the socket's reader callback), in slices of 256 messages, one
        per loop turn, so other work goes on during a long burst."""
        sync = link.sync
        for _ in range(256):
            try:
                frames = recv_frames(sync)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed under us (close())
                return
            self._on_reply(link, frames)
        self._loop.call_soon(self._drain, link)  # type: ignore[union-attr]

    def _on_reply(self, link: _Link, frames: list[bytes]) -> None:
        m = P.decode_client_reply(frames)
        if isinstance(m, P.StatusReply):
            self._on_status(link, m)
            return
        rid = getattr(m, "rid", None)
        q = self._queues.get(rid) if isinstance(rid, str) else None
        if q is None:
            self.stats.dropped["gateway_unknown_reply"] += 1
            return
        relay = self._relays.get(rid)
        if relay is not None:
            if relay.link is not link:  # a reply of the broker it moved away from
                self.stats.dropped["gateway_stale_reply"] += 1
                return
            if isinstance(m, P.ClientError) and relay.may_move(m.code) and self._move(rid, m.code):
                return
            frames = relay.relayed(m, frames)
        if q.qsize() >= _REPLY_QUEUE_MAX and not isinstance(m, (P.ClientFinal, P.ClientError)):
            self._abandon(rid, link)  # its HTTP client stopped reading: not buffered without bound
            q.put_nowait(P.encode_client_error(rid, ErrorCode.CANCELLED, "the client stopped reading its stream"))
            return
        q.put_nowait(frames)
        tm = self._timing.get(rid)
        if tm is not None:
            self._observe(tm, m)

    def _observe(self, tm: list, m) -> None:
        """TTFT, inter-token and end-to-end latency of one relayed reply (labels: the request's
        model as asked, and the worker the broker names)."""
        now = time.monotonic()
        t = type(m)
        if t is P.Accepted:
            tm[2] = m.worker
        elif t is P.ClientChunk:
            if not tm[3]:
                tm[3] = now
                self.stats.observe_latency("ttft", tm[1], tm[2], now - tm[0])
            else:
                self.stats.observe_latency("inter_token", tm[1], tm[2], now - tm[4])
            tm[4] = now
        elif t is P.ClientFinal and not m.finish_reason.startswith(P.REFUSED_PREFIX):  # an engine's refusal: no latency
            tm[2] = m.worker
            if not tm[3]:
                self.stats.observe_latency("ttft", tm[1], tm[2], now - tm[0])
            self.stats.observe_latency("e2e", tm[1], tm[2], now - tm[0])

    async def _watch(self, link: _Link) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await link.monitor.recv_multipart()).get("event", 0)
            if event & zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.up = True
                announce("gateway_broker_up", broker=link.endpoint)
                self._ask_status(link)
            elif event & zmq.EVENT_DISCONNECTED:
                link.up = False
                link.workers = []
                link.catalog = {}
                link.rows, link.paging = [], False
                self.log.warning("gateway_broker_lost", broker=link.endpoint, inflight=len(link.pending))
                for rid in list(link.pending):
                    q = self._queues.get(rid)
                    if q is not None and not self._move(rid, "broker_lost"):
                        q.put_nowait(P.encode_client_error(rid, ErrorCode.UNAVAILABLE,
                                                           f"broker connection lost ({link.endpoint}) before the reply"))
                link.pending.clear()

    def _on_status(self, link: _Link, m: P.StatusReply) -> None:
        """One STATUS page: the next is asked for while the broker says rows were left out
        (issue 32: a broker pages its rows; at most ``_MAX_STATUS_ROWS`` are read)."""
        b = m.broker if isinstance(m.broker, dict) else {}
        if b.get("rate_limited"):
            return  # the next period asks for the same page again
        offset = b.get("offset") if type(b.get("offset")) is int else 0
        rows = [w for w in m.workers if isinstance(w, dict)]
        if offset and offset != len(link.rows):
            return  # a page of an older round
        link.rows = rows if not offset else link.rows + rows
        total = b.get("workers_total")
        link.paging = bool(b.get("truncated") and rows and type(total) is int and len(link.rows) < min(total, _MAX_STATUS_ROWS))
        if link.paging:
            self._ask_status(link, len(link.rows))
            return
        link.workers = [w for w in link.rows if w.get("healthy")]
        link.catalog = {k: b.get(k) for k in ("aliases", "model_name")}

    def _ask_status(self, link: _Link, offset: int = 0) -> None:
        self._send(link, P.encode_status_query(True, offset))  # not sent: the next period asks again

    async def _status_loop(self, link: _Link) -> None:
        while True:
            await asyncio.sleep(_STATUS_PERIOD_S)
            if link.up:
                self._ask_status(link, len(link.rows) if link.paging else 0)


class _ProcessCollector:
    """``mesh_gateway_process_restarts{process=INDEX}``: which of ``--processes N`` answered, and how
    often its supervisor restarted it before this start."""

    def __init__(self, index: int, restarts: int) -> None:
        self.index, self.restarts = index, restarts

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        fam = GaugeMetricFamily("mesh_gateway_process_restarts", "Restarts of this gateway process (one of --processes N) "
                                "by its supervisor before it started", labels=["process"])
        fam.add_metric([str(self.index)], self.restarts)
        yield fam


async def serve_gateway(brokers: list[str], http: str, curve=None, control=None, **ingress_kw: Any) -> None:
    """Run the gateway until SIGINT/SIGTERM: connect to ``brokers``, serve HTTP on ``http``.
    ``control``: this process's :class:`brokers.gateway_supervisor.ChildControl` when it is one of
    ``--processes N`` (it listens with SO_REUSEPORT, says ``ready`` there, stops when the parent goes)."""
    from brokers.ingress import HttpIngress
    from brokers.ingress.tokenizers import PrefixCacheCollector

    from prometheus_client import CollectorRegistry

    from brokers.stats import GatewayCollector

    pool = BrokerPool(brokers, curve=curve)
    pool.start()
    registry = CollectorRegistry()
    registry.register(GatewayCollector(pool.stats))
    if control is not None:
        registry.register(_ProcessCollector(control.index, control.restarts))
    ingress = HttpIngress(pool, metrics_registry=registry, **ingress_kw)
    registry.register(PrefixCacheCollector(ingress.submitter.tokenizers))
    host, _, port = http.rpartition(":")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await ingress.start(host.strip("[]") or "127.0.0.1", int(port), reuse_port=control is not None)
        if control is None:
            announce("gateway_listening", url=url, brokers=brokers)
        else:  # one of N: the supervisor announces gateway_listening when all N listen
            announce("gateway_process_listening", url=url, brokers=brokers, process=control.index, restarts=control.restarts)
            control.ready(url)
            control.stop_with_parent(stop)
        await stop.wait()
    finally:
        await ingress.stop()
        await pool.close()
        if control is None:
            announce("gateway_stopped")
        else:  # the supervisor announces gateway_stopped when all N stopped
            control.close()
            announce("gateway_process_stopped", process=control.index)


# ---------------------------------------------------------------------------- command line


#: BrokerSettings fields that configure the HTTP ingress, here as in ``mesh broker --http``
_INGRESS_FIELDS = ("tokenizer", "chat_template", "http_max_connections", "http_max_connections_per_address",
                   "http_max_body_bytes_per_address", "http_trusted_proxies", "http_header_timeout_s", "http_idle_timeout_s",
                   "http_body_timeout_s", "http_request_timeout_s", "http_stream_idle_timeout_s", "trace_exporter",
                   "trace_endpoint")


def add_gateway_parser(subparsers):
    import argparse

    from brokers.gateway_supervisor import MAX_PROCESSES
    from mesh.config import BrokerSettings
    from mesh.settings_fields import add_flags

    p = subparsers.add_parser(
        "gateway", help="the HTTP API (OpenAI, SGLang /generate) in its own process, in front of one or more brokers",
        description="Serve the HTTP API of `mesh broker --http` from a separate process that submits to the brokers "
                    "over the client protocol (round robin over the connected ones): HTTP front ends scale on their "
                    "own, tokenisation and chat templates run beside no broker, and an HTTP flood cannot starve a "
                    "broker's sockets.")
    p.add_argument("--broker", action="append", required=True, metavar="ENDPOINT",
                   help="a broker's client endpoint, tcp://HOST:PORT (repeatable)")
    p.add_argument("--http", default="127.0.0.1:8000", help="HOST:PORT to serve HTTP on (default 127.0.0.1:8000)")
    p.add_argument("--api-key-file", help="file holding the key clients must send as Authorization: Bearer KEY")
    p.add_argument("--keys-file", default="", metavar="PATH", help="TOML file mapping API keys to tenants (docs/operations.md); "
                   "brokers take the tenants the gateway stamps with --trust-client-tenant")
    p.add_argument("--curve-secret", default="", metavar="PATH", help="this gateway's certificate (.key_secret from mesh "
                   "keygen): CURVE to the brokers")
    p.add_argument("--curve-server-key", default="", metavar="PATH", help="the brokers' public key (with --curve-secret)")
    # the ingress settings the gateway shares with mesh broker --http: same fields, help and checks
    add_flags(p, BrokerSettings, only=_INGRESS_FIELDS)
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help=f"serve the port from N gateway processes (1..{MAX_PROCESSES}, default 1), each with its own broker "
                        "connections, tokenizer pool and connection limits; the kernel spreads connections over them "
                        "(SO_REUSEPORT, Linux); a parent restarts one that dies (docs/operations.md)")
    p.add_argument("--restart-budget", type=int, default=5, metavar="N",
                   help="with --processes: restarts of one process in a row (one that served 30 s starts a new row) "
                        "before it stays down (0..1000, default 5)")
    p.add_argument("--process-slot", default="", help=argparse.SUPPRESS)  # FD:INDEX:RESTARTS, set by the supervisor
    add_log_level_arg(p, "info")
    p.set_defaults(func=_cmd_gateway)
    return p


def _cmd_gateway(args) -> int:
    from pathlib import Path

    from brokers.gateway_supervisor import check_processes
    from mesh import aio
    from mesh.config import BrokerSettings, build
    from mesh.errors import ConfigError
    from mesh.logs import configure
    from mesh.settings_fields import flag_values

    check_processes(args.processes, args.restart_budget)
    for b in args.broker:
        if not b.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"broker: {b!r} must be a tcp://, ipc:// or inproc:// endpoint")
    host, sep, port = args.http.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"http: expected HOST:PORT, got {args.http!r}")
    ingress = build(BrokerSettings, flag_values(BrokerSettings, args, only=_INGRESS_FIELDS))  # validated as the broker's
    key = None
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"api_key_file: cannot read {args.api_key_file}: {exc}") from None
        if not key:
            raise ConfigError(f"api_key_file: {args.api_key_file} is empty")
    from brokers.keys_file import load_key_ring

    keys = load_key_ring(args.keys_file, key)
    curve = None
    if args.curve_secret or args.curve_server_key:
        if not (args.curve_secret and args.curve_server_key):
            raise ConfigError("curve_secret: --curve-secret and --curve-server-key go together")
        from mesh.security import client_keys

        curve = client_keys(args.curve_secret, args.curve_server_key)
    control = _child_control(args.process_slot) if args.process_slot else None
    configure(args.log_level)
    if args.processes > 1 and control is None:
        from brokers.gateway_supervisor import Supervisor

        return aio.run(Supervisor(getattr(args, "_argv", None) or sys.argv[1:], args.processes, host.strip("[]") or "127.0.0.1",
                                  int(port), restart_budget=args.restart_budget, brokers=args.broker).run())
    from mesh.tracing import configure_tracing

    configure_tracing(ingress.trace_exporter, ingress.trace_endpoint, service="mesh-gateway")
    try:
        _serve(args, ingress, curve, key, keys, control)
    except BaseException as exc:
        if control is not None:  # its supervisor names the cause (a taken port, a tokenizer that does not load)
            from mesh.cli_run import busy_port_error

            busy = busy_port_error(exc)
            control.failed(str(busy or exc) or type(exc).__name__)
            if busy is not None or isinstance(exc, ConfigError):
                raise SystemExit(2) from None  # one line on the terminal: the supervisor's
        raise
    return 0


def _child_control(slot: str):
    """This process is one of ``--processes N`` (``--process-slot FD:INDEX:RESTARTS``): its control
    socket, and its index on every log line."""
    import structlog

    from brokers.gateway_supervisor import ChildControl, parse_slot

    control = ChildControl(*parse_slot(slot))
    structlog.contextvars.bind_contextvars(process=control.index)
    return control


def _serve(args, ingress, curve, key, keys, control) -> None:
    from mesh import aio
    from mesh.config import model_paths

    aio.run(serve_gateway(
        args.broker, args.http, curve=curve, control=control, api_key=key, keys=keys, tokenizers=model_paths(ingress.tokenizer, "tokenizer"),
        chat_templates=model_paths(ingress.chat_template, "chat_template"), max_connections=ingress.http_max_connections,
        max_connections_per_address=ingress.http_max_connections_per_address,
        max_body_bytes_per_address=ingress.http_max_body_bytes_per_address,
        trusted_proxies=ingress.http_trusted_proxies,
        header_timeout_s=ingress.http_header_timeout_s, idle_timeout_s=ingress.http_idle_timeout_s,
        body_timeout_s=ingress.http_body_timeout_s, request_timeout_s=ingress.http_request_timeout_s,
        stream_idle_timeout_s=ingress.http_stream_idle_timeout_s))
