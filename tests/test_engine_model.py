"""mesh.engine_model: sanity figures, scheduling, LRU + pinning, KV event consistency, LoadStat."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.engine_model import EngineConfig, EngineModel, StepResult, output_token_id
from mesh.errors import ConfigError
from mesh.hashing import sglang_page_hashes_with_digest
from mesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from mesh.load import LoadStat, prefill_rate_tokens_per_s


def run_until_idle(e: EngineModel, t: float = 0.0, max_steps: int = 100_000) -> tuple[float, list[StepResult]]:
    out = []
    for _ in range(max_steps):
        if not e.has_work():
            return t, out
        r = e.step(t)
        t += r.duration_s
        out.append(r)
    raise AssertionError("engine did not drain")


def warm_up(e: EngineModel, n_running: int, t: float = 0.0) -> float:
    """Step until every request is prefilled and a pure decode step of ``n_running`` ran."""
    for _ in range(10_000):
        r = e.step(t)
        t += r.duration_s
        if len(r.tokens) == n_running and not r.first_tokens and not e.num_waiting:
            return t
    raise AssertionError("no steady decode")


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


class Mirror:
    """Brute-force consumer: which pages does the engine hold, according to its events alone.

    Checks on the way: parents exist, hashes are SGLang's chain over the published tokens, stores
    never duplicate a live page, removals hit live leaves.
    """

    def __init__(self) -> None:
        self.pages: dict[int, tuple[int | None, bytes]] = {}

    def apply(self, ev) -> None:
        if isinstance(ev, AllBlocksCleared):
            self.pages.clear()
        elif isinstance(ev, BlockStored):
            bs = ev.block_size
            parent = ev.parent_block_hash
            assert len(ev.token_ids) == bs * len(ev.block_hashes)
            for i, h in enumerate(ev.block_hashes):
                assert parent is None or parent in self.pages, "parent not stored"
                prior = self.pages[parent][1] if parent is not None else None
                hs, digest = sglang_page_hashes_with_digest(ev.token_ids[i * bs : (i + 1) * bs], bs, prior)
                assert hs[0] & (2**64 - 1) == h, "not SGLang's chained hash"
                assert h not in self.pages, "duplicate store"
                self.pages[h] = (parent, digest)
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                assert h in self.pages, "removed an unknown page"
                assert all(p != h for p, _ in self.pages.values()), "removed a non-leaf"
                del self.pages[h]
        else:  # pragma: no cover
            raise AssertionError(ev)

    def view(self) -> dict[int, int | None]:
        return {h: p for h, (p, _) in self.pages.items()}


def engine_view(e: EngineModel) -> dict[int, int | None]:
    return dict(e.cached_blocks())


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": True}, "page_size"),
        ({"max_total_num_tokens": -1}, "max_total_num_tokens"),
        ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
        ({"hbm_bytes_per_s": float("inf")}, "hbm_bytes_per_s"),
        ({"decode_base_ms": -1.0}, "decode_base_ms"),
        ({"decode_log_interval": 0}, "decode_log_interval"),
        ({"chunked_prefill_size": 2.5}, "chunked_prefill_size"),
        ({"admission_reserve_tokens": 400_000}, "admission_reserve_tokens"),
        ({"vocab_size": "32000"}, "vocab_size"),
    ],
)
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kw)


# --------------------------------------------------------------------------- sanity figures


def test_idle_ttft_2000_tokens_uncached_is_85ms():
    e = EngineModel()
    e.submit("a", prompt(2000), 1, 0.0)
    r = e.step(0.0)
    assert r.first_tokens == [("a", 0, 2000)]
    # 5 ms + 2000/25000 s + attention 2000*2000*4e-9 ms
    assert r.duration_s * 1e3 == pytest.approx(85.016, abs=1e-6)


def test_ttft_with_1900_cached_tokens_is_about_9ms():
    e = EngineModel()
    base = prompt(1900)
    e.submit("warm", base + prompt(100, 10_000), 1, 0.0)
    t, _ = run_until_idle(e)
    e.submit("b", base + prompt(100, 20_000), 1, t)
    r = e.step(t)
    rid, cached, n = r.first_tokens[0]
    # Only full pages are cached: 1900 rounds down to 118 pages = 1888 tokens, leaving 112 to
    # compute: 5 + 112/25000 s = 9.48 ms (+0.0009 ms attention). The reference's "~9 ms" ignores
    # page alignment, which can add up to 15 tokens (0.6 ms): 9.0-10.0 ms is the honest band.
    assert (rid, cached, n) == ("b", 1888, 2000)
    assert 9.0 <= r.duration_s * 1e3 <= 10.0
    assert e.peek_cached_tokens(base + prompt(100, 30_000)) == 1888


def test_idle_single_decode_about_140_tokens_per_s():
    e = EngineModel()
    e.submit("a", prompt(2000), 101, 0.0)
    _, steps = run_until_idle(e)
    decode = [r.duration_s for r in steps[1:]]
    assert len(decode) == 100
    tps = len(decode) / sum(decode)
    assert 135 <= tps <= 145, tps


def test_batch_of_64_decodes_about_60_tokens_per_s_each():
    e = EngineModel()
    for i in range(64):
        e.submit(i, prompt(2000, 1 + 3000 * i), 200, 0.0)
    t = warm_up(e, 64)
    r = e.step(t)
    assert len(r.tokens) == 64 and not r.first_tokens
    per_req = 1 / r.duration_s
    assert 55 <= per_req <= 70, per_req  # 7 + 1.28 + ~7.3 ms = ~15.6 ms per step
    assert 3600 <= 64 * per_req <= 4400


def test_chunked_prefill_splits_long_prompts():
    e = EngineModel()
    e.submit("long", prompt(20_000), 1, 0.0)
    durations = []
    while e.has_work():
        r = e.step(0.0)
        durations.append(r.duration_s)
        if r.first_tokens:
            break
    assert len(durations) == 3  # 8192 + 8192 + 3616
    st = e.load_stat()
    assert st.total_prefill_uncached_tokens == 20_000
    assert abs(st.total_prefill_busy_us - sum(durations) * 1e6) <= 1


def test_prefill_counters_give_the_configured_rate():
    e = EngineModel()
    before = e.load_stat()
    e.submit("a", prompt(8000), 1, 0.0)
    run_until_idle(e)
    rate = prefill_rate_tokens_per_s(before, e.load_stat())
    assert rate is not None and 22_000 < rate < 25_000  # 25k/s minus the 5 ms overhead


# --------------------------------------------------------------------------- request lifecycle


def test_tokens_are_deterministic_and_finish_reports_usage():
    e = EngineModel()
    e.submit("x", prompt(40), 5, 0.0)
    _, steps = run_until_idle(e)
    toks = [tk for r in steps for rid, tk in r.tokens if rid == "x"]
    assert toks == [output_token_id("x", i, 32_000) for i in range(5)]
    fin = [f for r in steps for f in r.finished]
    assert fin == [("x", "length", {"prompt_tokens": 40, "completion_tokens": 5, "cached_tokens": 0})]


@pytest.mark.parametrize("max_new,n_tokens,first", [(0, 0, 0), (1, 1, 1)])
def test_zero_or_one_new_tokens_finish_right_after_prefill(max_new, n_tokens, first):
    e = EngineModel()
    e.submit("a", prompt(100), max_new, 0.0)
    r = e.step(0.0)
    assert len(r.tokens) == n_tokens and len(r.first_tokens) == first
    assert r.finished[0][2]["completion_tokens"] == max_new
    assert not e.has_work()


def test_submit_validation():
    e = EngineModel(EngineConfig(max_total_num_tokens=1000, admission_reserve_tokens=100))
    e.submit("a", [1], 1, 0.0)
    with pytest.raises(ValueError):
        e.submit("a", [1], 1, 0.0)
    with pytest.raises(ValueError):
        e.submit("b", [], 1, 0.0)
    with pytest.raises(ValueError):
        e.submit("c", prompt(901), 1, 0.0)
    with pytest.raises(ValueError):
        e.submit("d", [-1], 1, 0.0)
    with pytest.raises(ValueError):
        e.submit("e", [1], -1, 0.0)
    e.submit("f", prompt(900), 10, 0.0)  # fits exactly; max_new clipped to 0
    _, steps = run_until_idle(e)
    usage = {rid: u for r in steps for rid, _, u in r.finished}
    assert usage["f"]["completion_tokens"] == 0


def test_max_running_requests_is_respected():
    e = EngineModel(EngineConfig(max_running_requests=3))
    for i in range(5):
        e.submit(i, prompt(50, 100 * i + 1), 10, 0.0)
    e.step(0.0)
    st = e.load_stat()
    assert (st.num_running_reqs, st.num_waiting_reqs) == (3, 2)


def test_fifo_admission_head_of_line_blocks():
    cfg = EngineConfig(max_total_num_tokens=400, page_size=4, admission_reserve_tokens=0)
    e = EngineModel(cfg)
    e.submit("big1", prompt(300), 50, 0.0)
    e.step(0.0)
    e.submit("big2", prompt(300, 1000), 5, 0.0)  # does not fit next to big1
    e.submit("small", prompt(8, 5000), 5, 0.0)  # would fit, but FIFO keeps it behind big2
    e.step(0.0)
    assert e.load_stat().num_waiting_reqs == 2
    _, steps = run_until_idle(e)
    done = [rid for r in steps for rid, _, _ in r.finished]
    assert done.index("big2") < done.index("small")


def test_cancel_frees_kv():
    cfg = EngineConfig(page_size=16, chunked_prefill_size=1024)
    e = EngineModel(cfg)
    e.submit("a", prompt(5000), 100, 0.0)
    e.submit("w", prompt(10, 90_000), 100, 0.0)
    e.step(0.0)  # "a" is mid-prefill (chunked), "w" waits
    st = e.load_stat()
    assert st.num_running_reqs == 1 and st.num_tokens == 5001
    assert e.cancel("w") and e.cancel("a")
    assert not e.cancel("a") and not e.cancel("nope")
    assert not e.has_work()
    st = e.load_stat()
    assert st.num_running_reqs == 0 and st.num_total_tokens == 0
    # Only the 64 pages prefill already computed stay cached (unpinned); the rest is free.
    assert e.num_cached_pages == 64 and st.num_tokens == 1024
    assert e.free_tokens == cfg.max_total_num_tokens - 1024
    # Cancelling a decoding request frees its private KV too.
    e.submit("b", prompt(100, 7000), 100, 0.0)
    e.step(0.0)
    e.step(0.0)
    assert e.cancel("b")
    assert e.free_tokens == cfg.max_total_num_tokens - e.num_cached_pages * 16


def test_flush_cache_refused_while_running():
    e = EngineModel()
    e.submit("a", prompt(64), 3, 0.0)
    e.step(0.0)
    assert e.flush_cache(0.0) is False
    run_until_idle(e)
    assert e.num_cached_pages > 0
    assert e.flush_cache(1.0) is True
    assert e.num_cached_pages == 0 and e.peek_cached_tokens(prompt(64)) == 0
    assert e.step(1.0).kv_events == [AllBlocksCleared()]  # idle step flushes


def test_peek_has_no_side_effects():
    e = EngineModel(EngineConfig(page_size=4))
    e.submit("a", prompt(20), 1, 0.0)
    run_until_idle(e)
    before = (e.cached_blocks(), e.load_stat(), e.free_tokens)
    assert e.peek_cached_tokens(prompt(20)) == 16  # capped: one token must be computed
    assert e.peek_cached_tokens(prompt(21)) == 20
    assert e.peek_cached_tokens([9, 9, 9, 9, 9]) == 0
    assert (e.cached_blocks(), e.load_stat(), e.free_tokens) == before


# --------------------------------------------------------------------------- LRU and pinning


def small(**kw) -> EngineModel:
    base = dict(max_total_num_tokens=48, page_size=4, admission_reserve_tokens=0, chunked_prefill_size=64, decode_log_interval=1)
    base.update(kw)
    return EngineModel(EngineConfig(**base))


def hashes_of(tokens: list[int], ps: int = 4) -> list[int]:
    return [h & (2**64 - 1) for h in sglang_page_hashes_with_digest(tokens, ps)[0]]


def test_lru_evicts_least_recently_used_leaves_first():
    e = small()
    A, B, C = prompt(8, 100), prompt(8, 200), prompt(8, 300)
    t = 0.0
    for rid, p in (("a", A), ("b", B), ("c", C)):
        e.submit(rid, p, 0, t)
        t, _ = run_until_idle(e, t)
    e.submit("a2", A, 0, t)  # touches A's pages: B is now the least recently used
    t, _ = run_until_idle(e, t)
    e.drain_events()
    assert e.free_tokens == 24
    e.submit("d", prompt(40, 900), 0, t)  # needs 40 tokens: evict 4 pages
    r = e.step(t)
    removed = [h for ev in r.kv_events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    hb, hc = hashes_of(B), hashes_of(C)
    assert removed == [hb[1], hb[0], hc[1], hc[0]]  # leaf before parent, B before C
    held = {h for h, _ in e.cached_blocks()}
    assert set(hashes_of(A)) <= held


def test_pinned_pages_are_never_evicted():
    e = small(max_total_num_tokens=64)
    R = prompt(16, 100)
    e.submit("r", R, 20, 0.0)  # long runner: its 4 prompt pages stay pinned while it decodes
    e.step(0.0)
    pinned = set(hashes_of(R))
    t = 0.0
    for i in range(6):
        e.submit(f"x{i}", prompt(12, 1000 + 50 * i), 0, t)
        for _ in range(3):
            t += e.step(t).duration_s
            assert pinned <= {h for h, _ in e.cached_blocks()}
    run_until_idle(e, t)


# --------------------------------------------------------------------------- events


def test_events_released_on_the_flush_cadence():
    """After each prefill step, every decode_log_interval decode steps, and on going idle."""
    e = EngineModel(EngineConfig(page_size=4, decode_log_interval=5, max_total_num_tokens=10_000))
    e.submit("a", prompt(8), 30, 0.0)
    released: dict[int, list] = {}
    for step_no in range(1, 100):
        if step_no == 2:
            e.submit("b", prompt(8, 500), 5, 0.0)
        r = e.step(0.0)
        if r.kv_events:
            released[step_no] = r.kv_events
        if not e.has_work():
            break
    # 1: a's prefill (startup clear + 2 pages); 2: b's prefill (2 pages); b finishes at step 6
    # (a decode-only step) with one new output page, released at the 5th decode-only step (7);
    # a finishes at step 30 and the idle engine flushes its 7 output pages.
    assert sorted(released) == [1, 2, 7, 30]
    assert [type(x) for x in released[1]] == [AllBlocksCleared, BlockStored]
    assert [len(x.block_hashes) for x in released[2]] == [2]
    assert [len(x.block_hashes) for x in released[7]] == [1]
    assert [len(x.block_hashes) for x in released[30]] == [7]
    assert e.drain_events() == []


def test_snapshot_replays_to_the_cache_and_supersedes_pending():
    e = EngineModel(EngineConfig(page_size=4, decode_log_interval=1000))
    for i in range(5):
        e.submit(i, prompt(10 + 3 * i, 7 * i), 6, 0.0)
    for _ in range(4):
        e.step(0.0)
    snap = e.snapshot_events()
    assert isinstance(snap[0], AllBlocksCleared)
    m = Mirror()
    for ev in snap:
        m.apply(ev)
    assert m.view() == engine_view(e)
    assert e.drain_events() == []


def test_determinism():
    def run() -> list:
        e = EngineModel(EngineConfig(max_total_num_tokens=2000, page_size=8, chunked_prefill_size=256))
        out = []
        t = 0.0
        for i in range(30):
            e.submit(f"r{i}", prompt(40 + (i * 37) % 200, (i % 4) * 1000), (i * 13) % 60, t)
            r = e.step(t)
            t += r.duration_s
            out.append(r)
        _, rest = run_until_idle(e, t)
        return out + rest + [e.cached_blocks(), e.load_stat()]

    assert run() == run()


def test_retraction_under_kv_pressure_still_completes_everything():
    cfg = EngineConfig(max_total_num_tokens=256, page_size=4, admission_reserve_tokens=4, chunked_prefill_size=64)
    e = EngineModel(cfg)
    want = {}
    for i in range(8):
        want[i] = 60
        e.submit(i, prompt(30, 100 * i), 60, 0.0)
    _, steps = run_until_idle(e)
    got: dict[int, list[int]] = {}
    for r in steps:
        for rid, tk in r.tokens:
            got.setdefault(rid, []).append(tk)
        assert e.free_tokens >= 0
    for rid, n in want.items():
        assert got[rid] == [output_token_id(rid, i, cfg.vocab_size) for i in range(n)]
    fin = {rid: u for r in steps for rid, _, u in r.finished}
    assert all(fin[i]["completion_tokens"] == 60 for i in want)


def test_load_stat_matches_state():
    cfg = EngineConfig(max_total_num_tokens=1000, page_size=4, max_running_requests=2, admission_reserve_tokens=0)
    e = EngineModel(cfg)
    shared = prompt(40)
    e.submit("a", shared + [7, 7], 10, 0.0)
    e.step(0.0)
    e.submit("b", prompt(20, 500), 10, 0.0)
    e.submit("c", prompt(30, 900), 10, 0.0)
    e.submit("d", shared + [8, 8, 8], 10, 0.0)
    e.step(0.0)
    st = e.load_stat(dp_rank=3)
    assert (st.num_running_reqs, st.num_waiting_reqs, st.attn_dp_rank) == (2, 2, 3)
    assert (st.max_total_num_tokens, st.max_running_requests) == (1000, 2)
    # a: 42 prompt + 2 out; b: 20 prompt + 1 out
    assert st.num_tokens == 44 + 21 == cfg.max_total_num_tokens - e.free_tokens
    # c: nothing cached (30); d: shares a's 10 cached pages, 3 uncached tokens
    assert st.num_waiting_uncached_tokens == 30 + 3
    assert st.num_total_tokens == 44 + 21 + 30 + 43
    assert st.total_prefill_uncached_tokens == 42 + 20
    assert st.extended and LoadStat.from_wire(st.to_wire()) == st


# --------------------------------------------------------------------------- the replay property

ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 3), st.lists(st.integers(0, 50), max_size=10), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("cancel"), st.integers(0, 40)),
        st.tuples(st.just("flush")),
        st.tuples(st.just("snapshot")),
    ),
    max_size=60,
)
PREFIXES = [prompt(8, 1000), prompt(13, 2000), prompt(20, 1000), []]  # 0 and 2 share 8 tokens


def run_script(script: list[tuple], drain_every_step: bool) -> None:
    """Drive an engine through ``script`` checking the event mirror against the cache."""
    cfg = EngineConfig(
        max_total_num_tokens=96, page_size=4, max_running_requests=4, admission_reserve_tokens=4,
        chunked_prefill_size=16, decode_log_interval=3,
    )
    e = EngineModel(cfg)
    m = Mirror()
    n = 0
    t = 0.0

    def check(r: StepResult | None) -> None:
        if r is not None:
            for ev in r.kv_events:
                m.apply(ev)
        if drain_every_step:
            for ev in e.drain_events():
                m.apply(ev)
            assert m.view() == engine_view(e)
        elif (r is not None and r.kv_events) or not e.has_work():
            # A flush releases everything pending; an idle engine has flushed.
            if not e.has_work() and r is None:
                for ev in e.drain_events():
                    m.apply(ev)
            assert m.view() == engine_view(e)
        assert e.free_tokens >= 0
        st_ = e.load_stat()
        assert st_.num_tokens + e.free_tokens == cfg.max_total_num_tokens

    for op in script:
        if op[0] == "submit":
            p = PREFIXES[op[1]] + op[2]
            if not p:
                p = [1]
            e.submit(n, p, op[3], t)
            n += 1
        elif op[0] == "step":
            for _ in range(op[1]):
                r = e.step(t)
                t += r.duration_s
                check(r)
        elif op[0] == "cancel":
            e.cancel(op[1])
        elif op[0] == "flush":
            ok = e.flush_cache(t)
            assert ok == (not e.has_work())
        elif op[0] == "snapshot":
            m = Mirror()
            for ev in e.snapshot_events():
                m.apply(ev)
            assert m.view() == engine_view(e)
    for _ in range(10_000):
        if not e.has_work():
            break
        r = e.step(t)
        t += r.duration_s
        check(r)
    assert not e.has_work()
    r = e.step(t)  # idle: releases whatever is left
    for ev in r.kv_events:
        m.apply(ev)
    assert m.view() == engine_view(e)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.booleans())
def test_event_replay_equals_cache_at_every_step(script, drain_every_step):
    run_script(script, drain_every_step)


def test_event_replay_seeded_stress():
    """Longer scripts than hypothesis tends to draw: thousands of evictions, hundreds of retractions."""
    rng = random.Random(20240611)
    for i in range(150):
        script: list[tuple] = []
        for _ in range(60):
            k = rng.random()
            if k < 0.4:
                suffix = [rng.randrange(51) for _ in range(rng.randrange(11))]
                script.append(("submit", rng.randrange(4), suffix, rng.randrange(31)))
            elif k < 0.85:
                script.append(("step", rng.randrange(1, 5)))
            elif k < 0.95:
                script.append(("cancel", rng.randrange(40)))
            elif k < 0.98:
                script.append(("snapshot",))
            else:
                script.append(("flush",))
        run_script(script, drain_every_step=i % 2 == 0)


# --------------------------------------------------------------------------- cost


def test_decode_step_is_cheap():
    e = EngineModel()
    for i in range(64):
        e.submit(i, prompt(2000, 1 + 3000 * i), 100_000, 0.0)
    t = warm_up(e, 64)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            t += e.step(t).duration_s
        best = min(best, (time.perf_counter() - t0) / 200)
    assert best < 100e-6, best


def test_load_stat_counts_requests_of_the_step_in_flight_until_it_ends():
    # The model applies a step when it starts; its replies reach the router at the step's end.
    # Until then a request that step finishes is still running as seen from outside (SGLang
    # counts it until the batch's output is processed), or a router correcting its snapshot
    # with the replies it sees would count the request twice.
    eng = EngineModel(EngineConfig())
    eng.submit("a", list(range(1, 65)), 1, 0.0)  # one output token: done by the first step
    res = eng.step(0.0)
    assert [f[0] for f in res.finished] == ["a"] and res.duration_s > 0
    mid = res.duration_s / 2
    assert eng.load_stat(now_s=mid).num_running_reqs == 1
    assert eng.load_stat(now_s=res.duration_s).num_running_reqs == 0
    assert eng.load_stat().num_running_reqs == 0  # no time given: the model's own state


# ------------------------------------------------------------------ host tier (HiCache)


def _tiered(host_kv_tokens: int) -> EngineModel:
    return EngineModel(EngineConfig(max_total_num_tokens=1024, page_size=16, host_kv_tokens=host_kv_tokens,
                                    admission_reserve_tokens=16))


def _first_token(e: EngineModel, rid: str, p: list[int], t: float) -> tuple[float, int, list]:
    e.submit(rid, p, 1, t)
    t, results = run_until_idle(e, t)
    (ft,) = [x for r in results for x in r.first_tokens]
    return t, ft[1], [ev for r in results for ev in r.kv_events] + e.drain_events()


def test_host_tier_demotes_evicted_pages_and_loads_a_hit_instead_of_recomputing():
    a, b = prompt(800), prompt(800, start=5000)
    e = _tiered(4096)
    t, _, _ = _first_token(e, "a", a + [1], 0.0)
    t, _, evs = _first_token(e, "b", b + [1], t)  # a's pages leave the GPU for the host pool
    host = [ev for ev in evs if type(ev) is BlockStored and ev.medium == "CPU_PINNED"]
    gpu_gone = [h for ev in evs if type(ev) is BlockRemoved and ev.medium == "GPU" for h in ev.block_hashes]
    demoted = [h for ev in host for h in ev.block_hashes]
    assert demoted and set(demoted) == set(gpu_gone)  # every GPU eviction became a host store (before it)
    assert evs.index(host[0]) < min(i for i, ev in enumerate(evs) if type(ev) is BlockRemoved)
    e.submit("a2", a + [2], 1, t)
    r = e.step(t)
    cached = r.first_tokens[0][1]
    plain = _tiered(0)
    tp, _, _ = _first_token(plain, "a", a + [1], 0.0)
    tp, _, _ = _first_token(plain, "b", b + [1], tp)
    plain.submit("a2", a + [2], 1, tp)
    rp = plain.step(tp)
    assert cached == 800 and rp.first_tokens[0][1] < cached  # without the tier the evicted part is recomputed
    assert e.host_hit_tokens == 16 * len(demoted) and r.duration_s < rp.duration_s  # a PCIe load beats recompute
    evs = r.kv_events + e.drain_events()
    back = {h for ev in evs if type(ev) is BlockStored and ev.medium == "GPU" for h in ev.block_hashes}
    left_host = {h for ev in evs if type(ev) is BlockRemoved and ev.medium == "CPU_PINNED" for h in ev.block_hashes}
    assert left_host == set(demoted) and left_host <= back  # promoted: stored on the GPU, then gone from the host


def test_host_pool_is_bounded_and_drops_its_oldest():
    e = _tiered(256)  # 16 pages
    t = 0.0
    for i in range(4):
        t, _, _ = _first_token(e, f"r{i}", prompt(800, start=10_000 * (i + 1)) + [1], t)
    assert e.num_host_pages == 16  # full, never beyond


def test_host_tier_is_off_by_default_and_validated():
    assert EngineConfig().host_kv_tokens == 0 and EngineModel().num_host_pages == 0
    with pytest.raises(ConfigError, match="host_kv_tokens"):
        EngineConfig(host_kv_tokens=-1)
    with pytest.raises(ConfigError, match="host_transfer_bytes_per_s"):
        EngineConfig(host_transfer_bytes_per_s=0)
