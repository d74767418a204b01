"""A simulated GPU inference server (one DP rank): continuous batching, chunked prefill, a paged
radix prefix cache with LRU eviction, KV events and LoadStat -- as a pure state machine.

Used by the simulated workers (real time) and the discrete-event simulator (virtual time), so it
reads no clock, draws no random numbers and does no I/O: the owner of time calls
:meth:`EngineModel.step` with the step's start time and advances its clock by the returned
``duration_s``. Same inputs, same outputs, on every host. Defaults model an 8B dense model on one
H100 (``gpu-server-model.md``).

Scheduling (one :meth:`~EngineModel.step` = one scheduler iteration, SGLang-like, mixed chunked
prefill):

1. *Decode*: every fully prefilled running request gets one KV slot. When free KV is short, LRU
   unpinned leaf pages are evicted; if that is not enough the most recently admitted requests are
   *retracted* (KV released, request put back at the head of the waiting queue keeping its output;
   it is re-prefilled over prompt + output later, as SGLang retracts).
2. *Prefill*: a budget of ``chunked_prefill_size`` uncached tokens; first the partially prefilled
   ("chunked") request continues, then waiting requests are admitted FIFO while the budget lasts,
   ``running < max_running_requests`` and free KV after evicting unpinned cached pages covers the
   uncached prompt + ``admission_reserve_tokens``. Admission matches the longest cached full-page
   prefix (capped so that at least one prompt token is computed, as SGLang needs its logits); those
   tokens cost nothing. At most one request is partially prefilled at any time.
3. *Time*: ``decode_base_ms + decode_per_req_ms*batch + kv_tokens_in_batch*kv_bytes_per_token/hbm``
   for the decode batch (0 without one), plus ``prefill_overhead_ms + uncached/prefill_rate +
   sum(chunk_i*(ctx_before_i+chunk_i))*attention_coef_ms`` when the step carries prefill.
4. *Outputs*: a request whose prefill completes emits its first token (its TTFT point, listed in
   ``first_tokens``); each decode step emits one token per decoding request. A request finishes
   (``"length"``) after ``max_new_tokens`` tokens; 0 finishes right after prefill with no token.

KV memory (tokens): cached pages (pinned or not) + each running request's private tokens (its
uncached tokens allocated at admission, plus one slot per generated token). A request's context is
``pinned path pages + private tokens``. Prompt pages enter the cache as prefill computes them
(SGLang's ``cache_unfinished_req``); full pages of prompt + output enter when the request finishes.
A page that another request already inserted is shared and the duplicate copy freed. Retracted and
cancelled requests release their KV without inserting their output pages.

KV events: every new page -> BlockStored (SGLang chained SHA-256 page hash, stored unsigned,
``medium="GPU"``); every evicted page -> BlockRemoved; :meth:`~EngineModel.flush_cache` and engine
start -> AllBlocksCleared. Consecutive events are merged as SGLang does (a BlockStored continuing
the previous one's chain is appended to it; consecutive BlockRemoved are joined). They are buffered
and released in ``StepResult.kv_events`` after each step that carried prefill, every
``decode_log_interval`` decode steps, and when the engine goes idle; :meth:`drain_events` takes
them immediately.

Host tier (``host_kv_tokens`` > 0; off by default): SGLang HiCache's L2. A page evicted from the GPU
is demoted to a bounded host pool (BlockStored ``medium="CPU_PINNED"`` before its GPU BlockRemoved;
a full pool drops its oldest page: BlockRemoved on ``CPU_PINNED``). Admission continues the GPU
match into the host pool: those pages are loaded back (stored on the GPU again, then removed from
the host) at ``host_transfer_bytes_per_s`` instead of recomputed, and count as cached tokens.
Resync snapshots list GPU pages only (the index then under-reports the host tier, never over).

Page identity inside the cache is the router's content key (:func:`mesh.hashing.content_keys`), so
prefix matching is one dict probe per prompt page; SHA-256 is computed only for new pages.

Cache namespaces (``submit(lora_name=, extra_key=, cache_salt=)``, ``mesh.namespaces``): a
request's pages chain from its namespace's root key, so it reuses only pages of its own namespace,
as SGLang keeps LoRA adapters, extra keys and salts apart. Its page hashes are seeded differently
(a salt as SGLang seeds it, ``SHA-256(b"sglang-cache-salt-v1\0" + salt)``; adapter and extra key
folded into that seed, a simplification of SGLang's hash namespacing) and its BlockStored events
carry ``lora_name`` / ``cache_salt`` as SGLang's do (no ``extra_key``: SGLang publishes none).

DP attention (:class:`mesh.engine_dp.DpEngineModel`, only for a worker with ``dp_size`` > 1): ``dp_size`` of these
models behind one worker, each rank its own KV cache, batch, event stream and LoadStat, stepped in
lockstep; a request goes to the rank the router named (``routed_dp_rank``) or the least busy one.
"""

from __future__ import annotations

import heapq
import struct
from collections import OrderedDict
from hashlib import sha256 as _sha256
from collections import deque
from collections.abc import Sequence

import xxhash

from mesh.hashing import ROOT_KEY, content_keys
from mesh.namespaces import make_namespace, namespace_root_key
from mesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from mesh.load import LoadStat
from mesh.engine_config import EngineConfig, StepResult

__all__ = ["EngineConfig", "StepResult", "EngineModel", "output_token_id"]

_MEDIUM = "GPU"
_HOST_MEDIUM = "CPU_PINNED"  # SGLang's StorageMedium.CPU: HiCache's host tier (mesh.index.tiers)
_GOLDEN = 0x9E3779B1  # odd multiplier spreading consecutive positions over the vocabulary


def _namespace_seed(lora_name: str | None, extra_key: str | None, cache_salt: str | None) -> bytes:
    """SHA-256 chain seed of a namespaced request's first page (see the module docstring)."""
    if cache_salt and not lora_name and not extra_key:
        return _sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode()).digest()  # SGLang's own salt seed

    def part(v: str | None) -> bytes:
        if not v:
            return b"\x00"
        b = v.encode()
        return b"\x01" + len(b).to_bytes(8, "little") + b

    return _sha256(b"sglang-kv-event-namespace-v1" + part(lora_name) + part(extra_key) + part(cache_salt)).digest()


def _rid_seed(rid: object) -> int:
    return xxhash.xxh3_64_intdigest(repr(rid).encode())


def output_token_id(rid: object, position: int, vocab_size: int) -> int:
    """The deterministic token a request emits at output ``position`` (0-based)."""
    return (_rid_seed(rid) + position * _GOLDEN) % vocab_size


class _Page:
    """One cached page: a radix node keyed by its content key."""

    __slots__ = ("key", "parent", "hash", "digest", "tokens", "ref", "children", "stamp", "alive", "ns")

    def __init__(self, key: int, parent: _Page | None, digest: bytes, tokens: tuple[int, ...], stamp: int,
                 ns: tuple[str | None, str | None] | None = None) -> None:
        self.key = key
        self.parent = parent
        self.digest = digest  # SGLang chain digest: the next page's hash needs all 32 bytes
        self.hash = int.from_bytes(digest[:8], "big")  # SGLang's int64 hash, held unsigned
        self.tokens = tokens
        self.ref = 0  # running requests holding this page (pinned while > 0)
        self.children = 0
        self.stamp = stamp  # LRU clock: larger = used more recently
        self.alive = True
        self.ns = ns  # (lora_name, cache_salt) its events carry; None = plain


class _Req:
    __slots__ = (
        "rid", "prompt", "max_new", "arrival_s", "output", "seq", "keys", "path", "computed",
        "kv_tokens", "cached_tokens", "seed", "first_done", "admitted", "transferred", "root", "prior", "ns", "script",
    )

    def __init__(self, rid: object, prompt: list[int], max_new: int, arrival_s: float, keys: list[int],
                 root: int = ROOT_KEY, prior: bytes = b"", ns: tuple[str | None, str | None] | None = None) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_new = max_new
        self.arrival_s = arrival_s
        self.output: list[int] = []
        self.seq = prompt  # tokens whose KV prefill must produce (prompt, + output after a retraction)
        self.keys = keys  # content keys of the full pages of prompt + output known so far
        self.path: list[_Page] = []  # pinned cached pages, a root-first chain
        self.computed = 0  # tokens of seq whose KV exists (matched + prefilled)
        self.kv_tokens = 0  # tokens of KV this request holds (path pages + private)
        self.cached_tokens = 0
        self.seed = _rid_seed(rid)
        self.first_done = False
        self.admitted = False
        self.transferred = False  # PD decode leg: the prompt's KV arrives over the network
        self.root = root  # content key its chain starts from (its cache namespace)
        self.prior = prior  # SHA-256 chain seed of its first page (b"" = plain)
        self.ns = ns  # (lora_name, cache_salt) for its events, None = plain
        self.script: Sequence[int] = ()  # the output tokens it must emit first (submit(output_tokens=...))

    def next_token(self, vocab: int) -> int:
        """The token it emits next: its scripted one while the script lasts, else the rid-seeded one."""
        k = len(self.output)
        s = self.script
        return s[k] if k < len(s) else (self.seed + k * _GOLDEN) % vocab


class EngineModel:
    """One DP rank of a simulated SGLang server. Not thread-safe; single owner steps it."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self._ps = cfg.page_size
        self._pack_page = struct.Struct(f"<{cfg.page_size}I").pack  # ids validated at submit
        self._cache: dict[int, _Page] = {}  # content key -> page; insertion order is parent-first
        self._heap: list[tuple[int, int, _Page]] = []  # (stamp, push no., page): LRU eviction candidates
        self._push_no = 0
        self._clock = 0  # LRU stamps
        self._pinned_pages = 0
        self._private = 0  # KV tokens held by running requests outside cached pages
        self._reqs: dict[object, _Req] = {}
        self._waiting: deque[_Req] = deque()
        # Running requests past their prefill, in prefill-completion order (retraction takes the
        # last ones first).
        self._decoding: dict[object, _Req] = {}
        self._chunked: _Req | None = None  # the one partially prefilled running request
        self._decode_steps = 0
        self._prefill_tokens_total = 0
        self._prefill_busy_us = 0.0
        # The step in flight: its results (tokens, finished requests) reach the outside at
        # ``now + duration``, but this model applies them when the step starts. Until then the
        # requests it finishes are still running as far as anyone can see (load_stat(now_s=...)).
        self._finishing_until_s = float("-inf")
        self._finishing_n = 0
        # Pending events, merged in place: ["S", hashes, parent, tokens, ns] | ["R", hashes] | ["C"],
        # and the host tier's ["SH", ...] / ["RH", hashes] (medium CPU_PINNED).
        self._pending: list[list] = [["C"]]  # SGLang resets (and announces) its cache at start
        # The host tier (host_kv_tokens > 0): demoted pages by content key, oldest first
        self._host: OrderedDict[int, _Page] | None = OrderedDict() if cfg.host_kv_tokens >= cfg.page_size else None
        self._host_cap = cfg.host_kv_tokens // cfg.page_size
        self._load_tokens = 0  # host-tier tokens loaded by admissions of the step being planned
        self.host_hit_tokens = 0  # prompt tokens served from the host tier (reports)

    # ------------------------------------------------------------------ public API

    def submit(self, rid: object, prompt: Sequence[int], max_new_tokens: int, now_s: float, *, transferred: bool = False,
               lora_name: str | None = None, extra_key: str | None = None, cache_salt: str | None = None,
               output_tokens: Sequence[int] | None = None) -> None:
        """Queue a request. ``max_new_tokens`` is clipped so prompt + output fit the KV capacity.

        ``transferred`` (the decode leg of prefill/decode disaggregation): the prompt's KV is
        received from the prefill worker instead of computed, costing ``kv_transfer`` time
        (``kv_bytes_per_token / kv_transfer_bytes_per_s`` per uncached token) instead of prefill.
        ``lora_name`` / ``extra_key`` / ``cache_salt``: the request's cache namespace (see the
        module docstring); pages of other namespaces are never reused.
        ``output_tokens``: the tokens it emits first, in order (past their end, the rid-seeded
        ones of :func:`output_token_id`): a simulator whose later prompts contain this request's
        answer (a conversation, a replayed recording) makes the engine emit exactly that answer,
        so the pages of prompt + output it caches are the ones the later prompts hit.

        Raises ValueError on a duplicate rid, an empty prompt, bad token ids, a negative
        ``max_new_tokens`` or a prompt that cannot fit (prompt + admission reserve > capacity).
        """
        if rid in self._reqs:
            raise ValueError(f"duplicate rid {rid!r}")
        cfg = self.config
        n = len(prompt)
        if n == 0:
            raise ValueError("empty prompt")
        if n + cfg.admission_reserve_tokens > cfg.max_total_num_tokens:
            raise ValueError(f"prompt of {n} tokens exceeds the KV capacity")
        if type(max_new_tokens) is not int or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        toks = list(prompt)
        nsname = make_namespace(lora_name, extra_key, cache_salt)
        root, prior, ns = ROOT_KEY, b"", None
        if nsname is not None:
            root = namespace_root_key(nsname)
            prior = _namespace_seed(lora_name, extra_key, cache_salt)
            if lora_name or cache_salt:
                ns = (lora_name or None, cache_salt or None)
        keys = content_keys(toks, self._ps, root)  # also validates the ids (ValueError)
        # A lone request must always fit, so a retraction can never starve it.
        max_new = min(max_new_tokens, cfg.max_total_num_tokens - cfg.admission_reserve_tokens - n)
        req = _Req(rid, toks, max_new, now_s, keys, root, prior, ns)
        req.transferred = transferred
        if output_tokens:
            vocab = cfg.vocab_size
            if not all(type(t) is int and 0 <= t < vocab for t in output_tokens):
                raise ValueError(f"output_tokens must be ints in [0, {vocab})")
            req.script = output_tokens
        self._reqs[rid] = req
        self._waiting.append(req)

    def cancel(self, rid: object) -> bool:
        """Drop a waiting or running request and free its KV. False when the rid is unknown."""
        req = self._reqs.pop(rid, None)
        if req is None:
            return False
        if req.admitted:
            self._release(req)
            self._decoding.pop(rid, None)
            if self._chunked is req:
                self._chunked = None
        else:
            self._waiting.remove(req)
        return True

    def has_work(self) -> bool:
        return bool(self._reqs)

    @property
    def num_running(self) -> int:
        return len(self._decoding) + (self._chunked is not None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self, now_s: float) -> StepResult:
        """Run one scheduler iteration starting at ``now_s`` (see the module docstring).

        The model's behaviour does not depend on absolute time (LRU order is use order), so
        ``now_s`` only anchors the result: everything in it happens at ``now_s + duration_s``.
        """
        cfg = self.config
        res = StepResult(0.0)

        # 1. decode slots (evict, then retract newest-first, when short)
        batch = list(self._decoding.values())
        if batch and not self._alloc(len(batch)):
            batch = self._retract_for_decode(batch)
        n_dec = len(batch)
        kv_sum = 0
        for r in batch:
            r.kv_tokens += 1
            kv_sum += r.kv_tokens
        self._private += n_dec

        # 2. prefill chunk: continue the chunked request, then admit FIFO
        chunks = self._plan_prefill()

        # 3. time
        decode_ms = 0.0
        if n_dec:
            decode_ms = (
                cfg.decode_base_ms + cfg.decode_per_req_ms * n_dec
                + kv_sum * cfg.kv_bytes_per_token / cfg.hbm_bytes_per_s * 1e3
            )
        prefill_ms = 0.0
        if chunks:
            total = 0
            attn = 0
            xfer = 0
            for r, take in chunks:
                if r.transferred:
                    xfer += take
                    continue
                total += take
                attn += take * (r.computed + take)
            if total:
                prefill_ms = cfg.prefill_overhead_ms + total * 1e3 / cfg.prefill_tokens_per_s + attn * cfg.attention_coef_ms
            if xfer:
                prefill_ms += xfer * cfg.kv_bytes_per_token / cfg.kv_transfer_bytes_per_s * 1e3
            if self._load_tokens:  # host-tier hits admitted this step: loaded, not recomputed
                prefill_ms += self._load_tokens * cfg.kv_bytes_per_token / cfg.host_transfer_bytes_per_s * 1e3
                self._load_tokens = 0
            self._prefill_tokens_total += total
        duration_ms = decode_ms + prefill_ms
        res.duration_s = duration_ms / 1e3

        # 4. outputs: decode tokens, then prefill completions
        tokens = res.tokens
        vocab = cfg.vocab_size
        for r in batch:
            out = r.output
            tok = r.next_token(vocab)
            out.append(tok)
            tokens.append((r.rid, tok))
            if len(out) >= r.max_new:
                self._finish(r, res)
        for r, take in chunks:
            r.computed += take
            self._insert_computed(r)
            if r.computed == len(r.seq):
                self._prefill_done(r, res)

        # 5. counters and the event flush cadence
        if chunks:
            # Busy time of the whole mixed step: the GPU is not free for more prefill meanwhile, so
            # tokens/busy is the prefill rate a router can expect under the current decode load.
            self._prefill_busy_us += duration_ms * 1e3
            flush = True
        else:
            flush = False
            if n_dec:
                self._decode_steps += 1
                flush = self._decode_steps % cfg.decode_log_interval == 0
        if flush or not self._reqs:
            res.kv_events = self.drain_events()
        self._finishing_until_s = now_s + res.duration_s
        self._finishing_n = len(res.finished)
        return res

    def drain_events(self) -> list[KvEvent]:
        """Take the buffered KV events now, regardless of the flush cadence."""
        out: list[KvEvent] = []
        ps = self._ps
        for e in self._pending:
            k = e[0]
            if k == "S":
                ns = e[4]
                if ns is None:
                    out.append(BlockStored(tuple(e[1]), e[2], tuple(e[3]), ps, _MEDIUM))
                else:
                    out.append(BlockStored(tuple(e[1]), e[2], tuple(e[3]), ps, _MEDIUM, ns[0], cache_salt=ns[1]))
            elif k == "R":
                out.append(BlockRemoved(tuple(e[1]), _MEDIUM))
            elif k == "SH":
                ns = e[4] or (None, None)
                out.append(BlockStored(tuple(e[1]), e[2], tuple(e[3]), ps, _HOST_MEDIUM, ns[0], cache_salt=ns[1]))
            elif k == "RH":
                out.append(BlockRemoved(tuple(e[1]), _HOST_MEDIUM))
            else:
                out.append(AllBlocksCleared())
        self._pending = []
        return out

    def snapshot_events(self) -> list[KvEvent]:
        """AllBlocksCleared + BlockStored for every cached page, parent first (for a resync).

        Buffered events are discarded: the snapshot supersedes them.
        """
        self._pending = [["C"]]
        for p in self._cache.values():  # dict order is parent-first (a parent outlives its children)
            self._note_stored(p)
        return self.drain_events()

    def flush_cache(self, now_s: float) -> bool:
        """Drop every cached page. Refused (False) while requests are running or waiting.

        The AllBlocksCleared is released by the next :meth:`step` (idle flush) or
        :meth:`drain_events`; events still buffered from before are dropped as moot.
        """
        if self._reqs:
            return False
        for p in self._cache.values():
            p.alive = False
        self._cache.clear()
        if self._host is not None:
            self._host.clear()
        self._heap.clear()
        self._pinned_pages = 0
        self._pending = [["C"]]  # earlier buffered events are moot after a clear
        return True

    def peek_cached_tokens(self, prompt: Sequence[int], namespace: str | None = None) -> int:
        """Tokens of ``prompt`` admission would find cached right now (no side effects);
        ``namespace``: ``mesh.namespaces.make_namespace`` of the request's adapter/key/salt."""
        if not prompt:
            return 0
        return self._match_len(content_keys(prompt, self._ps, namespace_root_key(namespace)), len(prompt)) * self._ps

    def load_stat(self, dp_rank: int = 0, now_s: float | None = None) -> LoadStat:
        """SGLang's LoadStat with this rank's true numbers.

        ``now_s`` (drivers that publish while a step is in flight: the simulator, the stub
        workers): requests the step in flight will finish are still counted as running until
        its end, as SGLang's scheduler counts them until it has processed the batch's output.
        Without it the snapshot showed them gone a step early while their replies were still to
        come, and a router that corrects its snapshot with the replies it sees counted each such
        request twice (its load estimate was one low on about 10 % of workers at any time).

        ``num_tokens``: KV tokens in use, cached pages included. ``num_total_tokens``: KV that
        cannot be reclaimed (pinned pages + private) plus the tokens of every waiting request, the
        demand SGLang's ``kv_ok`` compares with capacity. ``total_prefill_busy_us``: duration of
        every step that carried prefill. ``num_waiting_uncached_tokens``: uncached prompt tokens of
        the waiting queue plus the part of the chunk-prefilled request not computed yet (prefill
        work still ahead of a new arrival, which is what a router needs to predict its TTFT).
        """
        cfg = self.config
        ps = self._ps
        waiting_tokens = 0
        waiting_uncached = 0
        for r in self._waiting:
            n = len(r.seq)
            waiting_tokens += n
            waiting_uncached += n - self._match_len(self._seq_keys(r), n) * ps
        c = self._chunked
        if c is not None:
            waiting_uncached += len(c.seq) - c.computed
        held = self._pinned_pages * ps + self._private
        running = self.num_running
        if now_s is not None and now_s < self._finishing_until_s:
            running += self._finishing_n
        return LoadStat(
            num_running_reqs=running,
            num_waiting_reqs=len(self._waiting),
            num_tokens=len(self._cache) * ps + self._private,
            max_total_num_tokens=cfg.max_total_num_tokens,
            attn_dp_rank=dp_rank,
            num_waiting_uncached_tokens=waiting_uncached,
            num_total_tokens=held + waiting_tokens,
            max_running_requests=cfg.max_running_requests,
            total_prefill_uncached_tokens=self._prefill_tokens_total,
            total_prefill_busy_us=int(self._prefill_busy_us),
        )

    # Introspection (tests, simulator reports).

    def cached_blocks(self) -> list[tuple[int, int | None]]:
        """(hash, parent hash or None) of every cached page, parent first; hashes unsigned."""
        return [(p.hash, p.parent.hash if p.parent is not None else None) for p in self._cache.values()]

    @property
    def num_cached_pages(self) -> int:
        return len(self._cache)

    @property
    def num_host_pages(self) -> int:
        """Pages in the host tier (0 without one)."""
        return len(self._host) if self._host is not None else 0

    @property
    def free_tokens(self) -> int:
        return self.config.max_total_num_tokens - len(self._cache) * self._ps - self._private

    # ------------------------------------------------------------------ cache internals

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _push(self, p: _Page) -> None:
        self._push_no += 1
        heapq.heappush(self._heap, (p.stamp, self._push_no, p))
        if len(self._heap) > 4 * len(self._cache) + 64:
            self._compact_heap()  # drop stale entries (re-pinned or re-stamped pages)

    def _seq_keys(self, r: _Req) -> list[int]:
        """Content keys of every full page of ``r.seq``, extending the cached list if needed."""
        return self._keys_upto(r, r.seq, len(r.seq) // self._ps)

    def _keys_upto(self, r: _Req, tokens: list[int], n_pages: int) -> list[int]:
        keys = r.keys
        have = len(keys)
        if have < n_pages:
            ps = self._ps
            parent = keys[-1] if keys else r.root
            keys.extend(content_keys(tokens[have * ps : n_pages * ps], ps, parent))
        return keys

    def _match_len(self, keys: list[int], n_tokens: int) -> int:
        """Pages of the cached prefix, leaving at least one token to compute."""
        limit = min(len(keys), (n_tokens - 1) // self._ps)
        cache = self._cache
        i = 0
        while i < limit and keys[i] in cache:
            i += 1
        return i

    def _free(self) -> int:
        return self.config.max_total_num_tokens - len(self._cache) * self._ps - self._private

    def _alloc(self, n_tokens: int) -> bool:
        """Make ``n_tokens`` free by evicting LRU unpinned leaves. False if impossible (no change
        beyond the evictions)."""
        if self._free() >= n_tokens:
            return True
        if self._free() + (len(self._cache) - self._pinned_pages) * self._ps < n_tokens:
            return False
        while self._free() < n_tokens:
            # self._heap, not a local: _evict may compact (replace) the heap
            stamp, _, p = heapq.heappop(self._heap)
            if p.alive and p.ref == 0 and p.children == 0 and p.stamp == stamp:
                self._evict(p)
        return True

    def _evict(self, p: _Page) -> None:
        del self._cache[p.key]
        p.alive = False
        if self._host is not None:
            self._demote(p)
        self._note_removed(p.hash)
        parent = p.parent
        if parent is not None:
            parent.children -= 1
            if parent.ref == 0 and parent.children == 0:
                self._push(parent)

    def _compact_heap(self) -> None:
        self._heap = [e for e in self._heap if e[2].alive and e[2].ref == 0 and e[2].children == 0 and e[2].stamp == e[0]]
        heapq.heapify(self._heap)

    def _pin(self, p: _Page) -> None:
        if p.ref == 0:
            self._pinned_pages += 1
        p.ref += 1

    def _add_pages(self, r: _Req, tokens: list[int], start: int, end: int) -> None:
        """Put pages ``start..end-1`` of ``tokens`` on ``r``'s path: share each cached page or insert
        a new one (BlockStored noted, merged as :meth:`_note_stored` merges).

        The hot loop of every simulation (one pass per prefill chunk), so the page, pin, clock and
        event bookkeeping of one page is written out inline here; :meth:`_note_stored` is the
        same merge rule for the snapshot path.
        """
        ps = self._ps
        keys = r.keys
        path = r.path
        cache = self._cache
        pend = self._pending
        pack = self._pack_page
        ns = r.ns
        clock = self._clock
        newly_pinned = 0
        for i in range(start, end):
            key = keys[i]
            clock += 1
            p = cache.get(key)
            if p is None:
                parent = path[-1] if path else None
                page = tokens[i * ps : (i + 1) * ps]
                if parent is not None:
                    digest = _sha256(parent.digest + pack(*page)).digest()
                    parent.children += 1
                    parent_hash = parent.hash
                else:
                    digest = _sha256(r.prior + pack(*page)).digest()
                    parent_hash = None
                p = _Page(key, parent, digest, tuple(page), clock, ns)
                cache[key] = p
                last = pend[-1] if pend else None
                if last is not None and last[0] == "S" and last[1][-1] == parent_hash and last[4] == ns:
                    last[1].append(p.hash)
                    last[3].extend(page)
                else:
                    pend.append(["S", [p.hash], parent_hash, list(page), ns])
            else:
                p.stamp = clock
            if p.ref == 0:
                newly_pinned += 1
            p.ref += 1
            path.append(p)
        self._clock = clock
        self._pinned_pages += newly_pinned
        # The request's own copy of these tokens either became the cached page or is freed.
        self._private -= ps * (end - start)

    def _insert_computed(self, r: _Req) -> None:
        """Insert the full pages of ``r.seq`` whose KV now exists (prefill progress)."""
        n_pages = r.computed // self._ps
        have = len(r.path)
        if have < n_pages:
            self._seq_keys(r)
            self._add_pages(r, r.seq, have, n_pages)

    def _release(self, r: _Req) -> None:
        """Unpin ``r``'s pages (touching them: most recently used) and free its private KV."""
        ps = self._ps
        for p in r.path:
            p.stamp = self._tick()
            p.ref -= 1
            if p.ref == 0:
                self._pinned_pages -= 1
                if p.children == 0:
                    self._push(p)
        self._private -= r.kv_tokens - len(r.path) * ps
        r.path = []
        r.kv_tokens = 0
        r.computed = 0
        r.admitted = False

    # ------------------------------------------------------------------ scheduling internals

    def _try_admit(self, r: _Req) -> bool:
        cfg = self.config
        ps = self._ps
        seq = r.seq
        keys = self._seq_keys(r)
        m = self._match_len(keys, len(seq))
        cache = self._cache
        path = [cache[keys[i]] for i in range(m)]
        loads = self._host_match(keys, m, len(seq)) if self._host else []
        gen_first = 1 if len(r.output) < r.max_new else 0  # slot of the token produced at prefill end
        need = len(seq) - m * ps + gen_first
        unpinned_in_path = sum(1 for p in path if p.ref == 0)
        reclaimable = (len(cache) - self._pinned_pages - unpinned_in_path) * ps
        if self._free() + reclaimable < need + cfg.admission_reserve_tokens:
            return False
        for hp in loads:  # out of the host pool before evicting, so demotions cannot push them out
            del self._host[hp.key]
        for p in path:  # pin before evicting so the matched prefix survives
            p.stamp = self._tick()
            self._pin(p)
        ok = self._alloc(need)
        assert ok, "admission check guarantees the eviction succeeds"
        self._private += need  # uncached prompt (+ the first token's slot)
        r.path = path
        r.computed = m * ps
        r.kv_tokens = m * ps + need
        r.admitted = True
        if loads:  # host-tier hits: back onto the GPU (stored there, then gone from the host)
            self._add_pages(r, seq, m, m + len(loads))
            self._note_host([hp.hash for hp in loads])
            n = len(loads) * ps
            r.computed += n
            self._load_tokens += n
            self.host_hit_tokens += n
        if not r.first_done:
            r.cached_tokens = r.computed
        return True

    def _plan_prefill(self) -> list[tuple[_Req, int]]:
        cfg = self.config
        budget = cfg.chunked_prefill_size
        chunks: list[tuple[_Req, int]] = []
        c = self._chunked
        if c is not None:
            take = min(len(c.seq) - c.computed, budget)
            chunks.append((c, take))
            budget -= take
            if c.computed + take < len(c.seq):
                return chunks
            # Completes this step: running as a decoder from now on (not in this step's batch,
            # which was fixed before planning).
            self._chunked = None
            self._decoding[c.rid] = c
        waiting = self._waiting
        while budget > 0 and waiting and self.num_running < cfg.max_running_requests:
            r = waiting[0]
            if not self._try_admit(r):
                break  # FIFO: the head blocks the queue, like SGLang
            waiting.popleft()
            take = min(len(r.seq) - r.computed, budget)
            chunks.append((r, take))
            budget -= take
            if r.computed + take < len(r.seq):
                self._chunked = r
                break
            self._decoding[r.rid] = r  # prefill completes this step (see above)
        return chunks

    def _prefill_done(self, r: _Req, res: StepResult) -> None:
        if len(r.output) >= r.max_new:  # max_new_tokens == 0
            self._finish(r, res)
            return
        tok = r.next_token(self.config.vocab_size)
        r.output.append(tok)
        if not r.first_done:
            r.first_done = True
            res.first_tokens.append((r.rid, r.cached_tokens, len(r.prompt)))
        res.tokens.append((r.rid, tok))
        if len(r.output) >= r.max_new:
            self._finish(r, res)

    def _finish(self, r: _Req, res: StepResult) -> None:
        # SGLang caches the finished request's prompt + output (full pages only).
        tokens = r.prompt + r.output
        n_pages = min(len(tokens), r.kv_tokens) // self._ps
        have = len(r.path)
        if have < n_pages:
            self._keys_upto(r, tokens, n_pages)
            self._add_pages(r, tokens, have, n_pages)
        self._release(r)
        del self._reqs[r.rid]
        self._decoding.pop(r.rid, None)
        res.finished.append(
            (r.rid, "length", {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.output), "cached_tokens": r.cached_tokens})
        )

    def _retract_for_decode(self, batch: list[_Req]) -> list[_Req]:
        """Retract newest-first until the remaining decode batch gets its slots."""
        if self._chunked is not None:
            self._retract(self._chunked)
            self._chunked = None
        batch = list(batch)
        while not self._alloc(len(batch)):
            victim = batch.pop()
            self._decoding.pop(victim.rid, None)
            self._retract(victim)
        return batch

    def _retract(self, r: _Req) -> None:
        self._release(r)
        r.seq = r.prompt + r.output
        self._waiting.appendleft(r)

    # ------------------------------------------------------------------ event buffer

    def _note_stored(self, p: _Page) -> None:
        parent = p.parent.hash if p.parent is not None else None
        pend = self._pending
        if pend:
            last = pend[-1]
            if last[0] == "S" and last[1][-1] == parent and last[4] == p.ns:
                last[1].append(p.hash)
                last[3].extend(p.tokens)
                return
        pend.append(["S", [p.hash], parent, list(p.tokens), p.ns])

    # ------------------------------------------------------------------ host tier

    def _host_match(self, keys: list[int], m: int, n_tokens: int) -> list[_Page]:
        """Host-tier pages continuing the GPU match of ``m`` pages (leaving a token to compute)."""
        limit = min(len(keys), (n_tokens - 1) // self._ps)
        host = self._host
        out = []
        i = m
        while i < limit:
            hp = host.get(keys[i])
            if hp is None:
                break
            out.append(hp)
            i += 1
        return out

    def _demote(self, p: _Page) -> None:
        """An evicted GPU page moves to the host pool (its host store noted before its GPU
        removal, as HiCache backs a page up before releasing it); a full pool drops its oldest."""
        host = self._host
        while len(host) >= self._host_cap:
            _, old = host.popitem(last=False)
            self._note_host([old.hash])
        host[p.key] = p
        parent = p.parent.hash if p.parent is not None else None
        self._pending.append(["SH", [p.hash], parent, list(p.tokens), p.ns])

    def _note_host(self, hashes: list[int]) -> None:
        pend = self._pending
        if pend and pend[-1][0] == "RH":
            pend[-1][1].extend(hashes)
        else:
            pend.append(["RH", list(hashes)])

    def _note_removed(self, h: int) -> None:
        pend = self._pending
        if pend and pend[-1][0] == "R":
            pend[-1][1].append(h)
        else:
            pend.append(["R", [h]])
