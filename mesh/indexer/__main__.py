"""``python -m mesh.indexer [flags]``: the same server as ``mesh indexer [flags]``."""

import argparse
import sys

from mesh.errors import ConfigError
from mesh.indexer.cli import add_indexer_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesh.indexer")
    sub = parser.add_subparsers(dest="cmd")
    add_indexer_parser(sub)
    args = parser.parse_args(["indexer", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"mesh indexer: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
