"""``python -m mesh.indexer [flags]``: the same server as ``mesh indexer [flags]``."""

import sys

from mesh.cli_run import run_one
from mesh.indexer.cli import add_indexer_parser

if __name__ == "__main__":
    sys.exit(run_one("indexer", add_indexer_parser))
