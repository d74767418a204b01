"""Tokenizers found, not configured (issue 30, build step 1).

Engines name their tokenizer (SGLang ``tokenizer_path`` in ``/server_info`` and ``/get_model_info``, vLLM
``/v1/models`` ``root``); the adapters announce it in READY; the broker's HTTP ingress and the gateway load
it from the local Hugging Face cache when no ``--tokenizer`` names the model's. The cache is built here in
tmp_path, in the hub's own layout (``models--ORG--NAME/{refs,blobs,snapshots}``), from the tokenizer the
tests already use (Mistral's Tekken tokenizer that ``mistral-common`` ships, converted by transformers,
under Qwen2's ChatML template): nothing is downloaded. Without a tokenizer anywhere, text requests say so
once per model in the log, are counted (STATUS, /metrics, /health) and ``mesh top`` shows them.
"""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest

from mesh import protocol as P
from mesh.adapters.sglang import info_from_server_info, tokenizer_of
from mesh.adapters.vllm import tokenizer_of_models
from mesh.errors import ConfigError
from mesh.tokenization.hub import hub_cache_dir, resolve_model_dir
from tests.tokenizer_support import COMMIT, MODEL_ID, build_hub_cache

# ---------------------------------------------------------------------------- unit: cache, wire, discovery


def test_a_model_id_resolves_through_the_local_hub_cache_and_a_missing_one_names_the_fix(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    (files / "tokenizer.json").write_text("{}")
    home = build_hub_cache(tmp_path / "hf", MODEL_ID, files)
    env = {"HF_HOME": str(home)}
    assert hub_cache_dir(env) == home / "hub"
    assert hub_cache_dir({"HF_HUB_CACHE": "/x/y", "HF_HOME": "/z"}) == Path("/x/y")
    d = resolve_model_dir(MODEL_ID, env)
    assert d.name == COMMIT and (d / "tokenizer.json").read_text() == "{}"
    assert resolve_model_dir(f"{MODEL_ID}@main", env) == d == resolve_model_dir(f"{MODEL_ID}@{COMMIT}", env)
    assert resolve_model_dir(str(files), env) == files == resolve_model_dir(str(files / "tokenizer.json"), env)
    # an engine on another host reports its own cache path: the same model in this host's cache
    assert resolve_model_dir(f"/engine-host-cache/hub/models--acme--garden-chat/snapshots/{COMMIT}", env) == d
    with pytest.raises(ConfigError, match="no tokenizer.json in the local Hugging Face cache.*--tokenizer MODEL=DIR"):
        resolve_model_dir("acme/other-model", env)
    with pytest.raises(ConfigError, match="does not exist .neither a model folder"):
        resolve_model_dir("/no/such/folder", env)


def test_check_tokenizers_accepts_a_cached_model_id_and_refuses_an_absent_one(tmp_path, monkeypatch):
    from mesh.config import check_tokenizers

    files = tmp_path / "files"
    files.mkdir()
    (files / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(build_hub_cache(tmp_path / "hf", MODEL_ID, files) / "hub"))
    check_tokenizers([MODEL_ID, f"other={MODEL_ID}"], [])
    with pytest.raises(ConfigError, match="tokenizer: model 'acme/absent'"):
        check_tokenizers(["acme/absent"], [])


def test_ready_carries_the_tokenizer_and_old_readies_still_decode():
    r = P.Ready("w", "m", "mixed", {}, 16, 8, 1000, 1, 1, 200, tokenizer=MODEL_ID)
    got = P.decode_worker(P.encode_ready(r)[0:3])
    assert isinstance(got, P.Ready) and got.tokenizer == MODEL_ID
    old = P.encode_ready(P.Ready("w", "m", "mixed", {}, 16, 8, 1000, 1, 1, 200))
    assert b"tokenizer" not in old[2]  # nothing new on the wire when there is nothing to say
    assert P.decode_worker(old).tokenizer == ""
    bad = P.pack({**P.unpack(old[2]), "tokenizer": 7})
    assert isinstance(P.decode_worker([old[0], old[1], bad]), P.ProtocolError)


def test_adapters_read_the_identity_the_way_the_engines_report_it():
    from mesh.adapters.settings import AttachSettings

    s = AttachSettings(url="http://127.0.0.1:30000", brokers=("tcp://127.0.0.1:5556",))
    info = info_from_server_info({"page_size": 16, "model_path": MODEL_ID, "tokenizer_path": MODEL_ID}, s)
    assert info.tokenizer == MODEL_ID and info.model == MODEL_ID
    assert tokenizer_of({"tokenizer_path": None, "model_path": "x"}) == ""  # named none: unknown, not guessed
    models = {"object": "list", "data": [{"id": "lora-a", "root": "/adapters/a", "parent": "served"},
                                         {"id": "served", "root": MODEL_ID}]}
    assert tokenizer_of_models(models, "served") == MODEL_ID
    assert tokenizer_of_models({"data": []}, "served") == "" == tokenizer_of_models(None, "served")


def test_the_stub_announces_its_tokenizer_as_sglang_and_vllm_do(tmp_path, tokenizer_cache):
    pytest.importorskip("tokenizers")
    from mesh.lab.tokenizer_builtin import build_model_dir
    from workers_stub.sglang_server import SglangStub, StubSettings

    files = build_model_dir(tmp_path / "m", tokenizer="tekken")
    os.environ["HF_HUB_CACHE"] = str(build_hub_cache(tmp_path / "hf", MODEL_ID, files) / "hub")
    try:
        stub = SglangStub(StubSettings(model="garden", model_path=MODEL_ID))
    finally:
        del os.environ["HF_HUB_CACHE"]
    info = stub.server_info()
    assert (info["model_path"], info["tokenizer_path"], info["served_model_name"]) == (MODEL_ID, MODEL_ID, "garden")
    assert stub.tokenizer is not None
    plain = SglangStub(StubSettings()).server_info()
    assert plain["tokenizer_path"] is None  # byte-keyed: it names no tokenizer, so nothing is announced


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tokenizer_cache) -> Path:
    """HF_HOME of a hub cache holding MODEL_ID: the ChatML model folder of test_http_tokenizer_path."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from mesh.lab.tokenizer_builtin import build_model_dir
    from tests.tokenizer_support import TEMPLATE

    files = build_model_dir(tmp_path_factory.mktemp("chatml"), chat_template=TEMPLATE.read_text(),
                            extra_special_tokens=["<|im_start|>", "<|im_end|>"], tokenizer="tekken")
    return build_hub_cache(tmp_path_factory.mktemp("hf"), MODEL_ID, files)


def _use_cache(procs, home: Path) -> None:
    """The processes spawned next find their Hugging Face cache under ``home`` (offline)."""
    procs.env.update({"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": "1"})


def _engines(procs, b, home: Path) -> list[str]:
    """Two stub engines started like SGLang (``--model-path ORG/NAME``, the tokenizer from their cache),
    one attached as SGLang, one as vLLM (its events in vLLM's format): each announces MODEL_ID its own way."""
    from mesh.lab.procs import wait_for_log_event

    _use_cache(procs, home)
    fmt = [(), ("--event-format", "vllm")]
    stubs = [procs.spawn(f"stub{i}", ["stub-sglang", "--port", "0", "--time-scale", "0.001", "--model-path", MODEL_ID,
                                      "--model", "garden", *fmt[i]]) for i in range(2)]
    recs = [wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen, start=p.log_start) for p in stubs]
    procs.spawn("a0", ["attach", "sglang", "--url", recs[0]["url"], "--broker", b.backend, "--worker-id", "a0"])
    procs.spawn("a1", ["attach", "vllm", "--url", recs[1]["url"], "--broker", b.backend, "--worker-id", "a1",
                       "--kv-endpoint", recs[1]["kv_endpoint"], "--replay-endpoint", recs[1]["replay_endpoint"],
                       "--block-size", "16"])
    return [r["url"] for r in recs]


def _door(procs, home: Path, *, via_gateway: bool):
    """A broker (with HTTP unless via the gateway) and the HTTP door, none given --tokenizer; the door's
    processes see ``home`` as their Hugging Face cache. Returns (broker, door process, ready event)."""
    _use_cache(procs, home)
    if via_gateway:
        b = procs.broker("b", "--policy", "cache_aware_greedy")
        return b, procs.spawn("gw", ["gateway", "--broker", b.frontend, "--http", "127.0.0.1:0"]), "gateway_listening"
    b = procs.broker("b", "--http", "127.0.0.1:0", "--policy", "cache_aware_greedy")
    return b, b, "http_listening"


@pytest.mark.parametrize("via_gateway", [False, True], ids=["broker_http", "gateway"])
def test_follow_up_lands_on_the_holder_with_the_announced_tokenizer_and_no_flag(procs, hub, via_gateway):
    from mesh.client import Client
    from mesh.lab.procs import wait_for_log_event
    from mesh.lab.up import wait_for_workers
    from tests.conftest import run
    from tests.tokenizer_support import conversations

    b, door, ready = _door(procs, hub, via_gateway=via_gateway)
    engines = _engines(procs, b, hub)
    url = wait_for_log_event(door.log_path, ready, 30, door.popen, start=door.log_start)["url"]
    run(wait_for_workers(b.frontend, 2), 40)

    want = {"a0": MODEL_ID, "a1": MODEL_ID}  # SGLang's tokenizer_path, vLLM's root
    seen: list[dict] = []

    async def announced() -> bool:
        async with Client(b.frontend) as c:
            seen.append({w["worker_id"]: w.get("tokenizer") for w in (await c.status()).workers})
        return seen[-1] == want

    # both registered at once, each with the tokenizer it announced: on a busy machine an adapter whose
    # engine misses health checks leaves and registers again, so one STATUS after wait_for_workers may
    # lack it (seen beside two CPU burners); what is tested is what each announces, not that they never flap
    from tests.conftest import until

    try:
        run(until(announced, 30, "both engines announced", step_s=0.1), 40)
    except TimeoutError:
        raise AssertionError(f"announced tokenizers: {seen[-3:]}, wanted {want}") from None
    # the door loads it as the engines register (parsing it stalls a broker's loop once: let it pass)
    wait_for_log_event(door.log_path, "announced_tokenizer_loaded", 30, door.popen, start=door.log_start)
    run(_until_serving(url), 30)
    turns, hits = run(conversations(url, b.frontend, engines), 90)
    print(f"turns {turns} cache-hit decisions {hits}")
    assert all(holder == w for holder, w, _ in turns), turns  # every follow-up went to the engine holding turn 1
    assert all(cached > 150 for _, _, cached in turns), turns  # where the prefix was cached
    assert hits == len(turns)
    assert "--tokenizer" not in " ".join(door.popen.args)  # never named on a command line
    log = door.log_path.read_text()
    assert "announced_tokenizer_loaded" in log and "text_routed_without_tokenizer" not in log


def test_without_any_tokenizer_text_is_counted_and_warned_once_with_the_fix(procs, hub, tmp_path):
    """The engines announce MODEL_ID, but the broker's host has an empty cache: text goes out keyed by
    bytes. One warning for the model (with the fix), every such request counted: STATUS, /metrics,
    /health and the telemetry ``mesh top`` reads."""
    from mesh.client import Client
    from mesh.lab.procs import wait_for_log_event
    from mesh.lab.up import wait_for_workers
    from mesh.top import render
    from tests.conftest import run

    empty = tmp_path / "empty-hf"
    (empty / "hub").mkdir(parents=True)
    _use_cache(procs, empty)
    b = procs.broker("b", "--http", "127.0.0.1:0", "--telemetry", "tcp://127.0.0.1:*")
    telemetry = wait_for_log_event(b.log_path, "broker_listening", 5, b.popen, start=b.log_start)["telemetry"]
    _engines(procs, b, hub)
    url = wait_for_log_event(b.log_path, "http_listening", 30, b.popen, start=b.log_start)["url"]
    run(wait_for_workers(b.frontend, 2), 40)

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, Client(b.frontend) as c:
            for i in range(3):
                async with s.post(url + "/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
            for i in range(2):
                msgs = [{"role": "user", "content": f"question {i}"}]
                async with s.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
            async with s.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}) as r:
                assert r.status == 200  # token ids need no tokenizer: not counted
            async with s.get(url + "/health") as r:
                health = await r.json()
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
            return health, metrics, (await c.status()).counters

    health, metrics, counters = run(go(), 60)
    assert counters.get("text_unmatched.garden") == 5, counters
    assert 'mesh_text_unmatched_total{model="garden"} 5.0' in metrics
    tr = health["text_routing"]
    assert tr["unmatched_text_requests"] == 5
    missing = tr["models_without_tokenizer"]["garden"]
    assert missing["tokenizer"] == MODEL_ID and "--tokenizer garden=DIR" in missing["fix"], missing
    log = b.log_path.read_text()
    assert log.count("text_routed_without_tokenizer") == 1, log  # once per model, however many requests
    assert "--tokenizer garden=DIR" in log
    # mesh top: the count and the fix under the routing table, from the broker's telemetry snapshot
    snap = _snapshot(telemetry)
    assert snap["text_unmatched"] == {"garden": 5}, snap
    from rich.console import Console

    con = Console(width=200, record=True)
    con.print(render({"b": snap}, {}, []))
    shown = con.export_text()
    assert "garden" in shown and "5 text requests" in shown and "--tokenizer" in shown, shown


def _snapshot(endpoint: str, timeout_s: float = 10.0) -> dict:
    """The next ``mesh.snapshot`` a broker's telemetry stream publishes (what ``mesh top`` reads)."""
    import zmq

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"mesh.snapshot")
    sub.connect(endpoint)
    try:
        assert sub.poll(int(timeout_s * 1000)), "no telemetry snapshot"
        return P.unpack(sub.recv_multipart()[1])
    finally:
        sub.close()


async def _until_serving(url: str) -> None:
    """Until the door answers a token-id request (a broker sheds while its loop-lag average is high)."""
    from tests.conftest import until

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async def ok() -> bool:
            async with s.post(url + "/generate", json={"input_ids": [9, 9, 9], "sampling_params": {"max_new_tokens": 1}}) as r:
                return r.status == 200

        await until(ok, 25, "the door serving", step_s=0.2)


# ---------------------------------------------------------------------------- prefix cache

_TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
_PREFIX_MODELS = {  # template, control tokens added, base tokenizer (SentencePiece v3 or byte-level Tekken)
    "chatml": ("qwen2_chatml.jinja", ["<|im_start|>", "<|im_end|>"], "tekken"),
    "mistral_v3": ("mistral_v3.jinja", [], "mistral_v3"),
    "llama3": ("llama3.jinja", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "tekken"),
}


@pytest.fixture(scope="module")
def prefix_models(tmp_path_factory, tokenizer_cache):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    import json

    from mesh.lab.tokenizer_builtin import build_model_dir
    from mesh.tokenization import ModelTokenizer

    out = {}
    for name, (tpl, extra, kind) in _PREFIX_MODELS.items():
        d = build_model_dir(tmp_path_factory.mktemp(name), chat_template=(_TEMPLATES / tpl).read_text(),
                            extra_special_tokens=extra, tokenizer=kind)
        if name == "llama3":
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            cfg["bos_token"] = "<|begin_of_text|>"
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        out[name] = ModelTokenizer.from_dir(d)
    return out


def _conversation(seed: int, turns: int, system: bool):
    """Chat turns with what trips tokenizers: accents, CJK, emoji, spaces and newlines at the edges, and
    control-token text typed by the user."""
    import random

    rng = random.Random(seed)
    words = ["garden", "rake", "café", "naïve", "東京", "🌱", " ", "\n", "  two", "[INST]", "<|im_end|>", "</s>", "x"]
    msgs = [{"role": "system", "content": "You sell garden tools. " * 20}] if system else []
    for _ in range(turns):
        msgs.append({"role": "user", "content": "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randrange(1, 60)))})
        yield list(msgs)
        msgs.append({"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(rng.randrange(1, 80)))})


@pytest.mark.parametrize("name", list(_PREFIX_MODELS))
def test_cached_prefixes_give_exactly_the_full_encode(prefix_models, name):
    from mesh.tokenization import ModelTokenizer

    tok = prefix_models[name]
    plain = ModelTokenizer(tok.files, prefix_cache_bytes=0)
    assert tok.prefix is not None and tok.prefix.available and plain.prefix is None
    for seed in range(3):
        for msgs in _conversation(seed, 12, system=name != "mistral_v3"):
            text, ids = tok.render_chat(msgs)
            assert (text, ids) == plain.render_chat(msgs), (name, seed, len(msgs))
            assert ids == tok.files.tokenizer.encode(text, add_special_tokens=False).ids  # the canonical encode
    c = tok.prefix.cache
    assert c.hits >= 3 * 10 and c.tokens_reused > 0, (c.hits, c.misses)
    assert c.unaligned == 0  # user text typing control tokens included: every boundary placed
    # a conversation costs about one record (the previous turn's keys move to the longer one)
    assert c.bytes < 3 * 4 * max(len(plain.render_chat(m)[1]) for m in _conversation(0, 12, True)) + 64 * 1024


def test_the_prefix_cache_stays_within_its_budget(prefix_models):
    from mesh.tokenization import ModelTokenizer

    tok = ModelTokenizer(prefix_models["chatml"].files, prefix_cache_bytes=40_000)
    plain = ModelTokenizer(tok.files, prefix_cache_bytes=0)
    for seed in range(12):  # twelve conversations at once, interleaved: more than the budget holds
        for msgs in _conversation(100 + seed, 6, system=True):
            assert tok.render_chat(msgs)[1] == plain.render_chat(msgs)[1]
            assert tok.prefix.cache.bytes <= 40_000
    assert tok.prefix.cache.hits > 0


def test_the_prefix_encoder_reads_each_encodings_ids_once(prefix_models):
    """``Encoding.ids`` builds a new Python list on every read: read once per token while looking for the
    boundaries to store, a 1k-token prompt cost a million list items (O(n^2), ~3 ms)."""
    from collections import Counter

    from mesh.tokenization import ModelTokenizer
    from mesh.tokenization.prefix_cache import PrefixEncoder

    tok = prefix_models["chatml"]
    reads: Counter = Counter()

    class Enc:
        def __init__(self, e):
            self._e = e

        @property
        def ids(self):
            reads["ids"] += 1
            return self._e.ids

        @property
        def offsets(self):
            reads["offsets"] += 1
            return self._e.offsets

        def __getattr__(self, name):
            return getattr(self._e, name)

    class Tok:
        def __init__(self, t):
            self._t = t

        def encode_batch(self, texts, **kw):
            reads["encodes"] += 1
            return [Enc(e) for e in self._t.encode_batch(texts, **kw)]

        def encode_batch_fast(self, texts, **kw):
            reads["encodes"] += 1
            return [Enc(e) for e in self._t.encode_batch_fast(texts, **kw)]

        def __getattr__(self, name):
            return getattr(self._t, name)

    enc = PrefixEncoder(Tok(tok.files.tokenizer))
    plain = ModelTokenizer(tok.files, prefix_cache_bytes=0)
    reads.clear()
    long_text = "garden rake café 東京 " * 150
    msgs = [{"role": "system", "content": long_text}, {"role": "user", "content": long_text}]
    for turn in range(3):
        text = tok.render(msgs)
        assert enc.encode(text) == plain.render_chat(msgs)[1]
        msgs += [{"role": "assistant", "content": long_text[turn:]}, {"role": "user", "content": long_text[: -turn - 1]}]
    assert enc.cache.hits == 2 and reads["encodes"] == 3, reads
    assert reads["ids"] <= reads["encodes"] and reads["offsets"] == 0, reads
    assert enc.cache.unaligned == 0


def test_a_boundary_swallowed_by_a_longer_added_token_stores_nothing_and_ids_stay_exact(prefix_models):
    """Boundaries are placed by counting boundary tokens (the fast encode has no offsets): a longer added
    token that swallows a boundary match breaks the count, so that encode stores nothing (counted
    ``unaligned``) instead of keys that might point at the wrong ids."""
    from tokenizers import AddedToken, Tokenizer

    from mesh.tokenization.prefix_cache import PrefixEncoder

    base = prefix_models["chatml"].files.tokenizer
    t = Tokenizer.from_str(base.to_str())
    t.add_special_tokens([AddedToken("x<|im_end|>", special=True, normalized=False)])
    enc = PrefixEncoder(t, written_by=lambda tok: tok in ("<|im_start|>", "<|im_end|>"))
    assert set(enc.boundary) == {"<|im_start|>", "<|im_end|>"}
    first = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nrake x<|im_end|> please<|im_end|>\n<|im_start|>assistant\n"
    for text in (first, first + "Sure.<|im_end|>\n<|im_start|>user\nand a hoe<|im_end|>\n<|im_start|>assistant\n", first):
        assert enc.encode(text) == t.encode(text, add_special_tokens=False).ids
    assert enc.cache.unaligned >= 2 and enc.cache.misses + enc.cache.hits == 3


def test_the_prefix_cache_counters_are_exported_per_tokenizer(prefix_models):
    """``mesh_tokenizer_prefix_cache_*`` (the gateway's /metrics): hits, misses, tokens reused and bytes of
    each loaded tokenizer's cache; one without a cache (no chat template, or none configured) is left out."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.exposition import generate_latest

    from brokers.ingress.tokenizers import PrefixCacheCollector, Tokenizers
    from mesh.tokenization import ModelTokenizer

    cached = ModelTokenizer(prefix_models["chatml"].files)  # a fresh cache
    plain = ModelTokenizer(cached.files, prefix_cache_bytes=0)
    pools = {"/cached": cached, "/plain": plain}
    t = Tokenizers(_Fleet({}), {"a": "/cached", "b": "/plain"},
                   loader=lambda path, tpl: (pools[path], SimpleNamespace(close=lambda: None)))
    msgs = [{"role": "system", "content": "You sell garden tools."}, {"role": "user", "content": "A rake?"}]
    cached.render_chat(msgs)
    n = len(cached.render_chat(msgs + [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Price?"}])[1])
    reg = CollectorRegistry()
    reg.register(PrefixCacheCollector(t))
    fams = {f.name: {s.labels["tokenizer"]: s.value for s in f.samples} for f in
            text_string_to_metric_families(generate_latest(reg).decode())}
    label = str(cached.files.path)
    assert fams["mesh_tokenizer_prefix_cache_hits"] == {label: 1.0}
    assert fams["mesh_tokenizer_prefix_cache_misses"] == {label: 1.0}
    assert 0 < fams["mesh_tokenizer_prefix_cache_tokens_reused"][label] < n
    assert fams["mesh_tokenizer_prefix_cache_bytes"][label] == cached.prefix.cache.bytes > 0


# ---------------------------------------------------------------------------- the ingress' choice


class _Fleet:
    """An IngressBackend stand-in: the catalog and announcements the ingress reads, its counters."""

    def __init__(self, announced: dict[str, str]) -> None:
        from mesh.broker_core.counters import BrokerStats

        self.stats = BrokerStats()
        self.announced = announced

    def model_catalog(self):
        return {m: 1 for m in self.announced}, {"alias": "garden"}, "mesh"

    def announced_tokenizers(self):
        return dict(self.announced)


def test_the_ingress_prefers_flags_loads_announced_tokenizers_once_and_retries_failures():
    import asyncio
    from types import SimpleNamespace

    from brokers.ingress.tokenizers import Tokenizers

    loads: list[str] = []
    now = [0.0]

    def loader(ident, template):
        loads.append(ident)
        if ident.startswith("absent/"):
            raise ConfigError(f"tokenizer: model {ident!r} has no tokenizer.json in the local Hugging Face cache")
        return (SimpleNamespace(name=f"tok:{ident}", files=SimpleNamespace(path=Path(ident))), SimpleNamespace(close=lambda: None))

    async def go():
        fleet = _Fleet({"garden": MODEL_ID, "other": "absent/model"})
        t = Tokenizers(fleet, {"pinned": "/flag/dir"}, clock=lambda: now[0], loader=loader, retry_s=60.0)
        assert loads == ["/flag/dir"]  # flag-named: loaded at start
        a, b, c = await asyncio.gather(t.for_model("garden"), t.for_model("alias"), t.for_model("garden"))
        assert a[0].name == b[0].name == c[0].name == f"tok:{MODEL_ID}" and loads.count(MODEL_ID) == 1  # once, shared
        assert await t.for_model("other") is None and await t.for_model("other") is None
        assert loads.count("absent/model") == 1  # a failure is not retried at once...
        now[0] += 61.0
        assert await t.for_model("other") is None and loads.count("absent/model") == 2  # ...but after retry_s
        for _ in range(3):
            t.note_text("other")
        assert fleet.stats.text_unmatched == {"other": 3}
        missing = t.health()["models_without_tokenizer"]
        assert missing["other"]["unmatched"] == 3 and "--tokenizer other=DIR" in missing["other"]["fix"], missing
        assert "no tokenizer.json" in missing["other"]["reason"] and "garden" not in missing
        fleet.announced["sim"] = ""
        t.note_text("sim")  # byte-keyed workers announce nothing: never counted
        assert "sim" not in fleet.stats.text_unmatched
        t2 = Tokenizers(fleet, {None: "/every/model"}, clock=lambda: now[0], loader=loader)
        assert (await t2.for_model("garden"))[0].name == "tok:/every/model"  # a flag for every model wins
        t2.prefetch()
        assert loads.count(MODEL_ID) == 1  # and nothing announced is loaded for it

    asyncio.run(go())
