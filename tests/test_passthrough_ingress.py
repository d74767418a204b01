"""The HTTP ingress's pass-through in process, against a scripted backend: what it submits (the
client's bytes, the routing key with the tools), and how each shape of answer reaches the client
(an engine's SSE byte for byte, a body in pieces, a refusal, mesh's own errors before and after the
first byte, a worker without pass-through support)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from types import SimpleNamespace

import aiohttp

from brokers.ingress import HttpIngress
from mesh import protocol as P
from tests.conftest import run
from tests.ingress_support import CatalogBackend


class ScriptedBackend(CatalogBackend):
    """An IngressBackend whose every request is answered with ``script`` (data maps or errors)."""

    served = {"m1": 1}
    aliases = {"alias": "m1"}

    def __init__(self, script) -> None:
        self.stats = SimpleNamespace(requests=Counter(), dropped=Counter(), text_unmatched=Counter())
        self.script = script
        self.subs: list[P.Submit] = []

    def submit(self, identity, sub, replies, *, quota_key=None) -> None:
        self.subs.append(sub)

        async def answer() -> None:
            replies.put_nowait(P.encode_accepted(sub.rid, "w7", "test", 1))
            for seq, (kind, data) in enumerate(self.script):
                await asyncio.sleep(0)
                if kind == "chunk":
                    replies.put_nowait(P.encode_client_chunk(sub.rid, seq, P.pack(data)))
                elif kind == "final":
                    replies.put_nowait(P.encode_client_final(sub.rid, "stop", {}, "w7", 1, P.pack(data)))
                else:
                    replies.put_nowait(P.encode_client_error(sub.rid, kind, data))

        asyncio.get_running_loop().create_task(answer())


async def _post(script, path: str, body: bytes):
    backend = ScriptedBackend(script)
    ing = HttpIngress(backend)
    url = await ing.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                return r.status, r.headers.get("Content-Type"), r.headers.get("x-mesh-worker"), await r.read(), backend
    finally:
        await ing.stop()


CHAT = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                   "tools": [{"type": "function", "function": {"name": "f"}}]}).encode()


def test_the_submit_carries_the_clients_bytes_and_a_key_with_the_tools():
    status, _, _, _, backend = run(_post([("final", {"token_ids": [], "raw": b"{}", "status": 200,
                                                    "content_type": "application/json"})], "/v1/chat/completions", CHAT))
    sub = backend.subs[0]
    assert status == 200 and sub.passthrough == {"path": "/v1/chat/completions", "method": "POST", "body": CHAT}
    assert sub.text.startswith('tools: [{"name": "f"}]\nuser: hi\n') and sub.stream


def test_an_engines_sse_is_relayed_byte_for_byte_and_a_later_mesh_error_is_an_sse_event():
    sse = [b'data: {"a": 1}\n\n', b'data: {"b"', b': 2}\n\n']
    script = [("chunk", {"token_ids": [], "raw": sse[0], "status": 200, "content_type": "text/event-stream"}),
              ("chunk", {"token_ids": [], "raw": sse[1]}), ("chunk", {"token_ids": [], "raw": sse[2]}),
              ("worker_lost", "the worker went away")]
    status, ctype, worker, body, _ = run(_post(script, "/v1/chat/completions", CHAT))
    assert (status, ctype, worker) == (200, "text/event-stream", "w7")
    head, tail = body[:len(b"".join(sse))], body[len(b"".join(sse)):]
    assert head == b"".join(sse) and json.loads(tail[len(b"data: "):])["error"]["code"] == "worker_lost"


def test_a_body_in_pieces_an_engine_refusal_and_mesh_errors_keep_their_status():
    pieces = [("chunk", {"token_ids": [], "raw": b'{"data": [', "status": 200, "content_type": "application/json"}),
              ("final", {"token_ids": [], "raw": b"1]}"})]
    status, ctype, _, body, _ = run(_post(pieces, "/v1/embeddings", b'{"input": "x"}'))
    assert (status, ctype, body) == (200, "application/json", b'{"data": [1]}')
    refusal = b'{"error": {"message": "no such tool"}}'
    status, _, _, body, _ = run(_post([("final", {"token_ids": [], "raw": refusal, "status": 422, "content_type": "application/json"})],
                                      "/v1/rerank", b'{"query": "q", "documents": ["d"]}'))
    assert (status, body) == (422, refusal)
    status, _, _, body, _ = run(_post([("no_worker", "no worker serves m1")], "/v1/responses", b'{"input": "x"}'))
    assert status == 503 and json.loads(body)["error"]["code"] == "no_worker"


def test_a_worker_without_passthrough_support_is_a_502_counted():
    status, _, _, body, backend = run(_post([("final", {"token_ids": [1, 2], "text": "made up"})], "/v1/score",
                                            b'{"text_1": "a", "text_2": "b"}'))
    assert status == 502 and "pass-through" in json.loads(body)["error"]["message"]
    assert backend.stats.dropped["passthrough_unsupported"] == 1


def test_models_by_id():
    async def body():
        backend = ScriptedBackend([])
        ing = HttpIngress(backend)
        url = await ing.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                got = {}
                for mid in ("m1", "alias", "mesh", "nope"):
                    async with s.get(f"{url}/v1/models/{mid}") as r:
                        got[mid] = (r.status, await r.json())
                return got
        finally:
            await ing.stop()

    got = run(body())
    assert got["m1"] == (200, {"id": "m1", "object": "model", "created": 0, "owned_by": "mesh", "root": "m1"})
    assert got["alias"][1]["root"] == "m1" and got["mesh"][0] == 200
    assert got["nope"] == (404, {"error": {"message": "The model `nope` does not exist.", "type": "invalid_request_error",
                                           "param": None, "code": "model_not_found"}})
