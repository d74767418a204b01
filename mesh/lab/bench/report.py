"""What the ``mesh bench`` commands share when they report: cell formatting and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["finish", "fmt", "write_json"]


def fmt(v: Any, spec: str = "{:.0f}") -> str:
    """A table cell: ``spec`` applied to ``v``, or "-" for a missing figure (None or NaN)."""
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return spec.format(v)


def finish(res: dict, console, json_path: str | None, print_results) -> int:
    """The end of a ``mesh bench`` command: print the results, write the JSON when asked, and the exit
    status (0 when every arm ran, 1 when one broke)."""
    print_results(res, console)
    if json_path:
        write_json(json_path, res, console)
    return 0 if res["ok"] else 1


def write_json(path: str, res: dict, console) -> None:
    """Write a benchmark's results (creating the folder) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    console.print(f"wrote {out}")
