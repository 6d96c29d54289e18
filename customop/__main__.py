"""``python -m customop``: the console script."""

import sys

from customop.cli import main

if __name__ == "__main__":
    sys.exit(main())
