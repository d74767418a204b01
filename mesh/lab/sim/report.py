"""Presentation of a simulation report: the rich table and the matplotlib plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["arm_label", "render_table", "render_lifecycle_table", "write_plot"]


def arm_label(arm: dict[str, Any]) -> str:
    return f"{arm['policy']}/{arm['provider']} R{arm['routers']} W{arm['workers']}"


def render_table(report: dict[str, Any], wall_s: Sequence[float] | None = None):
    """A rich Table with one row per arm (``wall_s``: optional wall seconds per arm)."""
    from rich.table import Table

    wl = report["workload"]
    title = (f"mesh sim: {wl['name']}, {wl['requests']} requests, oracle hit "
             f"{report['oracle_hit_rate'] * 100:.1f}%")
    t = Table(title=title)
    cols = ["policy", "provider", "R", "W", "hit%", "oracle%", "wCV", "busyCV", "util%",
            "ttft50", "ttft95", "ttft99", "e2e95", "req/s", "good%", "degr"]
    if wall_s is not None:
        cols.append("wall s")
    for c in cols:
        t.add_column(c, justify="left" if c in ("policy", "provider") else "right", no_wrap=True)
    t.caption = ("hit/oracle: cached prompt tokens %; wCV/busyCV: CV of requests/busy time per worker; "
                 "ttft/e2e: ms (p50/p95/p99); good: TTFT within SLO; degr: degraded decisions")
    for i, a in enumerate(report["arms"]):
        row = [
            a["policy"], a["provider"], str(a["routers"]), str(a["workers"]),
            f"{a['hit_rate'] * 100:.1f}", f"{(a['oracle_hit_rate'] or 0) * 100:.1f}",
            f"{a['worker_cv']:.3f}", f"{a['busy_cv']:.3f}", f"{a['utilisation'] * 100:.0f}",
            _ms(a['ttft_p50_ms']), _ms(a['ttft_p95_ms']), _ms(a['ttft_p99_ms']), _ms(a['e2e_p95_ms']),
            f"{a['throughput_rps']:.2f}", f"{a['goodput'] * 100:.1f}", str(a["degraded_decisions"]),
        ]
        if wall_s is not None:
            row.append(f"{wall_s[i]:.1f}" if i < len(wall_s) else "")
        t.add_row(*row)
    return t


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def render_lifecycle_table(report: dict[str, Any]):
    """Arms that ran the broker's core (``lifecycle = core``): what happened to every request under
    the faults injected. None when no arm ran the core."""
    from rich.table import Table

    arms = [a for a in report["arms"] if a.get("lifecycle") == "core"]
    if not arms:
        return None
    t = Table(title="broker lifecycle (BrokerCore in virtual time)")
    cols = ["policy", "R", "W", "faults", "ok", "failed", "lost", "dup", "retried", "ttft95 1st", "ttft95 retried",
            "expired", "conn lost", "ejected", "registered"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("policy", "faults", "failed") else "right", no_wrap=c != "failed")
    t.caption = ("faults: injected kills (k), pauses (p), broker restarts (b); failed: error codes clients got; "
                 "lost: no reply at all (held by a restarted broker); dup: more than one terminal reply (must be 0); "
                 "retried: finished on attempt > 1; ttft95: ms, first-attempt vs retried requests")
    for a in arms:
        fi = a.get("faults_injected", {})
        we = a.get("worker_events", {})
        faults = " ".join(f"{k[0]}{fi[k]}" for k in ("kill", "pause", "broker_restart") if fi.get(k)) or "-"
        failed = " ".join(f"{k} {v}" for k, v in a["failed"].items()) or "-"
        t.add_row(a["policy"], str(a["routers"]), str(a["workers"]), faults, str(a["requests_ok"]), failed, str(a["lost"]),
                  str(a["duplicated"]), str(a["retried"]), _ms(a.get("ttft_first_attempt_p95_ms")),
                  _ms(a.get("ttft_retried_p95_ms")), str(we.get("expired", 0)), str(we.get("connection_lost", 0)),
                  str(we.get("ejected", 0)), str(we.get("registered", 0)))
    return t


def write_plot(report: dict[str, Any], path: str) -> None:
    """Bars of hit rate (oracle dashed), worker CV and TTFT p95 per arm, saved as an image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    labels = [arm_label(a) for a in arms]
    x = list(range(len(arms)))
    width = max(8.0, 0.55 * len(arms) + 3)
    fig, axes = plt.subplots(3, 1, figsize=(width, 10), sharex=True)
    panels = [
        ("hit_rate", "KV hit rate", 100.0, "%"),
        ("worker_cv", "worker CV (requests)", 1.0, ""),
        ("ttft_p95_ms", "TTFT p95", 1.0, "ms"),
    ]
    colors = {"none": "#888888", "approx": "#e3a33b", "radix_tree": "#4c8bd6", "indexer": "#4caf6e"}
    bar_colors = [colors.get(a["provider"], "#6a5acd") for a in arms]
    for ax, (key, title, scale, unit) in zip(axes, panels):
        vals = [a[key] * scale for a in arms]
        bars = ax.bar(x, vals, color=bar_colors)
        ax.set_title(title + (f" ({unit})" if unit else ""))
        ax.grid(axis="y", alpha=0.3)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.1f}" if scale != 1.0 or v >= 10 else f"{v:.2f}", (b.get_x() + b.get_width() / 2, v),
                        ha="center", va="bottom", fontsize=7)
        if key == "hit_rate" and report.get("oracle_hit_rate") is not None:
            ax.axhline(report["oracle_hit_rate"] * 100, ls="--", color="k", lw=1, label="oracle (infinite cache)")
            ax.legend(loc="upper left", fontsize=8)
    axes[-1].set_xticks(x)
    axes[-1].set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    wl = report["workload"]
    fig.suptitle(f"mesh sim: {wl['name']} ({wl['requests']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
