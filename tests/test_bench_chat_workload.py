"""``mesh bench http``'s chat workload: multi-turn conversations sharing a system prompt (their shape,
the prefix cache on them through ``--tokenizer builtin``), the built-in load generator rotating bodies
against a real loopback server, and hostile shapes, bodies and bodies files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mesh.lab.bench.chat_workload import PASS_MARKER, chat_bodies, check_shape, mark_pass
from mesh.lab.bench.http_bench import run_http_bench
from mesh.lab.bench.http_load import MAX_BODIES, MAX_BODY_BYTES, check_bodies, read_bodies, run_load


def _words(n: int, seed: int) -> str:
    return " ".join(f"s{seed}w{i}" for i in range(n))


def _msgs(body: bytes) -> list[dict]:
    return json.loads(body)["messages"]


def test_conversations_share_the_system_prompt_and_resend_their_history():
    bodies = chat_bodies(_words, prompt_tokens=100, conversations=5, turns=4, model="m", max_new_tokens=3, stream=False)
    assert len(bodies) == 20 and len(set(bodies)) == 20
    convs = [[_msgs(bodies[t * 5 + j]) for t in range(4)] for j in range(5)]  # turn by turn: turn t of conversation j
    system = convs[0][0][0]
    assert system["role"] == "system" and len(system["content"].split()) == 30  # 30 % of the prompt
    users = set()
    for turns in convs:
        for t, msgs in enumerate(turns):
            assert msgs[0] == system and len(msgs) == 2 * t + 2 and msgs[-1]["role"] == "user"
            assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * t + ["user"]
            if t:
                assert msgs[:-2] == turns[t - 1]  # the history, then the answer and a new user message
            users.add(msgs[-1]["content"])
        assert PASS_MARKER in turns[0][1]["content"] and all(PASS_MARKER not in m["content"] for m in turns[-1][2:])
    assert len(users) == 20  # every user message distinct
    words = [sum(len(m["content"].split()) for m in _msgs(b)) - 2 for b in bodies]  # less the marker's two words
    assert sum(words) / len(words) == pytest.approx(100, abs=2)  # prompt_tokens on average
    assert json.loads(bodies[0])["max_tokens"] == 3 and json.loads(bodies[0])["model"] == "m"
    # every pass over the list is fresh conversations: the same list, other bodies
    again = [mark_pass(b, 1) for b in bodies]
    assert not set(again) & {mark_pass(b, 0) for b in bodies} and PASS_MARKER.encode() not in again[0]


class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the engines the load generator meets
    seen: Counter = Counter()
    peers: set = set()
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            self.seen[body] += 1
            self.peers.add(self.client_address[0])
        out = b'{"ok":true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_the_builtin_load_generator_rotates_the_bodies_against_a_real_server():
    _Recorder.seen, _Recorder.peers = Counter(), set()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        bodies = [json.dumps({"n": i, "text": f"[{PASS_MARKER}] {i}"}).encode() for i in range(3)]
        r = run_load(f"http://127.0.0.1:{srv.server_address[1]}/x", bodies, 2, 0.5, warmup_s=0, loadgen="python", sources=2)
    finally:
        srv.shutdown()
        srv.server_close()
    seen = _Recorder.seen
    assert r["requests"] > 0 and r["errors"] == 0
    assert sum(seen.values()) >= 7, seen  # a few passes over the 3 bodies
    assert all(PASS_MARKER.encode() not in b for b in seen)  # every marker replaced by the pass
    assert {json.loads(b)["n"] for b in seen} == {0, 1, 2}
    assert max(seen.values()) == 1  # each pass sends other bodies: none twice
    passes = Counter(json.loads(b)["text"].split("]")[0] for b in seen)
    assert passes["[p0"] == 3 and passes["[p1"] == 3, passes  # the list in turn, pass after pass
    assert _Recorder.peers == {"127.0.0.2", "127.0.0.3"}  # two clients, as a fair-share server counts them


@pytest.mark.parametrize("url, sources", [("http://127.0.0.1:1/", 0), ("http://127.0.0.1:1/", 251),
                                          ("http://127.0.0.1:1/", True), ("http://10.0.0.1:1/", 2)])
def test_hostile_source_counts_are_refused_naming_the_field(url, sources):
    with pytest.raises(ValueError, match="^sources:"):
        run_load(url, [b"{}"], 1, 1.0, loadgen="python", sources=sources)
    with pytest.raises(ValueError, match="^sources:"):
        run_load("http://127.0.0.1:1/", [b"{}"], 1, 1.0, loadgen="wrk", sources=2)


@pytest.mark.parametrize("bad, field", [
    ([], "bodies"), ([b"{}"] * (MAX_BODIES + 1), "bodies"), ([b""], "bodies[0]"), (["{}"], "bodies[0]"),
    ([b"{}", b"x" * (MAX_BODY_BYTES + 1)], "bodies[1]"), ([b"\xff\xfe"], "bodies[0]"), ([None], "bodies[0]"),
])
def test_hostile_bodies_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match="^" + re.escape(field) + ":"):
        check_bodies(bad)


@pytest.mark.parametrize("content", [b"not json", b'{"a": 1}', b'[1, 2]', b"[]", b'["\\ud800"]', b"\xff"])
def test_a_hostile_bodies_file_is_refused_naming_the_field(tmp_path, content):
    f = tmp_path / "bodies.json"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=r"^(bodies_file|bodies):"):
        read_bodies(f)
    p = subprocess.run([sys.executable, "-m", "mesh.lab.bench.http_load", "--url", "http://127.0.0.1:9/", "--bodies-file",
                        str(f), "-c", "1", "--seconds", "1"], capture_output=True, text=True, timeout=60) if content == b"[1, 2]" else None
    if p is not None:  # the generator itself: one line naming the field, exit 2, no traceback
        assert p.returncode == 2 and "bodies_file" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("conversations, turns, tokens, field", [
    (0, 4, 1000, "conversations"), (10_001, 4, 1000, "conversations"), (True, 4, 1000, "conversations"),
    (8, 0, 1000, "turns"), (8, 65, 1000, "turns"), (8, 2.0, 1000, "turns"), (8, 4, 0, "prompt_tokens"),
    (8, 4, 1 << 21, "prompt_tokens"), (8, 64, 50, "turns"),
])
def test_hostile_chat_shapes_are_refused_naming_the_field(conversations, turns, tokens, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        check_shape(conversations, turns, tokens)


def test_the_bench_refuses_a_bad_workload_before_starting_anything(tmp_path):
    kw = dict(arms=["broker_adapters"], concurrency=[1], seconds=1.0, path="/v1/chat/completions", log_dir=tmp_path,
              say=lambda m: None)
    with pytest.raises(ValueError, match="^chat_workload:"):
        run_http_bench(chat_workload="replay", **kw)
    with pytest.raises(ValueError, match="^conversations:"):
        run_http_bench(conversations=0, **kw)
    with pytest.raises(ValueError, match="^loadgen: wrk sends one body"):
        run_http_bench(loadgen="wrk", **kw)
    assert not any(tmp_path.iterdir())  # nothing was started or written


def test_the_cli_checks_the_workload_flags():
    from mesh.cli import build_parser

    parser = build_parser()
    for bad in (["--conversations", "0"], ["--turns", "-1"], ["--chat-workload", "replay"], ["--conversations", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "http", *bad])
    a = parser.parse_args(["bench", "http", "--chat-workload", "single", "--conversations", "8", "--turns", "2"])
    assert (a.chat_workload, a.conversations, a.turns) == ("single", 8, 2)
