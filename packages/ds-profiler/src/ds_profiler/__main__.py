"""``python -m ds_profiler``: see ``ds_profiler._cli``."""

import sys

from ds_profiler._cli import main

sys.exit(main())
