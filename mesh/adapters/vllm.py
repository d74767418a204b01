"""``mesh attach vllm``: vLLM specifics (``worker-telemetry.md`` §12).

* No HTTP discovery: ``--kv-endpoint`` (rank 0; rank r = port + r) and ``--block-size`` are
  required, ``--replay-endpoint``, ``--dp-size`` (default 1) and ``--topic`` optional. The model
  name comes from ``GET /v1/models`` (the entry without a ``parent``; entries with one are LoRA
  adapters, announced to the brokers and re-read every ``--lora-refresh-ms``), and the tokenizer
  announced in READY from its ``root`` (the model vLLM loaded); the KV capacity from ``vllm:cache_config_info``
  (``num_gpu_blocks x block_size``) unless ``--max-total-num-tokens`` is given.
* Events: tagged maps with unsigned (or 32-byte ``bytes``) hashes, ``lora_name``, ``extra_keys``,
  ``group_idx`` (hybrid models: only group 0 / main attention is kept by the decoder), batch rank =
  ``data_parallel_rank``; replay replies always carry the topic frame. Decoding and relaying are
  the shared ones (:mod:`mesh.adapters.backend`).
* Requests: ``POST /v1/completions`` (``prompt`` = token ids or text, ``stream: true``,
  ``stream_options.include_usage``, ``return_token_ids`` for the generated ids); chunks are
  already deltas. A LoRA request (``base:adapter``, the adapter's name or ``lora_path``) is sent
  with ``model`` = the adapter's name.
* Prefill/decode disaggregation (``role`` prefill / decode, the broker's ``--pd``), as
  vllm-router and production-stack drive vLLM's KV connectors (NixlConnector and the like): the
  prefill leg is the request with ``max_tokens: 1``, unstreamed, with ``kv_transfer_params``
  ``{"do_remote_decode": true, ...}`` (:data:`PREFILL_KV_TRANSFER_PARAMS`); the engine's answer
  carries the ``kv_transfer_params`` the decode engine needs (``do_remote_prefill``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_host``,
  ``remote_port``, ``tp_size``), sent in FINAL ``prefill_done``; the broker passes them to the
  decode leg in ``REQUEST.bootstrap["kv_transfer_params"]``, put in the decode request as they are.
* Load: ``/metrics`` (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` or v0's ``vllm:gpu_cache_usage_perc``), one LoadStat per ``engine``
  label.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from mesh import protocol as P
from mesh.adapters.backend import (Backend, EngineInfo, StreamState, engine_lora, engine_request_id, models_and_loras, rank_endpoint,
                                  replace_wildcard)
from mesh.adapters.engine_client import error_code_for_status, parse_prometheus
from mesh.adapters.settings import AttachSettings
from mesh.errors import ConfigError, ErrorCode, RequestError
from mesh.load import LoadStat

__all__ = ["VllmBackend", "completions_body", "loadstats_from_vllm_metrics", "prefill_body", "PREFILL_KV_TRANSFER_PARAMS",
           "tokenizer_of_models"]

#: The prefill request's ``kv_transfer_params`` (vLLM's examples/online_serving disaggregated
#: proxies and vllm-router): the engine keeps the KV for a remote decode and answers where it is.
PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                              "remote_block_ids": None, "remote_host": None, "remote_port": None}

# mesh params (SGLang's vocabulary, mesh/params.py) -> vLLM OpenAI completions fields.
_PARAMS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty", "min_new_tokens": "min_tokens",
    "min_tokens": "min_tokens", "seed": "seed", "sampling_seed": "seed", "logit_bias": "logit_bias",
    "skip_special_tokens": "skip_special_tokens", "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output", "cache_salt": "cache_salt", "priority": "priority", "n": "n",
}
# Constrained decoding: SGLang's flat keys -> vLLM's structured_outputs fields.
_STRUCTURED = {"json_schema": "json", "regex": "regex", "ebnf": "grammar", "structural_tag": "structural_tag"}
# Read elsewhere (max_new_tokens), or with no effect on vLLM's answer: it always returns token
# text and ids (return_token_ids), and streams every token.
_HANDLED = frozenset({"max_new_tokens", "return_text_in_logprobs", "return_prompt_token_ids", "stream_interval",
                      "return_logprob", "top_logprobs_num", "lora_path"})


class UnsupportedParam(ValueError):
    """A request parameter vLLM has no equivalent for: the request is refused (bad_request)
    naming it, rather than run without it."""


def completions_body(r: P.Request, info: EngineInfo) -> dict[str, Any]:
    """The vLLM ``/v1/completions`` body for one request. Raises :class:`UnsupportedParam`."""
    sub = r.submit
    params = sub.params or {}
    body: dict[str, Any] = {"model": info.model}
    structured: dict[str, Any] = {}
    for k, v in params.items():
        dst = _PARAMS.get(k)
        if dst is not None:
            body[dst] = v
        elif k in _STRUCTURED:
            if k == "json_schema" and isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError:
                    raise UnsupportedParam("json_schema: not valid JSON for vLLM's structured outputs") from None
            structured[_STRUCTURED[k]] = v
        elif k not in _HANDLED:
            raise UnsupportedParam(f"{k}: vLLM has no equivalent of this SGLang parameter")
    if structured:
        body["structured_outputs"] = structured
    lora = engine_lora(r, info)
    if lora is not None:
        body["model"] = lora  # vLLM serves each LoRA adapter under its own model name
    if params.get("return_logprob"):
        body["logprobs"] = int(params.get("top_logprobs_num") or 0)
    body["prompt"] = list(sub.input_ids) if sub.input_ids is not None else sub.text
    if "max_new_tokens" in params:  # else vLLM's default: the rest of the context
        body["max_tokens"] = sub.max_new_tokens
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    body["request_id"] = engine_request_id(r)  # vLLM's own request id (its logs, its abort path)
    body["return_token_ids"] = True
    if r.bootstrap and r.bootstrap.get("kv_transfer_params") is not None:
        body["kv_transfer_params"] = r.bootstrap["kv_transfer_params"]
    return body


def prefill_body(r: P.Request, info: EngineInfo) -> dict[str, Any]:
    """The prefill leg's ``/v1/completions`` body: the request with one output token, unstreamed,
    asking the engine to keep the KV for a remote decode. Raises :class:`UnsupportedParam`."""
    body = completions_body(r, info)
    body.pop("stream_options", None)
    body.pop("min_tokens", None)  # (it cannot exceed max_tokens)
    body.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    return body


def _logprob_lists(lp: dict[str, Any], ids: list | None, st: StreamState) -> None:
    """vLLM's OpenAI completions ``logprobs`` of one chunk (``tokens``, ``token_logprobs``,
    ``top_logprobs`` as {text: logprob}) -> SGLang's ``meta_info`` lists, the one form the
    ingress converts: ``output_token_logprobs`` [logprob, id, text] and ``output_top_logprobs``
    (alternatives carry no id in vLLM's answer: None). Anything malformed is skipped."""
    toks, lps = lp.get("tokens"), lp.get("token_logprobs")
    if not isinstance(toks, list) or not isinstance(lps, list) or len(toks) != len(lps):
        return
    same = ids is not None and len(ids) == len(toks)
    st.new_lists["output_token_logprobs"] = [[v, ids[i] if same else None, t] for i, (v, t) in enumerate(zip(lps, toks))]
    tops = lp.get("top_logprobs")
    if isinstance(tops, list) and len(tops) == len(toks):
        st.new_lists["output_top_logprobs"] = [
            [[v, None, t] for t, v in sorted(d.items(), key=lambda kv: -kv[1] if isinstance(kv[1], (int, float)) else 0)]
            if isinstance(d, dict) else [] for d in tops]


def tokenizer_of_models(d: Any, model: str) -> str:
    """The tokenizer a vLLM server names in ``/v1/models``: the ``root`` of the served model's entry (the
    ``--model`` it loaded, a model id or a folder; vLLM loads the tokenizer from there unless ``--tokenizer``
    says otherwise), or "" when the answer names none."""
    data = d.get("data") if isinstance(d, dict) else None
    entries = [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []
    entry = next((e for e in entries if e.get("id") == model), entries[0] if entries else {})
    root = entry.get("root")
    return root.strip() if isinstance(root, str) else ""


def loadstats_from_vllm_metrics(text: str, info: EngineInfo) -> list[LoadStat] | None:
    per: dict[int, dict[str, float]] = {}
    cap = info.max_total_num_tokens
    for name, labels, v in parse_prometheus(text):
        if not name.startswith("vllm:"):
            continue
        try:
            rank = int(labels.get("engine", 0))
        except ValueError:
            rank = 0
        per.setdefault(rank, {})[name[5:]] = v
    out = []
    per_rank_cap = max(1, cap // max(1, info.dp_size))
    for rank, m in sorted(per.items()):
        if "num_requests_running" not in m:
            continue
        usage = m.get("kv_cache_usage_perc", m.get("gpu_cache_usage_perc", 0.0))
        out.append(LoadStat(num_running_reqs=int(m["num_requests_running"]), num_waiting_reqs=int(m.get("num_requests_waiting", 0)),
                            num_tokens=int(max(0.0, usage) * per_rank_cap), max_total_num_tokens=per_rank_cap,
                            attn_dp_rank=rank, extended=False))
    return out or None


class VllmBackend(Backend):
    kind = "vllm"
    default_health_path = "/health"

    def __init__(self, s: AttachSettings) -> None:
        super().__init__(s)
        if not s.kv_endpoint:
            raise ConfigError("kv_endpoint: vLLM has no HTTP discovery; pass --kv-endpoint tcp://HOST:PORT (rank 0)")
        if not s.block_size:
            raise ConfigError("block_size: pass --block-size (vLLM's --block-size, default 16)")

    async def discover(self, http: aiohttp.ClientSession) -> EngineInfo:
        s = self.s
        model = s.model
        loras = None
        status, d = await self.get_json(http, "/v1/models")
        if not model:
            if status != 200 or not isinstance(d, dict) or not d.get("data"):
                raise self.not_ready("/v1/models", status)  # retried by discovery
            base, loras = models_and_loras(d)  # the base model, not data[0]: LoRA entries have a parent
            model = base or "vllm"
        elif status == 200:
            loras = models_and_loras(d)[1]  # the name is given: /v1/models only tells the adapters here
        tokenizer = tokenizer_of_models(d, model) if status == 200 else ""
        max_total = s.max_total_num_tokens
        if not max_total:
            try:
                status, text = await self.get_text(http, "/metrics")
            except RequestError:  # engine_error's mapping: /metrics is optional here
                status, text = 0, ""
            for name, labels, _v in parse_prometheus(text) if status == 200 else []:
                if name == "vllm:cache_config_info":
                    try:
                        max_total = int(labels.get("num_gpu_blocks", 0)) * int(labels.get("block_size", s.block_size))
                    except ValueError:
                        pass
                    break
        if not max_total:
            self.log.warning("kv_capacity_unknown", hint="pass --max-total-num-tokens for load-aware routing")
            max_total = 1 << 20
        dp = s.dp_size or 1
        host = s.url_host

        def ranked(ep: str | None) -> list[str | None]:
            if not ep:
                return [None] * dp
            base = replace_wildcard(ep, host)
            return [rank_endpoint(base, r) for r in range(dp)]

        return EngineInfo(model=model, block_size=int(s.block_size or 16), dp_size=dp, topic=s.topic or "",
                          kv_endpoints=ranked(s.kv_endpoint), replay_endpoints=ranked(s.replay_endpoint),
                          load_endpoints=ranked(s.load_endpoint), max_running_requests=s.max_running_requests or 256,
                          max_total_num_tokens=max_total, incremental_streaming=True, loras=loras, tokenizer=tokenizer)

    def request(self, r: P.Request, info: EngineInfo) -> tuple[str, dict[str, Any]]:
        return "/v1/completions", completions_body(r, info)

    def prefill_leg(self, r: P.Request, info: EngineInfo) -> tuple[str, dict[str, Any], None]:
        """The handoff follows the engine's answer (its ``kv_transfer_params``)."""
        return "/v1/completions", prefill_body(r, info), None

    def prefill_handoff(self, answer: Any) -> dict[str, Any] | None:
        ktp = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return {"kv_transfer_params": ktp} if isinstance(ktp, dict) and ktp else None

    def parse(self, obj: Any, st: StreamState, info: EngineInfo) -> None:
        if not isinstance(obj, dict):
            return
        err = obj.get("error")
        if err is not None:
            if isinstance(err, dict):
                code = err.get("code")
                msg = str(err.get("message") or err)
                st.error = (error_code_for_status(code) if isinstance(code, int) else ErrorCode.WORKER_ERROR, msg)
            else:
                st.error = (ErrorCode.WORKER_ERROR, str(err)[:512])
            return
        choices = obj.get("choices") or []
        if choices and isinstance(choices[0], dict):
            c = choices[0]
            ids = c.get("token_ids")
            if isinstance(ids, list):
                st.new_ids = ids
            text = c.get("text")
            if isinstance(text, str):
                st.new_text = text
            lp = c.get("logprobs")
            if isinstance(lp, dict):
                _logprob_lists(lp, ids if isinstance(ids, list) else None, st)
            fr = c.get("finish_reason")
            if fr == "abort":
                st.error = (ErrorCode.WORKER_ERROR, "engine aborted the request")
                return
            if fr:
                st.finish = str(fr)
        u = obj.get("usage")
        if isinstance(u, dict):
            details = u.get("prompt_tokens_details") or {}
            st.usage = {"prompt_tokens": int(u.get("prompt_tokens") or 0), "completion_tokens": int(u.get("completion_tokens") or 0),
                        "cached_tokens": int((details.get("cached_tokens") if isinstance(details, dict) else 0) or 0)}

    async def poll_load(self, http: aiohttp.ClientSession, info: EngineInfo) -> list[LoadStat] | None:
        status, text = await self.get_text(http, "/metrics")
        return loadstats_from_vllm_metrics(text, info) if status == 200 else None
