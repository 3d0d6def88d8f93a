"""A rank whose main thread blocks in C++ that runs no Python signal handler: a rendezvous
store wait for a key that never comes, as ``init_process_group`` does for a missing peer.
Prints ``BLOCKED`` once it waits. ``--own-handler``: the program installs its own SIGTERM
handler after ddpwatch attached (a checkpoint on SIGTERM), and waits ``--wait`` seconds."""

import argparse
import os
import signal
from datetime import timedelta

import torch.distributed as dist

import ddpwatch

parser = argparse.ArgumentParser()
parser.add_argument("port", type=int)
parser.add_argument("--own-handler", action="store_true")
parser.add_argument("--wait", type=float, default=60.0)
args = parser.parse_args()
ddpwatch.attach()
if args.own_handler:
    signal.signal(signal.SIGTERM, lambda *_: print("OWN HANDLER", flush=True))
store = dist.TCPStore("127.0.0.1", args.port, 1, True, timeout=timedelta(seconds=args.wait))
print("BLOCKED", os.getpid(), flush=True)
try:
    store.wait(["a key no rank ever writes"])
except Exception as exc:
    print("WAIT ENDED", type(exc).__name__, flush=True)
