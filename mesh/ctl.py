"""``mesh ctl``: the operators' client of a broker's admin API (HTTP, ``mesh broker --http``).

    mesh ctl workers                      # every worker: state, load, in-flight, KV capacity
    mesh ctl drain WORKER                 # no new requests; what it holds finishes
    mesh ctl eject WORKER [--for-s 600]   # no new requests for a while (then reinstated by itself)
    mesh ctl reinstate WORKER             # routable again (ejected, or drained by an operator)
    mesh ctl admit WORKER                 # a quarantined worker (a model not admitted yet) and its model

``--url`` (default ``http://127.0.0.1:8000``, or ``MESH_URL``) and the API key (``--api-key-file``
or ``MESH_API_KEY``; never a flag, it would show in the process list). Exit status: 0 done, 1 the
broker refused (unknown worker, a state that does not allow the action: its answer is printed),
2 usage or connection errors. Talks only to the URL it is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["add_ctl_parser"]


def add_ctl_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ctl", help="operate a broker's fleet over its admin API: list, drain, eject, reinstate workers",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["workers", "drain", "eject", "reinstate", "admit"], help="what to do")
    p.add_argument("worker", nargs="?", help="the worker id (drain, eject, reinstate, admit: a quarantined worker)")
    from mesh.cli_run import http_url, positive_float

    p.add_argument("--url", type=http_url, default=os.environ.get("MESH_URL", "http://127.0.0.1:8000"),
                   help="the broker's HTTP ingress (default $MESH_URL or http://127.0.0.1:8000)")
    p.add_argument("--api-key-file", help="file holding the broker's API key (default: $MESH_API_KEY)")
    p.add_argument("--for-s", type=positive_float, help="eject: seconds before the worker is reinstated by itself (default: the broker's eject_max_s)")
    p.add_argument("--timeout-s", type=positive_float, default=10.0, help="HTTP timeout (default 10 s)")
    p.add_argument("--json", action="store_true", help="print the broker's JSON answer instead of a table")
    p.set_defaults(func=_cmd_ctl)
    return p


def _key(args) -> str | None:
    if args.api_key_file:
        try:
            return Path(args.api_key_file).read_text().strip() or None
        except OSError as exc:
            raise _Usage(f"--api-key-file: {exc.strerror}: {args.api_key_file}") from None
    return os.environ.get("MESH_API_KEY") or None


class _Usage(Exception):
    pass


def _call(args, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    url = args.url.rstrip("/") + path
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    key = _key(args)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout_s) as resp:  # noqa: S310 - the operator's own URL
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {"error": {"message": exc.reason}}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _Usage(f"cannot reach {url}: {reason}") from None


def _table(workers: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{len(workers)} worker(s)")
    for c in ("worker", "model", "role", "state", "inflight", "running", "waiting", "kv use", "kv capacity", "ejected for"):
        t.add_column(c, justify="left" if c in ("worker", "model", "role", "state") else "right")
    for w in sorted(workers, key=lambda w: w["worker_id"]):
        load = w.get("load") or {}
        t.add_row(w["worker_id"], str(w.get("model", "")), w.get("role", ""), w.get("state", ""), str(w.get("inflight", 0)),
                  str(load.get("running", "-")), str(load.get("waiting", "-")),
                  f"{load['kv_usage'] * 100:.1f} %" if "kv_usage" in load else "-",
                  f"{w.get('kv_capacity_tokens', 0):,}", f"{w['ejected_for_s']:.0f} s" if w.get("ejected_for_s") else "")
    console = Console()
    Console(width=max(console.width, 140)).print(t)  # never squeezed below its natural width (pipes, CI)


def _cmd_ctl(args) -> int:
    try:
        if args.action == "workers":
            if args.worker:
                raise _Usage("workers takes no worker id")
            status, ans = _call(args, "GET", "/workers")
        else:
            if not args.worker:
                raise _Usage(f"{args.action} needs a worker id")
            if args.for_s is not None and args.action != "eject":
                raise _Usage("--for-s is for eject")
            body = {"for_s": args.for_s} if args.for_s is not None else None
            status, ans = _call(args, "POST", f"/workers/{urllib.request.quote(args.worker, safe='')}/{args.action}", body)
    except _Usage as exc:
        print(f"mesh ctl: {exc}", file=sys.stderr)
        return 2
    if status >= 400:
        err = ans.get("error", {}) if isinstance(ans, dict) else {}
        print(f"mesh ctl: {status} {err.get('code', '')}: {err.get('message', ans)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(ans, indent=2, sort_keys=True))
    elif args.action == "workers":
        _table(ans.get("data", []))
    else:
        print(f"{ans['worker_id']}: {ans['state']}" + (f" for {ans['ejected_for_s']:.0f} s" if ans.get("ejected_for_s") else ""))
    return 0
