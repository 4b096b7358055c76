"""``python -m funcgrad``: the seed demo (see ``funcgrad._demo``)."""

import sys

from ._demo import main

if __name__ == "__main__":
    sys.exit(main())
