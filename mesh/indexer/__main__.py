"""``python -m mesh.indexer [flags]``: the same server as ``mesh indexer [flags]``."""

import sys

from mesh.cli import main

if __name__ == "__main__":
    sys.exit(main(["indexer", *sys.argv[1:]]))
