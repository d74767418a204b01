"""A hostile worker against the newer peer-supplied fields: READY ``loras`` / ``tokenizer``, HEARTBEAT
``loras``, REQUEST ``dp_rank`` / ``lora``, and the broker loading the tokenizer a worker announced.

Expected: the decode boundary returns a ProtocolError (``bad_field``, counted by the broker) and never
raises; the broker keeps serving; an announced tokenizer that is not a tokenizer folder is refused with
a ConfigError, without reading any file beyond looking for ``tokenizer.json``.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

import pytest

from mesh import protocol as P
from mesh.errors import ConfigError
from tests.abuse_peers import FakeWorker, raw_dealer, status
from tests.conftest import run, until

FAST = ["--heartbeat-ms", "200"]


# --------------------------------------------------------------------------- helpers

def _ready_body(**over) -> dict:
    r = P.Ready("w1", "sim-llama-8b", "mixed", {}, 16, 256, 400_000, 1, 1, 200)
    body = P.unpack(P.encode_ready(r)[2])
    body.update(over)
    return body


def _ready_frames(**over) -> list[bytes]:
    return [P.WORKER_HEADER, P.encode_ready(P.Ready("w", "m", "mixed", {}, 16, 1, 1, 1, 1, 200))[1], P.pack(_ready_body(**over))]


def _hb_frames(**body) -> list[bytes]:
    return [P.WORKER_HEADER, P.encode_heartbeat()[1], P.pack(body)]


def _request_frames(**meta_over) -> list[bytes]:
    sub = P.encode_submit("r1", input_ids=[1, 2, 3], params={"max_new_tokens": 2})
    frames = P.encode_request(1, 1, 1000, "r1", sub[2], lora="a", dp_rank=0)
    meta = P.unpack(frames[2])
    meta.update(meta_over)
    return [frames[0], frames[1], P.pack(meta), frames[3]]


def _rejected(m) -> None:
    assert isinstance(m, P.ProtocolError), m
    assert m.reason == "bad_field", (m.reason, m.detail)


# --------------------------------------------------------------------------- 1. loras (decode)

BAD_LORAS = {
    "too_many": [f"a{i}" for i in range(P.MAX_LORAS + 1)],
    "huge_count": ["x"] * 100_000,
    "oversize_name": ["a" * (P.MAX_LORA_NAME_BYTES + 1)],
    "oversize_multibyte_name": ["\u00e9" * (P.MAX_LORA_NAME_BYTES // 2 + 1)],  # 129 chars, 258 bytes
    "empty_name": [""],
    "int_entry": ["ok", 1],
    "none_entry": [None],
    "bool_entry": [True],
    "bytes_entry": [b"abc"],
    "nested_list": [["a"]],
    "map_entry": [{"a": "b"}],
    "float_entry": [1.5],
    "not_a_list_str": "abc",
    "not_a_list_map": {"a": 1},
    "not_a_list_int": 7,
}


@pytest.mark.parametrize("name", sorted(BAD_LORAS))
def test_ready_with_hostile_loras_is_rejected(name):
    _rejected(P.decode_worker(_ready_frames(loras=BAD_LORAS[name])))


@pytest.mark.parametrize("name", sorted(BAD_LORAS))
def test_heartbeat_with_hostile_loras_is_rejected(name):
    _rejected(P.decode_worker(_hb_frames(loras=BAD_LORAS[name])))
    _rejected(P.decode_worker(_hb_frames(load=[], loras=BAD_LORAS[name])))


def test_loras_at_the_limits_are_accepted():
    full = [f"{i:0{P.MAX_LORA_NAME_BYTES}d}" for i in range(P.MAX_LORAS)]
    m = P.decode_worker(_ready_frames(loras=full))
    assert isinstance(m, P.Ready) and m.loras == full
    hb = P.decode_worker(_hb_frames(loras=full))
    assert isinstance(hb, P.Heartbeat) and hb.loras == full
    assert P.decode_worker(_hb_frames(loras=[])).loras == []


# --------------------------------------------------------------------------- 2. tokenizer (decode)

@pytest.mark.parametrize("value", [1, 1.0, True, b"/etc/passwd", ["a"], {"a": "b"}], ids=repr)
def test_ready_tokenizer_of_the_wrong_type_is_rejected(value):
    _rejected(P.decode_worker(_ready_frames(tokenizer=value)))


def test_ready_tokenizer_longer_than_the_limit_is_rejected():
    _rejected(P.decode_worker(_ready_frames(tokenizer="a" * (P.MAX_TOKENIZER_ID_BYTES + 1))))
    _rejected(P.decode_worker(_ready_frames(tokenizer="/" + "../" * 1_000_000)))  # ~3 MB traversal


def test_ready_tokenizer_limit_is_in_bytes_not_characters():
    """MAX_TOKENIZER_ID_BYTES names bytes; 1024 four-byte characters are 4096 bytes."""
    _rejected(P.decode_worker(_ready_frames(tokenizer="\U0001F600" * P.MAX_TOKENIZER_ID_BYTES)))


def test_ready_tokenizer_paths_decode_as_plain_strings():
    """The decoder does not judge paths (the loader does): they decode, bounded, without raising."""
    for t in ("/etc/passwd", "../../../../etc", "~root", "org/name@../../../x", "a\x00b"):
        m = P.decode_worker(_ready_frames(tokenizer=t))
        assert isinstance(m, P.Ready) and m.tokenizer == t


# --------------------------------------------------------------------------- 3. REQUEST dp_rank / lora

@pytest.mark.parametrize("value", [-1, 1024, 2**31, 2**63 - 1, -(2**63), True, False, 1.0, "0", [0], {"r": 0}], ids=repr)
def test_request_dp_rank_out_of_range_or_wrong_type_is_rejected(value):
    _rejected(P.decode_broker_to_worker(_request_frames(dp_rank=value)))


def test_request_dp_rank_in_range_is_accepted():
    for v in (0, 1023):
        m = P.decode_broker_to_worker(_request_frames(dp_rank=v))
        assert isinstance(m, P.Request) and m.dp_rank == v
    m = P.decode_broker_to_worker(_request_frames(dp_rank=None))
    assert isinstance(m, P.Request) and m.dp_rank is None


@pytest.mark.parametrize("value", [1, True, ["a"], b"a", "a" * (P.MAX_LORA_NAME_BYTES + 1)], ids=lambda v: repr(v)[:20])
def test_request_lora_hostile_is_rejected(value):
    _rejected(P.decode_broker_to_worker(_request_frames(lora=value)))


def test_kv_events_dp_rank_out_of_range_is_rejected():
    for v in (-1, 1024, True, 2**64 - 1, "0"):
        body = {"dp_rank": v, "epoch": 1, "seq": 0, "ts": 0.0, "events": []}
        m = P.decode_worker([P.WORKER_HEADER, P.encode_kv_events(0, 1, 0, 0.0, [])[1], P.pack(body)])
        assert isinstance(m, P.ProtocolError), (v, m)


def test_decoders_never_raise_on_hostile_new_fields():
    vals = [None, -1, 2**63 - 1, -(2**63), 1.5, float("nan"), True, "", "x" * 5000, b"\xff", [], [1], [[]], {}, {"a": 1},
            ["a"] * 300, ["\x00"], ["\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace")]]
    n = 0
    for v in vals:
        for frames in (_ready_frames(loras=v), _ready_frames(tokenizer=v), _hb_frames(loras=v), _hb_frames(load=v, loras=v)):
            P.decode_worker(frames)
            n += 1
        for frames in (_request_frames(dp_rank=v), _request_frames(lora=v)):
            P.decode_broker_to_worker(frames)
            n += 1
    assert n == 6 * len(vals)


# --------------------------------------------------------------------------- 4. announced tokenizer loading

class _OpenSpy:
    """Records every file Python opens while armed (sys.audit "open")."""

    installed: "_OpenSpy | None" = None

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.armed = False

    @classmethod
    def get(cls) -> "_OpenSpy":
        if cls.installed is None:
            cls.installed = cls()
            spy = cls.installed

            def hook(event, args):
                if spy.armed and event == "open" and args and isinstance(args[0], (str, bytes, Path)):
                    spy.paths.append(str(args[0]))
            sys.addaudithook(hook)
        return cls.installed

    def __enter__(self):
        self.paths.clear()
        self.armed = True
        return self

    def __exit__(self, *exc):
        self.armed = False


def _non_tokenizer_opens(paths: list[str]) -> list[str]:
    return [p for p in paths if Path(p).name != "tokenizer.json" and "site-packages" not in p and not p.endswith(".py")
            and "__pycache__" not in p]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An HF cache holding one (tokenizer-less) model, and a secret file next to it."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path / "hub")
    return tmp_path


HOSTILE_TOKENIZERS = {
    "etc_passwd": "/etc/passwd",
    "etc_dir": "/etc",
    "root_dir": "/",
    "relative_traversal": "../../../../../../../etc",
    "home": "~",
    "dev_zero": "/dev/zero",
    "proc_self_environ": "/proc/self/environ",
    "huge_relative": "a" * P.MAX_TOKENIZER_ID_BYTES,
    "huge_component_path": "/tmp/" + "b" * 1000,
    "nul_byte": "org/na\x00me",
    "revision_traversal_to_secret": "org/name@../../../secret.txt",
    "revision_traversal_to_passwd": "org/name@../../../../../../../../../../etc/passwd",
    "cache_path_traversal": "/elsewhere/models--org--name/../../../secret.txt",
    "whitespace": "   ",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TOKENIZERS))
def test_announced_hostile_tokenizer_is_refused_with_config_error(name, hub):
    from brokers.ingress.tokenizers import load_tokenizer

    spy = _OpenSpy.get()
    with spy:
        with pytest.raises(ConfigError):
            load_tokenizer(HOSTILE_TOKENIZERS[name], None)
    assert _non_tokenizer_opens(spy.paths) == [], f"opened files other than tokenizer.json: {spy.paths}"


class _Backend:
    def __init__(self, announced: dict[str, str]) -> None:
        self._announced = announced
        self.stats = type("S", (), {"text_unmatched": Counter()})()

    def model_catalog(self):
        return {m: 1 for m in self._announced}, {}, ""

    def lora_catalog(self):
        return {}

    def announced_tokenizers(self):
        return dict(self._announced)


def test_tokenizers_refuse_hostile_announcements_without_raising(hub):
    """Through the ingress path (prefetch + for_model + note_text + health): no exception, None each time."""
    from brokers.ingress.tokenizers import Tokenizers

    announced = {f"m{i}": t for i, t in enumerate(sorted(HOSTILE_TOKENIZERS.values()))}

    async def body():
        toks = Tokenizers(_Backend(announced), retry_s=60.0)
        try:
            toks.prefetch()
            for m in announced:
                assert await toks.for_model(m) is None
                toks.note_text(m)
                assert await toks.for_model(m) is None  # cached failure, no reload
            await asyncio.sleep(0)
            h = toks.health()
            assert set(h["models_without_tokenizer"]) == set(announced)
            assert len(toks._failed) == len(set(announced.values()))
        finally:
            toks.close()

    run(body(), timeout_s=20)


# --------------------------------------------------------------------------- 5. against a real broker

async def _one(frontend: str):
    from mesh.client import Client
    async with Client(frontend) as c:
        return await c.generate(input_ids=[1, 2, 3], max_new_tokens=2, deadline_ms=10_000)


def test_broker_counts_hostile_ready_fields_and_keeps_serving(procs):
    b = procs.broker("b", *FAST)

    async def body():
        bad = [
            _ready_frames(worker_id="bad1", loras=[f"a{i}" for i in range(P.MAX_LORAS + 1)]),
            _ready_frames(worker_id="bad2", loras=["ok", 1, None]),
            _ready_frames(worker_id="bad3", tokenizer="t" * 100_000),
            _ready_frames(worker_id="bad4", tokenizer=12),
            _ready_frames(worker_id="bad5", loras="notalist"),
        ]
        socks = []
        for f in bad:
            s = raw_dealer(b.backend)
            await s.send_multipart(f)
            socks.append(s)
        st = await until(lambda: _rejected_n(b.frontend, len(bad)), what="hostile READYs rejected")
        assert not [w for w in st.workers if w["worker_id"].startswith("bad")]
        ok = await FakeWorker(b.backend, "ok").start()
        # a registered worker sending hostile heartbeat loras: rejected, still registered, still serving
        for v in (["x"] * 100_000, [1], "s"):
            await ok.send(_hb_frames(loras=v))
        st = await until(lambda: _rejected_n(b.frontend, len(bad) + 3), what="hostile HEARTBEATs rejected")
        assert [w["worker_id"] for w in st.workers] == ["ok"]
        res = await _one(b.frontend)
        assert res is not None
        for s in socks:
            s.close()
        await ok.close()

    run(body())


async def _rejected_n(frontend: str, n: int):
    st = await status(frontend)
    return st if st.counters.get("frames_rejected.worker.bad_field", 0) >= n else None


def test_heartbeats_flipping_loras_every_beat_do_not_stop_the_broker(procs):
    b = procs.broker("b", *FAST)

    async def body():
        w = await FakeWorker(b.backend, "flip").start()
        sets = [[f"l{i}" for i in range(P.MAX_LORAS)], [], [f"m{i}" for i in range(P.MAX_LORAS)]]
        for i in range(600):  # far faster than any beat
            await w.send(P.encode_heartbeat(None, loras=sets[i % 3]))
            if i % 100 == 0:
                await asyncio.sleep(0)
        await w.send(P.encode_heartbeat(None, loras=["final"]))

        async def settled():
            st = await status(b.frontend)
            ws = [x for x in st.workers if x["worker_id"] == "flip"]
            return st if ws and ws[0]["loras"] == ["final"] else None
        st = await until(settled, what="last loras applied")
        assert [x["worker_id"] for x in st.workers] == ["flip"]
        assert await _one(b.frontend) is not None
        await w.close()

    run(body())
