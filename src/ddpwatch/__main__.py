"""``python -m ddpwatch``."""

import sys

from ddpwatch.cli import main

sys.exit(main())
