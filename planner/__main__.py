"""``python -m planner`` is the ``plan`` command."""

import sys

from planner.cli import main

sys.exit(main())
