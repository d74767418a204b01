"""Replaying a broker's recorded decisions (``mesh broker --record-decisions FILE``) in ``mesh sim``.

:func:`load_decisions` reads the file (format ``mesh-decisions``, see
:mod:`mesh.broker_core.recorder` and docs/simulator.md) into a :class:`Workload`: the Mooncake
fields (arrival, ``input_length``, ``output_length``, ``hash_ids``) at the file's ``block_size``,
the fleet it was recorded on (worker ids and roles, in the broker's pool order:
``Workload.fleet``) and each request's recorded decision kept aside (``Workload.recorded``) for
:func:`compare_decisions`. Arrival times stay as recorded (seconds since the file's start, times
``time_scale``): the replay's clock is the recording's.

Continuations. An engine caches prompt *and output* pages, and a later turn's prompt holds the
earlier answer: if the replayed engine emitted made-up tokens, later turns would miss what they hit
live. So, at load time, for each request ``r`` the first later request ``s`` whose ``hash_ids``
extend ``r``'s full-block prefix and whose prompt is longer (and of the same session pseudonym,
when both carry one) supplies ``r``'s partial last block (the first tokens of ``s``'s block at that
position) and ``r``'s output (``s``'s prompt tokens that follow, up to ``output_length``,
``SimRequest.output_script``): the replayed engine emits exactly the tokens the later prompt holds.
A request whose prefix is only blocks a whole fleet shares (no session to tell) may borrow another
request's tokens: the file cannot tell, the limit is documented.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from mesh.broker_core.recorder import FORMAT, VERSION
from mesh.errors import ConfigError
from mesh.lab.sim.workloads import SimRequest, Workload, seed_key

__all__ = ["is_decision_file", "load_decisions", "compare_decisions", "MAX_LINE_BYTES"]

_NS_RECORDED = 8  # segment key namespace of recorded block ids (workloads.py uses 1..7)
MAX_LINE_BYTES = 64 << 20  # a record of a 10M-token prompt at 16-token blocks is ~5 MB
_MAX_INPUT = 50_000_000
_MAX_OUTPUT = 10_000_000
_MAX_BLOCK = 1 << 16


def is_decision_file(path: str | Path) -> bool:
    """True when ``path``'s first line is a ``mesh-decisions`` header (else: a Mooncake trace)."""
    try:
        with Path(path).open("rb") as fh:
            head = fh.readline(MAX_LINE_BYTES)
    except OSError:
        return False
    try:
        o = json.loads(head)
    except ValueError:
        return False
    return isinstance(o, dict) and o.get("format") == FORMAT


def _int(where: str, o: dict, name: str, lo: int, hi: int) -> int:
    v = o.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise ConfigError(f"{where}: {name} must be an int in [{lo}, {hi}], got {str(v)[:40]}")
    return v


def _fleet(where: str, v: Any) -> list[tuple[str, str]]:
    if not isinstance(v, list) or len(v) > 100_000:
        raise ConfigError(f"{where}: fleet must be a list of {{id, role}}")
    out = []
    for w in v:
        if not (isinstance(w, dict) and isinstance(w.get("id"), str) and 0 < len(w["id"]) <= 256):
            raise ConfigError(f"{where}: fleet entries need an id (a string of 1..256 characters)")
        role = w.get("role")
        out.append((w["id"], role if isinstance(role, str) else "mixed"))
    return out


def load_decisions(path: str | Path, *, time_scale: float = 1.0, max_requests: int | None = None) -> Workload:
    """Load a recording (see the module docstring); ConfigError naming the line and field."""
    if not time_scale > 0:
        raise ConfigError(f"time_scale must be > 0, got {time_scale!r}")
    recs: list[tuple[float, int, dict[str, Any]]] = []
    fleet: list[tuple[str, str]] = []
    seen: set[str] = set()
    header: dict[str, Any] | None = None
    try:
        fh = Path(path).open("rb")
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from None
    with fh:
        for lineno, raw in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b""), 1):
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE_BYTES:
                raise ConfigError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                o = json.loads(raw)
            except ValueError as exc:
                raise ConfigError(f"{where}: not JSON: {exc}") from None
            if not isinstance(o, dict):
                raise ConfigError(f"{where}: a line must be a JSON object")
            if header is None:
                if o.get("format") != FORMAT:
                    raise ConfigError(f"{where}: format: not a {FORMAT} header")
                if o.get("version") != VERSION:
                    raise ConfigError(f"{where}: version: {str(o.get('version'))[:20]} (this mesh reads {VERSION})")
                _int(where, o, "block_size", 1, _MAX_BLOCK)
                header = o
                new = _fleet(where, o.get("fleet", []))
            elif "format" in o:
                raise ConfigError(f"{where}: format: a second header: a file holds one recording (its ids mean "
                                  f"nothing in another file); replay rotated files one by one")
            elif "fleet" in o and "input_length" not in o:
                new = _fleet(where, o["fleet"])
            else:
                if max_requests is not None and len(recs) >= max_requests:
                    continue
                recs.append((_timestamp(where, o), lineno, _check(where, o, header)))
                continue
            for w in new:
                if w[0] not in seen:
                    seen.add(w[0])
                    fleet.append(w)
    if header is None:
        raise ConfigError(f"{path}: empty: no {FORMAT} header")
    recs.sort(key=lambda x: (x[0], x[1]))  # by arrival; file order breaks ties
    reqs: list[SimRequest] = []
    recorded: list[dict[str, Any]] = []
    for i, (ts, _, o) in enumerate(recs):
        bs = o["block_size"]
        n = o["input_length"]
        ids = o["hash_ids"]
        segs = tuple((0, seed_key(_NS_RECORDED, h), bs, min(bs, n - j * bs)) for j, h in enumerate(ids[: -(-n // bs)]))
        sess = o.get("session")
        mt = o.get("max_tokens")
        reqs.append(SimRequest(i, ts / 1000.0 * time_scale, n, o["output_length"], segs,
                               session=sess if type(sess) is int else None,
                               max_tokens=mt if type(mt) is int and o["output_length"] <= mt <= _MAX_OUTPUT else None))
        recorded.append({k: o.get(k) for k in ("worker", "reason", "policy", "matched_blocks", "predicted_ttft_ms",
                                                "decode_worker", "attempts", "outcome", "ttft_ms", "e2e_ms", "cached_tokens",
                                                "output_length")})
    continued = _continuations(reqs, [o["hash_ids"] for _, _, o in recs])
    wl = Workload("recorded", reqs, {"trace": str(path), "time_scale": time_scale, "format": FORMAT,
                                     "policy": header.get("policy"), "broker_id": header.get("broker_id"),
                                     "block_size": header["block_size"], "continuations": continued})
    wl.fleet = fleet
    wl.recorded = recorded
    return wl


def _timestamp(where: str, o: dict) -> float:
    ts = o.get("timestamp")
    if type(ts) not in (int, float) or not math.isfinite(ts) or abs(ts) > 1e13:
        raise ConfigError(f"{where}: timestamp must be a finite number of ms, got {str(ts)[:40]}")
    return float(ts)


def _check(where: str, o: dict, header: dict) -> dict:
    """A record's replay fields, validated (ConfigError naming the field)."""
    n = _int(where, o, "input_length", 1, _MAX_INPUT)
    _int(where, o, "output_length", 0, _MAX_OUTPUT)
    if "block_size" not in o:
        o["block_size"] = header["block_size"]
    bs = _int(where, o, "block_size", 1, _MAX_BLOCK)
    ids = o.get("hash_ids")
    if not isinstance(ids, list) or not all(type(h) is int and 0 <= h < 1 << 63 for h in ids):
        raise ConfigError(f"{where}: hash_ids must be a list of non-negative ints")
    if len(ids) < -(-n // bs):
        raise ConfigError(f"{where}: hash_ids: {len(ids)} ids cannot cover input_length {n} at block_size {bs}")
    for name in ("worker", "reason"):
        v = o.get(name)
        if v is not None and not (isinstance(v, str) and len(v) <= 256):
            raise ConfigError(f"{where}: {name} must be a string of at most 256 characters")
    return o


def _continuations(reqs: list[SimRequest], ids: list[list[int]]) -> int:
    """Give each request the partial block and output a later prompt holds (module docstring);
    returns how many got one. One pass in arrival order: a request waits under the id of its
    last full block until a later request carrying that id at the same position extends it."""
    waiting: dict[int, list[int]] = {}
    done = 0
    for s, rs in enumerate(reqs):
        s_ids = ids[s]
        bs = rs.segments[0][2] if rs.segments else 1
        for j in range(min(len(s_ids), -(-rs.prompt_len // bs))):
            lst = waiting.get(s_ids[j])
            if not lst:
                continue
            keep = []
            for r in lst:
                rr = reqs[r]
                if rr.prompt_len // bs != j + 1 or rs.prompt_len <= rr.prompt_len or \
                        (rr.session is not None and rs.session is not None and rr.session != rs.session):
                    keep.append(r)
                    continue
                _continue(rr, rs, bs)
                done += 1
            if keep:
                waiting[s_ids[j]] = keep
            else:
                del waiting[s_ids[j]]
        full = rs.prompt_len // bs
        if full:
            waiting.setdefault(s_ids[full - 1], []).append(s)
    return done


def _continue(r: SimRequest, s: SimRequest, bs: int) -> None:
    """``r``'s partial last block and output become the tokens ``s``'s prompt holds there."""
    n = r.prompt_len
    full = n // bs
    segs = list(r.segments[:full])
    tail = n - full * bs
    if tail:
        key = s.segments[full][1]
        segs.append((0, key, bs, tail))
    r.segments = tuple(segs)
    script = []
    pos, end = n, min(s.prompt_len, n + r.output_len)
    while pos < end:
        b = pos // bs
        seg = s.segments[b]
        stop = min(end, b * bs + seg[3])
        script.append((seg[1], seg[2], pos - b * bs, stop - b * bs))
        pos = stop
    r.output_script = tuple(script)


def compare_decisions(wl: Workload, chosen: list[tuple[str, str] | None], limit: int = 20) -> dict[str, Any]:
    """Per request: the recorded decision's worker against the replay's (``chosen[i]``: its
    (worker, reason), None when it was not routed). Returns the share identical, per recorded
    reason, and the first ``limit`` divergences."""
    rec = wl.recorded or []
    by_reason: Counter[str] = Counter()
    same_by_reason: Counter[str] = Counter()
    diverged = []
    same = total = 0
    for i, r in enumerate(rec):
        if r.get("worker") is None:
            continue
        total += 1
        reason = str(r.get("reason"))
        by_reason[reason] += 1
        got = chosen[i] if i < len(chosen) else None
        if got is not None and got[0] == r["worker"]:
            same += 1
            same_by_reason[reason] += 1
        elif len(diverged) < limit:
            diverged.append({"request": i, "arrival_s": round(wl.requests[i].arrival_s, 6), "recorded": r["worker"],
                             "recorded_reason": reason, "replayed": got[0] if got else None,
                             "replayed_reason": got[1] if got else None})
    return {
        "compared": total, "identical": same, "identical_share": round(same / total, 6) if total else None,
        "by_reason": {k: {"requests": v, "identical": same_by_reason[k], "share": round(same_by_reason[k] / v, 6)}
                      for k, v in sorted(by_reason.items())},
        "first_divergences": diverged,
    }
