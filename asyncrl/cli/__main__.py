"""``python -m asyncrl.cli``: the ``asyncrl`` command without its console script."""

import sys

from asyncrl.cli import main

sys.exit(main())
