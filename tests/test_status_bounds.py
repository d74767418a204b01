"""STATUS on the client port (issue 32 leftover): it answered anyone, and 300 workers with the
largest accepted labels made a 1.0 MB reply to a 1-byte query. Now a client that is not
authorised gets a bounded summary (short rows, ``truncated``, paged by ``offset``), only an
authorised one whole rows, and each client identity is rate-limited (counted)."""

from __future__ import annotations

import time

import pytest

from mesh import protocol as P
from mesh.broker_core.core import BrokerCore
from mesh.broker_core.sends import TO_CLIENT
from mesh.broker_core.status import StatusLimiter, may_read_full_status
from mesh.client import Client
from mesh.config import BrokerSettings, build
from mesh.errors import ConfigError, ErrorCode, RequestError
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from mesh.routing.router import Router, make_policy
from tests.conftest import run, until

_FAT_LABELS = {f"k{i:02d}" + "x" * (P.MAX_LABEL_KEY_BYTES - 3): "v" * P.MAX_LABEL_VALUE_BYTES for i in range(P.MAX_LABELS)}


def _core(n: int, *, full=None, loras: int = 0, **settings) -> BrokerCore:
    core = BrokerCore(build(BrokerSettings, {"policy": "round_robin", **settings}), Router(make_policy("round_robin"), None),
                      status_full=full)
    core.start(0.0)
    for i in range(n):
        wid = f"w{i:03d}" + "i" * 200
        ready = P.Ready(wid, "m", "mixed", dict(_FAT_LABELS), 16, 64, 400_000, 1, 1, 500,
                        loras=[f"l{j}" + "z" * 250 for j in range(loras)] or None)
        core.worker_frames([wid.encode(), *P.encode_ready(ready)], 0.0)
        core.worker_frames([wid.encode(), *P.encode_heartbeat()], 0.0)
    core.take()
    return core


def _ask(core: BrokerCore, ident: bytes, now: float = 1.0, **query) -> tuple[int, P.StatusReply]:
    """One STATUS: (reply bytes, the reply)."""
    core.client_frames([ident, *P.encode_status_query(**query)], now)
    out = [s for s in core.take() if s.to == TO_CLIENT]
    assert len(out) == 1
    m = P.decode_client_reply(out[0].frames)
    assert isinstance(m, P.StatusReply)
    return sum(len(f) for f in out[0].frames), m


def test_a_status_query_from_anyone_gets_a_bounded_summary():
    core = _core(300)
    size, m = _ask(core, b"stranger")  # today: every worker's whole row, 1.0 MB
    assert size < 32_000, size
    assert len(m.workers) == 32 and m.broker["truncated"] is True and m.broker["summary"] is True
    assert m.broker["workers_total"] == 300 and m.broker["workers_healthy"] == 300
    assert all("labels" not in w for w in m.workers)
    # asking for whole rows is not enough: the client must be authorised
    size_full, m = _ask(core, b"stranger", full=True)
    assert size_full < 32_000 and m.broker["summary"] is True
    # paging covers every worker once
    seen: list[str] = []
    while True:
        _, m = _ask(core, b"pager", offset=len(seen))
        if not m.workers:
            break
        seen += [w["worker_id"] for w in m.workers]
    assert len(seen) == len(set(seen)) == 300


def test_the_worst_summary_row_is_bounded_and_an_authorised_client_reads_whole_rows():
    core = _core(40, loras=64, full=lambda ident: ident == b"operator")
    size, m = _ask(core, b"stranger", full=True)
    assert size < 128_000 and all(len(w["loras"]) == 4 for w in m.workers)
    _, m = _ask(core, b"operator", full=True)
    assert len(m.workers) == 40 and m.broker["truncated"] is False and "summary" not in m.broker
    assert m.workers[0]["labels"] == _FAT_LABELS and len(m.workers[0]["loras"]) == 64
    assert may_read_full_status(True) and may_read_full_status(False, admin=True) and not may_read_full_status(False)


def test_a_status_flood_is_rate_limited_per_identity_and_counted():
    core = _core(2, status_rate=10.0)
    answered = sum(1 for _ in range(200) if not _ask(core, b"flood", 1.0)[1].broker.get("rate_limited"))
    assert answered == 40  # the burst: 4 x the rate
    assert core.stats.flat()["frames_rejected.client.status_rate_limited"] == 160
    size, m = _ask(core, b"flood", 1.0)
    assert m.broker["rate_limited"] is True and not m.workers and size < 200
    assert not _ask(core, b"someone-else", 1.0)[1].broker.get("rate_limited")
    assert not _ask(core, b"flood", 2.0)[1].broker.get("rate_limited")  # a second later: 10 more
    lim = StatusLimiter(1.0)
    for i in range(10_000):  # a flood of identities is forgotten oldest-first, not kept
        lim.allow(i.to_bytes(4, "big"), 0.0)
    assert len(lim) <= 4096


@pytest.mark.parametrize("body", [{"full": "yes"}, {"full": 1}, {"offset": -1}, {"offset": 2**40}, {"offset": "3"},
                                  {"offset": 1.5}])
def test_hostile_status_fields_are_rejected_naming_the_field(body):
    core = _core(1)
    frames = [b"x", P.CLIENT_HEADER, bytes([P.Cmd.C_STATUS]), P.pack(body)]
    core.client_frames(frames, 1.0)
    assert not [s for s in core.take() if s.to == TO_CLIENT and isinstance(P.decode_client_reply(s.frames), P.StatusReply)]
    assert core.stats.flat()["frames_rejected.client.bad_field"] == 1
    err = P.decode_client(frames[1:])
    assert err.reason == "bad_field" and next(iter(body)) in str(err)
    _, m = _ask(core, b"y", offset=10_000)  # beyond the fleet: an empty page
    assert m.workers == [] and m.broker["truncated"] is True


@pytest.mark.parametrize("field,value", [("status_max_workers", 0), ("status_max_workers", 5000),
                                         ("status_rate", 0.0), ("status_rate", float("nan"))])
def test_hostile_status_flags_are_config_errors_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        build(BrokerSettings, {field: value})


def test_clients_and_the_gateway_page_through_a_summary(procs):
    """A real broker that shows 1 row per STATUS and answers 1 STATUS a second (burst 4):
    wait_for_workers, Client.status and the gateway (its /health counts the routable workers over
    the brokers' pages; a rate-limited page is asked again, not the round) still see all 5."""
    import aiohttp

    b = procs.broker("b", "--heartbeat-ms", "200", "--status-max-workers", "1", "--status-rate", "1")
    procs.workers("w", [b.backend], count=5)
    run(wait_for_workers(b.frontend, 5))
    g = procs.spawn("gw", ["gateway", "--http", "127.0.0.1:0", "--broker", b.frontend])
    url = wait_for_log_event(g.log_path, "gateway_listening", 30, g.popen, start=g.log_start)["url"]

    async def body():
        async with Client(b.frontend) as c:
            st = await c.status()
            one = await c.status(full=False, max_pages=1)

        async def five() -> bool:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                async with s.get(url + "/health") as r:
                    return (await r.json())["workers"] == 5
        await until(five, 20, "the gateway sees every page")
        return st, one

    st, one = run(body(), 60)
    assert len(st.workers) == 5 and len({w["worker_id"] for w in st.workers}) == 5
    assert len(one.workers) == 1 and one.broker["truncated"] is True


def test_a_rate_limited_status_is_a_clear_error(procs):
    b = procs.broker("b", "--heartbeat-ms", "200", "--status-rate", "1")

    async def body():
        async with Client(b.frontend) as c:
            t0 = time.monotonic()
            for _ in range(6):  # beyond the burst (4), a polling client is slowed down, not failed
                await c.status()
            slowed_s = time.monotonic() - t0
            with pytest.raises(RequestError) as ei:  # ... unless its timeout is shorter than the wait
                for _ in range(20):
                    await c.status(timeout_s=0.5)
            return ei.value, slowed_s

    err, slowed_s = run(body(), 30)
    print(f"6 STATUS at 1/s (burst 4) took {slowed_s:.2f} s")
    assert err.code is ErrorCode.RATE_LIMITED and "STATUS" in err.message
