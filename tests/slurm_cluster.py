"""A private one-node Slurm cluster for tests: its own munged, slurmctld and slurmd.

Everything (config, state, sockets, logs) lives in one temporary folder and the
daemons listen on free ports, so it neither needs nor touches a system Slurm.
Debian's ``slurm-wlm`` and ``munge`` provide the daemons (``.ci/run`` installs
them); they must run as root, as in CI.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from ddpwatch.core.ports import free_port_pair

DAEMONS = ("munged", "slurmctld", "slurmd", "srun")
MUNGE_KEY = Path("/etc/munge/munge.key")


def missing() -> str | None:
    """Why no cluster can be started here, or None."""
    absent = [name for name in DAEMONS if shutil.which(name) is None and not _sbin(name)]
    if absent:
        return "not installed: " + ", ".join(absent) + " (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the Slurm daemons need root"
    if not MUNGE_KEY.is_file():
        return f"no munge key at {MUNGE_KEY}"
    return None


def _sbin(name: str) -> str | None:
    path = Path("/usr/sbin") / name
    return str(path) if path.is_file() else None


def _command(name: str) -> str:
    return shutil.which(name) or _sbin(name) or name


class SlurmCluster:
    """Start with ``start()``; ``env`` is what ``srun`` needs; ``stop()`` ends every daemon."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[Path] = []

    def start(self, timeout: float = 30.0) -> None:
        for folder in ("state", "spool", "log"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        self._run(
            _command("munged"), "--force", f"--socket={self.munge_socket}",
            f"--key-file={MUNGE_KEY}", f"--pid-file={self.root / 'munged.pid'}",
            f"--log-file={self.root / 'log' / 'munged.log'}",
            f"--seed-file={self.root / 'munged.seed'}",
        )  # fmt: skip
        self._daemons.append(self.root / "munged.pid")
        self._write_conf()
        self._run(_command("slurmctld"))
        self._daemons.append(self.root / "slurmctld.pid")
        self._run(_command("slurmd"))
        self._daemons.append(self.root / "slurmd.pid")
        self._wait_idle(timeout)

    def stop(self) -> None:
        subprocess.run(
            [_command("scontrol"), "shutdown"], env=self.env, capture_output=True, timeout=20
        )
        for pid_file in reversed(self._daemons):
            self._kill(pid_file)

    def log(self) -> str:
        """The daemons' logs, for a failing test's message."""
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted((self.root / "log").glob("*.log"))
        )

    def _write_conf(self) -> None:
        node = socket.gethostname()
        controller, daemon = free_port_pair(), free_port_pair()
        self.conf.write_text(
            f"""\
ClusterName=ddpwatch
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={self.root / "state"}
SlurmdSpoolDir={self.root / "spool"}
SlurmctldPidFile={self.root / "slurmctld.pid"}
SlurmdPidFile={self.root / "slurmd.pid"}
SlurmctldPort={controller}
SlurmdPort={daemon}
SlurmctldLogFile={self.root / "log" / "slurmctld.log"}
SlurmdLogFile={self.root / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""
        )

    def _run(self, *command: str) -> None:
        subprocess.run(command, env=self.env, check=True, capture_output=True, timeout=30)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            result = subprocess.run(
                [_command("sinfo"), "--noheader", "--format=%t"],
                env=self.env, capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            state = result.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.3)
        raise RuntimeError(f"the test Slurm node is {state or 'not up'}:\n{self.log()}")

    @staticmethod
    def _kill(pid_file: Path) -> None:
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        for signal_number in (15, 9):
            try:
                os.kill(pid, signal_number)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.05)
