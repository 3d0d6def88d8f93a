"""A rank forks a child (as DataLoader workers are) after ddpwatch attached, then stops it with
SIGTERM, as DataLoader does with a worker that does not end in time. Prints ``ALIVE`` when
the rank itself is still there a second later."""

import os
import signal
import time

import ddpwatch

ddpwatch.attach()
pid = os.fork()
if pid == 0:
    time.sleep(30)
    os._exit(0)
time.sleep(0.2)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
time.sleep(1.0)
print("ALIVE", os.waitstatus_to_exitcode(status), flush=True)
