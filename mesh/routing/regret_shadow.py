"""The regret audit's shadow counterfactual (opt-in: ``RegretAudit(shadow_rate=...)``). Pure:
no I/O, no clock.

The per-decision audit (:mod:`mesh.routing.regret`) judges a baseline's pick on the fleet
cache_aware built; it cannot see the queues a baseline's own history would have built (a worse
hit rate means more prefill everywhere, and the requests after it wait behind that). Here each
policy -- ``cache_aware`` itself (its actual picks) and each baseline (its own rule) -- keeps a
tiny **shadow fleet** fed the same requests:

* per worker the prefill tokens queued on it, drained at the worker's measured prefill rate
  (a fluid queue), and the requests in flight there (ended at their predicted first token plus
  ``max_new_tokens`` decode steps), which is the load power-of-two and greedy read;
* which prompt blocks the shadow placed on which worker (every ``stride``-th content key of the
  prompt, with a bitmask of its holders, in one bounded LRU): the hits the policy's own history
  gives it.

Each request's TTFT under a policy is predicted from *that policy's* shadow (queue ahead of it
at the worker's rate plus its own uncached prefill), with the same formula for all, so the
model's constant errors cancel in the difference; the gauge is the running mean of
``ttft(baseline) - ttft(cache_aware)`` per baseline.

**Sample.** A request enters the shadows only when the hash of its *session key* (the content
key at ``session_tokens`` into the prompt, or its last key when shorter: the turns of one
conversation and the requests on one system prompt share it) falls in ``rate`` of the space;
the shadows then run at ``rate`` of the capacity (the drain rates and the cache), as SHARDS
samples a miss-ratio curve. With several routers sharing the fleet a router sees only its share
of the traffic: the capacity is scaled by that share too, read from the exchange's figures
(this router's uncached tokens sent over the fleet's, :attr:`WorkerState.fleet_sent_tokens`).
Pools above ``max_workers`` candidates are not shadowed (the pick's scan is O(workers)).

**Limits.** With several routers a router's shadow of cache_aware holds only its own picks,
which answered the whole fleet's state, and the turns of a session other routers took are in no
shadow's placements; and a fluid queue at one marginal rate is no model of chunked batches.
Hence opt-in: on the quality matrix it comes about as close as the per-decision figure with one
router and far off with several, where that shadow of cache_aware crowds a few workers at the
router's share of the capacity (docs/routing.md, "Shadow counterfactual"; ``mesh sim --matrix`` judges both when an
arm carries it).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from typing import Any, Sequence

from mesh.routing.view import RouteRequest, WorkerState

__all__ = ["ShadowAudit", "ShadowFleet"]

_MIX = 0x9E3779B97F4A7C15
_SPACE = 1 << 16


class ShadowFleet:
    """One policy's shadow queues and loads (module docstring). Workers are indexed by their pool
    order; which blocks each worker holds is kept by :class:`ShadowAudit` for every fleet at once."""

    __slots__ = ("q_tok", "at_s", "ends")

    def __init__(self, n: int) -> None:
        self.q_tok = [0.0] * n  # queued prefill tokens (at the shadow's capacity)
        self.at_s = [0.0] * n  # when q_tok was last drained
        self.ends: list[list[float]] = [[] for _ in range(n)]  # heap of in-flight end times

    def queued(self, i: int, rate: float, now_s: float) -> float:
        dt = now_s - self.at_s[i]
        if dt > 0.0:
            self.q_tok[i] = max(0.0, self.q_tok[i] - rate * dt)
            self.at_s[i] = now_s
        return self.q_tok[i]

    def load(self, i: int, now_s: float) -> int:
        h = self.ends[i]
        while h and h[0] <= now_s:
            heapq.heappop(h)
        return len(h)

    def place(self, i: int, uncached: float, end_s: float, now_s: float, rate: float) -> None:
        self.queued(i, rate, now_s)
        self.q_tok[i] += uncached
        heapq.heappush(self.ends[i], end_s)


def _depths(holders: OrderedDict, sk: Sequence[int], shift: int, full: int) -> dict[int, int]:
    """Worker index -> sampled keys of ``sk`` it holds in one fleet (its masks are bits
    ``shift`` .. ``shift + n`` of the packed entry, ``full`` = 2**n - 1; a held prefix: the walk
    stops at the first key none of its workers holds)."""
    out: dict[int, int] = {}
    get = holders.get
    alive = full
    for d, k in enumerate(sk):
        m = (get(k, 0) >> shift) & alive
        if d:
            gone = alive & ~m
            while gone:
                b = gone & -gone
                out[b.bit_length() - 1] = d
                gone ^= b
        if not m:
            return out
        alive = m
    while alive:
        b = alive & -alive
        out[b.bit_length() - 1] = len(sk)
        alive ^= b
    return out


class ShadowAudit:
    """Shadow fleets for cache_aware and each baseline (module docstring); :meth:`observe` after
    every cache_aware decision, :meth:`pays_ms` the gauge."""

    def __init__(self, baselines: Sequence[str], rng: random.Random | None = None, *, rate: float = 1.0,
                 stride_tokens: int = 128, session_tokens: int = 1024, max_workers: int = 64,
                 cache_tokens: int = 400_000, cache_threshold: float = 0.5, decode_step_ms: float = 7.0,
                 overhead_ms: float = 5.0, balance_abs: float = 32.0, balance_rel: float = 1.1) -> None:
        if not (isinstance(rate, (int, float)) and 0.0 < rate <= 1.0):
            raise ValueError(f"shadow rate must be in (0, 1], not {rate!r}")
        self.rng = rng or random.Random(0x5AD)
        self.baselines = tuple(baselines)
        self.rate = float(rate)
        self.cut = int(self.rate * _SPACE)
        self.stride_tokens = max(1, int(stride_tokens))
        self.session_tokens = max(1, int(session_tokens))
        self.max_workers = max_workers
        self.cache_tokens = cache_tokens
        self.cache_threshold = cache_threshold
        self.decode_step_ms = decode_step_ms
        self.overhead_ms = overhead_ms
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.fleets: dict[str, ShadowFleet] = {}
        self.order = ("cache_aware", *self.baselines)  # fleet j's mask: bits j*n .. (j+1)*n of an entry
        # sampled content key -> every fleet's bitmask of its holders, packed (one LRU for all)
        self.holders: OrderedDict[int, int] = OrderedDict()
        self.cap_keys = 1
        self._ids: tuple[str, ...] = ()
        self.n = 0  # requests shadowed
        self._u_mean = 0.0  # mean real uncached tokens per request (over about 200)
        self._u_n = 0
        self.step_ms = 12.0
        self.sum_ms = {b: 0.0 for b in self.baselines}
        self.skipped = 0

    # ------------------------------------------------------------------ observe
    def observe(self, req: RouteRequest, cands: Sequence[WorkerState], chosen: str, now_s: float,
                default_rate: float, uncached: Any = None, step_ms: float = 12.0) -> None:
        """Shadow one request routed to ``chosen``: ``uncached`` its real uncached tokens there
        (what a prefill step of this traffic carries) and ``step_ms`` a step's fixed time (decode
        base + prefill overhead) turn the measured rates into marginal ones (:meth:`_marginal`)."""
        if isinstance(uncached, (int, float)) and math.isfinite(uncached) and uncached >= 0:
            self._u_mean += (float(uncached) - self._u_mean) / min(self._u_n + 1, 200)
            self._u_n += 1
        self.step_ms = step_ms if isinstance(step_ms, (int, float)) and math.isfinite(step_ms) and step_ms >= 0 else 0.0
        keys = req.keys
        n = len(cands)
        if (not keys or n < 2 or n > self.max_workers or not math.isfinite(now_s)
                or not (isinstance(default_rate, (int, float)) and math.isfinite(default_rate) and default_rate > 0)):
            self.skipped += 1
            return
        bs = req.block_size or 16
        sess = keys[min(len(keys), max(1, self.session_tokens // bs)) - 1]
        if ((hash(sess) * _MIX) >> 24) & (_SPACE - 1) >= self.cut:
            return
        ids = tuple(w.worker_id for w in cands)
        if ids != self._ids:  # the pool changed: start the shadows over
            self._reset(ids, cands)
        try:
            ci = ids.index(chosen)
        except ValueError:
            self.skipped += 1
            return
        share = self._share(cands)
        stride = max(1, self.stride_tokens // bs)
        sk = keys[stride - 1::stride]
        L = req.prompt_tokens
        rates = [self._marginal(self._rate(w, default_rate)) for w in cands]
        scale = self.rate * share  # the shadows' share of the fleet's capacity
        ktok = stride * bs
        self.cap_keys = max(1, int(n * self.cache_tokens * scale / ktok))
        full = (1 << n) - 1
        picks = [ci]
        ttfts = [self._serve(self.fleets["cache_aware"], ci, _depths(self.holders, sk, 0, full), ktok, L, rates, scale, req,
                             now_s)]
        for j, b in enumerate(self.baselines, 1):
            f = self.fleets[b]
            dep = _depths(self.holders, sk, j * n, full)
            i = self._greedy(f, dep, ktok, L, scale, now_s) if b == "cache_aware_greedy" else self._p2c(f, now_s)
            picks.append(i)
            t = self._serve(f, i, dep, ktok, L, rates, scale, req, now_s)
            ttfts.append(t)
            self.sum_ms[b] += t - ttfts[0]
        self._hold(sk, sum(1 << (j * n + i) for j, i in enumerate(picks)))
        self.n += 1

    def _hold(self, sk: Sequence[int], bits: int) -> None:
        """Each fleet placed the prompt on its pick (``bits``, packed): its sampled keys are
        held there (one LRU)."""
        hs = self.holders
        pop = hs.pop
        for k in sk:
            hs[k] = pop(k, 0) | bits
        while len(hs) > self.cap_keys:
            hs.popitem(last=False)

    def _reset(self, ids: tuple[str, ...], cands: Sequence[WorkerState]) -> None:
        self._ids = ids
        self.fleets = {p: ShadowFleet(len(ids)) for p in self.order}
        self.holders.clear()

    @staticmethod
    def _rate(w: WorkerState, default: float) -> float:
        r = w.prefill_tokens_per_s
        return r if isinstance(r, (int, float)) and math.isfinite(r) and r > 0 else default

    def _marginal(self, r: float) -> float:
        """A worker's marginal prefill rate from its measured one: a worker measures tokens per
        busy second over steps that each carry a fixed ``step_ms`` beside about ``u`` tokens of
        this traffic's prefill (r = u / (step + u / R)); a queue drains in full chunks, where that
        fixed time is amortised, so it drains at R (kept within [r, 4 r])."""
        u = self._u_mean
        if u <= 0.0:
            return r
        busy_s = u / r - self.step_ms / 1000.0
        return r * 4.0 if busy_s <= u / (4.0 * r) else u / busy_s

    @staticmethod
    def _share(cands: Sequence[WorkerState]) -> float:
        """This router's share of the fleet's traffic (uncached tokens sent; 1 without peers)."""
        own = fleet = 0
        for w in cands:
            own += w.sent_tokens
            fleet += w.sent_tokens + w.peer_sent_tokens
        return min(1.0, max(0.05, own / fleet)) if fleet > 0 and own > 0 else 1.0

    def _serve(self, f: ShadowFleet, i: int, dep: dict[int, int], ktok: int, L: int, rates, scale: float,
               req: RouteRequest, now_s: float) -> float:
        """Place the request on shadow worker i (``dep``: the fleet's held depths); its predicted
        TTFT there, ms."""
        r = rates[i]
        hit = min(dep.get(i, 0) * ktok, max(0, L - 1))
        u = L - hit
        q = f.queued(i, r * scale, now_s)
        ttft_ms = self.overhead_ms + 1000.0 * (q / (r * scale) + u / r)
        end_s = now_s + ttft_ms / 1000.0 + max(0, req.max_new_tokens) * self.decode_step_ms / 1000.0
        f.place(i, u, end_s, now_s, r * scale)
        return ttft_ms

    def _greedy(self, f: ShadowFleet, dep: dict[int, int], ktok: int, L: int, scale: float, now_s: float) -> int:
        """cache_aware_greedy's rule on its own shadow (load: its in-flight requests; the
        imbalance bound scaled to the shadow's share)."""
        n = len(f.q_tok)
        loads = [f.load(i, now_s) for i in range(n)]
        lo = min(range(n), key=lambda i: (loads[i], i))
        hi = max(loads)
        if hi - loads[lo] > self.balance_abs * scale and hi > loads[lo] * self.balance_rel:
            return lo
        qb = max(1, math.ceil(L / ktok))
        best = None
        for i, d in dep.items():
            if d > self.cache_threshold * qb and (best is None or (loads[i], i) < (loads[best], best)):
                best = i
        return lo if best is None else best

    def _p2c(self, f: ShadowFleet, now_s: float) -> int:
        n = len(f.q_tok)
        rnd = self.rng.random
        a = int(rnd() * n)
        b = int(rnd() * (n - 1))
        if b >= a:
            b += 1
        return a if (f.load(a, now_s), a) <= (f.load(b, now_s), b) else b

    # ------------------------------------------------------------------ read
    def pays_ms(self) -> dict[str, float]:
        """Per baseline the mean shadow TTFT difference (ms per request cache_aware saves), and
        ``best`` (the smaller); empty before the first shadowed request."""
        if not self.n:
            return {}
        out = {b: s / self.n for b, s in self.sum_ms.items()}
        out["best"] = min(out.values())
        return out

    def snapshot(self) -> dict[str, Any]:
        return {"requests": self.n, "sums_ms": dict(self.sum_ms), "pays_ms": {k: round(v, 3) for k, v in self.pays_ms().items()}}
