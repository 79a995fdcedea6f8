"""``python -m longflash``: the ``longflash`` command line (``entrypoints/cli.py``)."""

import sys

from longflash.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
