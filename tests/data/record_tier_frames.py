"""Record KV-event payloads of a tiered cache from the engines' own wheels (tests/data/tier_frames.json).

Not run by the tests. Needs *unpacked* wheels (do not install them) and a Python with msgspec,
pyzmq, pydantic, psutil (as ``record_sglang_frames.py``)::

    pip download --no-deps sglang==0.5.23 sglang==0.5.18 vllm==0.34.0
    python -m zipfile -e sglang-0.5.23-*.whl /tmp/u0523
    python -m zipfile -e sglang-0.5.18-*.whl /tmp/u0518
    python -m zipfile -e vllm-0.34.0-*.whl /tmp/vllm
    python tests/data/record_tier_frames.py /tmp/u0523 /tmp/u0518 /tmp/vllm tests/data/tier_frames.json

Each engine's own event classes (SGLang's ``StorageMedium`` values; vLLM's ``MEDIUM_*``
constants), encoded by the engine's own ``msgspec.msgpack.Encoder`` as its publisher does (the
ZMQ payload frame): SGLang 0.5.23 tagged maps, 0.5.18 tagged arrays, vLLM 0.34 tagged maps.
The story (block size 4, tokens 1..8 = blocks h0, h1): stored on the GPU; backed up to the host
tier; removed from the GPU (a demotion); one batch per step, then removed from the host (gone).
vLLM's extra story demotes through its STORAGE tier too.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from record_sglang_frames import load_module, page_hashes  # noqa: E402


def load_vllm(root: str):
    """vllm/distributed/kv_events.py with its few vllm imports stubbed (only the classes are used)."""
    stubs = {
        "vllm.config.kv_events": {"KVEventsConfig": type("KVEventsConfig", (), {})},
        "vllm.logger": {"init_logger": lambda name: __import__("logging").getLogger(name)},
        "vllm.utils.network_utils": {n: (lambda *a, **k: None) for n in
                                     ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path")},
        "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    }
    for name, attrs in stubs.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
    spec = importlib.util.spec_from_file_location("vllm_kv_events", f"{root}/vllm/distributed/kv_events.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_kv_events"] = mod
    spec.loader.exec_module(mod)
    return mod


def sglang_story(kv, host: str, disk: str):
    hs, _ = page_hashes(list(range(1, 9)), 4)
    st = dict(block_hashes=hs, parent_block_hash=None, token_ids=list(range(1, 9)), block_size=4, lora_id=None)
    return hs, [
        [kv.BlockStored(**st, medium="GPU")],
        [kv.BlockStored(**st, medium=host)],
        [kv.BlockRemoved(block_hashes=hs[::-1], medium="GPU")],
        [kv.BlockStored(**st, medium=disk)],
        [kv.BlockRemoved(block_hashes=hs[::-1], medium=host)],
        [kv.BlockRemoved(block_hashes=hs[::-1], medium=disk)],
    ]


def vllm_story(kv):
    hs = [3262291359910021016, 7142137847444424233]  # any unsigned ids: vLLM publishes them as is
    st = dict(block_hashes=hs, parent_block_hash=None, token_ids=list(range(1, 9)), block_size=4, lora_id=None,
              lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention")
    return hs, [
        [kv.BlockStored(**st, medium=kv.MEDIUM_GPU)],
        [kv.BlockStored(**st, medium=kv.MEDIUM_CPU)],
        [kv.BlockRemoved(block_hashes=hs[::-1], medium=kv.MEDIUM_GPU, group_idx=0)],
        [kv.BlockStored(**st, medium=kv.MEDIUM_STORAGE)],
        [kv.BlockRemoved(block_hashes=hs[::-1], medium=kv.MEDIUM_CPU, group_idx=0)],
        [kv.BlockRemoved(block_hashes=hs[::-1], medium=kv.MEDIUM_STORAGE, group_idx=0)],
    ]


def main(sg23: str, sg18: str, vllm: str, out_path: str) -> None:
    import json

    import msgspec

    enc = msgspec.msgpack.Encoder()
    doc = {"recorded_with": "tests/data/record_tier_frames.py", "block_size": 4, "tokens": list(range(1, 9)),
           "steps": ["gpu_store", "host_store", "gpu_remove", "store_store", "host_remove", "store_remove"],
           "engines": {}}
    for name, root, form in (("sglang_0_5_23", sg23, "map"), ("sglang_0_5_18", sg18, "array")):
        for mod in [m for m in sys.modules if m.startswith("sglang")]:
            del sys.modules[mod]
        kv = load_module(root, name.split("_", 1)[1].replace("_", "."))
        hs, story = sglang_story(kv, kv.StorageMedium.CPU.value, kv.StorageMedium.DISK.value)
        doc["engines"][name] = {"form": form, "mediums": [m.value for m in kv.StorageMedium], "hashes": hs,
                                "payloads": [enc.encode(kv.KVEventBatch(ts=time.time(), events=evs, attn_dp_rank=0)).hex()
                                             for evs in story]}
    kv = load_vllm(vllm)
    hs, story = vllm_story(kv)
    doc["engines"]["vllm_0_34"] = {"form": "map", "mediums": [kv.MEDIUM_GPU, kv.MEDIUM_CPU, kv.MEDIUM_STORAGE],
                                   "hashes": hs,
                                   "payloads": [enc.encode(kv.KVEventBatch(ts=time.time(), events=evs,
                                                                           data_parallel_rank=0)).hex()
                                                for evs in story]}
    Path(out_path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
