"""Parse and run one ``mesh`` subcommand: the dispatch that ``mesh.cli`` and the sub-CLIs'
standalone entry points (``python -m mesh.adapters.cli``, ``python -m workers_stub.sglang_cli``,
...) share, so a sub-CLI never imports ``mesh.cli`` back."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from mesh.errors import ConfigError

__all__ = ["new_parser", "dispatch", "run_one"]


def new_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``mesh`` parser without subcommands, and its subparsers to add them to."""
    p = argparse.ArgumentParser(prog="mesh", description="mesh: a ZeroMQ request-router mesh for LLM inference fleets.")
    return p, p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")


def dispatch(parser: argparse.ArgumentParser, given: list[str]) -> int:
    """Parse ``given`` and run its command; a configuration error is one line and exit code 2."""
    args = parser.parse_args(given)
    args._argv = given  # which flags were given (explicit beats file)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"mesh: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run_one(name: str, add_parser: Callable[[argparse._SubParsersAction], object], argv: Sequence[str] | None = None) -> int:
    """``mesh NAME ARGV...`` with only NAME's parser (``add_parser`` adds it): a sub-CLI's ``main``."""
    parser, sub = new_parser()
    add_parser(sub)
    return dispatch(parser, [name, *(sys.argv[1:] if argv is None else argv)])
