"""``python -m ds_zero.estimate``: the ``ds-estimate`` command."""

import sys

from ds_zero.estimate.cli import main

if __name__ == "__main__":
    sys.exit(main())
