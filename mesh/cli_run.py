"""Parse and run one ``mesh`` subcommand: the dispatch that ``mesh.cli`` and the sub-CLIs'
standalone entry points (``python -m mesh.adapters.cli``, ``python -m workers_stub.sglang_cli``,
...) share, so a sub-CLI never imports ``mesh.cli`` back."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from mesh.errors import ConfigError

__all__ = ["new_parser", "dispatch", "run_one", "Parser", "positive_int", "nonneg_int", "positive_float", "nonneg_float",
           "int_list", "zmq_endpoint", "host_port", "writable_file", "port_number", "port_or_off",
           "busy_port_error", "http_url"]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the fix (not the usage block): a bad
    flag value exits 2 with ``mesh up: argument --rate: must be > 0, got '0' (see mesh up --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def new_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``mesh`` parser without subcommands, and its subparsers to add them to."""
    p = Parser(prog="mesh", description="mesh: a ZeroMQ request-router mesh for LLM inference fleets.")
    return p, p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")


# Flag value types: argparse turns their ValueError/ArgumentTypeError into the one-line error above.

def _number(kind: type, test: Callable[[float], bool], what: str) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} {what}, got {text!r}") from None
        if v != v or not test(v):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return v

    parse.__name__ = f"{kind.__name__} {what}"
    return parse


positive_int = _number(int, lambda v: v > 0, "> 0")
nonneg_int = _number(int, lambda v: v >= 0, ">= 0")
positive_float = _number(float, lambda v: 0 < v < float("inf"), "> 0")
nonneg_float = _number(float, lambda v: 0 <= v < float("inf"), ">= 0")


port_number = _number(int, lambda v: 0 <= v <= 65535, "a port in 0..65535")
port_or_off = _number(int, lambda v: -1 <= v <= 65535, "a port in 0..65535 or -1 (off)")


def busy_port_error(exc: BaseException) -> ConfigError | None:
    """A bind that failed because the address is taken, as one line naming the fix (None: another error)."""
    import errno

    if getattr(exc, "errno", None) != errno.EADDRINUSE:
        return None
    return ConfigError(f"an address is already in use ({exc}): stop what listens there or choose another port (0 = any free port)")


def int_list(text: str) -> tuple[int, ...]:
    """``8,64,512`` -> (8, 64, 512): comma-separated integers > 0."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers > 0 (like 8,64,512), got {text!r}")
        out.append(int(part))
    return tuple(out)


def zmq_endpoint(text: str) -> str:
    """A ZeroMQ endpoint with its transport: ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``."""
    if text.startswith(("ipc://", "inproc://")) and len(text.split("://", 1)[1]) > 0:
        return text
    if text.startswith("tcp://"):
        host, sep, port = text[6:].rpartition(":")
        if sep and host and (port == "*" or (port.isdigit() and int(port) < 65536)):
            return text
    hint = f"tcp://{text}" if "://" not in text else "tcp://HOST:PORT"
    raise argparse.ArgumentTypeError(f"expected a ZeroMQ endpoint like tcp://HOST:PORT, got {text!r} (did you mean {hint}?)")


def writable_file(text: str) -> str:
    """An output file path whose folder exists (checked before any process starts)."""
    from pathlib import Path

    parent = Path(text).expanduser().parent
    if Path(text).is_dir() or not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {'it is a folder' if Path(text).is_dir() else f'no folder {str(parent)!r}'}")
    return text


def http_url(text: str) -> str:
    """``http://HOST:PORT`` or ``https://...`` (the scheme is required)."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(text)
        u.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.hostname:
        raise argparse.ArgumentTypeError(f"expected a URL like http://127.0.0.1:8000, got {text!r}")
    return text


def host_port(text: str) -> str:
    """``HOST:PORT`` (PORT 0 = any free port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or "/" in text:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT like 127.0.0.1:8000, got {text!r}")
    return text


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
    except Exception as exc:  # OSError (HTTP servers) or zmq.ZMQError (ZeroMQ sockets): a busy port is a misuse
        err = busy_port_error(exc)
        if err is None:
            raise
        print(f"mesh: configuration error: {err}", file=sys.stderr)
        return 2


def run_one(name: str, add_parser: Callable[[argparse._SubParsersAction], object], argv: Sequence[str] | None = None) -> int:
    """``mesh NAME ARGV...`` with only NAME's parser (``add_parser`` adds it): a sub-CLI's ``main``."""
    parser, sub = new_parser()
    add_parser(sub)
    return dispatch(parser, [name, *(sys.argv[1:] if argv is None else argv)])
