"""What an adapter knows about its engine and the engine-specific interface it drives.

:class:`EngineInfo` is what discovery found; a :class:`Backend` (:mod:`mesh.adapters.sglang`,
:mod:`mesh.adapters.vllm`) knows how to discover, which HTTP endpoint serves a request, how an
answer is parsed into a :class:`StreamState` and how load is polled.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from mesh import protocol as P
from mesh.adapters.engine_client import engine_error
from mesh.adapters.settings import AttachSettings
from mesh.errors import ErrorCode, RetryableError
from mesh.load import LoadStat
from mesh.logs import get_logger
from mesh.routing.lora import request_lora, split_model

__all__ = ["EngineInfo", "StreamState", "Backend", "engine_request_id", "rank_endpoint", "replace_wildcard", "models_and_loras",
           "engine_lora"]

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")



# Engine request ids must be unique per engine: the broker's rid and attempt are unique per broker,
# and a salt drawn at start plus a counter keeps two brokers' (or two runs') ids apart without a
# random draw per request.
_RID_SALT = secrets.token_hex(3)
_RID_SEQ = itertools.count(1)


def engine_request_id(r: "P.Request") -> str:
    """The id the engine is given for one attempt: the caller's id (the HTTP ``x-request-id``,
    else the broker's), then the broker's request number and attempt, so the engine's logs name
    the caller's request (SGLang ``rid``, vLLM ``request_id``)."""
    return f"{r.submit.rid}/{r.rid}.{r.attempt}.{_RID_SALT}{next(_RID_SEQ):x}"[:256]



@dataclass
class EngineInfo:
    """What the adapter knows about the server (discovery + flags)."""

    model: str
    block_size: int
    dp_size: int
    topic: str = ""
    kv_endpoints: list[str | None] = field(default_factory=list)  # per rank; None = no KV events
    replay_endpoints: list[str | None] = field(default_factory=list)
    load_endpoints: list[str | None] = field(default_factory=list)
    max_running_requests: int = 256
    max_total_num_tokens: int = 1 << 20
    incremental_streaming: bool = False
    startup_time: float | None = None
    loras: list[str] | None = None  # LoRA adapters loaded on the engine (None: unknown)
    tokenizer: str = ""  # the engine's tokenizer as it names it (a model id or a path), announced in READY

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "tokenizer": self.tokenizer, "block_size": self.block_size, "dp_size": self.dp_size,
                "topic": self.topic, "kv_endpoints": self.kv_endpoints, "replay_endpoints": self.replay_endpoints,
                "load_endpoints": self.load_endpoints, "loras": self.loras}


def models_and_loras(d: Any) -> tuple[str | None, list[str]]:
    """A ``GET /v1/models`` answer -> (the base model, the LoRA adapters). Both engines list the
    base model(s) first and each loaded adapter as an entry whose ``parent`` is the base model and
    ``root`` its path (vLLM ``OpenAIServingModels.show_available_models``, SGLang
    ``http_server.available_models``, with ``--enable-lora``). Anything malformed is skipped."""
    data = d.get("data") if isinstance(d, dict) else None
    base = None
    loras: list[str] = []
    for e in data if isinstance(data, list) else ():
        if not isinstance(e, dict) or not isinstance(e.get("id"), str) or not e["id"]:
            continue
        if isinstance(e.get("parent"), str) and e["parent"]:
            if len(loras) < P.MAX_LORAS and len(e["id"].encode()) <= P.MAX_LORA_NAME_BYTES:
                loras.append(e["id"])
        elif base is None:
            base = e["id"]
    return base, sorted(set(loras))


def engine_lora(r: P.Request, info: EngineInfo) -> str | None:
    """The LoRA adapter a request asks this engine for: the one the broker resolved (REQUEST
    ``lora``), else (an older broker) read from the request (:mod:`mesh.routing.lora`:
    ``base:adapter``, the adapter's own name, or ``lora_path``); None for the base model."""
    if r.lora is not None:
        return r.lora
    sub = r.submit
    adapter = None
    name = sub.model
    if name and name != info.model:
        loras = info.loras or ()
        if name in loras:
            adapter = name
        else:
            base, adapter = split_model(name, (info.model,))
            # the base may be a broker-side alias: a ':' names an adapter of this engine's model,
            # or one this engine holds (else it is a model name with a colon, e.g. an alias)
            if adapter is not None and base != info.model and adapter not in loras:
                adapter = None
    return request_lora(sub.params, adapter)


def rank_endpoint(base: str, rank: int) -> str:
    """SGLang's per-rank endpoint: ``tcp://h:P`` -> ``tcp://h:P+r``; ``inproc://x``/``ipc://x`` -> ``x_dp{r}``."""
    if rank == 0:
        return base
    if base.startswith("tcp://"):
        host, _, port = base[6:].rpartition(":")
        return f"tcp://{host}:{int(port) + rank}"
    return f"{base}_dp{rank}"


def replace_wildcard(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` -> ``tcp://<host>:5557`` (a worker reports its bind address)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    h, _, port = endpoint[6:].rpartition(":")
    if h in _WILDCARD_HOSTS:
        h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{h}:{port}"


@dataclass(slots=True)
class StreamState:
    """Progress of one proxied request; a backend's ``parse`` fills the ``new_*`` fields per chunk."""

    n_ids: int = 0  # cumulative output ids seen (cumulative streams)
    text_len: int = 0
    new_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finish: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    error: tuple[ErrorCode, str] | None = None
    prompt_len: int = 0
    meta: dict[str, Any] | None = None  # the engine's own metadata of the latest event (SGLang meta_info)
    # positional meta lists (logprobs): the entries new in this event, and how many a cumulative
    # stream has shown so far, per key
    new_lists: dict[str, list] = field(default_factory=dict)
    lists_seen: dict[str, int] = field(default_factory=dict)


class Backend:
    """Engine-specific parts of an adapter. Subclasses: SglangBackend, VllmBackend."""

    kind = "engine"
    default_health_path = "/health"

    def __init__(self, s: AttachSettings) -> None:
        self.s = s
        self.log = get_logger(service="adapter", engine=self.kind)

    async def discover(self, http: aiohttp.ClientSession) -> EngineInfo:  # pragma: no cover - abstract
        raise NotImplementedError

    async def restarted(self, http: aiohttp.ClientSession, info: EngineInfo) -> bool:
        """True when the server is known to have restarted since discovery (False: unknown)."""
        return False

    def request(self, r: P.Request, info: EngineInfo) -> tuple[str, dict[str, Any]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def parse(self, obj: Any, st: StreamState, info: EngineInfo) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    async def poll_load(self, http: aiohttp.ClientSession, info: EngineInfo) -> list[LoadStat] | None:
        return None

    async def loras(self, http: aiohttp.ClientSession) -> list[str] | None:
        """The LoRA adapters loaded on the engine now (``GET /v1/models``), None when it does not say."""
        status, d = await self.get_json(http, "/v1/models")
        return models_and_loras(d)[1] if status == 200 else None

    def prefill_leg(self, r: P.Request, info: EngineInfo) -> tuple[str, dict[str, Any], dict[str, Any] | None] | None:
        """PD prefill leg (``bootstrap.mode == "prefill"``): (path, body, handoff) or None if
        unsupported. ``handoff``: the FINAL ``prefill_done`` data sent at once, the engine request
        running on until the decode server pulled the KV (SGLang's bootstrap); None: the FINAL
        follows the engine's answer, its data made by :meth:`prefill_handoff` (vLLM's
        ``kv_transfer_params``). Raises ValueError for a parameter the engine cannot take."""
        return None

    def prefill_handoff(self, answer: Any) -> dict[str, Any] | None:
        """What the decode leg needs from the prefill engine's answer (FINAL ``prefill_done``
        data), or None when the answer lacks it."""
        return None

    # The engine's side API (discovery, health, load): every failure leaves through engine_error.
    async def get_json(self, http: aiohttp.ClientSession, path: str, timeout_s: float = 5.0) -> tuple[int, Any]:
        """(status, decoded JSON body or None when not 200); raises :func:`engine_error`'s errors."""
        url = self.s.base_url + path
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return resp.status, None
                return 200, await resp.json(content_type=None)
        except Exception as exc:
            raise engine_error(exc, f"GET {url}") from exc

    async def get_text(self, http: aiohttp.ClientSession, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
        """(status, body text or "" when not 200); raises :func:`engine_error`'s errors."""
        url = self.s.base_url + path
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, (await resp.text() if resp.status == 200 else "")
        except Exception as exc:
            raise engine_error(exc, f"GET {url}") from exc

    async def get_status(self, http: aiohttp.ClientSession, path: str, timeout_s: float = 5.0) -> int:
        """The status of ``GET path`` (body read and dropped); raises :func:`engine_error`'s errors."""
        url = self.s.base_url + path
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return resp.status
        except Exception as exc:
            raise engine_error(exc, f"GET {url}") from exc

    def not_ready(self, path: str, status: int) -> RetryableError:
        """Discovery's answer to a non-200 side-API reply: the engine is not serving yet (retried)."""
        return RetryableError(ErrorCode.UNAVAILABLE, f"GET {self.s.base_url}{path}: HTTP {status}")
