"""The adapter's request proxy and HTTP load fallback against a real stub process (in-process
adapter, FakeBroker sending REQUEST/CANCEL frames): incremental streaming, non-streaming, HTTP
error mapping, cancellation reaching the engine, LoadStat from ``/metrics`` when there is neither a
LoadStat stream nor ``/v1/loads`` / ``/get_load``, and DP-size discovery.
"""

from __future__ import annotations


import aiohttp

from mesh import protocol as P
from mesh.adapters.base import Adapter
from mesh.adapters.engine_client import parse_prometheus
from mesh.adapters.settings import AttachSettings
from mesh.adapters.sglang import SglangBackend
from mesh.engine_model import output_token_id
from tests.conftest import run
from tests.adapters_support import FakeBroker, start_stub, until


def _submit(rid: str, ids: list[int], n: int, stream: bool = True) -> bytes:
    return P.encode_submit(rid, input_ids=ids, params={"max_new_tokens": n, "temperature": 0.0}, stream=stream)[2]


def _stub_made(tokens: list[int]) -> bool:
    return any(tokens == [output_token_id(k, i, 32_000) for i in range(len(tokens))] for k in range(1, 100))


def test_proxy_incremental_stream_errors_cancel_and_metrics_load(procs):
    _, rec = start_stub(procs, "stub", "--time-scale", "0.05", "--dp-size", "2", "--incremental-streaming-output",
                        "--http-load-api", "metrics", "--load-port", "-1", "--max-total-num-tokens", "4096")

    async def go():
        fb = FakeBroker().start()
        s = AttachSettings(url=rec["url"], brokers=(fb.endpoint,), worker_id="w", heartbeat_ms=100, load_poll_ms=100)
        ad = Adapter(s, SglangBackend(s))
        await ad.start()
        try:
            await until(lambda: fb.readies and fb.sessions, 10, "registration")
            r = fb.readies[0]
            assert (r.dp_size, r.block_size, r.max_total_num_tokens, r.model) == (2, 16, 4096, "stub-sglang-8b")
            assert ad.info.incremental_streaming and len(ad.relay.ranks) == 2

            # load from /metrics (no LoadStat stream, no /v1/loads, no /get_load): one per rank
            await until(lambda: any(len(h.load) == 2 for h in fb.heartbeats), 10, "load in heartbeats")
            hb = next(h for h in fb.heartbeats if len(h.load) == 2)
            assert sorted(x.attn_dp_rank for x in hb.load) == [0, 1] and not hb.load[0].extended
            assert ad.backend.unsupported == {"v1_loads", "get_load"}

            fb.request(1, _submit("s", list(range(1, 50)), 8))  # streamed, deltas from the server
            fb.request(2, _submit("n", list(range(1, 50)), 5, stream=False))
            fb.request(3, _submit("big", list(range(1, 5000)), 5))  # > KV capacity: HTTP 400
            await until(lambda: {1, 2} <= set(fb.finals) and 3 in fb.errors, 10, "replies")
            # the engine's last event (the one with the finish reason) rides in the FINAL, so the
            # stream ends as the engine's does; its meta_info is passed through
            f1 = fb.finals[1]
            last = P.unpack(f1.data)
            toks = [t for c in fb.chunks[1] for t in c["token_ids"]] + last["token_ids"]
            assert len(fb.chunks[1]) >= 2 and len(toks) == 8 and _stub_made(toks) and len(last["token_ids"]) == 1
            assert "".join(c.get("text", "") for c in fb.chunks[1]).split() != []
            assert all(c["meta_info"]["finish_reason"] is None for c in fb.chunks[1])
            assert [c["meta_info"]["completion_tokens"] for c in fb.chunks[1]] == list(range(1, 8))
            assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
            assert f1.finish_reason == "length" and f1.usage["completion_tokens"] == 8
            assert 2 not in fb.chunks and len(P.unpack(fb.finals[2].data)["token_ids"]) == 5
            # beyond the KV capacity: context_length_exceeded (issue 30; it was bad_request with the engine JSON inside)
            assert fb.errors[3].code == "context_length_exceeded" and "HTTP 400" in fb.errors[3].message

            # CANCEL mid-stream: the HTTP stream is closed and the server aborts the request
            fb.request(4, _submit("long", list(range(1, 40)), 100_000))
            await until(lambda: fb.chunks.get(4), 10, "first chunk")
            fb.cancel(4)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
                async def aborted() -> bool:
                    async with http.get(rec["url"] + "/metrics") as resp:
                        m = parse_prometheus(await resp.text())
                    return sum(v for n, _, v in m if n == "sglang:num_aborted_requests_total") == 1 and \
                        sum(v for n, _, v in m if n == "sglang:num_running_reqs") == 0
                await until(aborted, 5, "the engine counted the abort", step_s=0.02)
            assert 4 not in fb.finals and 4 not in fb.errors and ad.counters["requests_cancelled"] == 1

            # PD: the prefill leg is answered at once with the bootstrap address; both legs reach
            # the server with SGLang's bootstrap fields
            fb.request(5, _submit("pd", list(range(1, 40)), 4), bootstrap={"mode": "prefill", "room": 77, "decode_worker": "d"})
            await until(lambda: 5 in fb.finals, 10, "prefill_done")
            boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 77}
            assert fb.finals[5].finish_reason == "prefill_done" and P.unpack(fb.finals[5].data) == boot
            fb.request(6, _submit("pd", list(range(1, 40)), 4), attempt=2,
                       bootstrap={"mode": "decode", "room": 77, "prefill_worker": "w", **boot})
            await until(lambda: 6 in fb.finals, 10, "decode leg")
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
                async with http.get(rec["url"] + "/debug/requests") as resp:
                    bodies = [x["body"] for x in await resp.json() if x["path"] == "/generate"]
            pd = [b for b in bodies if b.get("bootstrap_room") == 77]
            assert len(pd) == 2 and all(b["bootstrap_host"] == "127.0.0.1" and b["bootstrap_port"] == 8998 for b in pd)
        finally:
            await ad.close()
            await fb.close()

    run(go(), 60)
