"""The OpenAI-compatible HTTP ingress, exercised with the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import openai
import pytest

from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.conftest import run


@pytest.fixture
def mesh_http(procs):
    b = procs.broker("b", "--http", "127.0.0.1:0", "--api-key", "sekret", "--heartbeat-ms", "200")
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]
    procs.workers("w", [b.backend], "--time-scale", "0.2", count=2)
    run(wait_for_workers(b.frontend, 2))
    return b, url


def _get(url: str, key: str | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if body.startswith("{") else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def _post(url: str, obj, key: str | None = "sekret", headers: dict | None = None) -> tuple[int, dict]:
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    req = urllib.request.Request(url, data=data, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_openai_client_streams_and_not(mesh_http):
    _, url = mesh_http
    client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=20)
    models = client.models.list()
    assert [m.id for m in models.data] == ["sim-llama-8b", "mesh"]  # the served model, then the fleet's name for it
    r = client.completions.create(model="mesh", prompt="The quick brown fox", max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5 and r.choices[0].text
    chunks = list(client.completions.create(model="mesh", prompt="The quick brown fox", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.strip() and chunks[-1].usage.completion_tokens == 6
    chat = client.chat.completions.create(model="mesh", messages=[{"role": "user", "content": "hi there"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    stream = client.chat.completions.create(model="mesh", messages=[{"role": "user", "content": "hi there"}], max_tokens=4,
                                            stream=True)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas).strip()
    # the second identical prompt found the first one's cache on the same worker
    r2 = client.completions.create(model="mesh", prompt="The quick brown fox" * 20, max_tokens=2)
    r3 = client.completions.create(model="mesh", prompt="The quick brown fox" * 20, max_tokens=2)
    assert r3.usage.prompt_tokens_details.cached_tokens > 0 or r2.usage.prompt_tokens < 32


def test_errors_auth_health_metrics(mesh_http):
    _, url = mesh_http
    assert _post(url + "/v1/completions", {"model": "mesh", "prompt": "x"}, key=None)[0] == 401
    assert _post(url + "/v1/completions", {"model": "mesh", "prompt": "x"}, key="wrong")[0] == 401
    code, body = _post(url + "/v1/completions", b"{not json")
    assert code == 400 and body["error"]["code"] == "bad_request"
    code, body = _post(url + "/v1/completions", {"prompt": "x"}, headers={"x-sgl-ttft-slo-ms": "soon"})
    assert code == 400 and "x-sgl-ttft-slo-ms" in body["error"]["message"]
    code, body = _post(url + "/v1/completions", {"prompt": "x", "max_tokens": -1})
    assert code == 400
    code, body = _post(url + "/v1/chat/completions", {"messages": "hi"})
    assert code == 400
    code, body = _post(url + "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 3}})
    assert code == 200 and len(body["output_ids"]) == 3 and body["meta_info"]["completion_tokens"] == 3
    assert _get(url + "/health")[0] == 200
    assert _get(url + "/readyz")[0] == 200
    code, text = _get(url + "/metrics", key="sekret")
    assert code == 200 and "mesh_requests_total" in text and 'outcome="ok"' in text and "mesh_worker_inflight" in text
    assert 'outcome="unauthorized"' in text and "mesh_decision_latency_seconds_bucket" in text
    # cache_aware (the default) learnt from the /generate request's first reply
    obs = re.search(r'^mesh_cost_model\{what="observations"\} (\S+)$', text, re.M)
    assert obs and float(obs.group(1)) >= 1, text[-2000:]
    assert re.search(r'^mesh_cost_model\{what="trusted"\} 0', text, re.M)  # one outcome is not enough


def test_health_503_without_workers(procs):
    b = procs.broker("b", "--http", "127.0.0.1:0")
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]
    assert _get(url + "/health")[0] == 503
    code, body = _post(url + "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None)
    assert code == 503 and body["error"]["code"] == "no_worker"
