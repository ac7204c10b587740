"""``python -m gateway`` is the ``capgate`` command."""

import sys

from gateway.cli import main

sys.exit(main())
