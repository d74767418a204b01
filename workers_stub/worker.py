"""The simulated GPU worker: :class:`mesh.engine_model.EngineModel` stepped in real time.

One :class:`SimWorker` is one GPU server. Its :class:`mesh.worker.WorkerAPI` keeps one link per
broker, so a single worker serves every broker of a mesh; requests from any broker share its
engine (its batch, its KV cache). It reports true load in every HEARTBEAT (the API's load
callback) and publishes KV events with SGLang's page-hash values after each prefill and every
``decode_log_interval`` decode steps (the API fans them out).

Request keys: the engine knows a request by an int ``key``; ``_jobs`` maps it back to the
(link, broker rid, attempt) it answers to, so replies go to the broker that sent the request.

Instant workers (answer every REQUEST at once, no engine) live in :mod:`workers_stub.instant`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import zmq.asyncio

from mesh import kv_events as KV
from mesh import protocol as P
from mesh.config import WorkerSettings
from mesh.discovery import Resolver
from mesh.engine_model import EngineConfig, EngineModel
from mesh.errors import ErrorCode
from mesh.hashing import text_to_tokens
from mesh.logs import get_logger
from mesh.namespaces import request_event_fields
from mesh.openai_passthrough import NO_ENGINE_MESSAGE
from mesh.sockets import CurveKeys
from mesh.worker import BrokerLink, Capabilities, WorkerAPI

__all__ = ["SimWorker"]


_WORDS = ("the", "mesh", "routes", "every", "request", "to", "a", "worker", "that", "holds", "its", "prefix",
          "in", "cache", "and", "keeps", "load", "even", "across", "GPUs", "while", "brokers", "share", "state")


def detok(token_ids: list[int]) -> str:
    """The stub's detokenizer: a deterministic word per token id (readable demo output)."""
    return "".join(" " + _WORDS[t % len(_WORDS)] for t in token_ids)


@dataclass(slots=True)
class _Job:
    link: BrokerLink
    rid: int
    attempt: int
    deadline_s: float
    stream: bool
    seq: int = 0
    tokens: list[int] | None = None  # collected output when not streaming
    mode: str = "mixed"  # mixed | prefill (PD first leg: stop after the prompt) | decode | prompt_only (max_new_tokens 0)


_TOKENIZERS: dict[str, object] = {}  # model folder -> mesh.tokenization.ModelTokenizer

#: Sampling parameters a simulated worker cannot honour (its output is made up, not sampled): a
#: request that sets one is refused by name rather than answered as if it had been applied.
UNHONOURED_PARAMS = ("stop", "stop_regex", "stop_token_ids", "json_schema", "regex", "ebnf", "structural_tag")


def unhonoured(params: dict | None) -> str | None:
    """The first parameter of ``params`` the simulated worker would ignore (None: none)."""
    if not params:
        return None
    for k in UNHONOURED_PARAMS:
        if params.get(k) not in (None, [], "", ()):
            return k
    return None


class SimWorker:
    """A simulated GPU worker process component. ``await run()``; ``stop()`` drains and exits."""

    def __init__(
        self,
        settings: WorkerSettings,
        worker_id: str,
        engine_cfg: EngineConfig | None = None,
        *,
        ctx: zmq.asyncio.Context | None = None,
        curve: CurveKeys | None = None,
        kv_events_to: str = "all",
        stream_interval: int = 1,
        fail_transfer_every: int = 0,
        fail_requests_every: int = 0,
        resolver: Resolver | None = None,
    ) -> None:
        self.s = settings
        self.worker_id = worker_id
        self.cfg = engine_cfg or EngineConfig()
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.stream_interval = max(1, stream_interval)
        self.fail_transfer_every = fail_transfer_every  # fault injection: every Nth KV transfer fails
        self._transfers = 0
        self.fail_requests_every = fail_requests_every  # fault injection: every Nth request errors
        self._requests_seen = 0
        self.log = get_logger(service="worker", worker_id=worker_id)
        self.engine = EngineModel(self.cfg)
        self._jobs: dict[int, _Job] = {}
        self._by_remote: dict[tuple[int, int, int], int] = {}  # (id(link), rid, attempt) -> key
        self._keys = itertools.count(1)
        self._work = asyncio.Event()
        self._idle = asyncio.Event()  # set whenever no request is in flight (drain waits on it)
        self._stopping = False
        if settings.tokenizer:
            self._encode("")  # load it now: a bad folder is a startup error, not a slow first request
        self._pending_kv: list[KV.KvEvent] = []
        self.time_scale = settings.time_scale
        caps = Capabilities(model=settings.model, role=settings.role, labels=dict(settings.labels), block_size=self.cfg.page_size,
                            max_running_requests=self.cfg.max_running_requests,
                            max_total_num_tokens=self.cfg.max_total_num_tokens, dp_size=1)
        self.api = WorkerAPI(self.ctx, settings.brokers, worker_id, lambda: caps, on_message=self._on_message,
                             on_session_lost=self._on_session_lost, load=lambda: [self.engine.load_stat(now_s=self._now())],
                             heartbeat_ms=settings.heartbeat_ms, liveness=settings.liveness,
                             reconnect_base_ms=settings.reconnect_base_ms, reconnect_cap_ms=settings.reconnect_cap_ms,
                             curve=curve, kv_events_to=kv_events_to, discovery_refresh_s=settings.discovery_refresh_s,
                             resolver=resolver)
        self.served = 0

    @property
    def epoch(self) -> int:
        return self.api.epoch

    @property
    def links(self) -> list[BrokerLink]:
        return self.api.links

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        engine = asyncio.create_task(self._engine_loop(), name="engine")
        try:
            await asyncio.gather(self.api.run(), engine)
        finally:
            engine.cancel()
            await asyncio.gather(engine, return_exceptions=True)
            await self.api.aclose()

    async def drain_and_stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop: tell brokers we are leaving, finish in-flight work, then close links."""
        self._stopping = True
        self.api.drain()
        if self._jobs:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                self.log.warning("drain_timeout", unfinished=len(self._jobs))
        self.api.disconnect(say_goodbye=True)  # a plain DISCONNECT: the broker forgets this worker

    # ------------------------------------------------------------------ inbound

    def _on_session_lost(self, link: BrokerLink, why: str) -> None:
        """The broker forgot this link's session: its requests are handled there; drop ours."""
        for key, job in list(self._jobs.items()):
            if job.link is link:
                self._drop_job(key)
                self.engine.cancel(key)

    def _on_message(self, link: BrokerLink, msg: object) -> None:
        t = type(msg)
        if t is P.Request:
            self._on_request(link, msg)  # type: ignore[arg-type]
        elif t is P.WorkerCancel:
            key = self._by_remote.get((id(link), msg.rid, msg.attempt))  # type: ignore[union-attr]
            if key is not None:
                self._drop_job(key)
                self.engine.cancel(key)
        elif t is P.Resync:
            # One sequence per worker stream (brokers and an indexer dedup by it), so the
            # snapshot goes out like any batch, after whatever is still buffered.
            self._flush_kv()
            self._send_kv(list(self.engine.snapshot_events()))
        elif isinstance(msg, Exception):
            self.log.warning("frame_rejected", reason=getattr(msg, "reason", "?"))

    def _encode(self, text: str) -> list[int]:
        """A text prompt's ids: the model's tokenizer (``--tokenizer``), else UTF-8 bytes."""
        if not self.s.tokenizer:
            return text_to_tokens(text)
        tok = _TOKENIZERS.get(self.s.tokenizer)
        if tok is None:  # one per process, shared by its workers
            from mesh.tokenization import ModelTokenizer

            tok = _TOKENIZERS[self.s.tokenizer] = ModelTokenizer.from_dir(self.s.tokenizer)
        try:
            return tok.encode(text)
        except (ValueError, TypeError):
            return text_to_tokens(text)

    def _on_request(self, link: BrokerLink, r: P.Request) -> None:
        sub = r.submit
        if self._stopping:
            link.send(P.encode_worker_error(r.rid, r.attempt, ErrorCode.UNAVAILABLE, "worker draining"))
            return
        prompt = sub.input_ids if sub.input_ids is not None else self._encode(sub.text or "")
        if self.fail_requests_every:
            self._requests_seen += 1
            if self._requests_seen % self.fail_requests_every == 0:
                # fault injection: a broken GPU answering with errors (outlier ejection tests)
                link.send(P.encode_worker_error(r.rid, r.attempt, ErrorCode.WORKER_ERROR, "injected worker fault"))
                return
        if sub.passthrough is not None:  # the engine's own OpenAI server would serve it: there is none here
            link.send(P.encode_worker_error(r.rid, r.attempt, ErrorCode.BAD_REQUEST, NO_ENGINE_MESSAGE))
            return
        bad = unhonoured(sub.params)
        if bad is not None:
            what = "response_format" if bad == "json_schema" else bad
            link.send(P.encode_worker_error(r.rid, r.attempt, ErrorCode.BAD_REQUEST,
                                            f"{what}: not supported by the simulated worker (mesh worker-stub makes its output "
                                            "up); send it to an SGLang or vLLM engine (mesh attach), or drop the parameter"))
            return
        mode = (r.bootstrap or {}).get("mode", "mixed")
        if mode == "mixed" and sub.max_new_tokens == 0:
            mode = "prompt_only"  # max_new_tokens 0: the prompt is prefilled (and cached), nothing is generated
        if mode == "decode" and self.fail_transfer_every:
            self._transfers += 1
            if self._transfers % self.fail_transfer_every == 0:
                # fault injection: the modelled KV transfer failed; retryable, nothing was streamed
                link.send(P.encode_worker_error(r.rid, r.attempt, ErrorCode.WORKER_ERROR, "KV transfer from the prefill worker failed"))
                return
        key = next(self._keys)
        now = self._now()
        try:
            lora, xkey, salt = request_event_fields(sub.params)  # the engine's cache namespace
            self.engine.submit(key, prompt, 1 if mode in ("prefill", "prompt_only") else max(1, sub.max_new_tokens), now,
                               transferred=mode == "decode", lora_name=lora, extra_key=xkey, cache_salt=salt)
        except ValueError as exc:
            link.send(P.encode_worker_error(r.rid, r.attempt, ErrorCode.BAD_REQUEST, str(exc)))
            return
        self._jobs[key] = _Job(link, r.rid, r.attempt, time.monotonic() + r.deadline_ms / 1000.0, sub.stream and mode != "prefill",
                               tokens=None if sub.stream else [], mode=mode)
        self._by_remote[(id(link), r.rid, r.attempt)] = key
        self._work.set()

    def _drop_job(self, key: int) -> _Job | None:
        job = self._jobs.pop(key, None)
        if job is not None:
            self._by_remote.pop((id(job.link), job.rid, job.attempt), None)
            if not self._jobs:
                self._idle.set()
        return job

    # ------------------------------------------------------------------ engine

    def _now(self) -> float:
        """Engine time in model seconds (real time divided by the time scale)."""
        return time.monotonic() / self.time_scale

    async def _engine_loop(self) -> None:
        pending: dict[int, list[int]] = {}
        while True:
            if not self.engine.has_work():
                self._flush_kv()
                self._work.clear()
                await self._work.wait()
                continue
            res = self.engine.step(self._now())
            await asyncio.sleep(res.duration_s * self.time_scale)
            self._check_deadlines()
            for key, tok in res.tokens:
                job = self._jobs.get(key)
                if job is None:
                    continue
                if job.mode in ("prefill", "prompt_only"):
                    continue
                if job.stream:
                    buf = pending.setdefault(key, [])
                    buf.append(tok)
                    if len(buf) >= self.stream_interval:
                        job.link.send(P.encode_worker_chunk(job.rid, job.attempt, job.seq, {"token_ids": buf, "text": detok(buf)}))
                        job.seq += 1
                        del pending[key]
                else:
                    job.tokens.append(tok)  # type: ignore[union-attr]
            for key, reason, usage in res.finished:
                job = self._drop_job(key)
                buf = pending.pop(key, None)
                if job is None:
                    continue
                if job.mode == "prefill":
                    # PD first leg: the prompt's KV is ready for the decode worker
                    job.link.send(P.encode_worker_final(job.rid, job.attempt, "prefill_done", usage, {}))
                    self.served += 1
                    continue
                if job.mode == "prompt_only":
                    usage = {**usage, "completion_tokens": 0}
                    data = {} if job.stream else {"token_ids": [], "text": ""}
                    job.link.send(P.encode_worker_final(job.rid, job.attempt, "length", usage, data))
                    self.served += 1
                    continue
                if buf:
                    job.link.send(P.encode_worker_chunk(job.rid, job.attempt, job.seq, {"token_ids": buf, "text": detok(buf)}))
                    job.seq += 1
                data = {} if job.stream else {"token_ids": job.tokens, "text": detok(job.tokens)}
                job.link.send(P.encode_worker_final(job.rid, job.attempt, reason, usage, data))
                self.served += 1
            if res.kv_events:
                self._pending_kv.extend(res.kv_events)
                self._flush_kv()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for key, job in list(self._jobs.items()):
            if job.deadline_s < now:
                self._drop_job(key)
                self.engine.cancel(key)
                job.link.send(P.encode_worker_error(job.rid, job.attempt, ErrorCode.DEADLINE_EXCEEDED, "deadline passed on worker"))

    def _flush_kv(self) -> None:
        if self._pending_kv:
            events, self._pending_kv = self._pending_kv, []
            self._send_kv(events)

    def _send_kv(self, events: list[KV.KvEvent]) -> None:
        """Send ``events`` as KV_EVENTS batches of at most ``MAX_KV_BATCH_BLOCKS`` blocks (brokers
        refuse larger ones; the API fans each out to the brokers)."""
        for chunk in KV.split_events(events, 1 << 62, 1 << 62, max_blocks=P.MAX_KV_BATCH_BLOCKS) or [[]]:
            self.api.publish_kv([KV.encode_event_map(e) for e in chunk])
