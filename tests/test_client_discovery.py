"""The client follows brokers by DNS: ``Client("dns+tcp://NAME:PORT")`` opens a link per address
NAME resolves to and re-resolves it, as workers do (tests/test_discovery.py). Real brokers on
127.0.0.2-5 (one port, as behind a headless Service), real simulated workers, and a resolver the
test controls ($MESH_RESOLVE_FILE, or a Resolver whose lookups fail on demand).

One fleet serves the module (process start-up is most of the cost): brokers a, b, c share a fast
worker; broker d's only worker ("holder") takes a minute per prefill, so whatever d receives
stays in flight until d is dropped from DNS.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from mesh.client import Client, SyncClient
from mesh.discovery import Resolver
from mesh.errors import ConfigError
from mesh.lab.procs import BrokerProc, ProcGroup
from mesh.lab.up import wait_for_workers
from tests.conftest import free_port, run, until, wait_until

NAME = "brokers.test"
REFRESH_S = 0.1  # the clients' re-resolution interval here
IPS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4", "d": "127.0.0.5"}


@dataclass
class Fleet:
    port: int
    brokers: dict[str, BrokerProc]

    @property
    def spec(self) -> str:
        return f"dns+tcp://{NAME}:{self.port}"

    def ep(self, name: str) -> str:
        return f"tcp://{IPS[name]}:{self.port}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("client-discovery") / "logs")
    port = free_port("127.0.0.2")
    holder = None
    try:
        brokers = {n: group.broker(n, "--heartbeat-ms", "200", frontend=f"tcp://{ip}:{port}") for n, ip in IPS.items()}
        group.workers("fast", [brokers[n].backend for n in "abc"], "--time-scale", "0.01", "--heartbeat-ms", "200")
        holder = group.workers("holder", [brokers["d"].backend], "--heartbeat-ms", "200", "--prefill-overhead-ms", "60000")

        async def ready():
            await asyncio.gather(*(wait_for_workers(b.frontend, 1) for b in brokers.values()))

        run(ready(), 30)
        yield Fleet(port, brokers)
    finally:
        if holder is not None and holder.alive():
            # first: it may hold a minute-long prefill, which broker d's drain would wait for
            holder.signal(signal.SIGKILL)
            holder.popen.wait(5)
        stubborn = [p.name for p in group.procs if p.alive() and p.stop(grace_s=10.0) == -9]
        assert not stubborn, f"processes needed SIGKILL at teardown: {stubborn}"


def _resolve_to(hosts: Path, *names: str) -> None:
    """Point NAME at the brokers ``names`` (atomically: a resolution never reads half a file)."""
    tmp = hosts.with_suffix(".tmp")
    tmp.write_text(f"{NAME} {' '.join(IPS[n] for n in names)}\n")
    os.replace(tmp, hosts)


@pytest.fixture
def hosts(tmp_path, monkeypatch) -> Path:
    f = tmp_path / "hosts"
    monkeypatch.setenv("MESH_RESOLVE_FILE", str(f))
    return f


async def _counters(fleet: Fleet, *names: str) -> dict[str, dict[str, int]]:
    async def one(n: str):
        async with Client(fleet.brokers[n].frontend) as c:
            return n, (await c.status()).counters

    return dict(await asyncio.gather(*(one(n) for n in names)))


def _served(before: dict, after: dict, name: str) -> int:
    return after[name].get("requests.ok", 0) - before[name].get("requests.ok", 0)


def _endpoints(c: Client) -> set[str]:
    return {link.endpoint for link in c.links}


async def _all_up(c: Client, want: set[str], what: str) -> None:
    await until(lambda: _endpoints(c) == want and all(link.up for link in c.links), 10, what)


async def _generate(c: Client, n: int, tag: int) -> list:
    return await asyncio.gather(*(c.generate(input_ids=[tag, i, 3], max_new_tokens=2, deadline_ms=8_000) for i in range(n)))


def test_invalid_specs_are_config_errors_naming_the_field():
    for bad in ("dns+tcp://brokers.test", "dns+tcp://:5556", "dns+tcp://*:5556", "http://127.0.0.1:1", "127.0.0.1:5555"):
        with pytest.raises(ConfigError, match="endpoints"):
            Client(["tcp://127.0.0.1:1", bad])
    with pytest.raises(ConfigError, match="discovery_refresh_s"):
        Client("dns+tcp://brokers.test:1", discovery_refresh_s=0)


def test_a_dns_name_reaches_every_broker_it_lists(fleet, hosts):
    _resolve_to(hosts, "a", "b")

    async def body():
        async with Client(fleet.spec, discovery_refresh_s=REFRESH_S) as c:
            # the first resolution is done when `async with` returns
            assert c.discovered == {fleet.spec: [fleet.ep("a"), fleet.ep("b")]}
            assert _endpoints(c) == {fleet.ep("a"), fleet.ep("b")}
            await _all_up(c, {fleet.ep("a"), fleet.ep("b")}, "links to both brokers up")
            before = await _counters(fleet, "a", "b")
            results = await asyncio.wait_for(_generate(c, 6, 1), 20)
            after = await _counters(fleet, "a", "b")
        assert all(r.token_ids and r.finish_reason for r in results), results
        assert _served(before, after, "a") >= 1 and _served(before, after, "b") >= 1, (before, after)
        return True

    assert run(body(), 40)


def test_the_client_follows_brokers_leaving_and_joining_the_name(fleet, hosts):
    _resolve_to(hosts, "a", "d")

    async def body():
        with capture_logs() as logs:
            async with Client(fleet.spec, discovery_refresh_s=REFRESH_S) as c:
                await _all_up(c, {fleet.ep("a"), fleet.ep("d")}, "links to a and d up")
                d_link = next(link for link in c.links if link.endpoint == fleet.ep("d"))
                before = await _counters(fleet, "a", "c", "d")
                # round robin: half go to a (served), half to d, whose worker holds them
                jobs = asyncio.gather(*(c.generate(input_ids=[2, i, 3], max_new_tokens=2, deadline_ms=10_000) for i in range(4)))
                await until(lambda: len(d_link.pending) == 2, 10, "two requests held by broker d")
                # d leaves the name, c joins it: the client follows without being recreated; what d
                # held fails over (unavailable, resubmitted) rather than waiting for its deadline
                _resolve_to(hosts, "a", "c")
                results = await asyncio.wait_for(jobs, 15)
                assert c.discovered == {fleet.spec: [fleet.ep("a"), fleet.ep("c")]}
                assert _endpoints(c) == {fleet.ep("a"), fleet.ep("c")}
                assert c.lost_requests == 2
                await until(lambda: d_link.sock.closed, 5, "the link to d closed")
                await _all_up(c, {fleet.ep("a"), fleet.ep("c")}, "links to a and c up")
                more = await asyncio.wait_for(_generate(c, 6, 3), 20)
                after = await _counters(fleet, "a", "c", "d")
        assert all(r.token_ids and r.finish_reason for r in results + more), results + more
        assert _served(before, after, "c") >= 1, (before, after)  # the broker that joined gets requests
        assert _served(before, after, "d") == 0, (before, after)
        assert after["d"].get("requests.cancelled", 0) - before["d"].get("requests.cancelled", 0) == 2, after["d"]
        changed = [e for e in logs if e["event"] == "discovery_changed"]
        assert changed[-1]["added"] == [fleet.ep("c")] and changed[-1]["removed"] == [fleet.ep("d")], changed
        return True

    assert run(body(), 60)


class _Outage(Resolver):
    """The override file, until ``down``: then every resolution fails (as a DNS outage would)."""

    down = False

    async def resolve(self, name: str) -> list[str] | None:
        if self.down:
            self.failures += 1
            return None
        return await super().resolve(name)


def test_a_failed_resolution_keeps_the_last_links(fleet, hosts):
    _resolve_to(hosts, "a", "b")
    resolver = _Outage(str(hosts))

    async def body():
        with capture_logs() as logs:
            async with Client(fleet.spec, discovery_refresh_s=REFRESH_S, resolver=resolver) as c:
                both = {fleet.ep("a"), fleet.ep("b")}
                await _all_up(c, both, "links to both brokers up")
                links = c.links
                resolver.down = True
                failed = c.discovery_failures
                await until(lambda: c.discovery_failures >= failed + 3, 10, "three failed resolutions")
                assert c.links == links and c.discovered == {fleet.spec: sorted(both)}
                before = await _counters(fleet, "a", "b")
                results = await asyncio.wait_for(_generate(c, 6, 4), 20)
                after = await _counters(fleet, "a", "b")
                assert c.links == links
        assert all(r.token_ids and r.finish_reason for r in results), results
        assert _served(before, after, "a") >= 1 and _served(before, after, "b") >= 1, (before, after)
        assert any(e["event"] == "discovery_failed" and e["kept"] == 2 for e in logs), logs
        return True

    assert run(body(), 40)


class _Counting(Resolver):
    resolutions = 0

    async def resolve(self, name: str) -> list[str] | None:
        self.resolutions += 1
        return await super().resolve(name)


def test_requests_wait_for_a_name_that_resolves_to_nothing_yet(fleet, hosts):
    hosts.write_text(f"{NAME}\n")  # the name exists, with no address (no broker scheduled yet)
    resolver = _Counting(str(hosts))

    async def body():
        async with Client(fleet.spec, discovery_refresh_s=REFRESH_S, resolver=resolver) as c:
            assert c.links == () and c.discovered == {fleet.spec: []}
            job = asyncio.ensure_future(c.generate(input_ids=[5, 6, 7], max_new_tokens=2, deadline_ms=8_000))
            status = asyncio.ensure_future(c.status(timeout_s=8))
            seen = resolver.resolutions
            await until(lambda: resolver.resolutions >= seen + 3, 10, "three more empty resolutions")
            assert not job.done() and not status.done()  # both wait for a broker rather than fail
            _resolve_to(hosts, "b")
            r = await asyncio.wait_for(job, 10)
            st = await asyncio.wait_for(status, 10)
            assert _endpoints(c) == {fleet.ep("b")} and st.workers
        assert r.token_ids and r.finish_reason
        return True

    assert run(body(), 30)


def test_the_sync_client_follows_the_name_too(fleet, hosts):
    _resolve_to(hosts, "a")
    with SyncClient(fleet.spec, discovery_refresh_s=REFRESH_S) as sc:
        assert sc.generate(input_ids=[8, 9], max_new_tokens=2, deadline_ms=8_000).token_ids
        _resolve_to(hosts, "b")
        inner = sc._client  # (the loop thread's Client: read-only looks, as c.links in the tests above)
        wait_until(lambda: {link.endpoint for link in inner.links} == {fleet.ep("b")}, 10, "followed a -> b")
        before = run(_counters(fleet, "a", "b"), 10)
        assert all(sc.generate(input_ids=[8, i], max_new_tokens=2, deadline_ms=8_000).token_ids for i in range(3))
        after = run(_counters(fleet, "a", "b"), 10)
    assert _served(before, after, "b") == 3 and _served(before, after, "a") == 0, (before, after)
