"""An SGLang-compatible simulated server: SGLang's HTTP API and ZMQ telemetry, no GPU.

``mesh stub-sglang --port P`` runs one "server" with ``--dp-size`` DP ranks, each an
:class:`~mesh.engine_model.EngineModel` stepped in real time (the same timing and KV-cache model
as the native simulated worker). It speaks the subset of SGLang 0.5.23 a router or adapter uses
(``worker-telemetry.md`` §9-§11):

* ``POST /generate``: ``text`` or ``input_ids`` (single or batch), ``sampling_params`` (unknown keys
  -> 400, as SGLang), ``stream`` (SSE, cumulative ``text``/``output_ids`` chunks unless
  ``--incremental-streaming-output``, then ``data: [DONE]``), ``rid``, ``routed_dp_rank``, PD
  ``bootstrap_*`` fields (accepted and recorded);
* ``POST /v1/completions`` and ``/v1/chat/completions`` (OpenAI chunk deltas, usage chunk with
  ``stream_options.include_usage``; vLLM's ``return_token_ids`` extension), ``GET /v1/models``;
* tool calls (Hermes ``<tool_call>``), ``<think>`` reasoning, ``n`` > 1 on chat, and ``POST
  /v1/embeddings``, ``/v1/responses``, ``/v1/rerank``, ``/v1/score``: :mod:`workers_stub.openai_extras`;
* ``/health`` (``/health_generate``), ``/ready``, ``/ping``; ``--fail-health`` makes the health
  endpoints answer 503;
* ``/server_info`` (``/get_server_info``) with the ``kv_events`` discovery block, ``/model_info``; both
  name the tokenizer as SGLang does (``tokenizer_path``: ``--tokenizer``, else ``--model-path``, a folder or
  a model id in the local Hugging Face cache; null when the stub keys text by bytes), and so does
  ``/v1/models``' ``root`` as vLLM's does;
* ``/v1/loads`` (JSON and ``format=prometheus``), ``/get_load`` (only with
  ``--http-load-api get_load``, emulating 0.5.12-0.5.20), ``/metrics`` with ``sglang:`` names;
* ``/flush_cache`` (refused with 400 while requests run; publishes ``AllBlocksCleared``).
* LoRA (``--enable-lora``, ``--lora-paths NAME[=PATH]``): ``/v1/models`` lists each adapter with
  ``parent`` = the base model (both engines' shape); ``POST /load_lora_adapter`` /
  ``/unload_lora_adapter`` (SGLang, JSON answer) and ``/v1/load_lora_adapter`` /
  ``/v1/unload_lora_adapter`` (vLLM, text answer); a request names its adapter by ``lora_path``,
  by ``model`` = the adapter (vLLM) or ``BASE:ADAPTER`` (SGLang); an adapter not loaded is a 400
  (``lora_path``) or 404 (unknown model), or is loaded on first use with ``--lora-dynamic``;
  ``/debug/stats`` ``lora_requests`` counts the requests each adapter served.

ZMQ, per rank r (ports ``base + r``): the KV event PUB and replay ROUTER
(:mod:`workers_stub.sglang_wire`), and the LoadStat PUB (on change, at least every second). Port 0
(the default) picks a free consecutive range; the resolved ports are in the readiness line
``sglang_stub_listening`` and in ``/server_info``.

Debug endpoints (stub only): ``POST /debug/health {"ok": bool}``, ``POST /debug/drop_publishes
{"rank", "count"}`` (next N batches skip the live PUB but stay replayable), ``POST
/debug/publish_malformed {"rank", "kind": bad_msgpack|bad_events|bad_envelope}``, ``GET
/debug/requests`` (last request bodies), ``GET /debug/stats`` (per rank: event sequence, cached
pages, requests served and their cached tokens: which DP rank a request landed on),
``POST /debug/pd_fault {"fault"}``.

Prefill/decode disaggregation (``--disaggregation-mode prefill|decode``): SGLang's bootstrap
contract on ``/generate`` and vLLM's ``kv_transfer_params`` on ``/v1/completions``, with faults to
inject (:mod:`workers_stub.pd_wire`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
import json
import math
import os
import random
import signal
import time
import uuid
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from mesh import kv_events as KV
from mesh import openai_logprobs as OL
from mesh import openai_passthrough as OP
from mesh.engine_model import EngineConfig, EngineModel
from mesh.hashing import text_to_tokens
from mesh.logs import announce, configure, get_logger
from mesh.namespaces import request_event_fields
from mesh.protocol import pack
from workers_stub.openai_extras import HttpError, OpenAIExtras
from workers_stub.pd_wire import PD_FAULTS, PD_MODES, PdRefused, PdWire
from workers_stub.sglang_wire import (
    EVENT_FORMATS,
    SGLANG_LOAD_PUB,
    SGLANG_PUB,
    SGLANG_REPLAY_ROUTER,
    KvPublisher,
    LoadPublisher,
    bind_port_range,
)

__all__ = ["StubSettings", "SglangStub", "serve_stub", "SAMPLING_KEYS"]

VERSION = "0.5.23"

#: ``sampling_params`` keys SGLang accepts; anything else is answered with HTTP 400.
from mesh.params import SAMPLING_KEYS  # noqa: E402 - the one vocabulary (re-exported)
_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do", "eiusmod",
          "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "enim", "ad", "minim", "veniam",
          "quis", "nostrud", "exercitation", "ullamco", "laboris", "nisi", "aliquip", "ex", "ea")


# Constrained output (``json_schema``) is spelled in its own token ids, far above any vocabulary
# the engine model draws from: multi-character JSON pieces from PIECE_BASE, then one id per ASCII
# character from CHAR_BASE (``json.dumps`` output is ASCII), so ``detokenize`` gives the JSON back.
PIECE_BASE = 1 << 24
_PIECES = ('{"', '"}', '": ', '": "', '", "', ', "', '", ', '"]', '["', 'true', 'false', 'null', '[]', '{}',
           *_WORDS, *(" " + w for w in _WORDS))
CHAR_BASE = PIECE_BASE + 4096
_PIECE_IDS = {piece: PIECE_BASE + i for i, piece in enumerate(_PIECES)}
_MAX_PIECE = max(len(x) for x in _PIECES)
EOS_TOKEN_ID = 2  # what a constrained answer "matched" when it ends (SGLang: {"type": "stop", "matched": id})


def _token_text(t: int) -> str:
    if t >= CHAR_BASE:
        if t < CHAR_BASE + 128:
            return chr(t - CHAR_BASE)
    elif t >= PIECE_BASE and t - PIECE_BASE < len(_PIECES):
        return _PIECES[t - PIECE_BASE]
    return " " + _WORDS[t % len(_WORDS)]


def request_stops(body: dict | None) -> tuple:
    """The stop strings and stop token ids of a request: SGLang's ``sampling_params`` (one dict)
    or the OpenAI body's own ``stop`` / ``stop_token_ids``."""
    if not isinstance(body, dict):
        return ()
    sp = body.get("sampling_params")
    src = sp if isinstance(sp, dict) else body
    stop = src.get("stop")
    strings = [stop] if isinstance(stop, str) else [x for x in stop if isinstance(x, str) and x] if isinstance(stop, list) else []
    ids = [t for t in src.get("stop_token_ids") or () if type(t) is int] if isinstance(src.get("stop_token_ids"), list) else []
    return (*strings, *ids)


def stop_hit(done: list[int], new: list[int], stops: tuple) -> tuple[int, str | int] | None:
    """(how many of ``new`` to keep, what matched) when one of ``new`` ends the output: a stop
    token id, or the token whose text completes a stop string (it and what follows are dropped)."""
    text = detokenize(done)
    for i, tok in enumerate(new):
        if tok in stops:
            return i, tok
        text += detokenize([tok])
        for s in stops:
            if type(s) is str and s in text[-(len(s) + 64):]:
                return i, s
    return None


def detokenize(tokens: list[int]) -> str:
    """The stub's stand-in detokenizer: one word per token (deterministic); the ids of constrained
    (JSON) output are their JSON pieces."""
    return "".join(_token_text(t) for t in tokens)


def tokenize_constrained(text: str) -> list[int]:
    """ASCII text (JSON) -> the stub's constrained-output ids: longest piece first, else one id per
    character (``detokenize`` inverts it)."""
    out: list[int] = []
    i, n = 0, len(text)
    while i < n:
        for size in range(min(_MAX_PIECE, n - i), 1, -1):
            tid = _PIECE_IDS.get(text[i:i + size])
            if tid is not None:
                out.append(tid)
                i += size
                break
        else:
            c = ord(text[i])
            if c >= 128:
                raise ValueError("constrained output must be ASCII")
            out.append(CHAR_BASE + c)
            i += 1
    return out


class _SchemaTooLarge(ValueError):
    pass


def json_for_schema(schema: Any, seed: int) -> Any:
    """A deterministic value conforming to a JSON schema: the stub's "enforcing engine". Knows
    type (also a list of types), properties/required, items/minItems/maxItems, enum, const,
    minimum/maximum (and exclusive ones), minLength/maxLength, anyOf/oneOf (the first),
    allOf (merged), $ref to #/$defs or #/definitions, and a few string formats. Raises ValueError
    for what it cannot satisfy (the server answers 400, as SGLang does for a bad grammar)."""
    rnd = random.Random(seed)
    root = schema if isinstance(schema, dict) else {}
    defs = {**(root.get("definitions") or {}), **(root.get("$defs") or {})}
    budget = [4000]

    def word() -> str:
        return _WORDS[rnd.randrange(len(_WORDS))]

    def gen(s: Any, depth: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0 or depth > 32:
            raise _SchemaTooLarge("json_schema: the schema is too large or too deeply nested for the stub")
        if s is True or s == {}:
            return word() if depth else {word(): word()}
        if not isinstance(s, dict):
            raise ValueError("json_schema: a schema must be an object or true")
        if "$ref" in s:
            ref = s["$ref"]
            target = defs.get(ref.rsplit("/", 1)[-1]) if isinstance(ref, str) else None
            if ref == "#":
                target = root
            if target is None:
                raise ValueError(f"json_schema: cannot resolve $ref {ref!r}")
            return gen(target, depth + 1)
        if "const" in s:
            return s["const"]
        if isinstance(s.get("enum"), list) and s["enum"]:
            return s["enum"][rnd.randrange(len(s["enum"]))]
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key]:
                return gen(s[key][0], depth + 1)
        if isinstance(s.get("allOf"), list) and s["allOf"]:
            merged = {k: v for k, v in s.items() if k != "allOf"}
            for sub in s["allOf"]:
                if isinstance(sub, dict):
                    merged = {**merged, **sub, "properties": {**(merged.get("properties") or {}), **(sub.get("properties") or {})},
                              "required": [*(merged.get("required") or []), *(sub.get("required") or [])]}
            return gen(merged, depth + 1)
        t = s.get("type")
        if isinstance(t, list):
            t = next((x for x in t if x != "null"), "null")
        if t is None:
            t = "object" if "properties" in s else "array" if "items" in s else "string"
        if t == "object":
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            out = {name: gen(sub, depth + 1) for name, sub in props.items()}
            for name in s.get("required") or []:
                if isinstance(name, str) and name not in out:
                    out[name] = word()
            if not out and depth == 0 and s.get("additionalProperties") is not False:
                out = {word(): word(), "n": rnd.randrange(100)}  # json_object mode: some object
            return out
        if t == "array":
            lo = s.get("minItems") if type(s.get("minItems")) is int else 0
            hi = s.get("maxItems") if type(s.get("maxItems")) is int else max(lo, 3)
            n = max(lo, min(hi, 2))
            items = s.get("items", True)
            if isinstance(s.get("prefixItems"), list):
                return [gen(x, depth + 1) for x in s["prefixItems"]]
            return [gen(items, depth + 1) for _ in range(n)]
        if t == "string":
            fmt = s.get("format")
            if fmt in _FORMATS:
                return _FORMATS[fmt]
            lo = s.get("minLength") if type(s.get("minLength")) is int else 1
            hi = s.get("maxLength") if type(s.get("maxLength")) is int else 1 << 16
            text = word()
            while len(text) < lo:
                text += " " + word()
            return text[:hi]
        if t in ("integer", "number"):
            step = 1 if t == "integer" else 0.5
            ex_lo, ex_hi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
            lo = ex_lo + step if type(ex_lo) in (int, float) else s.get("minimum")
            hi = ex_hi - step if type(ex_hi) in (int, float) else s.get("maximum")
            lo = lo if type(lo) in (int, float) else (hi - 100 if type(hi) in (int, float) else 0)
            hi = hi if type(hi) in (int, float) else lo + 100
            if t == "integer":
                lo_i, hi_i = math.ceil(lo), math.floor(hi)
                return rnd.randint(lo_i, hi_i) if lo_i <= hi_i else lo_i
            v = round(lo + (hi - lo) * rnd.random(), 2)
            return v if lo <= v <= hi else lo
        if t == "boolean":
            return rnd.random() < 0.5
        if t == "null":
            return None
        raise ValueError(f"json_schema: unsupported type {t!r}")

    return gen(schema, 0)


_FORMATS = {"date-time": "2024-01-02T03:04:05Z", "date": "2024-01-02", "time": "03:04:05", "email": "lorem@example.com",
            "uri": "https://example.com/lorem", "uuid": "123e4567-e89b-12d3-a456-426614174000", "ipv4": "192.0.2.1"}


def constrained_tokens(json_schema: Any, seed: int) -> list[int]:
    """SGLang's ``json_schema`` sampling parameter (a JSON string) -> the ids of a conforming
    answer; ValueError for a schema that is not JSON or that the generator cannot satisfy."""
    try:
        schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
    except ValueError:
        raise ValueError("json_schema: not valid JSON") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json_schema: must be a JSON object")
    return tokenize_constrained(json.dumps(json_for_schema(schema, seed)))


def token_logprob(tid: int, pos: int) -> float:
    """The chosen token's (deterministic) logprob: it is always the most likely (greedy)."""
    return -round(0.3 + ((tid * 2654435761 + pos * 97) % 1000) / 2000, 6)


def top_logprobs(tid: int, pos: int, n: int, vocab: int) -> list[tuple[float, int]]:
    """The ``n`` most likely tokens at a position, best first: the chosen token, then alternatives
    with distinct texts whose probabilities leave room (they sum to < 1)."""
    lp = token_logprob(tid, pos)
    base = tid % vocab
    out = [(lp, tid)]
    for k in range(1, n):
        out.append((round(lp - 2.0 - (k - 1) - ((tid + k) % 7) / 100, 6), (base + k) % vocab))
    return out[:n]


@dataclass
class StubSettings:
    """``mesh stub-sglang`` settings. Ports: 0 = any free (consecutive) range, None = off."""

    host: str = "127.0.0.1"
    port: int = 30000
    kv_port: int | None = 0
    replay_port: int | None = 0
    load_port: int | None = 0
    dp_size: int = 1
    event_format: str = "map"
    topic: str = ""
    replay_frames: int = 4
    buffer_steps: int = 10_000
    time_scale: float = 1.0
    model: str = "stub-sglang-8b"
    fail_health: bool = False
    incremental_streaming_output: bool = False
    http_load_api: str = "v1_loads"  # v1_loads | get_load (0.5.12-0.5.20) | metrics (metrics only)
    load_tick_s: float = 0.05
    engine: EngineConfig = field(default_factory=EngineConfig)
    log_level: str = "info"
    tokenizer: str = ""  # a model folder or id (SGLang --tokenizer-path): text is tokenised as the real engine would
    model_path: str = ""  # SGLang --model-path: a model id or folder; its tokenizer unless --tokenizer names one
    # LoRA (SGLang --enable-lora / --lora-paths NAME[=PATH]): listed in /v1/models with a parent, changed
    # by /load_lora_adapter; an unknown adapter is refused, or loaded on first use with lora_dynamic.
    # Without enable_lora any lora_path is served untracked (only its cache namespace matters).
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    lora_dynamic: bool = False
    disaggregation_mode: str = "null"  # null | prefill | decode (P/D legs: workers_stub.pd_wire)
    pd_fault: str = ""  # "" | prefill_error | bootstrap_hang | decode_error
    pd_waiting_timeout_s: float = 300.0  # a decode leg waits this long for its KV (SGLang's waiting timeout)

    def validate(self) -> None:
        if self.disaggregation_mode not in PD_MODES:
            raise ValueError(f"disaggregation_mode must be one of {PD_MODES}")
        if self.pd_fault and self.pd_fault not in PD_FAULTS:
            raise ValueError(f"pd_fault must be one of {PD_FAULTS}")
        if not 0 < self.pd_waiting_timeout_s <= 3600:
            raise ValueError("pd_waiting_timeout_s must be in (0, 3600]")
        if not 1 <= self.dp_size <= 64:
            raise ValueError("dp_size must be in [1, 64]")
        if self.event_format not in EVENT_FORMATS:
            raise ValueError(f"event_format must be one of {EVENT_FORMATS}")
        if self.replay_frames not in (3, 4):
            raise ValueError("replay_frames must be 3 or 4")
        if self.http_load_api not in ("v1_loads", "get_load", "metrics"):
            raise ValueError("http_load_api must be v1_loads, get_load or metrics")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError("time_scale must be a positive number")
        if self.buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        for spec in self.lora_paths:
            if not spec.partition("=")[0]:
                raise ValueError(f"lora_paths: {spec!r} is not NAME[=PATH]")


def _err_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "code": status, "retryable": status >= 500}}


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response(_err_body(status, message), status=status)


class _Job:
    __slots__ = ("key", "rid", "rank", "prompt_len", "max_new", "queue", "cached", "tokens", "finished", "t0", "forced", "lp",
                 "prompt", "stops")

    def __init__(self, key: int, rid: str, rank: int, prompt_len: int, max_new: int) -> None:
        self.key = key
        self.rid = rid
        self.rank = rank
        self.prompt_len = prompt_len
        self.max_new = max_new
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cached = 0
        self.tokens: list[int] = []
        self.finished: tuple[str, dict] | None = None
        self.t0 = time.monotonic()
        self.forced: list[int] | None = None  # constrained (json_schema) output: the answer's ids
        self.lp: tuple[int, bool, int] | None = None  # return_logprob: (top_logprobs_num, text in logprobs, logprob_start_len)
        self.prompt: list[int] | None = None  # kept for input logprobs only
        self.stops: tuple = ()  # stop strings and stop token ids (sampling params ``stop``, ``stop_token_ids``)


class _Rank:
    """One DP rank: its engine, its event and load publishers, its jobs."""

    def __init__(self, rank: int, s: StubSettings, kv: KvPublisher | None, load: LoadPublisher | None) -> None:
        self.rank = rank
        self.s = s
        self.engine = EngineModel(s.engine)
        self.kv = kv
        self.load = load
        self.jobs: dict[int, _Job] = {}
        self.work = asyncio.Event()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.requests_total = 0
        self.aborted_total = 0
        self.gen_throughput = 0.0
        self._tp_mark = (time.monotonic(), 0)

    def now(self) -> float:
        return time.monotonic() / self.s.time_scale

    def publish(self, events: list[KV.KvEvent]) -> None:
        if events and self.kv is not None:
            self.kv.publish(events)

    def submit(self, job: _Job, prompt: list[int], body: dict | None = None, lora: str | None = None,
               transferred: bool = False) -> None:
        _, xkey, salt = request_event_fields(body)  # lora (resolved) / extra_key / cache_salt: the cache namespace
        self.engine.submit(job.key, prompt, job.max_new, self.now(), lora_name=lora, extra_key=xkey,
                           cache_salt=salt, transferred=transferred)  # ValueError -> 400
        self.jobs[job.key] = job
        self.requests_total += 1
        self.prompt_tokens_total += len(prompt)
        self.work.set()

    def cancel(self, job: _Job) -> None:
        if self.jobs.pop(job.key, None) is not None:
            self.engine.cancel(job.key)
            self.aborted_total += 1

    def stop_early(self, job: _Job) -> None:
        """A constrained answer is complete (EOS): the request ends, not counted as aborted."""
        if self.jobs.pop(job.key, None) is not None:
            self.engine.cancel(job.key)
            self.cached_tokens_total += job.cached

    async def run(self) -> None:
        eng = self.engine
        while True:
            if not eng.has_work():
                self.publish(eng.drain_events())  # idle flush (e.g. a /flush_cache clear)
                self.work.clear()
                await self.work.wait()
                continue
            res = eng.step(self.now())
            await asyncio.sleep(res.duration_s * self.s.time_scale)
            jobs = self.jobs
            for key, cached, _plen in res.first_tokens:
                job = jobs.get(key)
                if job is not None:
                    job.cached = cached
            for key, tok in res.tokens:
                job = jobs.get(key)
                if job is not None:
                    job.queue.put_nowait(tok)
            self.generation_tokens_total += len(res.tokens)
            for key, reason, usage in res.finished:
                job = jobs.pop(key, None)
                if job is not None:
                    self.cached_tokens_total += usage.get("cached_tokens", 0)
                    job.queue.put_nowait((reason, usage))
            self.publish(res.kv_events)

    def load_snapshot(self) -> dict[str, Any]:
        ls = self.engine.load_stat(self.rank, now_s=self.now())
        now = time.monotonic()
        t0, n0 = self._tp_mark
        if now - t0 >= 1.0:
            self.gen_throughput = (self.generation_tokens_total - n0) / (now - t0)
            self._tp_mark = (now, self.generation_tokens_total)
        cap = ls.max_total_num_tokens
        hit = self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
        return {
            "timestamp": time.time(),
            "dp_rank": self.rank,
            "num_running_reqs": ls.num_running_reqs,
            "num_waiting_reqs": ls.num_waiting_reqs,
            "num_waiting_uncached_tokens": ls.num_waiting_uncached_tokens,
            "num_used_tokens": ls.num_tokens,
            "num_total_tokens": ls.num_total_tokens,
            "num_active_tokens": ls.num_total_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": cap,
            "max_running_requests": ls.max_running_requests,
            "token_usage": round(ls.num_tokens / cap, 6) if cap else 0.0,
            "gen_throughput": round(self.gen_throughput, 3),
            "cache_hit_rate": round(hit, 6),
            "utilization": round(min(1.0, ls.num_running_reqs / max(1, ls.max_running_requests)), 6),
            "total_prefill_uncached_tokens": ls.total_prefill_uncached_tokens,
            "total_prefill_busy_us": ls.total_prefill_busy_us,
            "decode_moments": [],
        }


class SglangStub:
    """The simulated server. ``await start()`` binds everything; ``await stop()`` releases it."""

    def __init__(self, s: StubSettings, *, ctx: zmq.asyncio.Context | None = None) -> None:
        s.validate()
        self.s = s
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.log = get_logger(service="sglang_stub")
        self.ranks: list[_Rank] = []
        self.healthy = not s.fail_health
        self.kv_base: int | None = None
        self.replay_base: int | None = None
        self.load_base: int | None = None
        self.http_port: int | None = None
        self.startup_time = time.time()
        self._keys = itertools.count(1)
        self.tokenizer = None
        # SGLang's tokenizer_path (announced in /server_info, /get_model_info and /v1/models' root): None
        # when the stub keys text by bytes, which no tokenizer reproduces
        self.tokenizer_path = s.tokenizer or s.model_path or None
        if self.tokenizer_path:  # as SGLang: the engine tokenises text itself, so its KV events hold real ids
            from mesh.tokenization import ModelTokenizer, resolve_model_dir

            self.tokenizer = ModelTokenizer.from_dir(resolve_model_dir(self.tokenizer_path))
        self._rr = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None
        # W3C traceparent headers of the last requests (SGLang continues them with --enable-trace):
        # what a test reads to see the trace reach the engine
        self.traceparents: deque[str] = deque(maxlen=256)
        self.recent_requests: deque[dict] = deque(maxlen=32)
        # LoRA adapters loaded (name -> path) and requests served per adapter (what a test reads)
        self.loras: dict[str, str] = {n: p or f"/adapters/{n}" for n, _, p in (x.partition("=") for x in s.lora_paths)}
        self.lora_served: Counter[str] = Counter()
        self.pd = PdWire(s.disaggregation_mode, s.pd_fault or None, s.pd_waiting_timeout_s, self._advertised_host(),
                         lambda: self.http_port)
        self.extras = OpenAIExtras(self)  # tool calls, reasoning, n > 1, Responses, embeddings, rerank, score

    # ------------------------------------------------------------------ lifecycle

    def _advertised_host(self) -> str:
        return "127.0.0.1" if self._zmq_host() == "*" else self.s.host

    def _zmq_host(self) -> str:
        h = self.s.host
        return "*" if h in ("0.0.0.0", "*", "::", "") else h

    async def start(self) -> dict[str, Any]:
        s = self.s
        host = self._zmq_host()
        n = s.dp_size
        used: set[int] = set()
        kv_socks: list = [None] * n
        replay_socks: list = [None] * n
        load_socks: list = [None] * n
        if s.kv_port is not None:
            kv_socks, self.kv_base = bind_port_range(self.ctx, SGLANG_PUB, host, s.kv_port, n)
            used.update(self.kv_base + r for r in range(n))
            if s.replay_port is not None:
                replay_socks, self.replay_base = bind_port_range(self.ctx, SGLANG_REPLAY_ROUTER, host, s.replay_port, n, used)
                used.update(self.replay_base + r for r in range(n))
        if s.load_port is not None:
            load_socks, self.load_base = bind_port_range(self.ctx, SGLANG_LOAD_PUB, host, s.load_port, n, used)
        for r in range(n):
            kv = None
            if kv_socks[r] is not None:
                kv = KvPublisher(r, kv_socks[r], replay_socks[r], topic=s.topic, form=s.event_format,
                                 replay_frames=s.replay_frames, buffer_steps=s.buffer_steps)
            load = LoadPublisher(r, load_socks[r]) if load_socks[r] is not None else None
            self.ranks.append(_Rank(r, s, kv, load))
        for rk in self.ranks:
            rk.publish(rk.engine.drain_events())  # the startup cache reset: AllBlocksCleared at seq 0
            self._tasks.append(asyncio.create_task(rk.run(), name=f"engine-{rk.rank}"))
            if rk.kv is not None and rk.kv.replay is not None:
                self._tasks.append(asyncio.create_task(rk.kv.serve_replay(), name=f"replay-{rk.rank}"))
        self._tasks.append(asyncio.create_task(self._load_loop(), name="load"))

        app = web.Application(client_max_size=64 * 1024 * 1024)
        self._routes(app)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port, reuse_address=True)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.http_port = sock.getsockname()[1]
        return self.describe()

    def describe(self) -> dict[str, Any]:
        s = self.s
        adv = self._advertised_host()
        out: dict[str, Any] = {
            "url": f"http://{adv}:{self.http_port}",
            "port": self.http_port,
            "dp_size": s.dp_size,
            "event_format": s.event_format,
            "topic": s.topic,
            "page_size": s.engine.page_size,
            "kv_endpoint": f"tcp://{adv}:{self.kv_base}" if self.kv_base is not None else None,
            "kv_port_base": self.kv_base,
            "replay_endpoint": f"tcp://{adv}:{self.replay_base}" if self.replay_base is not None else None,
            "replay_port_base": self.replay_base,
            "load_endpoint": f"tcp://{adv}:{self.load_base}" if self.load_base is not None else None,
            "load_port_base": self.load_base,
        }
        return out

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.pd.close()
        for rk in self.ranks:
            if rk.kv is not None:
                rk.kv.close()
            if rk.load is not None:
                rk.load.close()

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.load_tick_s)
            now = time.monotonic()
            for rk in self.ranks:
                if rk.load is not None:
                    rk.load.maybe_publish(rk.engine.load_stat(rk.rank, now_s=rk.now()), now)

    # ------------------------------------------------------------------ routes

    def _routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/generate", self.h_generate)
        r.add_put("/generate", self.h_generate)
        r.add_post("/v1/completions", self.h_completions)
        r.add_post("/v1/chat/completions", self.h_chat)
        r.add_get("/v1/models", self.h_models)
        self.extras.install(app)
        for path in ("/load_lora_adapter", "/v1/load_lora_adapter"):
            r.add_post(path, self.h_load_lora)
        for path in ("/unload_lora_adapter", "/v1/unload_lora_adapter"):
            r.add_post(path, self.h_unload_lora)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.h_health)
        r.add_get("/ready", self.h_health)
        r.add_get("/ping", lambda req: web.Response(text=""))
        r.add_get("/server_info", self.h_server_info)
        r.add_get("/get_server_info", self.h_server_info)
        r.add_get("/model_info", self.h_model_info)
        r.add_get("/get_model_info", self.h_model_info)
        if self.s.http_load_api == "v1_loads":
            r.add_get("/v1/loads", self.h_loads)
        if self.s.http_load_api == "get_load":
            r.add_get("/v1/loads", self.h_loads)
            r.add_get("/get_load", self.h_get_load)
        r.add_get("/metrics", self.h_metrics)
        r.add_get("/flush_cache", self.h_flush)
        r.add_post("/flush_cache", self.h_flush)
        r.add_post("/debug/health", self.h_debug_health)
        r.add_post("/debug/drop_publishes", self.h_debug_drop)
        r.add_post("/debug/publish_malformed", self.h_debug_malformed)
        r.add_get("/debug/requests", lambda req: web.json_response(list(self.recent_requests)))
        r.add_get("/debug/stats", self.h_debug_stats)
        r.add_get("/stub_pd/kv", self.h_pd_pull)
        r.add_post("/debug/pd_fault", self.h_debug_pd_fault)

    # ------------------------------------------------------------------ generation core

    def _pick_rank(self, hint: Any) -> _Rank:
        if hint is not None:
            if type(hint) is not int or not 0 <= hint < len(self.ranks):
                raise HttpError(400, f"routed_dp_rank {hint!r} out of range [0, {len(self.ranks)})")
            return self.ranks[hint]
        # SGLang's DP controller: round robin by default (shortest queue on ties is close enough).
        loads = [(rk.engine.num_running + rk.engine.num_waiting, i) for i, rk in enumerate(self.ranks)]
        least = min(x[0] for x in loads)
        cands = [self.ranks[i] for n, i in loads if n == least]
        return cands[next(self._rr) % len(cands)]

    def _lora(self, body: dict | None) -> str | None:
        """The adapter a request runs under, as the engines read it: the OpenAI ``model`` (an
        adapter's own name, vLLM; ``base:adapter``, SGLang), else SGLang's ``lora_path``. An
        adapter not loaded is refused as the engines refuse it, or loaded with ``lora_dynamic``."""
        if not body:
            return None
        model, lp = body.get("model"), body.get("lora_path")
        adapter, by_model = None, False
        if type(model) is str and model != self.s.model and self.s.enable_lora:
            by_model = True
            if model.startswith(f"{self.s.model}:"):
                adapter = model[len(self.s.model) + 1:].strip() or None
            else:
                adapter = model  # vLLM: any other name is an adapter's (or does not exist)
        if adapter is None and type(lp) is str and lp:
            adapter = lp
        if adapter is None or not self.s.enable_lora:
            return adapter
        if adapter not in self.loras:
            if not self.s.lora_dynamic:
                if by_model and model == adapter:  # vLLM's answer to an unknown model name
                    raise HttpError(404, f"The model `{adapter}` does not exist.")
                raise HttpError(400, f"Got LoRA adapter that has never been loaded: {adapter}")
            self.loras[adapter] = f"/adapters/{adapter}"
            self.log.info("stub_lora_loaded", lora_name=adapter, on_demand=True)
        self.lora_served[adapter] += 1
        return adapter

    def _start_job(self, prompt: list[int], max_new: int, rid: str | None, rank_hint: Any, body: dict | None = None,
                   transferred: bool = False) -> _Job:
        if not prompt:
            raise HttpError(400, "The input_ids / prompt is empty")
        if type(max_new) is not int or max_new < 0:
            raise HttpError(400, f"max_new_tokens must be a non-negative integer, got {max_new!r}")
        lora = self._lora(body)
        rk = self._pick_rank(rank_hint)
        job = _Job(next(self._keys), rid or uuid.uuid4().hex, rk.rank, len(prompt), max_new)
        job.stops = request_stops(body)
        try:
            rk.submit(job, prompt, body, lora, transferred)
        except ValueError as exc:
            raise HttpError(400, str(exc)) from None
        return job

    async def _next(self, job: _Job) -> tuple[list[int], tuple[str, dict] | None]:
        """New tokens since the last call (at least one item) and the finish, if reached."""
        toks: list[int] = []
        fin = None
        item = await job.queue.get()
        while True:
            if type(item) is tuple:
                fin = item
                break
            toks.append(item)
            try:
                item = job.queue.get_nowait()
            except asyncio.QueueEmpty:
                break
        if job.forced is not None:  # the engine model times the tokens; the constrained answer spells them
            base = len(job.tokens)
            toks = [job.forced[base + i] for i in range(min(len(toks), len(job.forced) - base))]
            if base + len(toks) == len(job.forced) and (fin is None or fin[0] == "length"):
                self.ranks[job.rank].stop_early(job)  # the JSON is complete: the engine stops at EOS
                fin = ("stop", {"cached_tokens": job.cached})
        elif job.stops and (fin is None or fin[0] == "length"):
            hit = stop_hit(job.tokens, toks, job.stops)
            if hit is not None:  # the output ends before what matched, as SGLang trims it
                toks = toks[:hit[0]]
                self.ranks[job.rank].stop_early(job)
                fin = ("stop", {"cached_tokens": job.cached, "matched": hit[1]})
        job.tokens.extend(toks)
        if fin is not None:
            job.finished = fin
        return toks, fin

    @staticmethod
    def _constraint(json_schema: Any, lp: tuple[int, bool, int] | None, prompt: list[int]) -> tuple:
        """What shapes a request's answer, checked before it starts: the constrained ids for a
        ``json_schema`` (an enforcing engine: the answer is JSON conforming to it, ending with
        ``stop`` when complete, ``length`` when cut short; deterministic per schema and prompt) and
        the logprobs asked for (:meth:`_logprob_req`)."""
        forced = None
        if json_schema is not None:
            seed = zlib.crc32(repr((json_schema, prompt[:256], len(prompt))).encode())
            try:
                forced = constrained_tokens(json_schema, seed)
            except ValueError as exc:
                raise HttpError(400, str(exc)) from None
        return forced, lp, prompt

    @staticmethod
    def _apply(job: _Job, c: tuple) -> None:
        job.forced, job.lp, prompt = c
        if job.lp is not None and job.lp[2] >= 0:
            job.prompt = list(prompt)

    @staticmethod
    def _logprob_req(body: dict) -> tuple[int, bool, int] | None:
        """SGLang's request-level logprob fields -> (top_logprobs_num, return_text_in_logprobs,
        logprob_start_len), or None without ``return_logprob``."""
        if not body.get("return_logprob"):
            return None
        top = body.get("top_logprobs_num") or 0
        start = body.get("logprob_start_len")
        start = -1 if start is None else start
        if type(top) is not int or not 0 <= top <= 64:
            raise HttpError(400, "top_logprobs_num must be an integer in [0, 64]")
        if type(start) is not int or start < -1:
            raise HttpError(400, "logprob_start_len must be an integer >= -1")
        return top, bool(body.get("return_text_in_logprobs")), start

    @staticmethod
    def _openai_logprob_req(body: dict, chat: bool) -> tuple[int, bool, int] | None:
        v = body.get("logprobs")
        if chat:
            if v is not True:
                return None
            top = body.get("top_logprobs") or 0
            if type(top) is not int or not 0 <= top <= 20:
                raise HttpError(400, "top_logprobs must be an integer in [0, 20]")
            return top, True, -1
        if v is None:
            return None
        if type(v) is not int or not 0 <= v <= 5:
            raise HttpError(400, "logprobs must be an integer in [0, 5]")
        return v, True, -1

    @staticmethod
    def _openai_schema(body: dict) -> Any:
        rf = body.get("response_format")
        if not isinstance(rf, dict):
            return body.get("json_schema")
        if rf.get("type") == "json_object":
            return '{"type": "object"}'
        if rf.get("type") == "json_schema":
            js = rf.get("json_schema")
            return (js.get("schema") if isinstance(js, dict) else None) or {"type": "object"}
        return None

    def _logprob_meta(self, job: _Job, start: int, inputs: bool) -> dict[str, Any]:
        """SGLang's meta_info logprob lists for output tokens ``start:`` (and the prompt's from
        ``logprob_start_len`` when ``inputs``): ``[logprob, token_id, text or null]`` triples."""
        if job.lp is None:
            return {}
        top_n, with_text, start_len = job.lp
        vocab = self.s.engine.vocab_size

        def triple(lp: float | None, t: int) -> list:
            return [lp, t, _token_text(t) if with_text else None]

        toks = job.tokens[start:]
        out: dict[str, Any] = {"output_token_logprobs": [triple(token_logprob(t, start + i), t) for i, t in enumerate(toks)]}
        if top_n:
            out["output_top_logprobs"] = [[triple(lp, a) for lp, a in top_logprobs(t, start + i, top_n, vocab)]
                                          for i, t in enumerate(toks)]
        if inputs and job.prompt is not None:
            prompt = job.prompt
            ps = range(min(start_len, len(prompt)), len(prompt))
            # position 0 has no logprob (nothing precedes it), as in SGLang
            out["input_token_logprobs"] = [triple(None if i == 0 else token_logprob(prompt[i], -1 - i), prompt[i]) for i in ps]
            if top_n:
                out["input_top_logprobs"] = [None if i == 0 else [triple(lp, a) for lp, a in top_logprobs(prompt[i], -1 - i, top_n, vocab)]
                                             for i in ps]
        return out

    def _encode(self, text: str) -> list[int]:
        """A text prompt's token ids: the model's tokenizer when given (``--tokenizer``), else the
        stand-in byte tokenizer."""
        if self.tokenizer is None:
            return text_to_tokens(text)
        try:
            return self.tokenizer.encode(text)
        except (ValueError, TypeError) as exc:
            raise HttpError(400, f"text could not be tokenised: {exc}") from None

    def _abandon(self, job: _Job) -> None:
        if job.finished is None:
            self.ranks[job.rank].cancel(job)

    def _meta(self, job: _Job, fin: tuple[str, dict] | None) -> dict[str, Any]:
        finish = None
        if fin is not None:
            finish = ({"type": "length", "length": job.max_new} if fin[0] == "length" else
                      {"type": "stop", "matched": fin[1].get("matched", EOS_TOKEN_ID)} if fin[0] == "stop" else {"type": fin[0]})
        return {
            "id": job.rid,
            "finish_reason": finish,
            "prompt_tokens": job.prompt_len,
            "completion_tokens": len(job.tokens),
            "cached_tokens": job.cached,
            "reasoning_tokens": 0,
            "weight_version": "default",
            "num_retractions": 0,
            "e2e_latency": round(time.monotonic() - job.t0, 6),
            "dp_rank": job.rank,
            "cached_tokens_details": None,
        }

    # ------------------------------------------------------------------ /generate

    def _record(self, path: str, body: Any) -> None:
        self.recent_requests.append({"path": path, "body": body})

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except Exception:
            raise HttpError(400, "request body is not valid JSON") from None
        if type(body) is not dict:
            raise HttpError(400, "request body must be a JSON object")
        self._record(request.path, body)
        return body

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise HttpError(400, "Either text or input_ids should be provided (exactly one).")
        if text is not None:
            if type(text) is str:
                return [self._encode(text)], False
            if type(text) is list and text and all(type(t) is str for t in text):
                return [self._encode(t) for t in text], True
            raise HttpError(400, "text must be a string or a list of strings")
        if type(ids) is list and ids and all(type(t) is int for t in ids):
            return [ids], False
        if type(ids) is list and ids and all(type(x) is list for x in ids):
            return list(ids), True
        raise HttpError(400, "input_ids must be a list of ints or a list of lists of ints")

    @staticmethod
    def _sampling(sp: Any) -> dict:
        if sp is None:
            return {}
        if type(sp) is not dict:
            raise HttpError(400, "sampling_params must be an object")
        for k in sp:
            if k not in SAMPLING_KEYS:
                raise HttpError(400, f"unknown field '{k}' in sampling_params")
        return sp

    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        tp = request.headers.get("traceparent")
        if tp is not None:
            self.traceparents.append(tp[:64])
        try:
            body = await self._body(request)
            prompts, batch = self._prompts(body)
            sps = body.get("sampling_params")
            sp_list = sps if type(sps) is list else [sps] * len(prompts)
            if len(sp_list) != len(prompts):
                raise HttpError(400, "sampling_params list length differs from the batch size")
            sp_list = [self._sampling(x) for x in sp_list]
            stream = bool(body.get("stream", False))
            rank_hint = body.get("routed_dp_rank", body.get("data_parallel_rank"))
            lp = self._logprob_req(body)
            cons = [self._constraint(sp.get("json_schema"), lp, p) for sp, p in zip(sp_list, prompts)]
            rids = body.get("rid")
            if batch:
                if stream:
                    raise HttpError(400, "the stub does not stream batch requests")
                rid_list = rids if type(rids) is list else [None] * len(prompts)
                jobs = [self._start_job(p, sp.get("max_new_tokens", 128), r, rank_hint, body)
                        for p, sp, r in zip(prompts, sp_list, rid_list)]
                for job, c in zip(jobs, cons):
                    self._apply(job, c)
                outs = []
                for job in jobs:
                    outs.append(await self._collect_generate(job, body))
                return web.json_response(outs)
            leg = self.pd.leg(body, openai=False)
            if leg is not None:
                self.pd.check_fault(leg)
                if leg == "decode":
                    await self.pd.pull_sglang(body)  # the prompt's KV, from the prefill server
                else:  # the prefill server makes one token and answers once the KV was pulled
                    sp_list[0] = {**sp_list[0], "max_new_tokens": 1}
                    stream = False
            job = self._start_job(prompts[0], sp_list[0].get("max_new_tokens", 128), rids if type(rids) is str else None, rank_hint,
                                  body, transferred=leg == "decode")
            self._apply(job, cons[0])
        except HttpError as exc:
            return _json_error(exc.status, exc.message)
        except PdRefused as exc:
            return _json_error(500, str(exc))
        if leg == "prefill":
            return await self._prefill_generate(job, body)
        if not stream:
            try:
                return web.json_response(await self._collect_generate(job, body))
            finally:
                self._abandon(job)
        return await self._stream_generate(request, job, body, prompts[0])

    async def _prefill_generate(self, job: _Job, body: dict) -> web.Response:
        """SGLang's prefill leg: the answer comes once a decode server pulled the room's KV."""
        try:
            out = await self._collect_generate(job, body)
        finally:
            self._abandon(job)
        try:
            await self.pd.offer_and_wait(body["bootstrap_room"], job.prompt_len)
        except PdRefused as exc:
            return _json_error(500, str(exc))
        return web.json_response(out)

    async def h_pd_pull(self, request: web.Request) -> web.Response:
        """A decode server pulls a handoff (the modelled KV transfer; :mod:`workers_stub.pd_wire`)."""
        try:
            wait_s = min(10.0, max(0.0, float(request.query.get("wait_s", "0"))))
        except ValueError:
            wait_s = 0.0
        got = await self.pd.serve_pull(request.query.get("key", ""), wait_s)
        return web.json_response(got) if got is not None else web.Response(status=404, text="no such KV handoff")

    async def h_debug_pd_fault(self, request: web.Request) -> web.Response:
        fault = (await self._debug_body(request)).get("fault")
        if fault is not None and fault not in PD_FAULTS:
            return _json_error(400, f"fault must be null or one of {PD_FAULTS}")
        self.pd.fault = fault
        return web.json_response({"fault": fault})

    def _gen_obj(self, job: _Job, fin, text: str, ids: list[int], body: dict, prompt: list[int] | None = None, *,
                 lp_from: int = 0, lp_inputs: bool = True) -> dict:
        meta = self._meta(job, fin)
        if job.lp is not None:
            meta.update(self._logprob_meta(job, lp_from, lp_inputs))
        out = {"text": text, "output_ids": ids, "meta_info": meta}
        if body.get("return_prompt_token_ids") and prompt is not None:
            out["prompt_token_ids"] = prompt
        return out

    async def _collect_generate(self, job: _Job, body: dict) -> dict:
        while job.finished is None:
            await self._next(job)
        return self._gen_obj(job, job.finished, detokenize(job.tokens), list(job.tokens), body)

    async def _sse_start(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    async def _stream_generate(self, request: web.Request, job: _Job, body: dict, prompt: list[int]) -> web.StreamResponse:
        incremental = self.s.incremental_streaming_output
        resp = await self._sse_start(request)
        first = True
        try:
            while True:
                toks, fin = await self._next(job)
                if not toks and fin is None:
                    continue
                if incremental:  # logprob lists are incremental too (the input ones in the first event only)
                    obj = self._gen_obj(job, fin, detokenize(toks), toks, body, lp_from=len(job.tokens) - len(toks), lp_inputs=first)
                    first = False
                else:  # cumulative, logprob lists included, as SGLang
                    obj = self._gen_obj(job, fin, detokenize(job.tokens), list(job.tokens), body, prompt)
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                if fin is not None:
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            self._abandon(job)  # client gone (ConnectionResetError / cancellation): abort the request
        return resp

    # ------------------------------------------------------------------ OpenAI

    @staticmethod
    def _usage(job: _Job) -> dict:
        return {"prompt_tokens": job.prompt_len, "completion_tokens": len(job.tokens),
                "total_tokens": job.prompt_len + len(job.tokens), "prompt_tokens_details": {"cached_tokens": job.cached}}

    @staticmethod
    def _max_tokens(body: dict, default: int) -> int:
        v = body.get("max_completion_tokens", body.get("max_tokens", default))
        if v is None:
            return default
        if type(v) is not int or v < 0:
            raise HttpError(400, f"max_tokens must be a non-negative integer, got {v!r}")
        return v

    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        tp = request.headers.get("traceparent")
        if tp is not None:
            self.traceparents.append(tp[:64])
        try:
            body = await self._body(request)
            p = body.get("prompt")
            if type(p) is list and len(p) == 1 and type(p[0]) in (str, list):
                p = p[0]
            if type(p) is str and p:
                prompt = self._encode(p)
            elif type(p) is list and p and all(type(t) is int for t in p):
                prompt = p
            else:
                raise HttpError(400, "prompt must be a non-empty string or list of token ids (n=1)")
            if body.get("n", 1) != 1:
                raise HttpError(400, "the stub supports n=1 only")
            cons = self._constraint(self._openai_schema(body), self._openai_logprob_req(body, False), prompt)
            leg = self.pd.leg(body, openai=True)  # vLLM's kv_transfer_params
            if leg is not None:
                self.pd.check_fault(leg)
                if leg == "decode":
                    await self.pd.pull_vllm(body["kv_transfer_params"])
            job = self._start_job(prompt, self._max_tokens(body, 16), None, body.get("routed_dp_rank", body.get("data_parallel_rank")),
                                  body, transferred=leg == "decode")
            self._apply(job, cons)
        except HttpError as exc:
            return _json_error(exc.status, exc.message)
        except PdRefused as exc:
            return _json_error(500, str(exc))
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = body.get("model") or self.s.model
        want_ids = bool(body.get("return_token_ids"))
        if not body.get("stream"):
            try:
                while job.finished is None:
                    await self._next(job)
            finally:
                self._abandon(job)
            choice = {"index": 0, "text": detokenize(job.tokens), "logprobs": OL.completion_logprobs(self._logprob_meta(job, 0, False)),
                      "finish_reason": job.finished[0], "matched_stop": None}
            if want_ids:
                choice["token_ids"] = list(job.tokens)
                choice["prompt_token_ids"] = prompt
            out = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
                   "usage": self._usage(job)}
            if leg == "prefill":  # vLLM: where the decode engine finds the KV
                out["kv_transfer_params"] = await self.pd.offer_vllm(job.prompt_len, -(-job.prompt_len // self.s.engine.page_size))
            return web.json_response(out)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = await self._sse_start(request)
        offset = OL.TextOffset()
        try:
            while True:
                toks, fin = await self._next(job)
                lps = OL.completion_logprobs(self._logprob_meta(job, len(job.tokens) - len(toks), False), offset=offset)
                choice = {"index": 0, "text": detokenize(toks), "logprobs": lps,
                          "finish_reason": fin[0] if fin else None, "matched_stop": None}
                if want_ids:
                    choice["token_ids"] = toks
                chunk = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice], "usage": None}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if fin is not None:
                    break
            if include_usage:
                chunk = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": self._usage(job)}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            self._abandon(job)
        return resp

    def _chat_prompt(self, body: dict) -> list[int]:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            if type(ids) is list and ids and all(type(t) is int for t in ids):
                return ids
            raise HttpError(400, "input_ids must be a list of ints")
        msgs = body.get("messages")
        if type(msgs) is not list or not msgs:
            raise HttpError(400, "messages must be a non-empty list")
        # what mesh passes through (tools, reasoning options, n > 1) is rendered with its tools, as the
        # engine renders it: the prefix an agent's next turn finds in the cache
        through = OP.passthrough_reason(body, chat=True) is not None
        if self.tokenizer is not None and self.tokenizer.files.chat_template is not None:
            try:
                if through:
                    tools = OP.template_tools(body)
                    kw = {**OP.template_kwargs(body), **({"tools": tools} if tools else {})}
                    return self.tokenizer.render_chat(OP.template_messages(msgs), True, kw or None)[1]
                return self.tokenizer.render_chat(msgs)[1]
            except (ValueError, TypeError) as exc:
                raise HttpError(400, f"messages: {exc}") from None
        if through:
            try:
                return text_to_tokens(OP.render_chat_text(OP.template_messages(msgs), OP.template_tools(body)))
            except ValueError as exc:
                raise HttpError(400, str(exc)) from None
        parts = []
        for m in msgs:
            if type(m) is not dict or type(m.get("role")) is not str:
                raise HttpError(400, "each message needs a role")
            c = m.get("content")
            if type(c) is list:
                c = "".join(p.get("text", "") for p in c if type(p) is dict)
            parts.append(f"<|{m['role']}|>\n{c or ''}\n")
        parts.append("<|assistant|>\n")
        return text_to_tokens("".join(parts))

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        tp = request.headers.get("traceparent")
        if tp is not None:
            self.traceparents.append(tp[:64])
        try:
            body = await self._body(request)
            if self.extras.handles_chat(body):
                return await self.extras.chat(request, body)
            prompt = self._chat_prompt(body)
            cons = self._constraint(self._openai_schema(body), self._openai_logprob_req(body, True), prompt)
            job = self._start_job(prompt, self._max_tokens(body, 128), body.get("rid") if type(body.get("rid")) is str else None,
                                  body.get("routed_dp_rank", body.get("data_parallel_rank")), body)
            self._apply(job, cons)
        except HttpError as exc:
            return _json_error(exc.status, exc.message)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = body.get("model") or self.s.model
        if not body.get("stream"):
            try:
                while job.finished is None:
                    await self._next(job)
            finally:
                self._abandon(job)
            msg = {"role": "assistant", "content": detokenize(job.tokens), "reasoning_content": None, "tool_calls": None}
            return web.json_response({"id": cid, "object": "chat.completion", "created": created, "model": model,
                                      "choices": [{"index": 0, "message": msg, "logprobs": OL.chat_logprobs(self._logprob_meta(job, 0, False)),
                                                   "finish_reason": job.finished[0],
                                                   "matched_stop": None}], "usage": self._usage(job)})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = await self._sse_start(request)

        def chunk(delta: dict, finish: str | None, lps: dict | None = None) -> bytes:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish, "matched_stop": None}], "usage": None}
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        try:
            await resp.write(chunk({"role": "assistant", "content": ""}, None))
            while True:
                toks, fin = await self._next(job)
                if toks:
                    lps = OL.chat_logprobs(self._logprob_meta(job, len(job.tokens) - len(toks), False))
                    await resp.write(chunk({"content": detokenize(toks)}, None, lps))
                if fin is not None:
                    await resp.write(chunk({}, fin[0]))
                    break
            if include_usage:
                obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": self._usage(job)}
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            self._abandon(job)
        return resp

    # ------------------------------------------------------------------ for workers_stub.openai_extras

    def chat_prompt(self, body: dict) -> list[int]:
        return self._chat_prompt(body)

    def max_tokens(self, body: dict, default: int) -> int:
        return self._max_tokens(body, default)

    def start_job(self, prompt: list[int], max_new: int, body: dict) -> _Job:
        rid = body.get("rid")
        return self._start_job(prompt, max_new, rid if type(rid) is str else None,
                               body.get("routed_dp_rank", body.get("data_parallel_rank")), body)

    async def next_tokens(self, job: _Job) -> tuple[list[int], tuple[str, dict] | None]:
        return await self._next(job)

    async def collect(self, job: _Job) -> str:
        """The job's whole output text, once it finished."""
        while job.finished is None:
            await self._next(job)
        return detokenize(job.tokens)

    def abandon(self, job: _Job) -> None:
        self._abandon(job)

    def record(self, path: str, body: Any) -> None:
        self._record(path, body)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    async def sse_start(self, request: web.Request) -> web.StreamResponse:
        return await self._sse_start(request)

    @staticmethod
    def forced_ids(text: str) -> list[int]:
        """The ids that spell ``text`` (ASCII) as output (:func:`tokenize_constrained`)."""
        return tokenize_constrained(text)

    @staticmethod
    def text_of(tokens: list[int]) -> str:
        return detokenize(tokens)

    async def h_models(self, request: web.Request) -> web.Response:
        """The base model, then each loaded LoRA adapter with ``parent`` = the base and ``root`` =
        its path (SGLang ``available_models`` with --enable-lora; vLLM's list has the same shape)."""
        m = self.s.model
        data = [{"id": m, "object": "model", "created": int(self.startup_time), "owned_by": "sglang", "root": self.tokenizer_path,
                 "max_model_len": self.s.engine.max_total_num_tokens}]
        data += [{"id": n, "object": "model", "created": int(self.startup_time), "owned_by": "sglang", "root": path, "parent": m,
                  "max_model_len": None} for n, path in self.loras.items()]
        return web.json_response({"object": "list", "data": data})

    async def h_load_lora(self, request: web.Request) -> web.Response:
        """SGLang ``POST /load_lora_adapter`` / vLLM ``POST /v1/load_lora_adapter``: ``lora_name``, ``lora_path``."""
        try:
            body = await self._body(request)
        except HttpError as exc:
            return _json_error(exc.status, exc.message)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not self.s.enable_lora:
            return _json_error(400, "LoRA is not enabled. Please set `--enable-lora` to True.")
        if type(name) is not str or not name or type(path) is not str or not path:
            return _json_error(400, "lora_name and lora_path are required")
        if name in self.loras:
            return _json_error(400, f"The lora adapter '{name}' has already been loaded.")
        self.loras[name] = path
        self.log.info("stub_lora_loaded", lora_name=name, on_demand=False)
        return self._lora_answer(request, f"Success: LoRA adapter '{name}' added successfully.")

    async def h_unload_lora(self, request: web.Request) -> web.Response:
        """SGLang ``POST /unload_lora_adapter`` / vLLM ``POST /v1/unload_lora_adapter``: ``lora_name``."""
        try:
            body = await self._body(request)
        except HttpError as exc:
            return _json_error(exc.status, exc.message)
        name = body.get("lora_name")
        if self.loras.pop(name if type(name) is str else "", None) is None:
            return _json_error(404 if request.path.startswith("/v1/") else 400, f"The lora adapter '{name}' cannot be found.")
        self.log.info("stub_lora_unloaded", lora_name=name)
        return self._lora_answer(request, f"Success: LoRA adapter '{name}' removed successfully.")

    def _lora_answer(self, request: web.Request, text: str) -> web.Response:
        if request.path.startswith("/v1/"):  # vLLM answers plain text
            return web.Response(text=text)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.loras)})

    # ------------------------------------------------------------------ health, info, load

    async def h_health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.Response(status=503, text="unhealthy (stub)")
        return web.Response(status=200, text="")

    def _kv_events_block(self) -> dict[str, Any] | None:
        s = self.s
        if self.kv_base is None:
            return None
        host = self._zmq_host()
        block: dict[str, Any] = {"publisher": "zmq", "endpoint_host": host, "endpoint_port_base": self.kv_base,
                                 "topic": s.topic, "block_size": s.engine.page_size, "dp_size": s.dp_size}
        if self.load_base is not None:
            block["load_endpoint_port_base"] = self.load_base
            block["load_topic"] = "load"
        if self.replay_base is not None:
            block["replay_endpoint_port_base"] = self.replay_base
        return block

    def server_info(self) -> dict[str, Any]:
        s = self.s
        cfg = s.engine
        host = self._zmq_host()
        kv_cfg = None
        if self.kv_base is not None:
            kv_cfg = {"publisher": "zmq", "endpoint": f"tcp://{host}:{self.kv_base}", "topic": s.topic, "buffer_steps": s.buffer_steps}
            if self.replay_base is not None:
                kv_cfg["replay_endpoint"] = f"tcp://{host}:{self.replay_base}"
        return {
            "model_path": s.model_path or s.model,
            "served_model_name": s.model,
            "tokenizer_path": self.tokenizer_path,
            "host": s.host,
            "port": self.http_port,
            "page_size": cfg.page_size,
            "dp_size": s.dp_size,
            "tp_size": 1,
            "pp_size": 1,
            "enable_dp_attention": False,
            "kv_events_config": json.dumps(kv_cfg) if kv_cfg else None,
            "load_publish_endpoint": f"tcp://{host}:{self.load_base}" if self.load_base is not None else "off",
            "enable_metrics": True,
            "incremental_streaming_output": s.incremental_streaming_output,
            "stream_interval": 1,
            "max_running_requests": cfg.max_running_requests,
            "chunked_prefill_size": cfg.chunked_prefill_size,
            "max_total_num_tokens": cfg.max_total_num_tokens,
            "max_req_input_len": cfg.max_total_num_tokens - cfg.admission_reserve_tokens,
            "startup_time": self.startup_time,
            "launch_command": "mesh stub-sglang",
            "disaggregation_mode": s.disaggregation_mode,
            "disaggregation_bootstrap_port": self.http_port,  # the stub's bootstrap (KV pull) is on its HTTP port
            "kv_events": self._kv_events_block(),
            "internal_states": [{"dp_rank": rk.rank, "max_total_num_tokens": cfg.max_total_num_tokens,
                                 "max_running_requests": cfg.max_running_requests,
                                 "last_gen_throughput": rk.gen_throughput} for rk in self.ranks],
            "version": VERSION,
            "frontend": "python",
            "stub": "mesh",
        }

    async def h_server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.server_info())

    async def h_model_info(self, request: web.Request) -> web.Response:
        m = self.s.model
        return web.json_response({"model_path": self.s.model_path or m, "served_model_name": m,
                                  "tokenizer_path": self.tokenizer_path, "is_generation": True,
                                  "weight_version": "default", "disaggregation_mode": self.s.disaggregation_mode,
                                  "architectures": ["StubForCausalLM"]})

    async def h_loads(self, request: web.Request) -> web.Response:
        q = request.query
        loads = [rk.load_snapshot() for rk in self.ranks]
        if "dp_rank" in q:
            try:
                want = int(q["dp_rank"])
            except ValueError:
                return _json_error(400, "dp_rank must be an int")
            loads = [x for x in loads if x["dp_rank"] == want]
        if q.get("format") == "prometheus":
            lines = []
            for x in loads:
                for k, v in x.items():
                    if k in ("dp_rank", "timestamp") or not isinstance(v, (int, float)):
                        continue
                    lines.append(f'sglang_{k}{{dp_rank="{x["dp_rank"]}"}} {float(v)}')
            return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
        return web.json_response({"timestamp": time.time(), "version": VERSION, "accelerator": "stub",
                                  "num_accelerators": self.s.dp_size, "loads": loads})

    async def h_get_load(self, request: web.Request) -> web.Response:
        out = []
        for rk in self.ranks:
            x = rk.load_snapshot()
            out.append({"dp_rank": rk.rank, "num_reqs": x["num_running_reqs"] + x["num_waiting_reqs"],
                        "num_waiting_reqs": x["num_waiting_reqs"], "num_tokens": x["num_total_tokens"],
                        "num_pending_tokens": max(0, x["num_total_tokens"] - x["num_used_tokens"]), "ts_tic": time.time()})
        return web.json_response(out)

    async def h_metrics(self, request: web.Request) -> web.Response:
        s = self.s
        multi = s.dp_size > 1
        fams: dict[str, tuple[str, str, list[tuple[str, float]]]] = {}

        def add(name: str, kind: str, help_: str, labels: str, v: float) -> None:
            fams.setdefault(name, (kind, help_, []))[2].append((labels, v))

        for rk in self.ranks:
            x = rk.load_snapshot()
            lab = f'model_name="{s.model}",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
            if multi:
                lab += f',dp_rank="{rk.rank}"'
            add("sglang:num_running_reqs", "gauge", "The number of running requests.", lab, x["num_running_reqs"])
            add("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", lab, x["num_waiting_reqs"])
            add("sglang:num_used_tokens", "gauge", "The number of used tokens.", lab, x["num_used_tokens"])
            add("sglang:token_usage", "gauge", "The token usage.", lab, x["token_usage"])
            add("sglang:max_total_num_tokens", "gauge", "KV capacity in tokens.", lab, x["max_total_num_tokens"])
            add("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", lab, x["gen_throughput"])
            add("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", lab, x["cache_hit_rate"])
            add("sglang:utilization", "gauge", "Scheduler utilization.", lab, x["utilization"])
            add("sglang:page_size", "gauge", "Tokens per KV page.", lab, s.engine.page_size)
            add("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", lab, rk.prompt_tokens_total)
            add("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.", lab, rk.generation_tokens_total)
            add("sglang:num_requests_total", "counter", "Number of requests processed.", lab, rk.requests_total)
            add("sglang:num_aborted_requests_total", "counter", "Number of requests aborted.", lab, rk.aborted_total)
            add("sglang:cached_tokens_total", "counter", "Number of cached prompt tokens.", lab + ',cache_source="device"',
                rk.cached_tokens_total)
        lines = []
        for name, (kind, help_, samples) in fams.items():
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                lines.append(f"{name}{{{labels}}} {float(v)}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def h_flush(self, request: web.Request) -> web.Response:
        if any(rk.engine.has_work() for rk in self.ranks):
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.")
        for rk in self.ranks:
            rk.engine.flush_cache(rk.now())
            rk.publish(rk.engine.drain_events())
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. "
                                             "(When there are running or waiting requests, the operation will not be performed.)\n")

    # ------------------------------------------------------------------ debug knobs

    async def _debug_body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except Exception:
            body = {}
        return body if type(body) is dict else {}

    def _debug_rank(self, body: dict) -> _Rank:
        r = body.get("rank", 0)
        if type(r) is not int or not 0 <= r < len(self.ranks):
            raise HttpError(400, "bad rank")
        rk = self.ranks[r]
        if rk.kv is None:
            raise HttpError(400, "KV events are off")
        return rk

    async def h_debug_health(self, request: web.Request) -> web.Response:
        body = await self._debug_body(request)
        self.healthy = bool(body.get("ok", True))
        self.log.info("stub_health_set", healthy=self.healthy)
        return web.json_response({"healthy": self.healthy})

    async def h_debug_drop(self, request: web.Request) -> web.Response:
        body = await self._debug_body(request)
        try:
            rk = self._debug_rank(body)
        except HttpError as exc:
            return _json_error(exc.status, exc.message)
        rk.kv.drop_next(int(body.get("count", 1)))  # type: ignore[union-attr]
        return web.json_response({"rank": rk.rank, "next_seq": rk.kv.seq})  # type: ignore[union-attr]

    async def h_debug_malformed(self, request: web.Request) -> web.Response:
        body = await self._debug_body(request)
        try:
            rk = self._debug_rank(body)
        except HttpError as exc:
            return _json_error(exc.status, exc.message)
        kv = rk.kv
        assert kv is not None
        kind = body.get("kind", "bad_msgpack")
        seq = None
        if kind == "bad_msgpack":
            seq = kv.publish_raw(b"\xc1\xc1 not msgpack")
        elif kind == "bad_batch":
            seq = kv.publish_raw(pack({"not": "a batch"}))
        elif kind == "bad_events":
            # one harmless valid event (removal of an unknown block) among garbage
            good = KV.encode_event_map(KV.BlockRemoved((0x1234,), "GPU"))
            events = [{"type": "Bogus"}, ["BlockStored", "not-a-list"], good, 42, {"type": "BlockStored", "block_hashes": []}]
            seq = kv.publish_raw(pack([time.time(), events, rk.rank]))
        elif kind == "bad_envelope":
            kv.send_raw_frames([kv.topic, b"\x00\x01", b"x"])
        else:
            return _json_error(400, f"unknown kind {kind!r}")
        return web.json_response({"rank": rk.rank, "seq": seq})

    async def h_debug_stats(self, request: web.Request) -> web.Response:
        out = []
        for rk in self.ranks:
            kv = rk.kv
            out.append({"rank": rk.rank, "next_seq": kv.seq if kv else None, "dropped": kv.dropped if kv else 0,
                        "replays_served": kv.replays_served if kv else 0, "cached_pages": rk.engine.num_cached_pages,
                        "requests": rk.requests_total, "cached_tokens": rk.cached_tokens_total})
        return web.json_response({"ranks": out, "healthy": self.healthy, "lora_requests": dict(self.lora_served),
                                  "pd": self.pd.counters})


async def serve_stub(s: StubSettings) -> None:
    """Run the stub until SIGTERM/SIGINT (the ``mesh stub-sglang`` entry point)."""
    configure(s.log_level)
    stub = SglangStub(s)
    desc = await stub.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    announce("sglang_stub_listening", pid=os.getpid(), **desc)
    await stop.wait()
    await stub.stop()
    announce("sglang_stub_stopped")
