"""``mesh attach sglang``: SGLang specifics (``worker-telemetry.md`` §5, §9-§11).

* Discovery: ``GET /server_info`` (``/get_server_info`` on old servers) -> ``kv_events`` block:
  ``endpoint_host`` (a wildcard is replaced by the host of ``--url``), ``endpoint_port_base`` (rank
  r -> base + r), ``topic``, ``block_size``, ``dp_size``, ``replay_endpoint_port_base``,
  ``load_endpoint_port_base``. Servers without the block (SGLang <= 0.5.17) fall back to the
  ``kv_events_config`` server arg. Every value can be overridden by a flag. Also read:
  ``served_model_name``, ``max_running_requests``, ``max_total_num_tokens``,
  ``incremental_streaming_output``, ``startup_time`` (a change across a health outage = restart),
  ``tokenizer_path`` (SGLang sets it to ``model_path`` unless ``--tokenizer-path`` names another; from
  ``/get_model_info`` when ``/server_info`` lacks it): the tokenizer identity announced in READY, which
  the brokers' HTTP ingress and the gateway load when no ``--tokenizer`` names the model's.
  LoRA adapters: ``GET /v1/models`` entries with a ``parent`` (servers run with
  ``--enable-lora``), announced to the brokers and re-read every ``--lora-refresh-ms``.
* Requests: ``POST /generate``, with ``stream: true`` when the client streams (else one JSON
  answer); streamed ``output_ids``/``text`` are cumulative unless
  the server runs with ``--incremental-streaming-output``; the adapter sends deltas as mesh CHUNKs,
  logprob lists in ``meta_info`` likewise (each CHUNK carries the entries of its own tokens).
  ``params`` keys SGLang knows as sampling params go to ``sampling_params`` (unknown keys there
  would be a 400), a few request-level keys pass through, the rest is dropped. A LoRA request
  (``base:adapter``, the adapter's name or ``lora_path``) gets ``lora_path`` = the adapter's name. PD bootstrap:
  ``REQUEST.bootstrap`` keys ``bootstrap_host|port|room|pair_key`` (or ``host``/``port``/``room``)
  become the top-level ``bootstrap_*`` fields of ``/generate``. DP attention: ``REQUEST.dp_rank``
  (the rank the broker chose, :mod:`mesh.routing.ranks`) becomes ``routed_dp_rank`` (SGLang's own
  field since 0.5.x; ``data_parallel_rank`` is its deprecated alias).
* Load when there is no LoadStat stream: ``/v1/loads?include=core`` (0.5.12+), else ``/get_load``
  (<= 0.5.20), else ``/metrics`` (``sglang:`` or ``sglang_`` names); an endpoint that answers 404
  is not asked again.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from mesh import protocol as P
from mesh.adapters.backend import Backend, EngineInfo, StreamState, engine_lora, engine_request_id, rank_endpoint, replace_wildcard
from mesh.adapters.engine_client import error_code_for_status, parse_prometheus
from mesh.adapters.settings import AttachSettings
from mesh.errors import ConfigError, ErrorCode, RequestError
from mesh.load import LoadStat
from mesh.openai_logprobs import LOGPROB_KEYS
from mesh.params import REQUEST_KEYS, SAMPLING_KEYS

__all__ = ["SglangBackend", "info_from_server_info", "tokenizer_of", "generate_body", "SAMPLING_KEYS", "loadstat_from_v1", "loadstats_from_metrics"]

_ALIASES = {"seed": "sampling_seed", "max_tokens": None, "min_tokens": "min_new_tokens"}
TOP_LEVEL_KEYS = REQUEST_KEYS
_BOOTSTRAP = {"bootstrap_host": "bootstrap_host", "bootstrap_port": "bootstrap_port", "bootstrap_room": "bootstrap_room",
              "bootstrap_pair_key": "bootstrap_pair_key", "host": "bootstrap_host", "port": "bootstrap_port",
              "room": "bootstrap_room"}


def _tcp(host: str, port: Any) -> str:
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{h}:{int(port)}"


def _endpoint_host(block_host: Any, url_host: str) -> str:
    if not isinstance(block_host, str) or block_host in ("*", "0.0.0.0", "::", "[::]", ""):
        return url_host
    return block_host


def tokenizer_of(d: dict[str, Any]) -> str:
    """The tokenizer an SGLang server names in ``/server_info`` or ``/get_model_info`` (``tokenizer_path``:
    a model id or a folder), or "" when it names none."""
    v = d.get("tokenizer_path")
    return v.strip() if isinstance(v, str) else ""


def info_from_server_info(d: dict[str, Any], s: AttachSettings) -> EngineInfo:
    """Build the engine description from a ``/server_info`` answer plus flag overrides."""
    host = s.url_host
    kv = d.get("kv_events") if isinstance(d.get("kv_events"), dict) else None
    if kv is None and isinstance(d.get("kv_events_config"), str):  # SGLang <= 0.5.17: no discovery block
        try:
            cfg = json.loads(d["kv_events_config"])
        except ValueError:
            cfg = None
        if isinstance(cfg, dict) and cfg.get("publisher") == "zmq" and str(cfg.get("endpoint", "")).startswith("tcp://"):
            h, _, port = cfg["endpoint"][6:].rpartition(":")
            kv = {"endpoint_host": h, "endpoint_port_base": int(port), "topic": cfg.get("topic", "")}
            rep = str(cfg.get("replay_endpoint") or "")
            if rep.startswith("tcp://"):
                kv["replay_endpoint_port_base"] = int(rep.rsplit(":", 1)[1])
    kv = kv or {}
    page = d.get("page_size")
    block_size = s.block_size or kv.get("block_size") or (page if isinstance(page, int) and page > 0 else None)
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("block_size: the server reports no page size; pass --block-size")
    dp = s.dp_size or kv.get("dp_size") or d.get("dp_size") or 1
    topic = s.topic if s.topic is not None else str(kv.get("topic") or "")
    ehost = _endpoint_host(kv.get("endpoint_host"), host)

    def ranked(flag: str | None, port_key: str) -> list[str | None]:
        if flag:
            base = replace_wildcard(flag, host)
        elif kv.get(port_key) is not None:
            base = _tcp(ehost, kv[port_key])
        else:
            return [None] * dp
        return [rank_endpoint(base, r) for r in range(dp)]

    states = d.get("internal_states") if isinstance(d.get("internal_states"), list) else []
    st0 = states[0] if states and isinstance(states[0], dict) else {}
    max_running = s.max_running_requests or d.get("max_running_requests") or st0.get("max_running_requests") or 256
    max_total = s.max_total_num_tokens or d.get("max_total_num_tokens") or st0.get("max_total_num_tokens") or (1 << 20)
    incremental = s.incremental_streaming if s.incremental_streaming is not None else bool(d.get("incremental_streaming_output"))
    st = d.get("startup_time")
    return EngineInfo(
        model=s.model or str(d.get("served_model_name") or d.get("model_path") or "sglang"),
        block_size=int(block_size), dp_size=int(dp), topic=topic,
        kv_endpoints=ranked(s.kv_endpoint, "endpoint_port_base"),
        replay_endpoints=ranked(s.replay_endpoint, "replay_endpoint_port_base"),
        load_endpoints=ranked(s.load_endpoint, "load_endpoint_port_base"),
        max_running_requests=int(max_running), max_total_num_tokens=int(max_total), incremental_streaming=incremental,
        startup_time=float(st) if isinstance(st, (int, float)) else None, tokenizer=tokenizer_of(d),
    )


def generate_body(r: P.Request, info: EngineInfo) -> dict[str, Any]:
    """The ``/generate`` body for a mesh REQUEST (streamed when the client streams).

    PD: ``REQUEST.bootstrap`` keys ``bootstrap_host|port|room|pair_key`` (the broker's ``room`` as
    ``bootstrap_room``, ``host``/``port`` likewise) become SGLang's top-level bootstrap fields.
    """
    sub = r.submit
    sp: dict[str, Any] = {}
    body: dict[str, Any] = {}
    for k, v in (sub.params or {}).items():
        k2 = _ALIASES.get(k, k)
        if k2 is None:
            continue
        if k2 in SAMPLING_KEYS:
            sp[k2] = v
        elif k2 in TOP_LEVEL_KEYS:
            body[k2] = v
    if "max_new_tokens" in (sub.params or {}):  # no limit given: the engine's own default applies
        sp["max_new_tokens"] = sub.max_new_tokens
    if sub.input_ids is not None:
        body["input_ids"] = list(sub.input_ids)
    else:
        body["text"] = sub.text
    lora = engine_lora(r, info)
    if lora is not None:
        body["lora_path"] = lora  # SGLang's field: the name of a loaded adapter
    body["sampling_params"] = sp
    body["stream"] = bool(sub.stream)  # unstreamed: one JSON answer, no SSE to parse
    body["rid"] = engine_request_id(r)
    if r.bootstrap:
        for k, v in r.bootstrap.items():
            dst = _BOOTSTRAP.get(k)
            if dst is not None and v is not None:
                body[dst] = v
    if r.dp_rank is not None:  # the router's DP-attention rank (a client's own routed_dp_rank wins)
        body.setdefault("routed_dp_rank", r.dp_rank)
    return body


def _error_from(obj: Any) -> tuple[ErrorCode, str]:
    if isinstance(obj, dict):
        msg = str(obj.get("message") or obj)
        code = obj.get("code") or obj.get("status_code")
        if isinstance(code, int) and 100 <= code < 600:
            return error_code_for_status(code), msg
        if obj.get("retryable"):
            return ErrorCode.WORKER_ERROR, msg
        if obj.get("type") in ("invalid_request_error", "BadRequestError"):
            return ErrorCode.BAD_REQUEST, msg
        return ErrorCode.WORKER_ERROR, msg
    return ErrorCode.WORKER_ERROR, str(obj)[:512]


def _new_lists(meta: dict[str, Any], st: StreamState, incremental: bool) -> None:
    """The logprob lists' entries new in this event: all of them with
    ``--incremental-streaming-output``, else past what earlier (cumulative) events showed, as
    SGLang's own OpenAI server slices them."""
    for k in LOGPROB_KEYS:
        v = meta.get(k)
        if type(v) is not list or not v:
            continue
        if incremental:
            st.new_lists[k] = v
            continue
        n = st.lists_seen.get(k, 0)
        if len(v) > n:
            st.new_lists[k] = v[n:]
            st.lists_seen[k] = len(v)


def _nn(v: Any) -> int:
    """Non-negative int from a JSON number (LoadStat fields)."""
    try:
        return max(0, int(v or 0))
    except (TypeError, ValueError):
        return 0


def loadstat_from_v1(d: dict[str, Any]) -> LoadStat:
    """One ``/v1/loads`` entry -> LoadStat (the same numbers the LoadStat stream carries)."""
    return LoadStat(
        num_running_reqs=_nn(d.get("num_running_reqs")), num_waiting_reqs=_nn(d.get("num_waiting_reqs")),
        num_tokens=_nn(d.get("num_used_tokens")), max_total_num_tokens=_nn(d.get("max_total_num_tokens")),
        attn_dp_rank=_nn(d.get("dp_rank")), num_waiting_uncached_tokens=_nn(d.get("num_waiting_uncached_tokens")),
        num_total_tokens=_nn(d.get("num_total_tokens")), max_running_requests=_nn(d.get("max_running_requests")),
        total_prefill_uncached_tokens=_nn(d.get("total_prefill_uncached_tokens")),
        total_prefill_busy_us=_nn(d.get("total_prefill_busy_us")), extended=True,
    )


def loadstat_from_get_load(d: dict[str, Any], info: EngineInfo) -> LoadStat:
    """One ``/get_load`` entry. 0.5.12-0.5.20 (shim: ``num_reqs`` = running + waiting) or <= 0.5.4."""
    waiting = _nn(d.get("num_waiting_reqs"))
    shim = "num_pending_tokens" in d or "ts_tic" in d
    running = max(0, _nn(d.get("num_reqs")) - waiting) if shim else _nn(d.get("num_reqs"))
    tokens = _nn(d.get("num_tokens")) - (_nn(d.get("num_pending_tokens")) if shim else 0)
    return LoadStat(num_running_reqs=running, num_waiting_reqs=waiting, num_tokens=max(0, tokens),
                    max_total_num_tokens=info.max_total_num_tokens, attn_dp_rank=_nn(d.get("dp_rank")), extended=False)


def loadstats_from_metrics(text: str, info: EngineInfo) -> list[LoadStat] | None:
    """``/metrics`` gauges (``sglang:`` or ``sglang_``) -> one LoadStat per dp_rank label."""
    per: dict[int, dict[str, float]] = {}
    for name, labels, v in parse_prometheus(text):
        if name.startswith("sglang:"):
            key = name[7:]
        elif name.startswith("sglang_"):
            key = name[7:]
        else:
            continue
        try:
            rank = int(labels.get("dp_rank", 0))
        except ValueError:
            continue
        per.setdefault(rank, {})[key] = v
    out = []
    for rank, m in sorted(per.items()):
        if "num_running_reqs" not in m:
            continue
        cap = int(m.get("max_total_num_tokens") or info.max_total_num_tokens)
        used = m.get("num_used_tokens")
        if used is None:
            used = m.get("token_usage", 0.0) * cap
        out.append(LoadStat(num_running_reqs=_nn(m.get("num_running_reqs")), num_waiting_reqs=_nn(m.get("num_queue_reqs")),
                            num_tokens=_nn(used), max_total_num_tokens=_nn(cap), attn_dp_rank=rank, extended=False))
    return out or None


class SglangBackend(Backend):
    kind = "sglang"
    default_health_path = "/health"

    def __init__(self, s: AttachSettings) -> None:
        super().__init__(s)
        self._unsupported: set[str] = set()

    @property
    def unsupported(self) -> frozenset[str]:
        """Load endpoints the server answered 404/405 (``v1_loads``, ``get_load``, ``metrics``): not asked again."""
        return frozenset(self._unsupported)

    async def _server_info(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        status, d = await self.get_json(http, "/server_info")
        if status == 404:
            status, d = await self.get_json(http, "/get_server_info")
        if status != 200 or not isinstance(d, dict):
            raise self.not_ready("/server_info", status)  # retried by discovery
        return d

    async def discover(self, http: aiohttp.ClientSession) -> EngineInfo:
        info = info_from_server_info(await self._server_info(http), self.s)
        try:
            info.loras = await self.loras(http)  # /v1/models: adapters have a parent (with --enable-lora)
        except RequestError:
            info.loras = None
        if not info.tokenizer:  # older servers: the model info endpoint names it
            status, d = await self.get_json(http, "/get_model_info")
            if status == 200 and isinstance(d, dict):
                info.tokenizer = tokenizer_of(d)
        if info.kv_endpoints and info.kv_endpoints[0] is None:
            self.log.warning("no_kv_events", hint="start the server with --kv-events-config '{\"publisher\":\"zmq\",...}' "
                             "(or pass --kv-endpoint); without events the brokers cannot route by this worker's cache")
        return info

    async def restarted(self, http: aiohttp.ClientSession, info: EngineInfo) -> bool:
        d = await self._server_info(http)
        st = d.get("startup_time")
        if isinstance(st, (int, float)) and info.startup_time is not None and float(st) != info.startup_time:
            info.startup_time = float(st)
            return True
        return False

    def request(self, r: P.Request, info: EngineInfo) -> tuple[str, dict[str, Any]]:
        return "/generate", generate_body(r, info)

    def prefill_leg(self, r: P.Request, info: EngineInfo) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """The prefill server gets the request with its own bootstrap address and the broker's
        room; the same three fields go back in FINAL data for the decode leg, at once (the prefill
        server's answer, unstreamed, comes when the decode server has pulled the KV)."""
        body = generate_body(r, info)
        body["stream"] = False
        boot = {"bootstrap_host": body.get("bootstrap_host") or self.s.bootstrap_host or self.s.url_host,
                "bootstrap_port": body.get("bootstrap_port") or self.s.bootstrap_port,
                "bootstrap_room": body.get("bootstrap_room", r.rid)}
        body.update(boot)
        return "/generate", body, boot

    def parse(self, obj: Any, st: StreamState, info: EngineInfo) -> None:
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            st.error = _error_from(obj["error"])
            return
        ids = obj.get("output_ids") or []
        text = obj.get("text") or ""
        if info.incremental_streaming:
            st.new_ids = list(ids)
            st.new_text = text if isinstance(text, str) else ""
        else:
            if isinstance(ids, list) and len(ids) > st.n_ids:
                st.new_ids = ids[st.n_ids:]
                st.n_ids = len(ids)
            if isinstance(text, str) and len(text) > st.text_len:
                st.new_text = text[st.text_len:]
                st.text_len = len(text)
        meta = obj.get("meta_info")
        if not isinstance(meta, dict):
            meta = {}
        else:
            st.meta = meta
            _new_lists(meta, st, info.incremental_streaming)
        fr = meta.get("finish_reason")
        if fr is None:
            return
        typ = fr.get("type") if isinstance(fr, dict) else str(fr)
        if typ == "abort":
            status = fr.get("status_code") if isinstance(fr, dict) else None
            code = error_code_for_status(status) if isinstance(status, int) else ErrorCode.WORKER_ERROR
            st.error = (code, f"engine aborted the request: {fr.get('message') if isinstance(fr, dict) else fr}")
            return
        st.finish = typ or "stop"
        st.usage = {k: _nn(meta.get(k)) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")}

    async def poll_load(self, http: aiohttp.ClientSession, info: EngineInfo) -> list[LoadStat] | None:
        if "v1_loads" not in self._unsupported:
            status, d = await self.get_json(http, "/v1/loads?include=core")
            if status == 200 and isinstance(d, dict) and isinstance(d.get("loads"), list):
                return [loadstat_from_v1(x) for x in d["loads"] if isinstance(x, dict)]
            if status in (404, 405):
                self._unsupported.add("v1_loads")
        if "get_load" not in self._unsupported:
            status, d = await self.get_json(http, "/get_load")
            if status == 200 and isinstance(d, list):
                return [loadstat_from_get_load(x, info) for x in d if isinstance(x, dict)]
            if status in (404, 405):
                self._unsupported.add("get_load")
        if "metrics" not in self._unsupported:
            status, text = await self.get_text(http, "/metrics")
            if status == 200:
                return loadstats_from_metrics(text, info)
            if status in (404, 405):
                self._unsupported.add("metrics")
        return None
