"""Broker discovery by DNS (issue 17 part 3): workers given dns+tcp://NAME:PORT follow the brokers
NAME resolves to, as brokers come, go and restart at new addresses, without restarting a worker.
Real brokers on 127.0.0.2-4 (one port, as behind a headless Service), a real worker process, and a
resolver the test controls ($MESH_RESOLVE_FILE)."""

from __future__ import annotations


import pytest

from mesh.client import Client
from mesh.discovery import Resolver, check_endpoint, endpoints_for, parse_dns
from mesh.errors import ConfigError

from conftest import free_port, run, until


def test_dns_specs_are_parsed_and_checked_by_name():
    assert parse_dns("dns+tcp://mesh-broker.default.svc:5556") == ("mesh-broker.default.svc", 5556)
    assert endpoints_for(5556, ["10.0.0.2", "::1", "10.0.0.1"]) == ["tcp://10.0.0.1:5556", "tcp://10.0.0.2:5556", "tcp://[::1]:5556"]
    check_endpoint("tcp://127.0.0.1:1")
    for bad in ("dns+tcp://name", "dns+tcp://:5", "dns+tcp://n:0", "http://x:1", "dns+tcp://*:5556"):
        with pytest.raises(ConfigError, match="brokers"):
            check_endpoint(bad)


def test_override_file_steers_resolution(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# name addresses...\nbrokers.test 127.0.0.2 127.0.0.3 not-an-ip\n")
    r = Resolver(str(f))
    assert run(r.resolve("brokers.test")) == ["127.0.0.2", "127.0.0.3"]
    assert run(r.resolve("localhost")) is not None  # not in the file: the system resolver


async def _workers_at(frontend: str) -> set[str]:
    async with Client(frontend) as c:
        st = await c.status()
    return {w["worker_id"] for w in st.workers if w.get("healthy")}


def test_workers_follow_brokers_through_dns(procs, tmp_path, monkeypatch):
    port = free_port("127.0.0.2")
    hosts = tmp_path / "hosts"
    hosts.write_text("brokers.test 127.0.0.2\n")
    monkeypatch.setenv("MESH_RESOLVE_FILE", str(hosts))

    def broker(name: str, ip: str):
        return procs.broker(name, "--heartbeat-ms", "200", frontend=f"tcp://{ip}:*", backend=f"tcp://{ip}:{port}")

    a = broker("a", "127.0.0.2")
    b = broker("b", "127.0.0.3")
    procs.workers("w", [f"dns+tcp://brokers.test:{port}"], "--time-scale", "0.01", "--heartbeat-ms", "200",
                  "--discovery-refresh-s", "0.2", count=1)
    wid = "w"  # (one worker: the id as given)

    async def sees(frontend: str, want: bool) -> bool:
        return (wid in await _workers_at(frontend)) == want

    async def body():
        await until(lambda: sees(a.frontend, True), 20, "registered with the broker DNS names")
        assert not await sees(b.frontend, True)
        hosts.write_text("brokers.test 127.0.0.2 127.0.0.3\n")  # scale up: a second broker appears
        await until(lambda: sees(b.frontend, True), 20, "registered with the new broker")
        hosts.write_text("brokers.test 127.0.0.3\n")  # broker a leaves the name: the worker says goodbye
        await until(lambda: sees(a.frontend, False), 20, "gone from the broker that left DNS")
        assert await sees(b.frontend, True)
        async with Client(b.frontend) as c:
            r = await c.generate(input_ids=[1, 2, 3], max_new_tokens=1, deadline_ms=10_000)
            assert r.worker == wid
        return True

    assert run(body(), 90)
    # broker b is replaced by a broker at a new address (a restarted pod): rejoined, no worker restart
    b.popen.terminate()
    b.popen.wait(10)
    c = broker("c", "127.0.0.4")
    hosts.write_text("brokers.test 127.0.0.4\n")
    run(until(lambda: sees(c.frontend, True), 20, "rejoined the replacement broker"), 30)
