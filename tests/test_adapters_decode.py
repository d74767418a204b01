"""Adapter decoding of recorded engine frames: SGLang 0.5.23 maps, 0.5.18 arrays, 2-element
batches, vLLM shapes; replay of recorded 3- and 4-frame replies; discovery and small pure helpers.

The SGLang fixtures were recorded from SGLang's own ``ZmqEventPublisher`` (see
``tests/data/record_sglang_frames.py``); the vLLM one is synthesized from vLLM 0.33's struct
definitions. Everything here runs in-process (no subprocess), so it is fast.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from mesh import kv_events as KV
from mesh import protocol as P
from mesh.adapters.backend import rank_endpoint, replace_wildcard
from mesh.adapters.engine_client import parse_prometheus
from mesh.adapters.kv_relay import BlockMirror, KvRelay, RankStream, split_events
from mesh.adapters.settings import AttachSettings
from mesh.adapters.sglang import generate_body, info_from_server_info, loadstat_from_v1, loadstats_from_metrics
from mesh.adapters.vllm import UnsupportedParam, completions_body
from mesh.errors import ErrorCode
from mesh.hashing import U64_MASK
from mesh.sockets import SocketSpec, make_socket
from tests.conftest import run
from tests.adapters_support import load_frames

_U = U64_MASK


def _relay(block_size: int, rank: int, topic: str = "", replay: str | None = None):
    sent: list[P.KvEventsMsg] = []
    rs = RankStream(rank, "tcp://127.0.0.1:9", replay, topic, block_size, epoch=7)

    def send(r: int, frames: list[bytes]) -> None:
        m = P.decode_worker(frames)
        assert isinstance(m, P.KvEventsMsg), m
        sent.append(m)

    relay = KvRelay(zmq.asyncio.Context.instance(), [rs], send, replay_timeout_s=3.0)
    return relay, rs, sent


def _events(msgs: list[P.KvEventsMsg]) -> list[list[KV.KvEvent]]:
    out = []
    for m in msgs:
        evs, skipped = KV.decode_events(m.events)
        assert not skipped
        out.append(evs)
    return out


def _expected_sglang(doc: dict, lora_name: str | None) -> list[list[KV.KvEvent]]:
    h01 = tuple(h & _U for h in doc["expected"]["h01"])
    h2 = doc["expected"]["h2"] & _U
    return [
        [KV.AllBlocksCleared()],
        [KV.BlockStored(h01, None, tuple(range(1, 9)), 4, "GPU")],
        [KV.BlockStored((h2,), h01[1], (9, 10, 11, 12), 4, "GPU")],
        [KV.BlockRemoved((h2,), "GPU")],
        # recorded with cache_salt "salt-a": the event's cache namespace, relayed as a map key
        [KV.BlockStored(((-42) & _U,), None, (7, 7, 7, 7), 4, "CPU_PINNED", lora_name, cache_salt="salt-a")],
        [KV.BlockRemoved(h01, "GPU"), KV.AllBlocksCleared()],
    ]


def _feed_live(relay, rs, frames_list) -> None:
    async def go():
        for f in frames_list:
            await relay.on_live(rs, f)
    run(go(), 10)


def test_recorded_sglang_0_5_23_map_frames_relay_exactly():
    doc = load_frames("sglang_0_5_23_frames.json")
    relay, rs, sent = _relay(4, doc["rank"], "kv@test")
    _feed_live(relay, rs, doc["live"])
    assert _events(sent) == _expected_sglang(doc, "adapter-x")
    assert [m.seq for m in sent] == list(range(6)) and {m.epoch for m in sent} == {7} and {m.dp_rank for m in sent} == {1}
    assert rs.last_seq == 5 and len(rs.mirror) == 0  # stored, removed, cleared
    assert relay.counters["history_lost"] == 0 and relay.counters["gaps"] == 0


def test_recorded_sglang_0_5_18_array_frames_relay_exactly():
    doc = load_frames("sglang_0_5_18_frames.json")
    relay, rs, sent = _relay(4, doc["rank"], "kv@test")
    _feed_live(relay, rs, doc["live"])
    # position 7 is 0.5.18's metadata map (cache salt), not a lora name
    assert _events(sent) == _expected_sglang(doc, None)


def test_two_element_batches_and_trailing_defaults_omitted():
    doc = load_frames("sglang_2elem_frames.json")
    relay, rs, sent = _relay(4, 0)
    _feed_live(relay, rs, doc["live"])
    h = (-3488128144981237669 & _U, 5674439469042975057)
    assert _events(sent) == [[KV.AllBlocksCleared()], [KV.BlockStored(h, None, tuple(range(1, 9)), 4, None)],
                             [KV.BlockRemoved((h[1],), None)]]
    assert len(rs.mirror) == 1  # the first block is still cached


def test_vllm_frames_unsigned_bytes_hashes_and_group_filter():
    doc = load_frames("vllm_0_33_frames.json")
    relay, rs, sent = _relay(16, 0, "kv-events")
    _feed_live(relay, rs, doc["live"])
    h = doc["expected"]["h"]
    b1, b2 = (int.from_bytes(bytes.fromhex(x)[-8:], "big") for x in doc["expected"]["bytes_hashes"])
    evs = _events(sent)
    assert evs[0] == [KV.BlockStored(tuple(h), None, tuple(range(32)), 16, "GPU")]
    assert evs[1] == [KV.BlockStored((b1, b2), None, tuple(range(100, 132)), 16, "GPU")]  # group 1 dropped
    assert evs[2] == [KV.BlockRemoved((h[1],), "GPU")]
    assert evs[3] == [KV.BlockStored((2**64 - 5,), h[0], tuple(range(16, 32)), 16, "GPU"), KV.AllBlocksCleared()]
    assert relay.counters["skipped_skipped_group"] == 2
    # relayed hashes are SGLang's signed int64 on the wire, the same u64 after decoding
    assert sent[3].events[0]["block_hashes"] == [-5]


def test_malformed_frames_are_counted_and_skipped_without_stopping():
    doc = load_frames("sglang_0_5_23_frames.json")
    relay, rs, sent = _relay(4, 1, "kv@test")
    live = doc["live"]
    topic = live[0][0]
    bad = [
        [topic, b"\x00\x01", b"x"],  # short sequence frame
        [topic, live[1][1]],  # two frames
        [topic, (1).to_bytes(8, "big"), b"\xc1 not msgpack"],  # consumes seq 1
        [topic, (2).to_bytes(8, "big"), P.pack({"not": "a batch"})],  # consumes seq 2
        [topic, (3).to_bytes(8, "big"), P.pack([1.0, [{"type": "Bogus"}, ["BlockStored", "x"], 5,
                                                      {"type": "BlockRemoved", "block_hashes": [9]}], 1])],
    ]
    renumbered = [[f[0], (4 + i).to_bytes(8, "big"), f[2]] for i, f in enumerate(live[1:3])]
    _feed_live(relay, rs, [live[0], *bad, *renumbered])
    c = relay.counters
    assert c["malformed_envelope"] == 2 and c["malformed_bad_msgpack"] == 1 and c["malformed_bad_batch"] == 1
    assert c["skipped_unknown_event_type"] == 1 and c["skipped_bad_event"] == 2
    assert c["history_lost"] == 0 and c["gaps"] == 0 and rs.last_seq == 5
    evs = _events(sent)
    assert evs[1] == [KV.BlockRemoved((9,), None)]  # the good event of the mixed batch got through
    assert evs[2][0].block_hashes == tuple(h & _U for h in doc["expected"]["h01"])  # and the stream went on


class _RecordedReplayServer:
    """A ROUTER answering every well-formed replay request with recorded reply frames."""

    def __init__(self, replies: list[list[bytes]]) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.sock = make_socket(ctx, SocketSpec(zmq.ROUTER, sndhwm=1000, rcvhwm=1000, linger_ms=0), bind="tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replies = replies
        self.requests: list[int] = []
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, delim, seq8 = await self.sock.recv_multipart()
            assert delim == b"" and len(seq8) == 8
            self.requests.append(int.from_bytes(seq8, "big"))
            for frames in self.replies:
                await self.sock.send_multipart([ident, *frames])

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)


def _replay_case(fixture: str, seen: int) -> tuple[KvRelay, RankStream, list[P.KvEventsMsg], list[int]]:
    """The relay saw live seqs 0..seen-1, then seq 5: it replays; the recorded buffer holds 2..5."""
    doc = load_frames(fixture)

    async def go():
        server = _RecordedReplayServer(doc["replay_from_0"])
        relay, rs, sent = _relay(4, doc["rank"], "kv@test", replay=server.endpoint)
        try:
            for f in doc["live"][:seen]:
                await relay.on_live(rs, f)
            await relay.on_live(rs, doc["live"][5])
        finally:
            relay.ranks[0].dealer and relay.ranks[0].dealer.close(linger=0)
            await server.close()
        return relay, rs, sent, server.requests

    return run(go(), 15)


def test_recorded_4_frame_replay_fills_a_gap():
    relay, rs, sent, requests = _replay_case("sglang_0_5_23_frames.json", seen=2)
    assert requests == [1]  # asked from the last seq it had (to verify the publisher), got 2..5
    assert [len(e) for e in _events(sent)] == [1, 1, 1, 1, 1, 2] and rs.last_seq == 5
    assert relay.counters["history_lost"] == 0 and relay.counters["replayed_batches"] == 4
    assert relay.counters["duplicates"] == 0  # the live seq 5 was recognised as already replayed


def test_recorded_3_frame_replay_with_lost_history_clears_the_rank():
    relay, rs, sent, requests = _replay_case("sglang_0_5_18_frames.json", seen=1)
    assert requests == [0]
    evs = _events(sent)
    # seq 1 is gone from the buffer: AllBlocksCleared is relayed before the replayed 2..5
    assert evs[1] == [KV.AllBlocksCleared()] and len(evs) == 6
    assert relay.counters["history_lost"] == 1 and rs.last_seq == 5


# --------------------------------------------------------------------------- pure helpers


def _settings(**kw) -> AttachSettings:
    return AttachSettings(url="http://10.1.2.3:30000", brokers=("tcp://127.0.0.1:5556",), **kw)


def test_discovery_from_server_info_replaces_wildcards_and_honours_flags():
    d = {"served_model_name": "m", "page_size": 16, "dp_size": 2, "max_running_requests": 64, "max_total_num_tokens": 5000,
         "startup_time": 12.5, "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "t",
                                             "block_size": 32, "dp_size": 2, "load_endpoint_port_base": 5561, "load_topic": "load",
                                             "replay_endpoint_port_base": 5559}}
    info = info_from_server_info(d, _settings())
    assert info.kv_endpoints == ["tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"]
    assert info.replay_endpoints == ["tcp://10.1.2.3:5559", "tcp://10.1.2.3:5560"]
    assert info.load_endpoints == ["tcp://10.1.2.3:5561", "tcp://10.1.2.3:5562"]
    assert (info.block_size, info.dp_size, info.topic, info.model, info.max_running_requests, info.max_total_num_tokens) == \
        (32, 2, "t", "m", 64, 5000)
    o = info_from_server_info(d, _settings(kv_endpoint="tcp://*:7000", block_size=16, dp_size=1, topic=""))
    assert o.kv_endpoints == ["tcp://10.1.2.3:7000"] and o.block_size == 16 and o.topic == ""
    # SGLang <= 0.5.17: no kv_events block, only the server arg
    old = {"page_size": 16, "kv_events_config": '{"publisher": "zmq", "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001"}'}
    oi = info_from_server_info(old, _settings())
    assert oi.kv_endpoints == ["tcp://10.1.2.3:6000"] and oi.replay_endpoints == ["tcp://10.1.2.3:6001"] and oi.load_endpoints == [None]
    assert info_from_server_info({"page_size": 16, "kv_events": None}, _settings()).kv_endpoints == [None]


def test_rank_endpoints_and_wildcards():
    assert rank_endpoint("tcp://h:5557", 3) == "tcp://h:5560"
    assert rank_endpoint("inproc://kv", 2) == "inproc://kv_dp2" and rank_endpoint("inproc://kv", 0) == "inproc://kv"
    assert replace_wildcard("tcp://*:1", "a.b") == "tcp://a.b:1" and replace_wildcard("tcp://0.0.0.0:1", "::1") == "tcp://[::1]:1"
    assert replace_wildcard("tcp://x:1", "a") == "tcp://x:1"


def test_split_events_respects_token_budget_and_chains_parents():
    ev = KV.BlockStored(tuple(range(1, 11)), 99, tuple(range(40)), 4, "GPU")
    parts = split_events([KV.AllBlocksCleared(), ev, KV.BlockRemoved(tuple(range(5)))], max_tokens=12, max_hashes=2)
    flat = [e for p in parts for e in p]
    stored = [e for e in flat if type(e) is KV.BlockStored]
    assert all(sum(len(e.token_ids) for e in p if type(e) is KV.BlockStored) <= 12 for p in parts)
    assert sum((e.block_hashes for e in stored), ()) == ev.block_hashes
    assert [e.parent_block_hash for e in stored] == [99] + [s.block_hashes[-1] for s in stored[:-1]]
    assert sum((e.block_hashes for e in flat if type(e) is KV.BlockRemoved), ()) == tuple(range(5))
    assert type(flat[0]) is KV.AllBlocksCleared


def test_block_mirror_snapshot_is_parent_first_and_merged():
    m = BlockMirror()
    m.apply([KV.BlockStored((1, 2), None, (1, 1, 2, 2), 2, "GPU"), KV.BlockStored((3,), 2, (3, 3), 2, "GPU"),
             KV.BlockStored((4,), 1, (4, 4), 2, "GPU"), KV.BlockStored((9,), None, (9, 9), 2, "CPU_PINNED")])
    m.apply([KV.BlockRemoved((3,), "GPU")])
    snap = m.snapshot_events()
    assert snap == [KV.BlockStored((1, 2), None, (1, 1, 2, 2), 2, "GPU"), KV.BlockStored((4,), 1, (4, 4), 2, "GPU"),
                    KV.BlockStored((9,), None, (9, 9), 2, "CPU_PINNED")]
    m2 = BlockMirror()
    m2.apply(snap)
    assert m2.blocks == m.blocks


def test_request_bodies_and_load_parsing():
    sub = P.decode_client(P.encode_submit("c1", input_ids=[1, 2, 3], params={"max_new_tokens": 5, "temperature": 0.5, "seed": 3,
                                                                                "cache_salt": "s", "weird": 1}))
    req = P.Request(7, 2, 1000, "c1", {"bootstrap_host": "10.0.0.9", "bootstrap_port": 8998, "room": 42}, sub)
    b = generate_body(req, info_from_server_info({"page_size": 16}, _settings()))
    assert b["input_ids"] == [1, 2, 3] and b["stream"] is True and b["cache_salt"] == "s" and "weird" not in b
    assert b["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.5, "sampling_seed": 3}
    assert (b["bootstrap_host"], b["bootstrap_port"], b["bootstrap_room"]) == ("10.0.0.9", 8998, 42)
    vinfo = info_from_server_info({"page_size": 16, "served_model_name": "m"}, _settings())
    with pytest.raises(UnsupportedParam, match="weird"):  # vLLM is never sent a request with a parameter missing
        completions_body(req, vinfo)
    sub.params.pop("weird")
    vb = completions_body(req, vinfo)
    assert vb["prompt"] == [1, 2, 3] and vb["max_tokens"] == 5 and vb["seed"] == 3 and vb["model"] == "m"
    assert vb["cache_salt"] == "s"
    ls = loadstat_from_v1({"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 100,
                           "max_total_num_tokens": 1000, "max_running_requests": 8, "num_total_tokens": 150})
    assert (ls.attn_dp_rank, ls.num_running_reqs, ls.num_tokens, ls.extended) == (1, 3, 100, True)
    text = ('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m",dp_rank="1"} 4.0\n'
            'sglang:num_queue_reqs{model_name="m",dp_rank="1"} 2\nsglang:token_usage{dp_rank="1"} 0.5\n'
            'sglang:max_total_num_tokens{dp_rank="1"} 1000\n')
    assert parse_prometheus(text)[0] == ("sglang:num_running_reqs", {"model_name": "m", "dp_rank": "1"}, 4.0)
    (m,) = loadstats_from_metrics(text, info_from_server_info({"page_size": 16}, _settings()))
    assert (m.attn_dp_rank, m.num_running_reqs, m.num_waiting_reqs, m.num_tokens, m.extended) == (1, 4, 2, 500, False)


def test_http_status_mapping_is_retryable_where_another_worker_may_succeed():
    from mesh.adapters.engine_client import error_code_for_status

    assert error_code_for_status(400) is ErrorCode.BAD_REQUEST and not ErrorCode.BAD_REQUEST.retryable
    assert error_code_for_status(429) is ErrorCode.OVERLOADED and ErrorCode.OVERLOADED.retryable
    assert error_code_for_status(503) is ErrorCode.UNAVAILABLE and error_code_for_status(500) is ErrorCode.WORKER_ERROR


def test_cli_parsers_build_settings_and_reject_bad_flags():
    import argparse

    import pytest

    from mesh.adapters.cli import add_attach_parser, make_backend, settings_from_args
    from mesh.errors import ConfigError
    from workers_stub.sglang_cli import add_stub_sglang_parser
    from workers_stub.sglang_cli import settings_from_args as stub_settings

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    add_attach_parser(sub)
    add_stub_sglang_parser(sub)
    a = p.parse_args(["attach", "sglang", "--url", "http://h:30000", "--broker", "tcp://b:1", "--broker", "tcp://b:2",
                      "--label", "zone=a", "--block-size", "32"])
    s = settings_from_args(a)
    assert s.brokers == ("tcp://b:1", "tcp://b:2") and s.labels == {"zone": "a"} and s.block_size == 32
    v = p.parse_args(["attach", "vllm", "--url", "http://h:8000", "--broker", "tcp://b:1"])
    with pytest.raises(ConfigError):
        make_backend("vllm", settings_from_args(v))  # vLLM needs --kv-endpoint and --block-size
    with pytest.raises(ConfigError):
        settings_from_args(p.parse_args(["attach", "sglang", "--url", "ftp://h", "--broker", "tcp://b:1"]))
    st = stub_settings(p.parse_args(["stub-sglang", "--kv-events-config",
                                     '{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"t"}',
                                     "--load-publish-endpoint", "off", "--page-size", "32"]))
    assert (st.kv_port, st.replay_port, st.load_port, st.topic, st.engine.page_size) == (5557, 5558, None, "t", 32)
    off = stub_settings(p.parse_args(["stub-sglang", "--kv-events-config", '{"publisher":"null"}']))
    assert off.kv_port is None and off.replay_port is None


def test_mesh_cli_wiring():
    import pytest

    from mesh.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    if "attach" not in sub.choices or "stub-sglang" not in sub.choices:
        pytest.skip("mesh attach / mesh stub-sglang are not wired into mesh/cli.py yet")
    args = build_parser().parse_args(["attach", "sglang", "--url", "http://h:1", "--broker", "tcp://b:2"])
    assert args.engine == "sglang" and callable(args.func)
    args = build_parser().parse_args(["stub-sglang", "--port", "0"])
    assert args.port == 0 and callable(args.func)


def test_vllm_body_translates_sglang_params_or_refuses_them():
    info = info_from_server_info({"page_size": 16, "served_model_name": "base"}, _settings())

    def body(**params):
        sub = P.decode_client(P.encode_submit("c", input_ids=[1, 2], params=params))
        return completions_body(P.Request(1, 1, 1000, "c", None, sub), info)

    b = body(json_schema='{"type": "object"}', regex=None or "a+", no_stop_trim=True, return_logprob=True, top_logprobs_num=3,
             lora_path="my-adapter", min_new_tokens=2, spaces_between_special_tokens=False)
    assert b["structured_outputs"] == {"json": {"type": "object"}, "regex": "a+"}
    assert b["include_stop_str_in_output"] is True and b["logprobs"] == 3 and b["min_tokens"] == 2
    assert b["model"] == "my-adapter"  # vLLM serves a LoRA adapter under its own name
    assert "max_tokens" not in body()  # no limit given: vLLM's default (the rest of the context)
    for k, v in {"extra_key": "x", "return_hidden_states": True, "custom_params": {}, "stop_regex": "x"}.items():
        with pytest.raises(UnsupportedParam, match=k):
            body(**{k: v})
    with pytest.raises(UnsupportedParam, match="json_schema"):
        body(json_schema="{not json")


def test_vllm_logprobs_become_sglang_meta_lists_for_the_ingress():
    from mesh.adapters.backend import StreamState
    from mesh.adapters.vllm import VllmBackend
    from mesh.openai_logprobs import completion_logprobs

    info = info_from_server_info({"page_size": 16, "served_model_name": "base"}, _settings())
    st = StreamState()
    chunk = {"choices": [{"index": 0, "text": " Hello world", "token_ids": [9906, 1917], "finish_reason": None,
                          "logprobs": {"text_offset": [0, 6], "token_logprobs": [-0.25, -1.5], "tokens": [" Hello", " world"],
                                       "top_logprobs": [{" Hello": -0.25, " Hi": -1.75}, {" there": -0.5, " world": -1.5}]}}]}
    VllmBackend.parse(None, chunk, st, info)
    assert st.new_ids == [9906, 1917]
    assert st.new_lists["output_token_logprobs"] == [[-0.25, 9906, " Hello"], [-1.5, 1917, " world"]]
    assert st.new_lists["output_top_logprobs"][1] == [[-0.5, None, " there"], [-1.5, None, " world"]]
    out = completion_logprobs(st.new_lists)  # what the ingress turns them into
    assert out["tokens"] == [" Hello", " world"] and out["token_logprobs"] == [-0.25, -1.5]
    assert out["top_logprobs"][0] == {" Hello": -0.25, " Hi": -1.75}
    st2 = StreamState()
    VllmBackend.parse(None, {"choices": [{"text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": "bad"}}]}, st2, info)
    assert st2.new_lists == {} and st2.new_text == "x"  # malformed logprobs are skipped, the text is kept
