"""``mesh stub-sglang`` as a real process: SGLang's HTTP API and ZMQ wire formats (§1-§4, §9-§11)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import zmq
import zmq.asyncio

from mesh import kv_events as KV
from mesh import protocol as P
from mesh.load import LoadStat
from mesh.sockets import SocketSpec, make_socket
from tests.conftest import run
from tests.test_adapters_support import start_stub

SUB = SocketSpec(zmq.SUB, sndhwm=1000, rcvhwm=10_000, linger_ms=0)
DEALER = SocketSpec(zmq.DEALER, sndhwm=100, rcvhwm=10_000, linger_ms=0)


async def _sse(resp: aiohttp.ClientResponse) -> list[str]:
    body = (await resp.read()).decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    return [ev[len("data: "):] for ev in body.split("\n\n") if ev][:-1]  # without the [DONE]


async def _recv(sock, timeout_s: float = 5.0) -> list[bytes]:
    return await asyncio.wait_for(sock.recv_multipart(), timeout_s)


async def _replay(ctx, endpoint: str, start: int) -> list[list[bytes]]:
    d = make_socket(ctx, DEALER, connect=endpoint)
    try:
        await d.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            f = await _recv(d)
            out.append(f)
            if b"\xff" * 8 in f:
                return out
    finally:
        d.close(linger=0)


def test_http_api_and_default_zmq_wire(procs):
    _, rec = start_stub(procs, "stub", "--dp-size", "2", "--time-scale", "0.05", "--topic", "kv@t")

    async def go():
        url = rec["url"]
        ctx = zmq.asyncio.Context.instance()
        subs = [make_socket(ctx, SUB, connect=f"tcp://127.0.0.1:{rec['kv_port_base'] + r}") for r in range(2)]
        load_sub = make_socket(ctx, SUB, connect=rec["load_endpoint"])
        for s in subs:
            s.setsockopt(zmq.SUBSCRIBE, b"kv@")
        load_sub.setsockopt(zmq.SUBSCRIBE, b"load")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url + "/server_info") as r:
                info = await r.json()
            kv = info["kv_events"]
            assert kv == {"publisher": "zmq", "endpoint_host": "127.0.0.1", "endpoint_port_base": rec["kv_port_base"], "topic": "kv@t",
                          "block_size": 16, "dp_size": 2, "load_endpoint_port_base": rec["load_port_base"], "load_topic": "load",
                          "replay_endpoint_port_base": rec["replay_port_base"]}
            assert info["page_size"] == 16 and info["dp_size"] == 2 and info["max_total_num_tokens"] == 400_000
            for path in ("/health", "/ready", "/health_generate"):
                async with http.get(url + path) as r:
                    assert r.status == 200
            async with http.get(url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "stub-sglang-8b"

            prompt = list(range(1, 70))
            async with http.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 5},
                                                          "rid": "r1", "routed_dp_rank": 1}) as r:
                out = await r.json()
            assert out["meta_info"]["id"] == "r1" and out["meta_info"]["dp_rank"] == 1 and len(out["output_ids"]) == 5
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
            assert (out["meta_info"]["prompt_tokens"], out["meta_info"]["completion_tokens"]) == (69, 5)

            # streaming: cumulative chunks, finish on the last, then [DONE]; the prefix is now cached
            async with http.post(url + "/generate", json={"input_ids": prompt + [7], "sampling_params": {"max_new_tokens": 6},
                                                          "stream": True, "routed_dp_rank": 1}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                chunks = [json.loads(x) for x in await _sse(r)]
            ids = [c["output_ids"] for c in chunks]
            assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:])) and len(ids[-1]) == 6
            assert [c["meta_info"]["finish_reason"] for c in chunks][-1]["type"] == "length"
            assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
            assert chunks[-1]["text"].startswith(chunks[0]["text"]) and chunks[-1]["meta_info"]["cached_tokens"] == 64

            async with http.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_token": 1}}) as r:
                assert r.status == 400 and "max_new_token" in (await r.json())["error"]["message"]

            async with http.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "stream": True,
                                                                "return_token_ids": True, "stream_options": {"include_usage": True}}) as r:
                cs = [json.loads(x) for x in await _sse(r)]
            assert sum(len(c["choices"][0]["token_ids"]) for c in cs if c["choices"]) == 4
            assert cs[-1]["choices"] == [] and cs[-1]["usage"]["completion_tokens"] == 4
            async with http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                     "max_tokens": 3, "stream": True}) as r:
                cc = [json.loads(x) for x in await _sse(r)]
            assert cc[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and cc[-1]["choices"][0]["finish_reason"] == "length"
            async with http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}) as r:
                assert (await r.json())["object"] == "chat.completion"

            async with http.get(url + "/v1/loads") as r:
                loads = (await r.json())["loads"]
            assert [x["dp_rank"] for x in loads] == [0, 1] and loads[1]["num_used_tokens"] > 0
            async with http.get(url + "/get_load") as r:
                assert r.status == 404  # removed in 0.5.21, as the stub's default emulates 0.5.23
            async with http.get(url + "/metrics") as r:
                metrics = await r.text()
            assert 'sglang:num_running_reqs{model_name="stub-sglang-8b"' in metrics and 'dp_rank="1"' in metrics

            # live KV stream of rank 1: [topic, seq8, msgpack [ts, events, 1]] with map events
            f = await _recv(subs[1])
            assert len(f) == 3 and f[0] == b"kv@t" and len(f[1]) == 8
            batch = P.unpack(f[2])
            assert batch[2] == 1 and isinstance(batch[1][0], dict) and batch[1][0]["type"] == "BlockStored"
            async with http.post(url + "/flush_cache") as r:
                assert r.status == 200
            seen_clear = False
            for _ in range(20):
                f = await _recv(subs[0])
                if P.unpack(f[2])[1] == [{"type": "AllBlocksCleared"}]:
                    seen_clear = True
                    break
            assert seen_clear

            # replay (>= 0.5.22 shape): [b"", topic, seq8, payload] ..., then [b"", b"", ff*8, b""]
            rep = await _replay(ctx, f"tcp://127.0.0.1:{rec['replay_port_base'] + 1}", 0)
            assert rep[-1] == [b"", b"", b"\xff" * 8, b""]
            assert all(len(m) == 4 and m[1] == b"kv@t" for m in rep[:-1])
            seqs = [int.from_bytes(m[2], "big") for m in rep[:-1]]
            assert seqs == list(range(len(seqs))) and len(seqs) >= 3
            assert KV.decode_batch(rep[0][3]).events == (KV.AllBlocksCleared(),)  # the startup reset

            lf = await _recv(load_sub)
            assert lf[0] == b"load" and len(lf[1]) == 8
            ls = LoadStat.from_wire(P.unpack(lf[2]))
            assert ls.extended and ls.max_total_num_tokens == 400_000 and len(P.unpack(lf[2])) == 11
        for s in [*subs, load_sub]:
            s.close(linger=0)

    run(go(), 40)


def test_legacy_array_format_three_frame_replay_and_get_load(procs):
    _, rec = start_stub(procs, "stub-old", "--event-format", "array", "--replay-frames", "3", "--http-load-api", "get_load",
                        "--time-scale", "0.05", "--fail-health", "--load-port", "-1")

    async def go():
        url = rec["url"]
        assert rec["load_endpoint"] is None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for path in ("/health", "/ready"):
                async with http.get(url + path) as r:
                    assert r.status == 503  # --fail-health
            async with http.post(url + "/generate", json={"text": "x" * 40, "sampling_params": {"max_new_tokens": 2}}) as r:
                assert r.status == 200
            async with http.get(url + "/get_load") as r:
                gl = await r.json()
            assert gl[0]["dp_rank"] == 0 and "num_pending_tokens" in gl[0]
            async with http.get(url + "/server_info") as r:
                assert "load_endpoint_port_base" not in (await r.json())["kv_events"]
            async with http.post(url + "/debug/health", json={"ok": True}) as r:
                assert (await r.json())["healthy"] is True
            async with http.get(url + "/health") as r:
                assert r.status == 200
        rep = await _replay(zmq.asyncio.Context.instance(), rec["replay_endpoint"], 0)
        assert rep[-1] == [b"", b"\xff" * 8, b""] and all(len(m) == 3 for m in rep)
        events = [e for m in rep[:-1] for e in P.unpack(m[2])[1]]
        assert events[0] == ["AllBlocksCleared"] and events[1][0] == "BlockStored" and len(events[1]) == 8

    run(go(), 40)
