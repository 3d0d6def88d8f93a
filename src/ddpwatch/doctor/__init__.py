"""``ddpwatch doctor``: pre-flight checks before a launch, one line each with its fix.

A job script runs it first (``ddpwatch doctor --nproc-per-node 8 && torchrun ...``): it exits
1 when a check fails, so a job that would die at start-up with ``invalid device ordinal``,
``Address already in use`` or an unresolvable master is not started. Warnings and skips do not
fail.

Three steps, a module each: ``gather.py`` reads the machine once into a ``Setup`` (torch, NVML,
the GPUs, the backend, the master's host and port, the server the ranks would report to);
``checks.py`` turns it into one ``Check`` per line, reading nothing itself; ``report.py``
prints them. Whatever needs torch or NVML becomes a skip line saying what could not be
checked, and a check that raises becomes a fail line with the exception's text: a pre-flight
tool that dies with a traceback has checked nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import IO

from ddpwatch.doctor import checks, gather, report


def torchrun_options(args: argparse.Namespace) -> dict[str, str | bool]:
    """The torchrun options doctor was given, by ``TorchrunOptions``' names."""
    given = {
        "nnodes": getattr(args, "nnodes", None),
        "master_port": getattr(args, "master_port", None),
        "standalone": getattr(args, "standalone", None),
    }
    return {k: v if isinstance(v, bool) else str(v) for k, v in given.items() if v is not None}


def doctor_main(args: argparse.Namespace, stream: IO[str] | None = None) -> int:
    """``ddpwatch doctor``: print every check; 0 when none failed, else 1."""
    out = sys.stdout if stream is None else stream
    marks = report.marks_for(out)
    try:
        setup = gather.gather(
            os.environ,
            nproc=args.nproc_per_node,
            addr=args.addr,
            backend=args.backend,
            server_key=args.curve_server_key,
            client_key_file=args.curve_client_key_file,
            timeout=args.timeout,
            torchrun=torchrun_options(args),
        )
    except Exception as exc:
        failed = f"{marks['fail']} doctor: cannot read this environment ({gather.describe(exc)})"
        report.write([failed], out)
        return 1
    found = checks.run_checks(setup)
    report.write(report.report(setup, found, marks), out)
    return checks.exit_code(found)
