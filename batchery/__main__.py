"""``python -m batchery``: the ``batchery`` command."""

import sys

from batchery.cli import main

sys.exit(main())
