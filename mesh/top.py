"""``mesh top``: a live table of the fleet from one or more brokers' telemetry streams."""

from __future__ import annotations

import time

import zmq
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mesh.protocol import ProtocolError, unpack

__all__ = ["run_top", "render", "regret_line"]


def render(snapshots: dict[str, dict], rates: dict[str, float], events: list[str]) -> Group:
    t = Table(title="mesh top", expand=True)
    for c, j in (("broker", "left"), ("worker", "left"), ("role", "left"), ("labels", "left"), ("health", "left"),
                 ("in-flight", "right"), ("running", "right"), ("waiting", "right"), ("KV use", "right"),
                 ("requests", "right"), ("hit rate", "right")):
        t.add_column(c, justify=j)
    for bid, snap in sorted(snapshots.items()):
        for w in sorted(snap.get("workers", []), key=lambda w: w["worker_id"]):
            load = w.get("load") or {}
            t.add_row(bid, w["worker_id"], w.get("role", ""), ",".join(f"{k}={v}" for k, v in (w.get("labels") or {}).items()),
                      "[green]ok[/]" if w.get("healthy") else "[red]out[/]", str(w.get("inflight", 0)),
                      str(load.get("running", "-")), str(load.get("waiting", "-")),
                      f"{load['kv_usage']:.0%}" if "kv_usage" in load else "-", str(w.get("requests", 0)),
                      f"{w.get('hit_rate', 0.0):.1%}")
    r = Table(title="routing", expand=True)
    for c in ("broker", "state", "in-flight", "req/s", "decisions", "degraded"):
        r.add_column(c)
    for bid, snap in sorted(snapshots.items()):
        dec = ", ".join(f"{k}={v}" for k, v in sorted((snap.get("decisions") or {}).items()))
        r.add_row(bid, snap.get("state", "?"), str(snap.get("inflight", 0)), f"{rates.get(bid, 0.0):.1f}", dec,
                  str(snap.get("degraded_decisions", 0)))
    parts = [t, r]
    for bid, snap in sorted(snapshots.items()):  # cache_aware's regret audit (mesh.routing.regret)
        line = regret_line(bid, snap.get("regret"))
        if line is not None:
            parts.append(line)
    for bid, snap in sorted(snapshots.items()):  # text the HTTP ingress could not tokenise: no cache hits for it
        for model, n in sorted((snap.get("text_unmatched") or {}).items()):
            parts.append(Text(f"{bid}: {n} text requests for model {model} went out without its tokenizer (byte keys "
                              f"never match its engines' cache): put its tokenizer in the local Hugging Face cache or "
                              f"pass --tokenizer {model}=DIR", style="yellow"))
    ev = Table(title="recent events", expand=True, show_header=False)
    ev.add_column("event")
    for e in events[-6:]:
        ev.add_row(e)
    return Group(*parts, ev)


_SHORT = {"power_of_two": "power-of-two", "cache_aware_greedy": "greedy"}


def regret_line(bid: str, regret) -> Text | None:
    """"cache-aware pays X ms per request" for one broker (None without an audit or decisions):
    predicted, against each baseline's pick from the same view (docs/routing.md "Regret audit")."""
    if not isinstance(regret, dict):
        return None
    pays = regret.get("pays_ms")
    base = regret.get("baselines")
    if not isinstance(pays, dict) or not pays or not isinstance(base, dict):
        return None
    parts = []
    for name, short in _SHORT.items():
        v = pays.get(name)
        if isinstance(v, (int, float)):
            parts.append(f"{'saves' if v >= 0 else 'costs'} {abs(v):.0f} ms vs {short}")
    n = max((b["decisions"] for b in base.values() if isinstance(b, dict) and isinstance(b.get("decisions"), int)),
            default=0)
    best = pays.get("best")
    if not parts or not isinstance(best, (int, float)):
        return None
    style = "green" if best >= 0 else "red"
    obs = regret.get("observed")
    seen = obs.get("pays_ms", {}).get("best") if isinstance(obs, dict) and isinstance(obs.get("pays_ms"), dict) else None
    measured = f"; {seen:+.0f} ms with its own TTFT measured" if isinstance(seen, (int, float)) else ""
    return Text(f"{bid}: cache-aware pays {best:+.0f} ms per request against the better baseline "
                f"({', '.join(parts)}; predicted over {n} decisions{measured})", style=style)


#: Seconds without a message from an endpoint before ``mesh top`` says nothing is connected there.
SILENT_AFTER_S = 3.0


def run_top(endpoints: list[str], *, refresh_s: float = 1.0, duration_s: float | None = None,
            silent_after_s: float = SILENT_AFTER_S) -> int:
    ctx = zmq.Context()
    subs: dict[zmq.Socket, str] = {}  # one SUB per endpoint: a silent one can be named
    poller = zmq.Poller()
    for ep in endpoints:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1000)
        sub.setsockopt(zmq.SUBSCRIBE, b"mesh.")
        subs[sub] = ep
        poller.register(sub, zmq.POLLIN)
        sub.connect(ep)
    heard: set[str] = set()
    told: set[str] = set()
    t0 = time.monotonic()
    snapshots: dict[str, dict] = {}
    prev_ok: dict[str, tuple[float, int]] = {}
    rates: dict[str, float] = {}
    events: list[str] = []
    t_end = None if duration_s is None else time.monotonic() + duration_s
    try:
        with Live(render(snapshots, rates, events), refresh_per_second=4, screen=False) as live:
            while t_end is None or time.monotonic() < t_end:
                for sub, _ in poller.poll(int(refresh_s * 1000)):
                    heard.add(subs[sub])
                    while True:
                        try:
                            topic, body = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except ValueError:
                            continue
                        try:
                            d = unpack(body)
                        except ProtocolError:
                            continue
                        if not isinstance(d, dict):
                            continue
                        bid = str(d.get("broker_id", "?"))
                        if topic == b"mesh.snapshot":
                            done = sum(v for k, v in (d.get("requests") or {}).items() if isinstance(v, int))
                            now = time.monotonic()
                            if bid in prev_ok and now > prev_ok[bid][0]:
                                rates[bid] = (done - prev_ok[bid][1]) / (now - prev_ok[bid][0])
                            prev_ok[bid] = (now, done)
                            snapshots[bid] = d
                        elif topic == b"mesh.event":
                            events.append(f"{time.strftime('%H:%M:%S')} {bid}: {d.get('event')} {d.get('worker_id', '')}")
                if time.monotonic() - t0 >= silent_after_s:
                    for ep in endpoints:
                        if ep not in heard and ep not in told:
                            told.add(ep)
                            events.append(f"nothing connected at {ep}: no broker publishes telemetry there "
                                          f"(start one with --telemetry {ep}, or point mesh top at its telemetry endpoint)")
                live.update(render(snapshots, rates, events))
    except KeyboardInterrupt:
        pass
    finally:
        for sub in subs:
            sub.close()
        ctx.term()
    return 0
