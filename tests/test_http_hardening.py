"""Attacks on the broker's HTTP ingress: injection through guessed local identities, oversized
bodies, slowloris, malformed input, stream statuses, load shedding and secrets. Real broker and
worker processes over 127.0.0.1 (plus one in-process check of the reply filter)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import msgpack
import openai
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from brokers.ingress import MAX_BODY_BYTES, MAX_SUBMIT_BYTES, HttpIngress
from brokers.stats import BrokerStats
from mesh import protocol as P
from mesh.client import Client
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until

KEY = "k3y-" + "x" * 20


def _url(b) -> str:
    return wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]


def _post(url: str, obj, key: str | None = KEY, headers: dict | None = None, timeout: float = 20) -> tuple[int, dict, dict]:
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    req = urllib.request.Request(url, data=data, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            return r.status, (json.loads(raw) if raw.startswith("{") else {"raw": raw}), dict(r.headers)
    except urllib.error.HTTPError as e:
        raw = e.read().decode("utf-8", "replace")
        try:
            return e.code, json.loads(raw), dict(e.headers)
        except ValueError:  # not an OpenAI-style body: the assertions on it fail with the text
            return e.code, {"raw": raw, "error": {"code": None}}, dict(e.headers)


def _post_served(url: str, obj, key: str | None = KEY, timeout_s: float = 15.0) -> tuple[int, dict, dict]:
    """_post as a well-behaved client: a 429 (the broker sheds load while its loop lags, e.g.
    right after parsing a huge body on a busy machine) is retried after its Retry-After."""
    t_end = time.monotonic() + timeout_s
    while True:
        code, body, headers = _post(url, obj, key=key)
        if code != 429 or time.monotonic() > t_end:
            return code, body, headers
        assert headers.get("Retry-After")
        time.sleep(0.2)  # a client's back-off on 429, bounded by t_end (Retry-After says 1 s; a test need not wait that long)


def _get(url: str, key: str | None = KEY) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def _counters(frontend: str) -> dict:
    async with Client(frontend) as c:
        return (await c.status(timeout_s=5)).counters


def _key_file(tmp_path) -> str:
    p = tmp_path / "api.key"
    p.write_text(KEY + "\n")
    return str(p)


@pytest.fixture
def instant_mesh(procs, tmp_path):
    """A broker with HTTP (key from a file) and two instant workers: fast answers for validation."""
    b = procs.broker("b", "--http", "127.0.0.1:0", "--api-key-file", _key_file(tmp_path), "--heartbeat-ms", "200")
    url = _url(b)
    procs.workers("w", [b.backend], "--instant", count=2)
    run(wait_for_workers(b.frontend, 2))
    return b, url


# ---------------------------------------------------------------------------- 1. injection


class _FakeBroker:
    """Just the local-client surface of the broker: every submit is answered first with a reply
    for another rid (what a forged identity would inject), then with its own FINAL."""

    def __init__(self) -> None:
        self.stats = BrokerStats()
        self.idents: list[bytes] = []
        self.cancelled: list[bytes] = []

        class S:
            default_deadline_ms = 5000

        self.s = S()

    def submit(self, ident, sub, q, quota_key=None) -> None:
        self.idents.append(ident)
        rid = sub.rid
        data = msgpack.packb({"token_ids": [7, 7]})
        q.put_nowait(P.encode_client_final("someone-else", "length", {"completion_tokens": 1}, "evil", 1,
                                           msgpack.packb({"text": "INJECTED"})))
        q.put_nowait(P.encode_client_final(rid, "length", {"completion_tokens": 2}, "w", 1, data))

    def cancel(self, ident) -> None:
        self.cancelled.append(ident)

    def model_catalog(self):
        return {"m": 1}, {}, "mesh"

    def announced_tokenizers(self):
        return {}

    def forget(self, ident) -> None:
        pass


async def _post_to_fake(fake, path: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    """POST ``bodies`` in turn to an ingress serving in front of ``fake`` (a broker stand-in that
    injects replies); returns (status, JSON) of each."""
    ing = HttpIngress(fake)
    url = await ing.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            outs = []
            for b in bodies:
                async with s.post(url + path, json=b) as r:
                    outs.append((r.status, await r.json()))
            return outs
    finally:
        await ing.stop()


def test_foreign_replies_dropped_and_identities_random():
    async def body():
        fake = _FakeBroker()
        outs = await _post_to_fake(fake, "/v1/completions", [{"prompt": "hi", "max_tokens": 2}] * 2)
        for status, out in outs:
            assert status == 200 and "INJECTED" not in out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 2
        assert fake.stats.dropped["http_foreign_reply"] == 2
        a, b = fake.idents
        assert a != b and a.startswith(b"\x00http:") and len(a) >= len(b"\x00http:") + 16
        for (_, out), ident in zip(outs, fake.idents):
            suffix = ident[len(b"\x00http:"):]
            assert suffix.hex() not in out["id"] and suffix.decode("latin-1") not in out["id"]
            assert not suffix.isdigit()

    run(body(), 20)


def test_guessed_http_identity_cannot_inject(procs):
    """A DEALER that claims the identity the first HTTP requests used to get must not reach them."""
    b = procs.broker("b", "--http", "127.0.0.1:0", "--heartbeat-ms", "200")
    url = _url(b)
    procs.workers("w", [b.backend], "--time-scale", "0.2", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        ctx = zmq.asyncio.Context()
        socks = []
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                victim = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "hello victim", "max_tokens": 40}))
                async with Client(b.frontend) as c:
                    await until(lambda: _inflight(c), 10, "victim in flight")
                for n in range(1, 4):
                    d = ctx.socket(zmq.DEALER)
                    d.setsockopt(zmq.ROUTING_ID, b"\x00http:" + str(n).encode())
                    d.setsockopt(zmq.LINGER, 0)
                    d.connect(b.frontend)
                    socks.append(d)
                    await d.send_multipart(P.encode_submit(f"evil-{n}", text="INJECTED", params={"max_new_tokens": 1}))
                r = await asyncio.wait_for(victim, 30)
                out = await r.json()
                r.release()
            assert r.status == 200, out
            assert out["usage"]["completion_tokens"] == 40 and out["choices"][0]["finish_reason"] == "length"
        finally:
            for d in socks:
                d.close(0)
            ctx.term()

    run(body(), 45)


async def _inflight(c: Client) -> bool:
    return (await c.status(timeout_s=5)).broker.get("inflight", 0) >= 1


# ---------------------------------------------------------------------------- 2. poison pill


def test_oversized_bodies_get_413_and_workers_survive(instant_mesh):
    b, url = instant_mesh
    code, body, _ = _post(url + "/v1/completions", {"prompt": "a" * 5_000_000, "max_tokens": 1})
    assert code == 413 and body["error"]["code"] == "too_large"
    # under the body limit, but the role prefixes make the encoded SUBMIT exceed the frame cap
    n_msgs = (MAX_BODY_BYTES - 64) // 3
    raw = b'{"max_tokens":1,"messages":[' + b",".join([b"{}"] * n_msgs) + b"]}"
    assert len(raw) <= MAX_BODY_BYTES and 7 * n_msgs > MAX_SUBMIT_BYTES
    code, body, _ = _post(url + "/v1/chat/completions", raw)
    assert code == 413 and body["error"]["code"] == "too_large" and "messages" in body["error"]["message"]
    # a prompt near the limit that fits is served, and both workers are still registered
    code, body, _ = _post_served(url + "/v1/completions", {"prompt": "b" * (MAX_BODY_BYTES - 1000), "max_tokens": 3})
    assert code == 200 and body["usage"]["completion_tokens"] == 3
    run(wait_for_workers(b.frontend, 2, timeout_s=5))
    c = run(_counters(b.frontend))
    assert c.get("requests.too_large") == 2 and not c.get("workers.expired") and not c.get("workers.disconnected")


def test_encoded_submit_size_is_checked(monkeypatch):
    """What the ingress adds (tokenisation, role prefixes) can grow a body; the encoded SUBMIT is
    checked against the frame cap before anything is submitted (shown here with a small cap)."""
    import brokers.ingress.submit as hi

    monkeypatch.setattr(hi, "MAX_SUBMIT_BYTES", 1000)

    async def body():
        fake = _FakeBroker()
        [(status, out)] = await _post_to_fake(fake, "/v1/chat/completions", [{"messages": [{}] * 200}])
        assert status == 413 and out["error"]["code"] == "too_large" and "encoded" in out["error"]["message"]
        assert fake.idents == [] and fake.stats.requests["too_large"] == 1

    run(body(), 20)


# ---------------------------------------------------------------------------- 3. slowloris


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _server_closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1 << 16, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_slowloris_cannot_exhaust_descriptors(procs):
    limit, n_slow, fd_cap = 64, 400, 256
    b = procs.broker("b", "--http", "127.0.0.1:0", "--http-max-connections", str(limit), "--http-header-timeout-s", "30",
                     "--heartbeat-ms", "200")
    url = _url(b)
    procs.workers("w", [b.backend], "--instant", count=1)
    run(wait_for_workers(b.frontend, 1))
    resource.prlimit(b.pid, resource.RLIMIT_NOFILE, (fd_cap, fd_cap))  # a small budget, as on a default 1024 box
    base_fds = _fd_count(b.pid)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    slow: list[socket.socket] = []
    try:
        for i in range(n_slow):  # more slow connections than the limit, and than the descriptor budget
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-a: " if i % 2 else b"G")
            slow.append(s)
        peak_fds = _fd_count(b.pid)

        async def served():
            async with Client(b.frontend) as c:
                r = await c.generate(input_ids=[1, 2, 3], max_new_tokens=2, deadline_ms=5000)
            assert r.token_ids == [1, 2]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                async with s.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}) as r:
                    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2

        run(served(), 30)
        run(until(lambda: _fd_count(b.pid) <= base_fds + limit + 8, 10, "broker descriptors back under the budget"))
        held = sum(1 for s in slow if not _server_closed(s))
        c = run(_counters(b.frontend))
        print(f"slowloris: {n_slow} slow connections, {held} still held by the broker (limit {limit}), "
              f"broker fds base {base_fds} peak-sample {peak_fds} after {_fd_count(b.pid)}, evicted {c.get('dropped.http_conn_evicted')}")
        assert held <= limit and peak_fds < fd_cap
        assert c.get("dropped.http_conn_evicted", 0) >= n_slow - limit
    finally:
        for s in slow:
            s.close()
    assert b.alive()


def test_header_body_and_idle_timeouts(procs):
    b = procs.broker("b", "--http", "127.0.0.1:0", "--http-header-timeout-s", "0.5", "--http-idle-timeout-s", "0.8",
                     "--http-body-timeout-s", "0.5", "--heartbeat-ms", "200")
    url = _url(b)
    procs.workers("w", [b.backend], "--time-scale", "0.2", count=1)
    run(wait_for_workers(b.frontend, 1))
    host, port = url.removeprefix("http://").rsplit(":", 1)

    def closed_within(s: socket.socket, t: float) -> float:
        t0 = time.monotonic()
        s.settimeout(t)
        try:
            while s.recv(4096):
                pass
        except socket.timeout:
            raise AssertionError(f"connection still open after {t}s") from None
        except ConnectionResetError:
            pass
        return time.monotonic() - t0

    silent = socket.create_connection((host, int(port)), timeout=5)
    dripping = socket.create_connection((host, int(port)), timeout=5)
    dripping.sendall(b"GET /health HTTP/1.1\r\n")
    assert closed_within(silent, 5) < 3 and closed_within(dripping, 5) < 3
    slow_body = socket.create_connection((host, int(port)), timeout=5)
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    slow_body.settimeout(5)
    assert b" 400 " in slow_body.recv(4096).split(b"\r\n")[0]
    # keep-alive: a finished request's connection is closed once idle for the idle timeout ...
    ka = socket.create_connection((host, int(port)), timeout=5)
    ka.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ka.recv(4096).startswith(b"HTTP/1.1 200")
    assert closed_within(ka, 5) < 4
    # ... while a request that runs longer than the header timeout is not cut
    code, body, _ = _post_served(url + "/v1/completions", {"prompt": "long one", "max_tokens": 30}, key=None)
    assert code == 200 and body["usage"]["completion_tokens"] == 30
    c = run(_counters(b.frontend))
    assert c.get("dropped.http_header_timeout", 0) >= 2 and c.get("dropped.http_body_timeout", 0) >= 1
    for s in (silent, dripping, slow_body, ka):
        s.close()


class _SilentBroker(_FakeBroker):
    def submit(self, ident, sub, q, quota_key=None) -> None:  # never answers: the request stays busy
        self.idents.append(ident)


def test_connections_all_busy_get_503_and_are_closed():
    async def body():
        fake = _SilentBroker()
        ing = HttpIngress(fake, max_connections=2)
        url = await ing.start("127.0.0.1", 0)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                held = [asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "x"},
                                                     headers={"x-mesh-deadline-ms": "60000"})) for _ in range(2)]
                await until(lambda: len(fake.idents) == 2, 5, "two requests busy")
                r, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
                w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                raw = await asyncio.wait_for(r.read(), 5)  # read() to EOF: the broker closed it
                w.close()
                for t in held:
                    t.cancel()
                await asyncio.gather(*held, return_exceptions=True)
            # the clients went away: their requests are cancelled at once, not at their deadline
            await until(lambda: sorted(fake.cancelled) == sorted(fake.idents), 5, "requests of gone clients cancelled")
        finally:
            await ing.stop()
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head
        assert json.loads(payload)["error"]["code"] == "unavailable"
        assert fake.stats.dropped["http_conn_refused"] == 1 and len(ing.guard.conns) == 0

    run(body(), 20)


# ---------------------------------------------------------------------------- 4. bad input


def test_bad_headers_and_bodies_are_400(instant_mesh):
    _, url = instant_mesh
    c = url + "/v1/completions"
    for v in ("soon", "-5", "0", "99999999999999999999", "1_000", "1e3", " "):
        code, body, _ = _post(c, {"prompt": "x"}, headers={"x-mesh-deadline-ms": v})
        assert code == 400 and "x-mesh-deadline-ms" in body["error"]["message"], (v, code, body)
    assert _post(c, b"[" * 100_000 + b"]" * 100_000)[0] == 400
    assert _post(c, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")[0] == 400
    assert _post(c, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}")[0] == 400
    assert _post(c, b'{"prompt": "\\ud800"}')[0] == 400
    assert _post(c, b"\xff\xfe")[0] == 400
    bad = [
        {"prompt": "x", "stream": True, "stream_options": "yes"}, {"prompt": "x", "stream": True, "stream_options": []},
        {"prompt": "x", "stream_options": {"include_usage": "yes"}},
        {"prompt": [True, False]}, {"prompt": [-1]}, {"prompt": [2**40]}, {"prompt": [1.5]}, {"prompt": []}, {"prompt": [[1, 2]]},
        {"prompt": ["a", "b"]}, {"prompt": {"a": 1}}, {"prompt": None}, {"prompt": "x", "stop": {"a": 1}},
        {"prompt": "x", "stop": ["a"] * 5}, {"prompt": "x", "stop": [1]}, {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "temperature": float("nan")}, {"prompt": "x", "temperature": 1e308 * 10}, {"prompt": "x", "top_p": 2},
        {"prompt": "x", "n": True}, {"prompt": "x", "max_tokens": True}, {"prompt": "x", "max_tokens": 1.0},
        {"prompt": "x", "max_tokens": 10**9}, {"prompt": "x", "stream": "yes"}, {"prompt": "x", "model": 5},
    ]
    for obj in bad:
        data = json.dumps(obj).encode()
        code, body, _ = _post(c, data)
        assert code == 400 and body["error"]["code"] == "bad_request", (obj, code, body)
    # n > 1 passes through to the engine since issue 31; simulated workers have none: a 400 that says so
    code, body, _ = _post_served(c, {"prompt": "x", "n": 2})
    assert code == 400 and "needs an engine" in body["error"]["message"], (code, body)
    chat = url + "/v1/chat/completions"
    for msgs in ([{"content": {"a": 1}}], [{"role": 5, "content": "x"}], [5], [], "hi", None,
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]):
        code, body, _ = _post(chat, {"messages": msgs})
        assert code == 400 and body["error"]["code"] == "bad_request", (msgs, code, body)
    gen = url + "/generate"
    for obj in ({"text": "x", "input_ids": [1]}, {"input_ids": [True]}, {"text": "x", "sampling_params": []},
                {"text": "x", "sampling_params": {"max_new_tokens": "3"}}, {"text": "x", "rid": {"a": 1}}, {"text": ["a"]}):
        code, body, _ = _post(gen, obj)
        assert code == 400, (obj, code, body)
    # and the good shapes still work
    assert _post_served(c, {"prompt": ["just one"], "max_tokens": 2, "stop": "x", "temperature": 0, "n": 1})[0] == 200
    code, body, _ = _post_served(chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": None}],
                                 "max_tokens": 2})
    assert code == 200 and body["choices"][0]["message"]["role"] == "assistant"


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
_json = st.recursive(_json_leaf, lambda ch: st.one_of(st.lists(ch, max_size=4), st.dictionaries(st.text(max_size=8), ch, max_size=4)),
                     max_leaves=12)
_fields = ["prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "stop", "temperature",
           "top_p", "n", "model", "text", "input_ids", "sampling_params", "rid", "role", "content"]
_value = st.one_of(_json, st.lists(st.integers(min_value=-3, max_value=2**33), min_size=1, max_size=5),
                   st.lists(st.fixed_dictionaries({}, optional={"role": _json, "content": _json}), max_size=3),
                   st.fixed_dictionaries({}, optional={"max_new_tokens": _json, "include_usage": _json, "temperature": _json}))
_valid = st.sampled_from([
    {"prompt": "hello", "max_tokens": 3},
    {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True}},
    {"text": "hello", "sampling_params": {"max_new_tokens": 2}},
    {"input_ids": [5, 6], "stream": True},
])
_mutated = st.builds(lambda base, extra: {**base, **extra}, _valid, st.dictionaries(st.sampled_from(_fields), _value, max_size=2))
_bodies = st.one_of(
    _valid, _mutated, _mutated,
    st.dictionaries(st.sampled_from(_fields), _value, max_size=6),
    _json,
    st.binary(max_size=40),
)


def test_fuzz_json_bodies_never_500(instant_mesh):
    _, url = instant_mesh
    seen: dict[int, int] = {}

    @settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]), body=_bodies,
           deadline=st.one_of(st.just("3000"), st.just("3000"), st.text(alphabet="0123456789-_+e. x", max_size=12)))
    def check(path, body, deadline):
        if isinstance(body, bytes):
            data = body
        else:
            if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
                body["max_tokens"] = body["max_tokens"] % 64  # instant workers, but keep outputs small
            data = json.dumps(body).encode()
        code, out, _ = _post(url + path, data, headers={"x-mesh-deadline-ms": deadline})
        seen[code] = seen.get(code, 0) + 1
        assert code != 500 and code < 500 or out["error"]["code"] in ("no_worker", "unavailable", "deadline_exceeded"), (path, data[:200], code, out)
        if code != 200:
            assert "Traceback" not in json.dumps(out) and out["error"]["code"]

    check()
    assert 400 in seen and 200 in seen, seen
    code, body, _ = _post_served(url + "/v1/completions", {"prompt": "still serving", "max_tokens": 2})
    assert code == 200 and body["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------- 5./6. statuses


def test_stream_errors_before_output_keep_status_and_429_retry_after(procs):
    empty = procs.broker("e", "--http", "127.0.0.1:0", "--park-timeout-s", "0.2")
    empty_url = _url(empty)
    b = procs.broker("b", "--http", "127.0.0.1:0", "--max-inflight", "1", "--heartbeat-ms", "200")
    url = _url(b)
    procs.workers("w", [b.backend], "--time-scale", "0.2", count=1)
    run(wait_for_workers(b.frontend, 1))

    code, body, _ = _post(empty_url + "/v1/completions", {"prompt": "x", "stream": True}, key=None)
    assert code == 503 and body["error"]["code"] == "no_worker"
    code, body, _ = _post(empty_url + "/generate", {"text": "x", "stream": True}, key=None)
    assert code == 503 and body["error"]["code"] == "no_worker"

    # long enough (about 4 s of decoding) that it is still in flight while the 429s are checked
    holder = threading.Thread(target=_post, args=(url + "/v1/completions", {"prompt": "hold", "max_tokens": 1000}),
                              kwargs={"key": None, "timeout": 30})
    holder.start()
    try:
        async def busy():
            async with Client(b.frontend) as c:
                return await _inflight(c)

        run(until(busy, 10, "holder in flight"))
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)
        with pytest.raises(openai.RateLimitError) as ei:
            client.completions.create(model="mesh", prompt="x", max_tokens=2, stream=True)
        assert ei.value.response.headers.get("retry-after") == "1"
        assert ei.value.body["code"] == "overloaded"
        for path, obj in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
                          ("/v1/completions", {"prompt": "x"})):
            code, body, headers = _post(url + path, obj, key=None)
            assert code == 429 and body["error"]["code"] == "overloaded" and headers.get("Retry-After") == "1"
    finally:
        holder.join(30)
    # once output has started, a stream is a 200 with SSE events
    chunks = list(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=5, timeout=20).completions.create(
        model="mesh", prompt="x", max_tokens=3, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices).strip()


# ---------------------------------------------------------------------------- 7. secrets


def _broker_exit(*args: str, env: dict | None = None) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "mesh.cli", "broker", "--frontend", "tcp://127.0.0.1:*", "--backend",
                        "tcp://127.0.0.1:*", "--http", "127.0.0.1:0", *args], capture_output=True, text=True, timeout=30,
                       env={**os.environ, **(env or {})})
    return p.returncode, p.stderr


def test_api_key_file_env_and_metrics_auth(procs, tmp_path):
    kf = _key_file(tmp_path)
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    code, err = _broker_exit("--api-key-file", str(tmp_path / "missing"))
    assert code == 2 and "api_key_file" in err and "does not exist" in err
    code, err = _broker_exit("--api-key-file", str(empty))
    assert code == 2 and "api_key_file" in err and "empty" in err
    code, err = _broker_exit("--api-key-file", kf, "--api-key", "other")
    assert code == 2 and "api_key_file" in err and "not both" in err

    b = procs.broker("b", "--http", "127.0.0.1:0", "--api-key-file", kf, "--metrics", ":0")
    url = _url(b)
    metrics_ep = wait_for_log_event(b.log_path, "metrics_listening", 10, b.popen)["endpoint"]
    assert metrics_ep.startswith("http://127.0.0.1:") and not metrics_ep.endswith(":0/metrics")
    assert _get(url + "/metrics", key=None)[0] == 401
    assert _get(url + "/metrics", key=KEY + "x")[0] == 401
    assert _get(url + "/metrics", key=KEY[:-1])[0] == 401
    code, text = _get(url + "/metrics", key=KEY)
    assert code == 200 and 'outcome="unauthorized"' in text
    assert _get(url + "/health", key=None)[0] == 503  # probes stay open (no workers here)
    assert "api_key_on_command_line" not in b.log_path.read_text()

    procs.env["MESH_API_KEY"] = "from-env"
    e = procs.broker("e", "--http", "127.0.0.1:0")
    eu = _url(e)
    assert _get(eu + "/v1/models", key="from-env")[0] == 200 and _get(eu + "/v1/models", key=None)[0] == 401
    del procs.env["MESH_API_KEY"]
    f = procs.broker("f", "--http", "127.0.0.1:0", "--api-key", "on-the-command-line")
    fu = _url(f)
    assert _get(fu + "/v1/models", key="on-the-command-line")[0] == 200
    assert "api_key_on_command_line" in f.log_path.read_text()
