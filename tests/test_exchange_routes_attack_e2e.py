"""Attacks on the routed prompts the exchange carries by default, from outside, with real processes.

A real broker (``--exchange``, routes on: the default) has a configured ``--peer`` that is a
test-owned ZeroMQ PUB on 127.0.0.1: a hostile (or misconfigured) neighbour publishing valid
``PEER_LOAD`` messages whose ``routes`` lie. Two stub workers serve; clients are real sockets.
Outcomes and counts are asserted, never timings; waits are deadline loops polling STATUS,
/metrics or the broker's replies.

* **Forged routes for prompts the attacker knows**: routes claiming that prompts the attacker
  will have sent (it knows them, and computes their anchors exactly as a broker does, at the
  workers' block size) live on ``w-0``. A burst of follow-ups is attracted to ``w-0`` only as
  far as cache_aware's imbalance guard allows (``balance_abs_threshold`` /
  ``balance_rel_threshold``, checked decision by decision), every request is served, the
  forged matches are counted, and one speculative TTL after the last forged message the
  routes attract nothing (expired, matches stop growing).
* **Routes for workers the broker does not have, from a neighbour with another block size,
  or whose anchors do not fit their page count**: ignored without error (requests served as
  plain misses, nothing routed to an unknown id), the unfit ones counted as ``bad_routes``.
* **Flood of maximum-size route messages** (``soak``): 1,024 routes x 64 anchors (or the
  longest valid route) per message at 20 a second beside client requests: every request
  served, the excess dropped and counted by the per-peer byte budget, the peer-route table
  within its bound.

Where the peer-route counters surface: ``peer_routes_<what>`` are the provider's statistics,
exported in /metrics as ``mesh_provider_stat{provider, stat}`` and in STATUS under
``broker["exchange"]["peer_routes"]``; ``exchange.routes_received`` (and the budget's
``exchange.dropped_*``) are STATUS counters.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import re
import statistics
import threading
import time
import urllib.request
from collections import Counter

import pytest
import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.client import Client
from mesh.hashing import content_keys
from mesh.index.peer_routes import PeerRoutes, _anchor_positions, route_anchors
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from mesh.routing.cache_policies import CacheAware
from mesh.routing.providers import LocalIndexProvider
from tests.conftest import run, until

BS = 16  # the workers' page size (--page-size): the block size the broker keys prompts by
W0, W1 = "w-0", "w-1"  # procs.workers("w", ..., count=2)
_CA = inspect.signature(CacheAware.__init__).parameters
ABS = _CA["balance_abs_threshold"].default  # the broker's cache_aware defaults (brokers.main passes neither)
REL = _CA["balance_rel_threshold"].default
# the broker's provider (brokers.main: make_provider("radix_tree")) speculates, and keeps peers'
# routes, for its default TTL (there is no CLI flag for it)
TTL_S = inspect.signature(LocalIndexProvider.__init__).parameters["speculative_ttl_s"].default
MAX_KEYS = inspect.signature(PeerRoutes.__init__).parameters["max_keys"].default
FLOOD_MESSAGES = 200  # the soak's flood: at least ten seconds at 20 a second
ATTACKER = "evil"  # sorts after the broker's id "b": the broker keeps router rank 0 (no tie parting)


# --------------------------------------------------------------------------- helpers


def prompt(n_pages: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32_000) for _ in range(n_pages * BS)]


def forged_route(worker: str, tokens: list[int], bs: int = BS) -> tuple[str, int, list[int]]:
    """What a broker that routed ``tokens`` to ``worker`` publishes (mesh.routing.peers.PeerPublisher.note_route)."""
    keys = content_keys(tokens, bs)
    return worker, len(keys), route_anchors(keys)


class Attacker:
    """A configured --peer that is a test-owned PUB: publishes ``routes`` in a valid PEER_LOAD
    every ``period_s`` (a thread), sequence numbers increasing, no load figures."""

    def __init__(self, period_s: float = 0.05, broker_id: str = ATTACKER) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.broker_id = broker_id
        self.period_s = period_s
        self.cycle: list = [[]]  # the routes of successive messages (cycled): a list, or seq -> list
        self.seq = 0
        self.sent = 0
        self.last_routes_sent_s = float("-inf")  # monotonic time of the last send that carried routes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def set_routes(self, *cycle) -> None:
        """Publish these routes from the next message on (several: in turn; a callable makes
        each message's routes from its sequence number)."""
        with self._lock:
            self.cycle = [r if callable(r) else list(r) for r in cycle] or [[]]

    def _loop(self) -> None:
        i = 0
        while not self._stop.is_set():
            with self._lock:
                routes = self.cycle[i % len(self.cycle)]
                if callable(routes):
                    routes = routes(self.seq)
                frames = P.encode_peer_load(P.PeerLoad(self.broker_id, 1, self.seq, True, [], 1000, routes))
                routed = bool(routes)
                self.seq += 1
                i += 1
                self.pub.send_multipart(frames)
                self.sent += 1
                if routed:
                    self.last_routes_sent_s = time.monotonic()
            self._stop.wait(self.period_s)  # the attacker's own send rate, not a synchronisation

    def close(self) -> None:
        self._stop.set()
        self._t.join(5)
        self.pub.close(0)
        self.ctx.term()


async def status(frontend: str):
    async with Client(frontend) as c:
        return await c.status()


def scrape(metrics_url: str) -> dict[str, float]:
    """``mesh_provider_stat`` by stat name (the peer-route counters among them)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("mesh_provider_stat{"):
            m = re.search(r'stat="([^"]+)"', line)
            if m:
                out[m.group(1)] = float(line.rsplit(" ", 1)[1])
    return out


async def peer_stats(metrics_url: str) -> dict[str, float]:
    return await asyncio.to_thread(scrape, metrics_url)


def start(procs, *broker_extra: str, attacker: Attacker, worker_extra=()):
    """The broker (exchange on, the attacker its only --peer, /metrics on) and two stub workers;
    returns (broker, metrics url)."""
    b = procs.broker("b", "--exchange", "tcp://127.0.0.1:*", "--peer", attacker.endpoint,
                     "--metrics", "127.0.0.1:0", *broker_extra)
    url = wait_for_log_event(b.log_path, "metrics_listening", 10, b.popen, start=b.log_start)["endpoint"]
    procs.workers("w", [b.backend], "--page-size", str(BS), *worker_extra, count=2)
    run(wait_for_workers(b.frontend, 2), 30)
    return b, url


class RawClient:
    """A client DEALER reading every reply in the order the broker sent it (ACCEPTED names the
    worker and the decision's reason): the broker's own in-flight count per worker can be
    replayed decision by decision."""

    def __init__(self, frontend: str) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(frontend)
        self.events: list = []  # Accepted / ClientFinal / ClientError, in arrival order

    async def send(self, rid: str, ids: list[int], max_new_tokens: int) -> None:
        await self.sock.send_multipart(P.encode_submit(rid, input_ids=ids, params={"max_new_tokens": max_new_tokens},
                                                       stream=True, deadline_ms=60_000))

    async def collect(self, rids: set[str], timeout_s: float) -> dict[str, P.Accepted]:
        """Read replies until every one of ``rids`` ended (FINAL or error); returns their ACCEPTEDs."""
        open_ = set(rids)
        accepted: dict[str, P.Accepted] = {}
        t_end = time.monotonic() + timeout_s
        while open_:
            left = t_end - time.monotonic()
            assert left > 0, f"requests not answered within {timeout_s}s: {sorted(open_)[:5]}..."
            m = P.decode_client_reply(await asyncio.wait_for(self.sock.recv_multipart(), left))
            if isinstance(m, P.ClientChunk):
                continue
            self.events.append(m)
            if isinstance(m, P.Accepted):
                accepted[m.rid] = m
            elif isinstance(m, (P.ClientFinal, P.ClientError)):
                open_.discard(m.rid)
        return accepted

    async def one(self, rid: str, ids: list[int], max_new_tokens: int = 4, timeout_s: float = 20.0) -> P.Accepted:
        await self.send(rid, ids, max_new_tokens)
        return (await self.collect({rid}, timeout_s))[rid]

    def close(self) -> None:
        self.sock.close(0)


def over_bound(load: float, lo: float) -> bool:
    """cache_aware's imbalance guard for a holder (imbalance_scope "holder"): no holder to stick to."""
    return load - lo > ABS and load > lo * REL


def replay(events: list, workers: tuple[str, ...]) -> list[tuple[str, str, dict[str, int]]]:
    """(worker, reason, in-flight per worker just before the decision) for every ACCEPTED, from
    the replies in the order the broker sent them (it releases a request before it sends its FINAL)."""
    inflight = dict.fromkeys(workers, 0)
    where: dict[str, str] = {}
    out = []
    for m in events:
        if isinstance(m, P.Accepted):
            out.append((m.worker, m.reason, dict(inflight)))
            inflight[m.worker] = inflight.get(m.worker, 0) + 1
            where[m.rid] = m.worker
        elif isinstance(m, (P.ClientFinal, P.ClientError)) and m.rid in where:
            inflight[where.pop(m.rid)] -= 1
    return out


def assert_clean_log(b) -> None:
    text = b.log_path.read_text()
    assert "Traceback" not in text and '"level": "error"' not in text, text[-3000:]


# --------------------------------------------------------------------------- 1. forged routes


def test_forged_routes_attract_a_burst_only_as_far_as_the_load_guard_allows_and_expire_after_one_ttl(procs):
    """A hostile peer claims ``w-0`` holds 60 long prompts it knows (and 64 more, never sent
    until the end). A burst of follow-ups of the 60 (each prompt plus a suffix of its own) is
    sent at once: every one is served; decision by decision (the broker's replies replayed in
    order) a request went to ``w-0`` only while ``w-0`` was not over cache_aware's imbalance
    bound (``load - lo > balance_abs_threshold and load > lo x balance_rel_threshold``), so the
    burst is not all on ``w-0``; the forged claim shows as cache hits on ``w-0`` and as
    ``peer_routes_matches``. Once the attacker stops, its routes attract nothing from one
    speculative TTL on: a follow-up of a claimed prompt is a plain miss, the entries have
    expired and the match count stops growing.

    The broker reads no LoadStat here (``--load-freshness-s`` tiny): a request's pressure is
    then the broker's own in-flight count, which the replayed replies reproduce exactly. (With
    LoadStats the guard reads the snapshot plus the changes since, which misses a request
    still in transit when the snapshot was taken: the bound holds for the estimate, and an
    outside observer could not check it decision by decision.)"""
    n_burst, n_reserve, pages = 60, 64, 48
    burst = [prompt(pages, seed=1000 + i) for i in range(n_burst)]
    reserve = [prompt(pages, seed=5000 + i) for i in range(n_reserve)]
    forged = [forged_route(W0, p) for p in burst + reserve]
    evil = Attacker()
    try:
        b, metrics = start(procs, "--load-freshness-s", "0.001", attacker=evil)
        evil.set_routes(forged)

        async def body():
            # the attacker is heard (the slow joiner's first messages are lost) and its routes are in
            await until(lambda: _routes_in(metrics, len(forged)), 15.0, "the forged routes taken", step_s=0.05)
            c = RawClient(b.frontend)
            try:
                rids = {f"burst-{i}" for i in range(n_burst)}
                for i, p in enumerate(burst):  # all at once: the burst
                    await c.send(f"burst-{i}", p + prompt(1, seed=9000 + i), 128)
                accepted = await c.collect(rids, 60.0)
                evil.set_routes([])  # the attacker goes quiet (still alive, no routes)
                last_forged_s = evil.last_routes_sent_s
                finals = [m for m in c.events if isinstance(m, P.ClientFinal)]
                errors = [m for m in c.events if isinstance(m, P.ClientError)]
                assert not errors and len(finals) == n_burst and set(accepted) == rids, (errors[:3], len(finals))
                decisions = replay(c.events, (W0, W1))
                got = Counter(w for w, _, _ in decisions)
                reasons = Counter((w, r) for w, r, _ in decisions)
                for w, r, inf in decisions:
                    lo = min(inf.values())
                    if w == W0:  # the forged holder only while it is within the guard's bound
                        assert not over_bound(inf[W0], lo), (inf, r, reasons)
                    else:  # left only because the guard excluded it (no LoadStat: no stall escape)
                        assert over_bound(inf[W0], lo) and r == "load_override", (inf, r, reasons)
                # the forged claim attracted (counted as cache hits and matches), the guard bounded it
                assert reasons[(W0, "cache_hit")] == got[W0] > ABS and got[W1] >= 1, reasons
                print(f"\nburst of {n_burst}: {dict(reasons)}")
                st = await peer_stats(metrics)
                assert st["peer_routes_matches"] >= n_burst, st  # every follow-up matched the forged routes
                assert (await status(b.frontend)).counters.get("exchange.routes_received", 0) >= len(forged)

                # ---- one TTL after the last forged message the routes attract nothing
                probes = iter(reserve)
                first_miss: list[float] = []

                async def unattracted():
                    a = await c.one(f"probe-{len(c.events)}", next(probes) + [7] * BS)
                    if a.reason == "cache_miss_min_load":
                        first_miss.append(time.monotonic())
                        return True
                    assert a.worker == W0 and a.reason == "cache_hit", a  # before: still the forged holder
                    return False

                await until(unattracted, TTL_S + 15.0, "the forged routes expired", step_s=0.2)
                # the decision came after the expiry: at least one TTL after the last forged send
                assert first_miss[0] >= last_forged_s + TTL_S, (first_miss[0] - last_forged_s, TTL_S)
                before = await peer_stats(metrics)
                for i in range(5):  # still-unsent claimed prompts: plain misses now, no match counted
                    a = await c.one(f"after-{i}", next(probes) + [8] * BS)
                    assert a.reason == "cache_miss_min_load", a
                after = await peer_stats(metrics)
                assert after["peer_routes_matches"] == before["peer_routes_matches"], (before, after)
                assert after["peer_routes_entries"] == 0 and after["peer_routes_expired"] > 0, after
                # the operator sees the same figures in STATUS
                pr = (await status(b.frontend)).broker["exchange"]["peer_routes"]
                assert pr["peer_routes_matches"] == after["peer_routes_matches"] and pr["peer_routes_entries"] == 0, pr
            finally:
                c.close()

        run(body(), 90.0)
        assert_clean_log(b)
    finally:
        evil.close()


async def _routes_in(metrics: str, n: int) -> bool:
    st = await peer_stats(metrics)
    return st.get("peer_routes_routes", 0) >= n


# --------------------------------------------------------------------------- 2. ghosts, block size, unfit anchors


def test_routes_for_unknown_workers_or_another_block_size_are_ignored_without_error(procs):
    """A neighbour claims prompts live on workers the broker does not have (``ghost-*``), another
    one (misconfigured: 32-token pages) claims prompts on ``w-0`` with anchors of its own block
    size, and some routes' anchors do not fit their page count. The broker takes the messages,
    counts the unfit routes as ``peer_routes_bad_routes``, and serves follow-ups of all those
    prompts as plain misses on its own workers: nothing is routed to an unknown id, nothing is
    attracted to ``w-0`` by the foreign block size, and it keeps serving."""
    n = 12
    ghost_prompts = [prompt(40, seed=100 + i) for i in range(n)]
    bs32_prompts = [prompt(40, seed=200 + i) for i in range(n)]
    unfit = [(W0, 100, [1, 2, 3]), (W1, 1, [5, 6]), (W0, 2**31 - 1, [7] * 10)]
    routes = ([forged_route(f"ghost-{i}", p) for i, p in enumerate(ghost_prompts)]
              + [forged_route(W0, p, bs=32) for p in bs32_prompts] + unfit)
    evil = Attacker()
    try:
        b, metrics = start(procs, attacker=evil)
        evil.set_routes(routes)

        async def body():
            async def taken():
                st = await peer_stats(metrics)
                return st.get("peer_routes_routes", 0) >= 2 * n and st.get("peer_routes_bad_routes", 0) >= len(unfit)

            await until(taken, 15.0, "the routes taken", step_s=0.05)
            c = RawClient(b.frontend)
            try:
                rids = set()
                for i, p in enumerate(ghost_prompts + bs32_prompts):  # follow-ups, concurrently
                    rids.add(f"f-{i}")
                    await c.send(f"f-{i}", p + prompt(1, seed=300 + i), 16)
                accepted = await c.collect(rids, 60.0)
                finals = {m.rid for m in c.events if isinstance(m, P.ClientFinal)}
                errors = [m for m in c.events if isinstance(m, P.ClientError)]
                assert not errors and finals == rids, errors[:3]
                assert {a.worker for a in accepted.values()} <= {W0, W1}
                assert {a.reason for a in accepted.values()} == {"cache_miss_min_load"}, Counter(a.reason for a in accepted.values())
                # the broker keeps serving: a fresh request after it all
                a = await c.one("after", prompt(3, seed=400))
                assert a.worker in (W0, W1)
            finally:
                c.close()
            st = await peer_stats(metrics)
            print(f"\npeer routes {({k: v for k, v in st.items() if k.startswith('peer_routes')})}")
            assert st["peer_routes_bad_routes"] >= len(unfit), st
            assert st["peer_routes_entries"] <= MAX_KEYS, st
            s = await status(b.frontend)
            assert {w["worker_id"] for w in s.workers} == {W0, W1}
            assert all(not k.startswith("exchange.rejected") for k in s.counters), s.counters  # valid messages: none refused
            assert s.broker["exchange"]["peer_routes"]["peer_routes_bad_routes"] >= len(unfit)

        run(body(), 60.0)
        assert b.alive()
        assert_clean_log(b)
    finally:
        evil.close()


# --------------------------------------------------------------------------- 3. flood (soak)


@pytest.mark.soak
def test_a_flood_of_maximum_route_messages_is_budgeted_and_the_table_stays_bounded(procs):
    """Maximum-size route messages at 20 a second (about 600 KB each, three times the per-peer
    byte budget) beside client requests, for at least ``FLOOD_MESSAGES`` messages: in turn
    1,024 routes x 64 anchors (more anchors than any page count has: every route unfit) and
    1,024 of the longest valid routes with fresh random anchors each message (stored: they
    overflow the table). Every request is served, the excess is dropped by the peer's byte
    budget and counted, and the peer-route table holds at most ``max_keys`` anchor entries,
    evicting the oldest. The request p50 beside the flood is printed."""
    rng = random.Random(7)
    longest = 2**31 - 1
    n_valid = len(_anchor_positions(longest))
    unfit = [(f"worker-{i:04d}", 1, [rng.randrange(2**64) for _ in range(P.MAX_ROUTE_ANCHORS)])
             for i in range(P.MAX_EXCHANGE_ROUTES)]
    base_anchors = [[rng.randrange(2**63) for _ in range(n_valid)] for _ in range(P.MAX_EXCHANGE_ROUTES)]

    def valid(seq: int) -> list:  # fresh anchors every message (cheaply: xor with the sequence number)
        return [(f"worker-{i:04d}", longest, [a ^ seq for a in anchors]) for i, anchors in enumerate(base_anchors)]

    sizes = [len(P.encode_peer_load(P.PeerLoad(ATTACKER, 1, 2**40, True, [], 1000, r))[2]) for r in (unfit, valid(2**40))]
    assert all(s <= P.MAX_EXCHANGE_BYTES for s in sizes)
    evil = Attacker()
    try:
        b, metrics = start(procs, attacker=evil, worker_extra=("--time-scale", "0.01"))

        async def latencies(n: int, until_sent: int = 0) -> list[float]:
            out = []
            async with Client(b.frontend) as c:
                while len(out) < n or evil.sent < until_sent:
                    i = len(out)
                    t0 = time.monotonic()
                    await c.generate(input_ids=prompt(4, seed=i) + [i], max_new_tokens=4, deadline_ms=20_000)
                    out.append(time.monotonic() - t0)
            return out

        async def over_budget():
            return (await status(b.frontend)).counters.get("exchange.dropped_bytes", 0) > 0

        base = run(latencies(40), 60)
        evil.set_routes(unfit, valid)  # the flood: the two kinds of message in turn, 20 a second
        run(until(over_budget, 30.0, "the flood over the peer's budget", step_s=0.1), 40)
        under = run(latencies(40, until_sent=evil.sent + FLOOD_MESSAGES), 300)
        evil.set_routes()
        c = run(status(b.frontend), 20).counters
        st = scrape(metrics)
        assert b.alive()
    finally:
        evil.close()
    print(f"\n{len(under)} requests, p50 {statistics.median(base) * 1000:.1f} ms alone, "
          f"{statistics.median(under) * 1000:.1f} ms beside the route flood (max {max(under) * 1000:.0f} ms); "
          f"exchange {({k: v for k, v in c.items() if k.startswith('exchange')})}; "
          f"peer routes {({k: v for k, v in st.items() if k.startswith('peer_routes')})}")
    assert len(under) >= 40 and c.get("requests.ok", 0) == len(base) + len(under), c  # every request served
    assert c.get("exchange.dropped_bytes", 0) > 0, c  # the excess, counted by the per-peer budget
    assert st["peer_routes_bad_routes"] > 0 and st["peer_routes_routes"] > 0, st
    assert st["peer_routes_anchors"] > MAX_KEYS and 0 < st["peer_routes_entries"] <= MAX_KEYS, st  # bounded...
    assert st["peer_routes_evicted"] > 0, st  # ... oldest first
