"""The request proxy: one mesh REQUEST served against the engine's HTTP API.

Every outcome but a cancel ends in a FINAL or an ERROR frame on the request's :class:`ReplyLink`
(a P/D prefill leg may send both: FINAL ``prefill_done`` at its handoff, ERROR if it fails later);
an exception of the engine path is mapped by :func:`~mesh.adapters.engine_client.engine_error`
into the ERROR's code. The engine is reached through an :class:`EngineTransport`
(:class:`mesh.adapters.engine_http.EngineHttp`); what is sent and how answers are read is the
:class:`~mesh.adapters.backend.Backend`'s.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import AbstractAsyncContextManager
from typing import Any, AsyncIterator, Callable, Protocol

import orjson

from mesh import protocol as P
from mesh import tracing
from mesh.adapters.backend import Backend, EngineInfo, StreamState
from mesh.adapters.deadlines import Deadlines
from mesh.adapters.engine_client import engine_error, engine_refusal, error_code_for_status, sse_events
from mesh.adapters.passthrough import PASSTHROUGH_NOT_DISAGGREGATED, PassthroughProxy
from mesh.errors import ErrorCode, RequestError
from mesh.openai_logprobs import LOGPROB_KEYS

__all__ = ["ReplyLink", "EngineTransport", "RequestProxy", "DP_RANK_HEADER"]

#: Pins a request to a DP rank: vLLM's OpenAI server (``_get_data_parallel_rank``) and SGLang's
#: OpenAI endpoints read it; SGLang's ``/generate`` takes the body field ``routed_dp_rank``.
DP_RANK_HEADER = "X-Data-Parallel-Rank"


class ReplyLink(Protocol):
    """Where one request's CHUNK, FINAL and ERROR frames go (a :class:`mesh.worker.BrokerLink`)."""

    def send(self, frames: list[bytes]) -> bool: ...


class EngineTransport(Protocol):
    """The request path to the engine (:class:`mesh.adapters.engine_http.EngineHttp`)."""

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> tuple[int, bytes]: ...

    def stream(self, method: str, path: str, body: bytes = b"",
               headers: dict[str, str] | None = None) -> AbstractAsyncContextManager[tuple[int, AsyncIterator[bytes]]]: ...


class RequestProxy:
    """Serves the REQUESTs of one attached engine. ``counters`` are the adapter's (shared);
    ``on_unavailable`` is called when the engine looks gone (the adapter checks its health now)."""

    def __init__(self, backend: Backend, engine: EngineTransport, info: EngineInfo, *, url: str, base_url: str,
                 worker_id: str, counters: Counter, log, on_unavailable: Callable[[], None]) -> None:
        self.backend = backend
        self.engine = engine
        self.info = info
        self.url = url
        self.base_url = base_url
        self.worker_id = worker_id
        self.counters = counters
        self.log = log
        self.on_unavailable = on_unavailable
        self.deadlines = Deadlines()  # the requests' deadlines, on one timer
        # what mesh does not render goes to the engine's own OpenAI endpoint (mesh.adapters.passthrough)
        self.passthrough = PassthroughProxy(engine, info, url=url, counters=counters, log=log,  # type: ignore[arg-type]
                                            deadlines=self.deadlines)

    async def serve(self, link: ReplyLink, r: P.Request) -> None:
        """Serve one REQUEST; every outcome but a cancel ends in a FINAL or an ERROR frame. An
        exception of the engine path is mapped by :func:`engine_error` into the ERROR's code."""
        try:
            if (r.bootstrap or {}).get("mode") == "prefill" and r.submit.passthrough is not None:
                code, msg = ErrorCode.BAD_REQUEST, PASSTHROUGH_NOT_DISAGGREGATED
            elif (r.bootstrap or {}).get("mode") == "prefill":
                code, msg = await self._prefill_leg(link, r)
            else:
                code, msg = await self._proxy(link, r)
        except Exception as exc:
            err = engine_error(exc, f"{self.backend.kind} engine at {self.url}")
            if err.code is ErrorCode.INTERNAL:
                self.log.error("request_failed", rid=r.rid, error=str(err)[:500], exc_info=exc)
            elif err.code is ErrorCode.UNAVAILABLE:
                self.on_unavailable()  # is the engine still there? check now, not in a second
            code, msg = (err.code, err.message) if isinstance(err, RequestError) else (ErrorCode.INTERNAL, str(err))
        if code is not None:
            self.counters[f"errors_{code.value}"] += 1
            link.send(P.encode_worker_error(r.rid, r.attempt, code, msg))

    async def _prefill_leg(self, link: ReplyLink, r: P.Request) -> tuple[ErrorCode | None, str]:
        """PD prefill leg. Its outcome always reaches the broker: FINAL ``prefill_done`` hands
        the request to the decode leg, and an ERROR for this same attempt, even after that FINAL,
        says the leg failed (the broker then aborts the decode leg and retries the pair).

        SGLang (the backend's handoff is known at once): a disaggregated prefill server only
        finishes once the decode server pulled the KV, so the FINAL with the bootstrap address goes
        first and the engine request runs on here. vLLM (no handoff yet): the engine's answer
        carries the ``kv_transfer_params`` the decode leg needs; the FINAL follows it. Either way
        the engine request is bounded by ``bootstrap_timeout_s`` (and the request's deadline)."""
        try:
            plan = self.backend.prefill_leg(r, self.info)
        except ValueError as exc:  # a parameter this engine has no equivalent for (vLLM): refused by name
            self.counters["params_refused"] += 1
            return ErrorCode.BAD_REQUEST, f"{self.backend.kind} adapter: {exc}"[:512]
        if plan is None:
            return ErrorCode.BAD_REQUEST, f"{self.backend.kind} adapter: prefill/decode disaggregation is not supported"
        path, body, handoff = plan
        self.counters["prefill_legs"] += 1
        if handoff is not None:
            self._send_prefill_done(link, r, {}, handoff)
        try:
            code, msg, answer = await self._prefill_request(path, body, r)
        except Exception:  # the engine is unreachable or reset the connection: mapped in serve
            self.counters["prefill_leg_errors"] += 1
            raise
        if code is None:  # (an engine may answer 200 with an error or an aborted request inside)
            st = StreamState()
            self.backend.parse(answer, st, self.info)
            if st.error is not None:
                code, msg = st.error
            elif handoff is None:
                data = self.backend.prefill_handoff(answer)
                if data is None:
                    code, msg = ErrorCode.WORKER_ERROR, ("the prefill engine's answer carries no KV transfer parameters "
                                                         "(is it started for disaggregated prefill, e.g. --kv-transfer-config?)")
                else:
                    self._send_prefill_done(link, r, st.usage, data)
        if code is not None:
            self.counters["prefill_leg_errors"] += 1
            self.log.warning("prefill_leg_failed", rid=r.rid, attempt=r.attempt, code=code.value, error=msg[:200])
        return code, msg

    async def _prefill_request(self, path: str, body: dict[str, Any], r: P.Request) -> tuple[ErrorCode | None, str, Any]:
        """The prefill leg's engine request: (None, "", answer JSON) or (code, message, None).
        Transport errors propagate (mapped by :func:`engine_error` in :meth:`serve`)."""
        bound_s = self.backend.s.bootstrap_timeout_s
        deadline_s = r.deadline_ms / 1000 if r.deadline_ms > 0 else None
        timeout_s = bound_s if deadline_s is None else min(bound_s, deadline_s)
        try:
            async with asyncio.timeout(timeout_s):
                status, raw = await self.engine.request("POST", path, orjson.dumps(body))
        except TimeoutError:
            if deadline_s is not None and deadline_s <= bound_s:
                return ErrorCode.DEADLINE_EXCEEDED, "deadline passed during the prefill leg", None
            self.counters["prefill_leg_timeouts"] += 1
            return ErrorCode.WORKER_ERROR, (f"prefill leg did not complete within bootstrap_timeout_s={bound_s:g} "
                                            f"(prefill or KV handoff to the decode server stuck)"), None
        if status != 200:
            return error_code_for_status(status), f"prefill leg: HTTP {status} from {path}: {raw[:512].decode('utf-8', 'replace')}", None
        try:
            return None, "", orjson.loads(raw)
        except orjson.JSONDecodeError:
            return ErrorCode.WORKER_ERROR, f"prefill leg: {path} answered no JSON", None

    def _send_prefill_done(self, link: ReplyLink, r: P.Request, usage: dict[str, int], data: dict[str, Any]) -> None:
        prompt = len(r.submit.input_ids) if r.submit.input_ids is not None else 0
        link.send(P.encode_worker_final(r.rid, r.attempt, "prefill_done",
                                        {"prompt_tokens": usage.get("prompt_tokens", prompt), "completion_tokens": 0,
                                         "cached_tokens": usage.get("cached_tokens", 0)}, data))

    async def _proxy(self, link: ReplyLink, r: P.Request) -> tuple[ErrorCode | None, str]:
        """:meth:`_proxy_engine`, in a CLIENT span continuing the caller's trace when tracing is on
        and the SUBMIT carries a ``traceparent``; the engine gets this span's ``traceparent``
        header (SGLang and vLLM continue it with their own OpenTelemetry tracing)."""
        tp = r.submit.traceparent
        if tp is None or not tracing.enabled():
            return await self._proxy_engine(link, r, None)
        with tracing.client_span(f"mesh adapter {self.backend.kind}", tp,
                                 {"mesh.request_id": r.submit.rid, "mesh.worker": self.worker_id,
                                  "mesh.attempt": r.attempt, "server.address": self.url}):
            mine = tracing.current_traceparent()
            code, msg = await self._proxy_engine(link, r, {"traceparent": mine} if mine else None)
            if code is not None:
                tracing.annotate(error_code=code.value)
            return code, msg

    async def _proxy_engine(self, link: ReplyLink, r: P.Request,
                            headers: dict[str, str] | None) -> tuple[ErrorCode | None, str]:
        """Run one request against the server; returns an error to send, or (None, "") when done.

        A request the client does not stream is sent unstreamed when the backend allows it (one
        JSON body, no SSE). A streamed one becomes CHUNKs for every engine event but the one that
        carries the finish reason, whose delta rides in the FINAL, so a stream ends as the
        engine's does. The engine's own per-event metadata (SGLang's ``meta_info``) is passed
        through: scalars on every CHUNK, all of it (bounded) on an unstreamed FINAL. Positional
        lists (logprobs, :data:`~mesh.openai_logprobs.LOGPROB_KEYS`) travel as their new part: a
        CHUNK carries the entries of its own tokens (the input ones with the first), a streamed
        FINAL those of its delta, whether the engine streams them cumulatively or not."""
        sub = r.submit
        if r.dp_rank is not None:  # DP attention: the header vLLM and SGLang's OpenAI endpoints read
            headers = {**(headers or {}), DP_RANK_HEADER: str(r.dp_rank)}
        if sub.passthrough is not None:
            return await self.passthrough.serve(link, r, headers)
        try:
            path, body = self.backend.request(r, self.info)
        except ValueError as exc:  # a parameter this engine has no equivalent for (vLLM): refused by name
            self.counters["params_refused"] += 1
            return ErrorCode.BAD_REQUEST, f"{self.backend.kind} adapter: {exc}"[:512]
        engine_streams = bool(body.get("stream"))
        try:
            payload = orjson.dumps(body)
        except (orjson.JSONEncodeError, TypeError) as exc:  # e.g. an integer param beyond 64 bits
            return ErrorCode.BAD_REQUEST, f"request parameters cannot be sent to the engine as JSON: {exc}"[:512]
        st = StreamState(prompt_len=len(sub.input_ids) if sub.input_ids is not None else 0)
        timeout_s = r.deadline_ms / 1000 if r.deadline_ms > 0 else None
        final_sent = False
        try:
            async with self.deadlines.bound(timeout_s):
                if not engine_streams:
                    status, raw = await self.engine.request("POST", path, payload, headers)
                    if status != 200:
                        return engine_refusal(status, raw, path)
                    obj = orjson.loads(raw)  # not JSON: engine_error's worker_error
                    self.backend.parse(obj, st, self.info)
                    if st.error is not None:
                        return st.error
                    if st.finish is None:
                        return ErrorCode.WORKER_ERROR, "engine answer holds no finish reason"
                    self._send_final(link, r, st, st.new_ids, st.new_text)
                    return None, ""
                # What the FINAL carries: everything for an unstreamed client; for a streaming one
                # the deltas from the event with the finish reason on (usage may follow it).
                held_ids: list[int] = []
                held_text: list[str] = []
                held_lists: dict[str, list] = {}
                seq = 0
                async with self.engine.stream("POST", path, payload, headers) as (status, chunks):
                    if status != 200:
                        head = b""
                        async for piece in chunks:
                            head += piece
                            if len(head) >= 4096:
                                break
                        return engine_refusal(status, head, path)
                    async for data in sse_events(chunks):
                        if final_sent:
                            continue  # read to the end: the connection is then reused
                        if data == b"[DONE]":
                            if st.finish is not None:
                                self._send_final(link, r, st, held_ids, "".join(held_text), held_lists)
                                final_sent = True
                            continue
                        try:
                            obj = orjson.loads(data)
                        except orjson.JSONDecodeError:
                            self.counters["bad_stream_chunks"] += 1
                            continue
                        st.new_ids, st.new_text = [], ""
                        if st.new_lists:
                            st.new_lists = {}
                        self.backend.parse(obj, st, self.info)
                        if st.error is not None:
                            return st.error
                        if sub.stream and st.finish is None and (st.new_ids or st.new_text):
                            chunk: dict[str, Any] = {"token_ids": st.new_ids}
                            if st.new_text:
                                chunk["text"] = st.new_text
                            if st.meta is not None:
                                chunk["meta_info"] = _scalar_meta(st.meta)
                            if st.new_lists or held_lists:
                                _extend_lists(held_lists, st.new_lists)
                                chunk["meta_info"] = {**chunk.get("meta_info", {}), **self.bounded_lists(held_lists)}
                                held_lists = {}
                            link.send(P.encode_worker_chunk(r.rid, r.attempt, seq, chunk))
                            seq += 1
                        else:
                            held_ids.extend(st.new_ids)
                            held_text.append(st.new_text)
                            _extend_lists(held_lists, st.new_lists)
                    if not final_sent and st.finish is not None:  # a stream without [DONE]
                        self._send_final(link, r, st, held_ids, "".join(held_text), held_lists)
                        final_sent = True
        except TimeoutError:
            if final_sent:
                return None, ""
            return ErrorCode.DEADLINE_EXCEEDED, "deadline passed while the engine was generating"
        except Exception:
            if final_sent:
                return None, ""  # the answer is out; the engine only failed to end the stream cleanly
            raise  # mapped by engine_error in _serve
        if not final_sent:
            return ErrorCode.WORKER_ERROR, "engine stream ended without a finish reason"
        return None, ""

    def _send_final(self, link: ReplyLink, r: P.Request, st: StreamState, ids: list[int], text: str,
                    lists: dict[str, list] | None = None) -> None:
        """``lists``: for a streamed answer, the positional lists of the delta sent here (the
        engine's last meta then contributes its scalars only); None: the meta is the whole answer's."""
        usage = {"prompt_tokens": st.usage.get("prompt_tokens", st.prompt_len),
                 "completion_tokens": st.usage.get("completion_tokens", 0),
                 "cached_tokens": st.usage.get("cached_tokens", 0)}
        data: dict[str, Any] = {"token_ids": ids}
        if text:
            data["text"] = text
        if lists is not None:
            meta = _scalar_meta(st.meta) if st.meta is not None else {}
            if lists:
                meta.update(self.bounded_lists(lists))
            if st.meta is not None or lists:
                data["meta_info"] = meta
        elif st.meta is not None:
            data["meta_info"] = self._final_meta(st.meta)
        link.send(P.encode_worker_final(r.rid, r.attempt, st.finish or "stop", usage, data))
        self.counters["requests_ok"] += 1

    def _final_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The engine's final metadata, whole unless it would crowd the frame (logprobs of a long
        answer): then its scalars only, counted."""
        if len(meta) <= 32 and all(type(v) in _META_SCALARS or type(v) is dict and len(v) <= 8 for v in meta.values()):
            return meta  # the common case, nothing to measure
        try:
            if len(P.pack(meta)) <= _MAX_META_BYTES:
                return meta
        except (TypeError, ValueError, OverflowError):
            pass
        lists = {k: v for k, v in meta.items() if k in LOGPROB_KEYS and type(v) is list}
        kept = self.bounded_lists(lists, measure=True) if lists else {}
        if len(kept) == len(lists):  # what was dropped is not a list
            self.counters["meta_info_truncated"] += 1
        return {**_scalar_meta(meta), **kept}

    def bounded_lists(self, lists: dict[str, list], measure: bool = False) -> dict[str, list]:
        """Positional meta lists within the frame budget: whole when they fit, else without the
        input lists, then without the alternatives (top logprobs), then none (counted as
        ``meta_info_truncated`` when anything is dropped)."""
        if not measure and sum(len(v) for v in lists.values()) <= 256:
            return lists  # a chunk's worth: nothing to measure
        for keep in (lambda k: True, lambda k: not k.startswith("input_"), lambda k: k == "output_token_logprobs"):
            cand = {k: v for k, v in lists.items() if keep(k)}
            try:
                if len(P.pack(cand)) <= _MAX_META_BYTES:
                    if len(cand) < len(lists):
                        self.counters["meta_info_truncated"] += 1
                    return cand
            except (TypeError, ValueError, OverflowError):
                pass
        self.counters["meta_info_truncated"] += 1
        return {}


_META_SCALARS = (int, float, str, bool, type(None))
_MAX_META_BYTES = 1 << 20  # FINAL frames stay far below the 4 MiB frame cap


def _extend_lists(into: dict[str, list], new: dict[str, list]) -> None:
    for k, v in new.items():
        into.setdefault(k, []).extend(v)


def _scalar_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """Per-chunk metadata: the scalar fields (counts, ids, latencies) and the finish reason, not
    the lists (logprobs) that SGLang repeats cumulatively in every chunk."""
    return {k: v for k, v in meta.items() if type(v) in _META_SCALARS or (k == "finish_reason" and type(v) is dict)}
