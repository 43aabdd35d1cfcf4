"""``python -m specserve ...``: the same command as the ``specserve`` console script."""

import sys

from specserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
