"""``python -m primus_ext`` is ``primus-ext``."""

import sys

from .cli import main

sys.exit(main())
