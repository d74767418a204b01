"""Helpers of the tokenizer tests (test_http_tokenizer_path.py, test_tokenizer_discovery.py): a Hugging Face
hub cache built from local files, the ChatML test template, and two-turn conversations through an HTTP door."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import aiohttp

from tests.conftest import until

MODEL_ID = "acme/garden-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(root: Path, model_id: str, files: Path, commit: str = COMMIT) -> Path:
    """``files``' regular files as ``model_id`` at ``commit`` in a hub cache under ``root`` (HF_HOME):
    content-addressed blobs, a snapshot of relative symlinks, refs/main. Returns HF_HOME."""
    repo = root / "hub" / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for f in files.iterdir():
        if f.is_file():
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return root


async def kv_batches_at_least(c, n: int) -> bool:
    return (await c.status()).counters.get("kv.batches", 0) >= n


TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen2_chatml.jinja"
SYSTEM = ("You are the support assistant of a company that sells garden tools. Answer politely, cite the order "
          "number when you have one, never promise a delivery date, and keep answers under five sentences. ") * 4


async def cache_hits(c) -> float:
    return float((await c.status()).counters.get("decisions.cache_hit", 0))


async def conversations(url: str, frontend: str, engines: list[str], n: int = 4) -> tuple[list[tuple[str, str, int]], float]:
    """n two-turn conversations. Turn 1 goes straight to engine k % 2 (the broker never sees it:
    only that engine's KV events can tell the broker where the conversation is); turn 2 goes
    through the broker. Returns (holder, worker of turn 2, cached tokens of turn 2) each, and the
    broker's cache-hit decisions for the second turns."""
    from mesh.client import Client

    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, Client(frontend) as c:
        async def published() -> int:  # KV batches the engines have published so far
            total = 0
            for e in engines:
                async with s.get(e + "/debug/stats") as r:
                    total += sum(rk["next_seq"] or 0 for rk in (await r.json())["ranks"])
            return total

        batches0, published0 = (await c.status()).counters.get("kv.batches", 0), await published()
        firsts = []
        for k in range(n):
            msgs = [{"role": "system", "content": f"{k}) " + SYSTEM},
                    {"role": "user", "content": [{"type": "text", "text": f"Where is order {1000 + k}?"}]}]
            async with s.post(engines[k % 2] + "/v1/chat/completions", json={"model": "mesh", "messages": msgs, "max_tokens": 4}) as r:
                body = await r.json()
                assert r.status == 200, body
                firsts.append((msgs, body["choices"][0]["message"]["content"], f"a{k % 2}"))
        want = batches0 + await published() - published0
        await until(lambda: kv_batches_at_least(c, want), 10, "every KV batch the engines published at the broker",
                    step_s=0.02)
        before = await cache_hits(c)
        for msgs, answer, holder in firsts:
            follow = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the invoice?"}]
            async with s.post(url + "/v1/chat/completions", json={"model": "mesh", "messages": follow, "max_tokens": 4}) as r:
                body = await r.json()
                assert r.status == 200, body
                out.append((holder, r.headers["x-mesh-worker"], body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        return out, await cache_hits(c) - before
