"""``python -m batchery.cli``: the ``batchery`` command."""

import sys

from batchery.cli import main

sys.exit(main())
