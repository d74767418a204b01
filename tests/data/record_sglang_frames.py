"""Record real SGLang KV-event frames into a JSON fixture (how tests/data/sglang_*_frames.json were made).

Not run by the tests. Needs an *unpacked* sglang wheel (do not install it) and a Python with
msgspec, pyzmq, pydantic, psutil (``worker-telemetry.md`` §14)::

    pip download --no-deps sglang==0.5.23 && python -m zipfile -e sglang-0.5.23-*.whl /tmp/u0523
    python tests/data/record_sglang_frames.py /tmp/u0523 0.5.23 tests/data/sglang_0_5_23_frames.json

It builds SGLang's own ``ZmqEventPublisher`` (rank 1, ``buffer_steps=4``, a topic), publishes six
batches, records the live frames a SUB receives, then the replay a DEALER gets from seq 0 (only
the last four batches are still buffered, so the replay starts at seq 2: lost history).
0.5.23 emits tagged maps and 4-frame replies; 0.5.18 tagged arrays and 3-frame replies.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import sys
import time
import types
from array import array


def page_hashes(tokens, page_size, prior=None):
    out = []
    for s in range(0, len(tokens), page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(array("I", tokens[s:s + page_size]).tobytes())
        prior = h.digest()
        u = int(h.hexdigest()[:16], 16)
        out.append(u - 2**64 if u >= 2**63 else u)
    return out, prior


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def load_module(root: str, version: str):
    path = f"{root}/sglang/srt/disaggregation/kv_events.py"
    if version >= "0.5.20":
        for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
            m = types.ModuleType(name)
            m.__path__ = [f"{root}/{name.replace('.', '/')}"]
            sys.modules[name] = m
        rc = types.ModuleType("sglang.srt.runtime_context")
        rc.get_parallel = lambda: None  # only the publisher-rank check needs it
        sys.modules["sglang.srt.runtime_context"] = rc
        net = types.ModuleType("sglang.srt.utils.network")

        class NetworkAddress:  # only /server_info helpers use it
            pass

        net.NetworkAddress = NetworkAddress
        sys.modules["sglang.srt.utils.network"] = net
    spec = importlib.util.spec_from_file_location("sglang_kv_events", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sglang_kv_events"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(root: str, version: str, out_path: str) -> None:
    import zmq

    kv = load_module(root, version)
    rank = 1
    base, rbase = free_port(), free_port()
    # before 0.5.22 there is no "bind" key: the PUB binds only for a wildcard host (else it connects)
    host = "127.0.0.1" if version >= "0.5.22" else "*"
    kw = dict(attn_dp_rank=rank, endpoint=f"tcp://{host}:{base - rank}", replay_endpoint=f"tcp://{host}:{rbase - rank}",
              buffer_steps=4, topic="kv@test")
    if version >= "0.5.22":
        kw["bind"] = True
    pub = kv.ZmqEventPublisher(**kw)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{base}")
    time.sleep(0.5)  # slow joiner (a recording script, not a test)

    h01, d1 = page_hashes(list(range(1, 9)), 4)
    (h2,), _ = page_hashes([9, 10, 11, 12], 4, d1)
    stored = dict(block_hashes=h01, parent_block_hash=None, token_ids=list(range(1, 9)), block_size=4, lora_id=None, medium="GPU")
    batches = [
        [kv.AllBlocksCleared()],
        [kv.BlockStored(**stored)],
        [kv.BlockStored(block_hashes=[h2], parent_block_hash=h01[1], token_ids=[9, 10, 11, 12], block_size=4, lora_id=None,
                        medium="GPU")],
        [kv.BlockRemoved(block_hashes=[h2], medium="GPU")],
    ]
    if version >= "0.5.22":
        batches.append([kv.BlockStored(block_hashes=[-42], parent_block_hash=None, token_ids=[7, 7, 7, 7], block_size=4, lora_id=None,
                                       medium="CPU_PINNED", cache_salt="salt-a", session_id="sess-1", lora_name="adapter-x")])
    else:
        batches.append([kv.BlockStoredWithMetadata(block_hashes=[-42], parent_block_hash=None, token_ids=[7, 7, 7, 7], block_size=4,
                                                   lora_id=None, medium="CPU_PINNED",
                                                   metadata=kv.BlockStoredMetadata(cache_salt="salt-a"))])
    batches.append([kv.BlockRemoved(block_hashes=h01, medium="GPU"), kv.AllBlocksCleared()])
    for evs in batches:
        pub.publish(kv.KVEventBatch(ts=time.time(), events=evs))
    live = [sub.recv_multipart() for _ in batches]

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{rbase}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replay = []
    while True:
        frames = dealer.recv_multipart()
        replay.append(frames)
        if b"\xff" * 8 in frames[1:3]:
            break
    pub.shutdown()
    doc = {
        "source": f"sglang {version} ZmqEventPublisher (real wheel code), rank {rank}, buffer_steps 4, topic 'kv@test'",
        "recorded_with": "tests/data/record_sglang_frames.py",
        "block_size": 4,
        "rank": rank,
        "expected": {"h01": h01, "h2": h2},
        "live": [[f.hex() for f in m] for m in live],
        "replay_from_0": [[f.hex() for f in m] for m in replay],
    }
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out_path}: {len(live)} live, {len(replay)} replay messages")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
