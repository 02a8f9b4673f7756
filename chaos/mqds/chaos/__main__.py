"""``python -m mqds.chaos``: see :func:`mqds.chaos.runner.main`."""

from __future__ import annotations

import sys

from mqds.chaos.runner import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
