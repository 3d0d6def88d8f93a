"""A module slow to import (``slow_start.py``): ``SLOW_IMPORT_S`` seconds, like Lightning's
imports on a loaded machine."""

import os
import time

time.sleep(float(os.environ.get("SLOW_IMPORT_S", "4")))
