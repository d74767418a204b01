"""The admin API's second line of defence: without keys it answers only clients on this host, and a
reverse proxy on the same host does not make everyone loopback (issue 32, "Admin API"). Behind
``--http-trusted-proxies`` the client the proxy names is the client: its address keys the admin rule
and the per-address bounds. The rules in process (mesh.proxies), then against a real broker."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from mesh.config import BrokerSettings, build
from mesh.errors import ConfigError
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from mesh.proxies import TrustedProxies, parse_trusted_proxies
from tests.conftest import run


def test_the_client_is_the_peer_unless_a_trusted_proxy_names_it():
    none = TrustedProxies()
    assert none.client("127.0.0.1", {}).loopback
    # a proxy nobody declared: the request is not loopback, whatever address the proxy has
    c = none.client("127.0.0.1", {"X-Forwarded-For": "203.0.113.9"})
    assert c.address == "127.0.0.1" and not c.loopback
    assert not none.client("127.0.0.1", {"Forwarded": "for=203.0.113.9"}).loopback
    assert not none.client("198.51.100.2", {}).loopback

    tp = TrustedProxies(parse_trusted_proxies("127.0.0.1/32, 10.0.0.0/8"))
    # the right-most address that is not a trusted proxy: what the last trusted hop was told
    assert tp.client("127.0.0.1", {"X-Forwarded-For": "1.2.3.4, 203.0.113.9, 10.1.1.1"}).address == "203.0.113.9"
    assert not tp.client("127.0.0.1", {"X-Forwarded-For": "203.0.113.9"}).loopback
    assert tp.client("127.0.0.1", {"X-Forwarded-For": "127.0.0.1"}).loopback  # the proxy's own host: trusted hops only
    # a peer that is not a trusted proxy cannot name a client
    assert tp.client("198.51.100.2", {"X-Forwarded-For": "127.0.0.1"}).address == "198.51.100.2"
    # garbage breaks the chain: nothing left of it is believed
    assert tp.client("127.0.0.1", {"X-Forwarded-For": "127.0.0.1, junk"}).address == "127.0.0.1"
    assert tp.client("127.0.0.1", {"X-Forwarded-For": ",".join(["10.0.0.1"] * 10_000)}).address == "127.0.0.1"


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "not-an-ip", "1.2.3.4,,x"])
def test_a_bad_trusted_proxy_is_a_config_error_naming_the_field(bad):
    with pytest.raises(ConfigError, match="http_trusted_proxies"):
        build(BrokerSettings, {"http_trusted_proxies": bad})


def _get(url: str, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _post(url: str, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json", **(headers or {})},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("trusted", [False, True], ids=["no_proxy_declared", "proxy_declared"])
def test_without_keys_the_admin_api_answers_only_local_clients(procs, trusted):
    extra = ("--http-trusted-proxies", "127.0.0.1/32") if trusted else ()
    b = procs.broker("b", "--http", "127.0.0.1:0", *extra)
    procs.workers("w", [b.backend])
    run(wait_for_workers(b.frontend, 1), 30)
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]
    outside = {"X-Forwarded-For": "203.0.113.9"}
    assert _get(url + "/workers") == 200  # this host, no proxy
    assert _get(url + "/workers", outside) == 403  # through a proxy, a client elsewhere: no listing
    assert _post(url + "/workers/w/drain", outside) == 403  # nor a drain
    # through the declared proxy, a client on the proxy's host is local; undeclared, no proxied request is
    assert _get(url + "/workers", {"X-Forwarded-For": "127.0.0.1"}) == (200 if trusted else 403)
    listing = urllib.request.urlopen(url + "/workers", timeout=10).read()
    assert [w["state"] for w in json.loads(listing)["data"]] != ["draining"]  # the refused drain changed nothing
