"""What the ``mesh bench`` commands share when they report: cell formatting and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["fmt", "write_json"]


def fmt(v: Any, spec: str = "{:.0f}") -> str:
    """A table cell: ``spec`` applied to ``v``, or "-" for a missing figure (None or NaN)."""
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return spec.format(v)


def write_json(path: str, res: dict, console) -> None:
    """Write a benchmark's results (creating the folder) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    console.print(f"wrote {out}")
