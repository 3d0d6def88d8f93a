"""A job that starts its second rank the way Lightning does (``tests/agent/test_early.py``):
rank 0 runs this script with no rank variables and starts a copy of it with ``LOCAL_RANK=1``,
which imports a module that takes ``SLOW_IMPORT_S`` seconds, as Lightning does on a loaded
machine, and writes ``IMPORTED_FILE`` once that import ends. Neither imports torch."""

import os
import subprocess
import sys

if "LOCAL_RANK" not in os.environ:
    env = {**os.environ, "LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}
    sys.exit(subprocess.call([sys.executable, os.path.abspath(__file__)], env=env))

import slowly_imported  # noqa: F401  the slow import the early hello must beat

with open(os.environ["IMPORTED_FILE"], "w") as f:
    f.write("imported\n")
