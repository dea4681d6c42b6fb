"""``python -m autopar``: the ``autopar`` command (see `autopar.cli`)."""

import sys

from autopar.cli import main

sys.exit(main())
