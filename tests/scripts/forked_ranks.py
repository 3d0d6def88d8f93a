"""Run the ranks of several small jobs at once, each rank started as torchrun starts it (its
environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, rank 0 hosting the
store) but forked from this interpreter once it has imported torch: one torch import for every
rank of every job, where torchrun pays one per rank and one for its agent. As torchrun's agent
does, once a rank of a job fails the job's other ranks get SIGTERM a monitor interval later.

    python forked_ranks.py SCRIPT OUTDIR JOBS

JOBS is JSON: ``[{"name": "size", "args": ["all_gather_size"], "nproc": 3, "env": {}}, ...]``.
What rank r of job "size" prints is in OUTDIR/size.r (stdout) and OUTDIR/size.r.err.
"""

import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback

import torch  # noqa: F401  imported once, for every rank
import torch.distributed as dist

MONITOR_INTERVAL_S = 0.1  # torchrun's --monitor-interval default


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: each is held until all are picked, so two jobs of one
    run never draw the same MASTER_PORT (a job whose store cannot bind leaves its ranks
    waiting in init, and their records never come)."""
    held = [socket.socket() for _ in range(count)]
    try:
        for sock in held:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()


def be_rank(script: str, args: list[str], env: dict[str, str], out: str) -> None:
    """In a forked child: become the rank, run ``script`` as ``__main__``, never return."""
    code = 1
    try:
        os.environ.update(env)
        for stream, path in ((1, out), (2, out + ".err")):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, stream)
            os.close(fd)
        dist.set_debug_level_from_env()  # torch read it at import, before this rank's setting
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    script, outdir, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    sys.stdout.flush()
    job_of: dict[int, str] = {}
    for job, port in zip(jobs, free_ports(len(jobs)), strict=True):
        nproc = job["nproc"]
        common = {
            **job.get("env", {}),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for rank in range(nproc):
            env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            pid = os.fork()
            if pid == 0:
                be_rank(script, job["args"], env, os.path.join(outdir, f"{job['name']}.{rank}"))
            job_of[pid] = job["name"]
    while job_of:
        pid, status = os.wait()
        name = job_of.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            time.sleep(MONITOR_INTERVAL_S)
            for other, job in job_of.items():
                if job == name:
                    os.kill(other, signal.SIGTERM)


if __name__ == "__main__":
    main()
