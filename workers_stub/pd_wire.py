"""The stub's prefill/decode disaggregation: both engines' P/D wire contracts, and faults.

A stub started with ``--disaggregation-mode prefill|decode`` (SGLang's flag) serves one leg of a
disaggregated request, the KV "transfer" between two stubs being an HTTP pull of the prefill
server's handoff record (``GET /stub_pd/kv?key=K&wait_s=S`` on the prefill server's HTTP port):

* SGLang (``POST /generate`` with ``bootstrap_host|port|room``): the prefill server runs the
  prompt (one output token), then offers room ``bootstrap_room`` and answers only once a decode
  server pulled it (SGLang's prefill request ends when its KV is transferred). The decode server
  pulls ``bootstrap_host:bootstrap_port`` for the room (long polls, retrying an unreachable or
  not-yet-ready prefill server, as SGLang's KV receiver waits) for up to ``waiting_timeout_s``
  (SGLang's ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 300 s), then decodes with the prompt's KV
  received (no prefill compute). Point the prefill adapter's ``--bootstrap-port`` at the stub's
  HTTP port (``disaggregation_bootstrap_port`` in ``/server_info``).
* vLLM (``POST /v1/completions`` with ``kv_transfer_params``, NixlConnector's fields): a request
  with ``do_remote_decode`` is a prefill; its answer carries ``kv_transfer_params``
  (``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
  ``remote_host``, ``remote_port``, ``tp_size``), the handoff kept for ``waiting_timeout_s``. A
  request with ``do_remote_prefill`` is a decode: it pulls ``remote_host:remote_port`` for
  ``remote_request_id`` once and fails when the KV is not there (vLLM's default
  ``kv_load_failure_policy`` "fail").

Faults (``--pd-fault``, or ``POST /debug/pd_fault {"fault": F|null}``): ``prefill_error`` (the
prefill leg answers HTTP 500 and offers nothing: the decode server waits), ``bootstrap_hang``
(the prefill runs but its handoff never completes and its request never ends), ``decode_error``
(the decode leg answers HTTP 500 before pulling). Killing a prefill stub mid-request is the
fourth (the test's SIGKILL).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp

__all__ = ["PD_MODES", "PD_FAULTS", "PdWire", "PdRefused"]

PD_MODES = ("null", "prefill", "decode")
PD_FAULTS = ("prefill_error", "bootstrap_hang", "decode_error")
_PULL_WAIT_S = 1.0  # one long poll of a decode server waiting for its room


class PdRefused(Exception):
    """A P/D leg fails (an injected fault, or the KV never came): the server answers HTTP 500."""


class _Handoff:
    __slots__ = ("prompt_len", "ready", "pulled", "expires_s")

    def __init__(self) -> None:
        self.prompt_len = 0
        self.ready = asyncio.Event()  # the prefill is done: a decode server may pull it
        self.pulled = asyncio.Event()  # a decode server pulled it
        self.expires_s = 0.0


class PdWire:
    """One stub's P/D side: handoffs it offers as a prefill server, pulls it makes as a decode
    server. ``host`` / ``port()``: where decode servers reach this one (its HTTP address)."""

    def __init__(self, mode: str, fault: str | None, waiting_timeout_s: float, host: str, port) -> None:
        self.mode = mode
        self.fault = fault
        self.waiting_timeout_s = waiting_timeout_s
        self.host = host
        self._port = port
        self.engine_id = uuid.uuid4().hex
        self._handoffs: dict[str, _Handoff] = {}
        self._http: aiohttp.ClientSession | None = None
        self.counters = {"prefill_legs": 0, "decode_legs": 0, "pulls_served": 0, "faults": 0, "pull_failures": 0}

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    # ------------------------------------------------------------------ which leg
    def leg(self, body: dict, *, openai: bool) -> str | None:
        """"prefill", "decode" or None (not a P/D request, or this server is not in P/D mode)."""
        if self.mode == "null":
            return None
        if openai:
            ktp = body.get("kv_transfer_params")
            if type(ktp) is not dict:
                return None
            return "prefill" if ktp.get("do_remote_decode") else "decode" if ktp.get("do_remote_prefill") else None
        return self.mode if body.get("bootstrap_room") is not None else None

    def check_fault(self, leg: str) -> None:
        """Raise :class:`PdRefused` when a fault makes this leg fail at once."""
        self.counters[f"{leg}_legs"] += 1
        if (leg, self.fault) in (("prefill", "prefill_error"), ("decode", "decode_error")):
            self.counters["faults"] += 1
            raise PdRefused(f"injected fault {self.fault}: the {leg} leg failed")

    # ------------------------------------------------------------------ prefill side
    def _handoff(self, key: str) -> _Handoff:
        h = self._handoffs.get(key)
        if h is None:
            h = self._handoffs[key] = _Handoff()
        return h

    async def offer_and_wait(self, room: Any, prompt_len: int) -> None:
        """SGLang prefill: offer room ``room`` and return once a decode server pulled it (raises
        :class:`PdRefused` after ``waiting_timeout_s``; with ``bootstrap_hang``, never returns)."""
        key = str(room)
        if self.fault == "bootstrap_hang":
            self.counters["faults"] += 1
            await asyncio.Event().wait()  # the KV handoff never completes (until the caller goes away)
        h = self._handoff(key)
        h.prompt_len = prompt_len
        h.ready.set()
        try:
            await asyncio.wait_for(h.pulled.wait(), self.waiting_timeout_s)
        except TimeoutError:
            raise PdRefused(f"room {key}: no decode server pulled the KV within {self.waiting_timeout_s:g} s") from None
        finally:
            self._handoffs.pop(key, None)

    async def offer_vllm(self, prompt_len: int, n_blocks: int) -> dict[str, Any]:
        """vLLM prefill: keep the handoff for a remote decode; its ``kv_transfer_params`` (never
        returns with ``bootstrap_hang``)."""
        if self.fault == "bootstrap_hang":
            self.counters["faults"] += 1
            await asyncio.Event().wait()
        key = uuid.uuid4().hex
        h = self._handoff(key)
        h.prompt_len = prompt_len
        h.expires_s = time.monotonic() + self.waiting_timeout_s
        h.ready.set()
        self._expire()
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(range(max(1, n_blocks))),
                "remote_engine_id": self.engine_id, "remote_request_id": key, "remote_host": self.host,
                "remote_port": self._port(), "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": prompt_len,
                "remote_blocks_expiry_time": None, "remote_registration_generation": 0, "transfer_mode": "pull"}

    def _expire(self) -> None:
        now = time.monotonic()
        for k in [k for k, h in self._handoffs.items() if h.expires_s and h.expires_s < now]:
            del self._handoffs[k]

    async def serve_pull(self, key: str, wait_s: float) -> dict[str, Any] | None:
        """``GET /stub_pd/kv``: the handoff ``key`` once ready (waiting up to ``wait_s``), else None."""
        h = self._handoffs.get(key)
        placeholder = h is None
        if h is None:
            if wait_s <= 0:
                return None
            h = self._handoff(key)  # the decode server came first: wait for the prefill to offer it
        if not h.ready.is_set():
            try:
                await asyncio.wait_for(h.ready.wait(), wait_s)
            except TimeoutError:
                if placeholder and self._handoffs.get(key) is h and not h.ready.is_set():
                    del self._handoffs[key]  # never offered: no placeholder lingers
                return None
        h.pulled.set()
        self._handoffs.pop(key, None)
        self.counters["pulls_served"] += 1
        return {"prompt_len": h.prompt_len}

    # ------------------------------------------------------------------ decode side
    async def _get(self, url: str, timeout_s: float) -> dict | None:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        async with self._http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return await resp.json() if resp.status == 200 else None

    async def pull_sglang(self, body: dict) -> None:
        """SGLang decode: pull the room from its prefill server, waiting (long polls, retrying an
        unreachable server) up to ``waiting_timeout_s``; raises :class:`PdRefused` after that."""
        host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
        url = f"http://{host}:{port}/stub_pd/kv?key={room}&wait_s={_PULL_WAIT_S}"
        end = time.monotonic() + self.waiting_timeout_s
        while time.monotonic() < end:
            try:
                if await self._get(url, _PULL_WAIT_S + 5.0) is not None:
                    return
            except (aiohttp.ClientError, TimeoutError, ValueError):
                await asyncio.sleep(0.1)  # the prefill server is not there (yet, or any more)
        self.counters["pull_failures"] += 1
        raise PdRefused(f"KV of room {room} not received within {self.waiting_timeout_s:g} s")

    async def pull_vllm(self, ktp: dict) -> None:
        """vLLM decode: pull the prefill's blocks once; raises :class:`PdRefused` when they are not there."""
        url = f"http://{ktp.get('remote_host')}:{ktp.get('remote_port')}/stub_pd/kv?key={ktp.get('remote_request_id')}&wait_s=0"
        try:
            got = await self._get(url, 5.0)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            got = None
            why = f"{type(exc).__name__}"
        else:
            why = "unknown remote_request_id"
        if got is None:
            self.counters["pull_failures"] += 1
            raise PdRefused(f"KV load failed from {ktp.get('remote_host')}:{ktp.get('remote_port')} ({why})")
