"""``ddpwatch doctor`` run for real: the CLI in environments made of real variables, real sockets
and a real ``Server`` on 127.0.0.1.

The expectations are those of a machine without a GPU (CPU torch, or CUDA torch with no device,
and no NVML driver), which is what this project's test machines are; a GPU machine skips them.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import zmq
from conftest import LiveServer

import ddpwatch.doctor.gather as gathering
from ddpwatch.cli import main
from ddpwatch.core.ports import free_port_pair
from ddpwatch.core.protocol import Sample, encode
from ddpwatch.core.security import ServerCurve, generate_keys
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.doctor.checks import Check, check_gpus, run_checks
from ddpwatch.doctor.gather import gather
from ddpwatch.doctor.report import MARKS, report
from ddpwatch.server.service import Server


def _nvml_starts() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or _nvml_starts() or os.path.exists("/dev/nvidiactl"),
    reason="the expected lines are those of a machine without a GPU or NVML",
)

HOST = socket.gethostname()
REAL_TORCHRUN_PORT = gathering.TORCHRUN_PORT
SKIP = MARKS["skip"]  # an en dash
TORCH_LINE = (
    f"✔ torch: {torch.__version__}, a CPU build (no CUDA)"
    if torch.version.cuda is None
    else f"✔ torch: {torch.__version__}, CUDA {torch.version.cuda}, no GPU visible"
)
NVML_FIX = (
    "    fix: install the NVIDIA driver; in a container, expose the GPUs with the NVIDIA container "
    "toolkit (--gpus all) so libnvidia-ml.so.1 is there"
)
NVML_ABSENT = "NVML: cannot start (NVMLError_LibraryNotFound: NVML Shared Library Not Found)"
NVML_CPU = "NVML: not needed: the job runs on CPU (gloo, no NVIDIA GPU on this machine), GPU checks skipped"
LOCAL_RANK_UNSET = [
    f"{SKIP} LOCAL_RANK: not set here: the launcher sets it in each rank",
    "    fix: to check a rank's view, run doctor as one (srun ddpwatch doctor, or under mpirun)",
]
CURVE_HINT = "a server with --curve-secret-file answers only with DDPWATCH_SERVER_KEY set"
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL", "TORCHELASTIC_", "CUDA_")
LAUNCHER_NAMES = {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK",
                  "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_SIZE"}  # fmt: skip


@pytest.fixture(autouse=True)
def _torchrun_port_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """With MASTER_PORT unset doctor checks torchrun's default, 29500, which another job on
    this shared machine may hold: the tests move that default to a port known to be free."""
    monkeypatch.setattr(gathering, "TORCHRUN_PORT", free_port())


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test builds its environment from nothing the shell exported."""
    for name in list(os.environ):
        if name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    """``ddpwatch doctor ARGS`` through the real CLI: (exit code, stdout lines)."""
    code = main(["doctor", "--timeout", "0.3", *args])
    return code, capsys.readouterr().out.splitlines()


def entry(lines: list[str], name: str) -> list[str]:
    """The line of check ``name`` and its fix line, if it has one."""
    for index, line in enumerate(lines):
        if line.split(" ", 1)[1].startswith(f"{name}: "):
            follow = lines[index + 1 : index + 2]
            return [line] + [f for f in follow if f.startswith("    fix: ")]
    raise AssertionError(f"no {name} line in:\n" + "\n".join(lines))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def addr(server: LiveServer | CurveServer) -> str:
    return f"127.0.0.1:{server.port}"


# the whole report ------------------------------------------------------------------------------


def test_a_healthy_cpu_setup_passes_with_every_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    master_port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master_port))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    code, lines = doctor(capsys, "--addr", addr(live_server))
    backends = "torch has nccl and gloo" if dist.is_nccl_available() else "torch has gloo, not nccl"
    assert lines == [
        f"ddpwatch doctor on {HOST}: 4 ranks per node ($LOCAL_WORLD_SIZE), backend gloo (default: no CUDA)",
        TORCH_LINE,
        f"✔ backend: gloo (default: no CUDA) is available; {backends}",
        f"{SKIP} {NVML_CPU}",
        "✔ GPUs: 4 ranks per node on CPU (gloo, no GPU visible)",
        "✔ CUDA_VISIBLE_DEVICES: unset: CUDA shows every GPU",
        *LOCAL_RANK_UNSET,
        "✔ MASTER_ADDR: 127.0.0.1 resolves to 127.0.0.1 (this host)",
        f"✔ MASTER_PORT: {master_port} is free on this host",
        "✔ CURVE: off: plain TCP to 127.0.0.1, which only this host can reach",
        f"✔ server: 127.0.0.1:{live_server.port} (--addr) answered: no rank connected yet",
        "8 ok, 0 failed, 0 warnings, 2 skipped",
    ]
    assert code == 0


def test_ascii_log_gets_ascii_marks(live_server: LiveServer) -> None:
    """A job log in an ASCII locale cannot take ✔: the marks become words, not a crash."""
    result = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "doctor", "--timeout", "0.3", "--addr", addr(live_server),
         "--backend", "gloo"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "ascii", "LOCAL_RANK": "x", "CUDA_VISIBLE_DEVICES": "0,x",
             "MASTER_PORT": str(free_port())},
    )  # fmt: skip
    lines = result.stdout.splitlines()
    assert entry(lines, "LOCAL_RANK") == [
        "[FAIL] LOCAL_RANK: 'x' is not a non-negative integer",
        "    fix: unset it: the launcher sets LOCAL_RANK in each rank",
    ]
    assert entry(lines, "CUDA_VISIBLE_DEVICES")[0] == (
        "[warn] CUDA_VISIBLE_DEVICES: 0,x: CUDA stops reading at 'x' and shows only 0"
    )
    assert entry(lines, "NVML") == [f"[skip] {NVML_CPU}"]
    assert entry(lines, "CURVE")[0].startswith("[ok] CURVE: ")
    assert lines[-1] == "5 ok, 1 failed, 1 warning, 3 skipped"
    assert (result.returncode, result.stderr) == (1, "")


# GPUs per node and the backend -----------------------------------------------------------------


def test_more_ranks_than_gpus_fails_under_nccl_only(
    capsys: pytest.CaptureFixture[str], live_server: LiveServer
) -> None:
    code, lines = doctor(
        capsys, "--nproc-per-node", "4", "--backend", "nccl", "--addr", addr(live_server)
    )
    assert (
        lines[0]
        == f"ddpwatch doctor on {HOST}: 4 ranks per node (--nproc-per-node), backend nccl (--backend)"
    )
    assert entry(lines, "GPUs") == [
        "✖ GPUs: 4 ranks per node but 0 GPUs visible: local ranks 0-3 would fail with 'invalid device ordinal'",
        "    fix: NCCL needs a GPU per rank: run on a GPU node (check the job's GPU allocation and "
        "CUDA_VISIBLE_DEVICES), or train on CPU with gloo",
    ]
    if not dist.is_nccl_available():  # a CPU build of torch
        assert entry(lines, "backend") == [
            f"✖ backend: nccl is not in torch {torch.__version__}",
            "    fix: NCCL comes with CUDA builds of torch on Linux: install one, or train on CPU with gloo",
        ]
    assert entry(lines, "NVML")[0] == f"⚠ {NVML_ABSENT}"  # a GPU job without NVML: a warning
    assert code == 1

    code, lines = doctor(
        capsys, "--nproc_per_node", "4", "--backend", "gloo", "--addr", addr(live_server)
    )
    assert entry(lines, "GPUs") == ["✔ GPUs: 4 ranks per node on CPU (gloo, no GPU visible)"]
    assert code == 0


def test_five_ranks_on_four_gpus_names_the_rank_that_fails() -> None:
    """The classic case needs GPUs, so its numbers are given to the pure check directly."""
    setup = gather(os.environ, addr="127.0.0.1:9")
    nccl = dataclasses.replace(setup, gpus=4, nproc=5, backend="nccl")
    assert check_gpus(nccl) == Check(
        "GPUs",
        "fail",
        "5 ranks per node but 4 GPUs visible: local rank 4 would fail with 'invalid device ordinal'",
        "use --nproc-per-node 4, or make 5 GPUs visible (the job's GPU allocation, CUDA_VISIBLE_DEVICES)",
    )
    gloo = check_gpus(dataclasses.replace(nccl, backend="gloo"))
    assert (gloo.status, gloo.what) == (
        "warn",
        "5 ranks per node but 4 GPUs visible: local rank 4 would fail with 'invalid device ordinal' "
        "if they use cuda:LOCAL_RANK",
    )
    fits = check_gpus(dataclasses.replace(nccl, nproc=3))
    assert (fits.status, fits.what) == ("ok", "3 ranks per node, 4 GPUs visible, 1 left idle")


def test_ranks_per_node_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    code, lines = doctor(capsys, "--backend", "nccl", "--addr", addr(live_server))
    assert (
        lines[0]
        == f"ddpwatch doctor on {HOST}: 3 ranks per node ($LOCAL_WORLD_SIZE), backend nccl (--backend)"
    )
    assert entry(lines, "GPUs")[0].startswith("✖ GPUs: 3 ranks per node but 0 GPUs visible")
    assert code == 1

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "three")
    code, lines = doctor(capsys, "--backend", "nccl", "--addr", addr(live_server))
    assert entry(lines, "GPUs") == [
        f"{SKIP} GPUs: 0 GPUs visible; ranks per node unknown (LOCAL_WORLD_SIZE='three' is not a "
        "positive integer): not compared",
        "    fix: pass --nproc-per-node N as given to torchrun",
    ]


# CUDA_VISIBLE_DEVICES and LOCAL_RANK -----------------------------------------------------------


def test_cuda_visible_devices_read_as_cuda_reads_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    def visible(value: str, *args: str) -> tuple[int, list[str]]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        code, lines = doctor(capsys, "--addr", addr(live_server), *args)
        return code, entry(lines, "CUDA_VISIBLE_DEVICES")

    assert visible("0,1,0") == (1, [
        "✖ CUDA_VISIBLE_DEVICES: 0,1,0 repeats 0: CUDA then shows no GPU at all",
        "    fix: list each GPU once",
    ])  # fmt: skip
    assert visible("0,x,2") == (0, [
        "⚠ CUDA_VISIBLE_DEVICES: 0,x,2: CUDA stops reading at 'x' and shows only 0",
        "    fix: remove or correct 'x': every entry after it is ignored",
    ])  # fmt: skip
    assert visible("0,1,") == (0, ["✔ CUDA_VISIBLE_DEVICES: 0,1, lists 2 GPUs"])
    assert visible("GPU-8e1f,GPU-8e1f") == (1, [
        "✖ CUDA_VISIBLE_DEVICES: GPU-8e1f,GPU-8e1f repeats GPU-8e1f: CUDA then shows no GPU at all",
        "    fix: list each GPU once",
    ])  # fmt: skip
    too_few = [
        "CUDA_VISIBLE_DEVICES: 0,1 lists 2 GPUs for 4 ranks per node",
        "    fix: list one GPU per local rank (e.g. CUDA_VISIBLE_DEVICES=0,1,2,3), or lower --nproc-per-node",
    ]
    assert visible("0,1", "--nproc-per-node", "4", "--backend", "gloo") == (
        0,
        ["⚠ " + too_few[0], too_few[1]],
    )
    assert visible("0,1", "--nproc-per-node", "4", "--backend", "nccl") == (
        1,
        ["✖ " + too_few[0], too_few[1]],
    )
    assert visible("", "--nproc-per-node", "2", "--backend", "gloo") == (
        0, ["✔ CUDA_VISIBLE_DEVICES: '' hides every GPU (a CPU run with gloo)"]
    )  # fmt: skip
    assert visible("-1", "--nproc-per-node", "2", "--backend", "nccl")[1][0] == (
        "✖ CUDA_VISIBLE_DEVICES: '-1' hides every GPU: 2 ranks per node need one"
    )


def test_local_rank_against_visible_devices_and_ranks_per_node(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    def local_rank(rank: str, *args: str) -> tuple[int, list[str]]:
        monkeypatch.setenv("LOCAL_RANK", rank)
        code, lines = doctor(capsys, "--addr", addr(live_server), *args)
        return code, entry(lines, "LOCAL_RANK")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    fix = (
        "    fix: give each rank a GPU of its own: list them all in CUDA_VISIBLE_DEVICES, or with "
        "one GPU per rank (Slurm's --gpus-per-task) use cuda:0"
    )
    beyond = "LOCAL_RANK: 2 but CUDA_VISIBLE_DEVICES=0,1 shows 2 GPUs: cuda:2 would fail with 'invalid device ordinal'"
    assert local_rank("2", "--backend", "nccl") == (1, ["✖ " + beyond, fix])
    assert local_rank("2", "--backend", "gloo") == (0, ["⚠ " + beyond, fix])
    assert local_rank("1", "--backend", "gloo") == (
        0,
        ["✔ LOCAL_RANK: 1, on CPU (gloo, no GPU visible)"],
    )
    assert local_rank("4", "--backend", "gloo", "--nproc-per-node", "4") == (1, [
        "✖ LOCAL_RANK: 4 but 4 ranks per node (local ranks 0-3)",
        "    fix: make --nproc-per-node match the ranks the launcher starts on each node",
    ])  # fmt: skip
    assert local_rank("one", "--backend", "gloo") == (1, [
        "✖ LOCAL_RANK: 'one' is not a non-negative integer",
        "    fix: unset it: the launcher sets LOCAL_RANK in each rank",
    ])  # fmt: skip
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local_rank("0", "--backend", "nccl")[1] == [
        "✖ LOCAL_RANK: 0 but no GPU visible: cuda:0 would fail with 'invalid device ordinal'",
        fix,
    ]
    monkeypatch.delenv("LOCAL_RANK")
    code, lines = doctor(capsys, "--addr", addr(live_server))
    assert (code, entry(lines, "LOCAL_RANK")) == (0, LOCAL_RANK_UNSET)


# MASTER_ADDR and MASTER_PORT -------------------------------------------------------------------


def test_busy_master_port_fails_and_a_free_one_passes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()  # a leftover job's TCPStore
    port = holder.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(port))
    code, lines = doctor(capsys, "--addr", addr(live_server))
    busy = entry(lines, "MASTER_PORT")
    assert busy[0].startswith(
        f"✖ MASTER_PORT: {port} is in use on this host (Address already in use): "
        f"held by pid {os.getpid()} ("  # this test's own process holds it
    )
    spare = int(busy[1].split("MASTER_PORT=")[1].split(")")[0])
    assert busy[1] == (
        f"    fix: pick a free one (MASTER_PORT={spare}), or stop pid {os.getpid()} if it is "
        "left over from an earlier run"
    )
    assert spare > port
    with socket.create_server(("127.0.0.1", spare)):  # the suggestion is free
        pass
    assert code == 1

    holder.close()
    code, lines = doctor(capsys, "--addr", addr(live_server))
    assert entry(lines, "MASTER_PORT") == [f"✔ MASTER_PORT: {port} is free on this host"]
    assert code == 0


def test_unset_master_port_checks_torchrun_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    """torchrun on several nodes listens on 29500 without --master-port, so that port is
    checked. This machine's 29500 may be anyone's (the demo job takes it when free): whichever
    it is, the line says it was checked as torchrun's default."""
    monkeypatch.setattr(gathering, "TORCHRUN_PORT", REAL_TORCHRUN_PORT)
    code, lines = doctor(capsys, "--addr", addr(live_server), "--nnodes", "2")
    checked = "MASTER_PORT: 29500 (unset: torchrun's default) is "
    line = entry(lines, "MASTER_PORT")[0]
    assert line == f"✔ {checked}free on this host" or line.startswith(f"✖ {checked}in use")
    assert code == (0 if line.startswith("✔") else 1)


def test_a_held_master_port_names_the_process_holding_it(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    live_server: LiveServer,
    http_server: tuple[subprocess.Popen[bytes], int],
) -> None:
    """A leftover process on torchrun's default port of a job on two nodes (here the default
    is moved to a port a real ``http.server`` holds: 29500 itself cannot be taken on a shared
    machine)."""
    process, port = http_server
    monkeypatch.setattr(gathering, "TORCHRUN_PORT", port)
    code, lines = doctor(capsys, "--addr", addr(live_server), "--nnodes", "2")
    busy = entry(lines, "MASTER_PORT")
    program = os.path.basename(sys.executable)
    assert busy[0] == (
        f"✖ MASTER_PORT: {port} (unset: torchrun's default) is in use on this host (Address "
        f"already in use): held by pid {process.pid} ({program} -m http.server {port} "
        "--bind 127.0.0.1)"
    )
    spare = int(busy[1].split("--master-port ")[1].split(";")[0])
    assert busy[1] == (
        f"    fix: pick a free one (torchrun --master-port {spare}; on one node --standalone "
        f"picks one), or stop pid {process.pid} if it is left over from an earlier run"
    )
    assert code == 1

    monkeypatch.setenv("MASTER_PORT", str(port))  # named, the same process is named
    code, lines = doctor(capsys, "--addr", addr(live_server))
    assert entry(lines, "MASTER_PORT")[0].endswith(
        f"is in use on this host (Address already in use): held by pid {process.pid} "
        f"({program} -m http.server {port} --bind 127.0.0.1)"
    )
    monkeypatch.delenv("MASTER_PORT")
    code, lines = doctor(capsys, "--addr", addr(live_server), "--master-port", str(port))
    assert entry(lines, "MASTER_PORT")[0].startswith(f"✖ MASTER_PORT: {port} (--master-port) is")
    assert code == 1


def _hold(port: int, within_s: float) -> socket.socket:
    """Listen on ``port`` once it is free, trying for ``within_s``: another test's job (the
    demo's ranks) may hold it for a few seconds and let it go before this test's last check.
    A holder that keeps it longer (someone else's job on this machine) holds it for the test."""
    deadline = time.monotonic() + within_s
    while True:
        holder = socket.socket()
        try:
            holder.bind(("0.0.0.0", port))
            holder.listen(1)
            return holder
        except OSError:
            holder.close()
            if time.monotonic() > deadline:
                return socket.socket()  # held all along: by someone who keeps it
            time.sleep(0.5)


@pytest.mark.e2e
def test_one_node_without_a_port_passes_as_torchrun_runs_with_29500_held(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    live_server: LiveServer,
    tmp_path: Path,
) -> None:
    """Issue #33: with 29500 held, ``doctor --nproc-per-node 2`` failed "29500 (unset:
    torchrun's default) is in use" while ``torchrun --nproc-per-node 2`` ran: on one node
    without --master-port torch 2.13's torchrun picks a free port. Both for real, the port
    held here (or by whoever holds it on this machine already)."""
    monkeypatch.setattr(gathering, "TORCHRUN_PORT", REAL_TORCHRUN_PORT)
    holder = _hold(REAL_TORCHRUN_PORT, within_s=60.0)
    try:
        assert gathering.port_in_use(REAL_TORCHRUN_PORT) is not None
        code, lines = doctor(capsys, "--addr", addr(live_server), "--nproc-per-node", "2")
        assert entry(lines, "MASTER_PORT") == [
            "✔ MASTER_PORT: torchrun picks a free port: one node and no --master-port, a c10d "
            "rendezvous on localhost:0"
        ]
        script = tmp_path / "rendezvous.py"
        script.write_text("import torch.distributed as d\nd.init_process_group('gloo')\nd.barrier()\n")
        job = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert job.returncode == 0, job.stderr[-2000:]
        code, lines = doctor(capsys, "--addr", addr(live_server), "--master-port", "29500")
        assert entry(lines, "MASTER_PORT")[0].startswith("✖ MASTER_PORT: 29500 (--master-port) is")
        assert code == 1  # where torchrun would fail: told
    finally:
        holder.close()


def test_a_port_left_in_time_wait_is_free_as_for_tcpstore(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    """A finished job's store leaves its port in TIME_WAIT: a plain bind is refused, the next
    store binds it anyway, and doctor must say what the store will find."""
    listener = socket.create_server(("127.0.0.1", 0))  # SO_REUSEADDR, like the store's
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # this side closes first: it is the one left in TIME_WAIT
    time.sleep(0.1)
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError) as refused:
        plain.bind(("0.0.0.0", port))
    assert refused.value.errno == errno.EADDRINUSE

    monkeypatch.setenv("MASTER_PORT", str(port))
    code, lines = doctor(capsys, "--addr", addr(live_server))
    assert entry(lines, "MASTER_PORT") == [f"✔ MASTER_PORT: {port} is free on this host"]
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=5))
    store.set("bound", "yes")
    assert code == 0


def test_unresolvable_master_addr_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    with pytest.raises(OSError) as lookup:
        socket.getaddrinfo("node0.invalid", None)
    monkeypatch.setenv("MASTER_ADDR", "node0.invalid")
    monkeypatch.setenv("MASTER_PORT", "29500")
    code, lines = doctor(capsys, "--addr", addr(live_server))
    assert entry(lines, "MASTER_ADDR") == [
        f"✖ MASTER_ADDR: node0.invalid does not resolve ({lookup.value.strerror})",
        "    fix: use a host name or IP address every node can resolve (in Slurm: the first of "
        "scontrol show hostnames $SLURM_JOB_NODELIST)",
    ]
    assert entry(lines, "MASTER_PORT") == [
        f"{SKIP} MASTER_PORT: 29500 not checked: MASTER_ADDR does not resolve"
    ]
    assert code == 1


def test_master_port_of_another_host_is_left_to_that_host(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")  # TEST-NET-1: never this host
    monkeypatch.setenv("MASTER_PORT", "29500")
    code, lines = doctor(capsys, "--addr", addr(live_server))
    assert entry(lines, "MASTER_ADDR") == [
        "✔ MASTER_ADDR: 192.0.2.7 resolves to 192.0.2.7 (another host)"
    ]
    assert entry(lines, "MASTER_PORT") == [
        f"{SKIP} MASTER_PORT: 29500 not checked: MASTER_ADDR 192.0.2.7 is another host, the port "
        "check applies on that host",
        "    fix: run ddpwatch doctor on 192.0.2.7",
    ]
    assert code == 0


# the ddpwatch server -----------------------------------------------------------------------------


def push_sample(port: int, rank: int, world_size: int) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sample = Sample(v=1, rank=rank, t=time.time(), world_size=world_size, host="node-a", pid=1)
    sock.send(encode(sample))
    sock.close()
    context.term()


def test_reachable_server_reports_the_ranks_it_sees(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    push_sample(live_server.port, rank=0, world_size=4)
    live_server.wait_for(lambda s: s["stats"]["received"] == 1, 10)
    monkeypatch.setenv("DDPWATCH_ADDR", addr(live_server))  # where the agent finds it
    code, lines = doctor(capsys)
    assert entry(lines, "server") == [
        f"✔ server: 127.0.0.1:{live_server.port} ($DDPWATCH_ADDR) answered: 1 of 4 ranks connected"
    ]
    assert code == 0


def test_unreachable_server_fails_when_named(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port_pair()  # nothing listens there
    code, lines = doctor(capsys, "--addr", f"127.0.0.1:{port}")
    assert entry(lines, "server") == [
        f"✖ server: 127.0.0.1:{port} (--addr): no server answered on 127.0.0.1:{port + 1} within "
        f"0.3 s: that is the query port of ddpwatch serve (its rank port {port} + 1)",
        f"    fix: start it: ddpwatch serve --port {port}; {CURVE_HINT}",
    ]
    assert code == 1


def test_unreachable_default_server_only_warns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody asked for a server: the ranks would report to $MASTER_ADDR:5599, and a job
    without one trains as before, so its absence is a warning."""
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")
    code, lines = doctor(capsys)
    assert entry(lines, "server") == [
        "⚠ server: 192.0.2.7:5599 (the agent's default, $MASTER_ADDR): no server answered on "
        "192.0.2.7:5600 within 0.3 s: that is the query port of ddpwatch serve (its rank port "
        "5599 + 1)",
        "    fix: start it: ddpwatch serve --host 0.0.0.0 on 192.0.2.7, ports 5599-5600 open; "
        f"{CURVE_HINT}; without one the ranks train as before, unwatched",
    ]
    assert entry(lines, "CURVE") == [
        "⚠ CURVE: off: plain TCP to 192.0.2.7: anyone on the path can read stacks and tracebacks",
        "    fix: ddpwatch keygen, serve with --curve-secret-file, export DDPWATCH_SERVER_KEY "
        "(docs/security.md)",
    ]
    assert code == 0


class CurveServer:
    """A real ``Server`` with CurveZMQ on, on a thread."""

    def __init__(self, keys: Path) -> None:
        self.public_file, secret, self.public = generate_keys(keys)
        self.port = free_port_pair()
        self.server = Server(
            "127.0.0.1", self.port, Thresholds(), curve=ServerCurve.from_files(secret)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(5)


@pytest.fixture
def curve_server(tmp_path: Path) -> Iterator[CurveServer]:
    server = CurveServer(tmp_path / "keys")
    yield server
    server.stop()


def test_curve_server_answers_only_with_its_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, curve_server: CurveServer
) -> None:
    where = f"127.0.0.1:{curve_server.port} (--addr)"
    code, lines = doctor(capsys, "--addr", addr(curve_server))
    assert entry(lines, "server") == [
        f"✖ server: {where}: no server answered on 127.0.0.1:{curve_server.port + 1} within 0.3 s: "
        f"that is the query port of ddpwatch serve (its rank port {curve_server.port} + 1)",
        f"    fix: start it: ddpwatch serve --port {curve_server.port}; {CURVE_HINT}",
    ]
    assert code == 1

    monkeypatch.setenv("DDPWATCH_SERVER_KEY", curve_server.public)
    code, lines = doctor(capsys, "--addr", addr(curve_server))
    assert entry(lines, "CURVE") == [
        "✔ CURVE: on: the server key is valid, a fresh client key per socket"
    ]
    assert entry(lines, "server") == [f"✔ server: {where} answered: no rank connected yet"]
    assert code == 0

    monkeypatch.delenv("DDPWATCH_SERVER_KEY")
    code, lines = doctor(
        capsys, "--addr", addr(curve_server), "--curve-server-key", str(curve_server.public_file)
    )
    assert entry(lines, "server") == [f"✔ server: {where} answered: no rank connected yet"]
    assert code == 0


def test_unusable_curve_keys_fail_and_are_not_sent_in_the_clear(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, curve_server: CurveServer,
    tmp_path: Path,
) -> None:  # fmt: skip
    monkeypatch.setenv("DDPWATCH_SERVER_KEY", "short")
    code, lines = doctor(capsys, "--addr", addr(curve_server))
    assert entry(lines, "CURVE") == [
        "✖ CURVE: DDPWATCH_SERVER_KEY must be a 40-character Z85 key, got 5",
        "    fix: DDPWATCH_SERVER_KEY is the server's public key (ddpwatch keygen prints it), "
        "DDPWATCH_CLIENT_KEY_FILE a client's .key_secret file (docs/security.md)",
    ]
    assert entry(lines, "server") == [
        f"{SKIP} server: 127.0.0.1:{curve_server.port} (--addr) not asked: the CURVE key is unusable"
    ]
    assert code == 1

    monkeypatch.setenv("DDPWATCH_SERVER_KEY", curve_server.public)
    code, lines = doctor(
        capsys, "--addr", addr(curve_server), "--curve-client-key-file", str(tmp_path / "none")
    )
    assert entry(lines, "CURVE")[0] == (
        f"✖ CURVE: cannot read key file {tmp_path / 'none'}: no such file"
    )
    assert code == 1

    monkeypatch.delenv("DDPWATCH_SERVER_KEY")
    monkeypatch.setenv("DDPWATCH_CLIENT_KEY_FILE", str(tmp_path / "none"))
    code, lines = doctor(capsys, "--addr", addr(curve_server))
    assert entry(lines, "CURVE")[0] == (
        "⚠ CURVE: DDPWATCH_CLIENT_KEY_FILE is set but DDPWATCH_SERVER_KEY is not: the client "
        "key is unused and traffic is plain TCP"
    )


# without torch, without NVML -------------------------------------------------------------------

WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; "
    "from ddpwatch.cli import main; sys.exit(main(sys.argv[1:]))"
)


def doctor_without_torch(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``ddpwatch doctor`` in a Python where ``import torch`` fails.

    The seam is one line: ``sys.modules['torch'] = None`` makes every ``import torch`` raise
    ImportError, as in an environment without torch, while ddpwatch and the rest stay real.
    """
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, "doctor", "--timeout", "0.3", *args],
        capture_output=True, text=True, encoding="utf-8", timeout=60,
        env={**os.environ, "PYTHONIOENCODING": "utf-8", **env},
    )  # fmt: skip


def test_without_torch_every_torch_check_is_a_skip(live_server: LiveServer) -> None:
    result = doctor_without_torch(
        "--addr", addr(live_server), "--nproc-per-node", "2", MASTER_PORT=str(free_port())
    )
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"ddpwatch doctor on {HOST}: 2 ranks per node (--nproc-per-node), "
        "backend gloo (default: no torch or NVML to count GPUs)"
    )
    assert entry(lines, "torch") == [
        f"{SKIP} torch: not importable (ModuleNotFoundError: import of torch halted; None in "
        "sys.modules): CUDA devices, NCCL and gloo not checked",
        "    fix: run doctor with the job's Python (the environment torchrun uses)",
    ]
    assert entry(lines, "backend") == [
        f"{SKIP} backend: gloo (default: no torch or NVML to count GPUs) not checked without torch"
    ]
    assert entry(lines, "GPUs") == [
        f"{SKIP} GPUs: cannot count visible GPUs: torch is not importable and NVML is unavailable",
        "    fix: run doctor with the job's Python, or pip install nvidia-ml-py",
    ]
    assert entry(lines, "server")[0].startswith("✔ server: ")
    assert lines[-1] == "4 ok, 0 failed, 0 warnings, 6 skipped"
    assert (result.returncode, result.stderr) == (0, "")


def test_without_torch_the_exit_code_is_the_real_failures(live_server: LiveServer) -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        result = doctor_without_torch("--addr", addr(live_server), MASTER_PORT=str(port))
    lines = result.stdout.splitlines()
    assert entry(lines, "MASTER_PORT")[0].startswith(
        f"✖ MASTER_PORT: {port} is in use on this host (Address already in use): "
        f"held by pid {os.getpid()} ("
    )
    assert lines[-1] == "3 ok, 1 failed, 0 warnings, 6 skipped"
    assert (result.returncode, result.stderr) == (1, "")


def test_nvml_absent_for_real(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    """A GPU job without NVML is warned, with how to get it; a CPU job needs none."""
    code, lines = doctor(capsys, "--addr", addr(live_server), "--backend", "nccl")
    assert entry(lines, "NVML") == [f"⚠ {NVML_ABSENT}", NVML_FIX]

    monkeypatch.setattr(gathering, "NVIDIA_DEVICE", __file__)  # a GPU machine, gloo
    code, lines = doctor(capsys, "--addr", addr(live_server), "--backend", "gloo")
    assert entry(lines, "NVML") == [f"⚠ {NVML_ABSENT}", NVML_FIX]
    assert code == 0

    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    code, lines = doctor(capsys, "--addr", addr(live_server), "--backend", "nccl")
    assert entry(lines, "NVML") == [
        "⚠ NVML: nvidia-ml-py not importable (ModuleNotFoundError: import of pynvml halted; None "
        "in sys.modules): GPU UUIDs, memory and processes will read as null",
        "    fix: pip install nvidia-ml-py",
    ]


def test_a_cpu_job_gets_no_driver_advice(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    """gloo on a machine without an NVIDIA GPU (this one): NVML's absence is no problem and
    nothing is to be installed, whether the backend is named or found (no CUDA: gloo)."""
    for args in (("--backend", "gloo"), ()):
        code, lines = doctor(capsys, "--addr", addr(live_server), *args)
        assert entry(lines, "NVML") == [f"{SKIP} {NVML_CPU}"]
        assert not [line for line in lines if "driver" in line or "nvidia-ml-py" in line]
        assert code == 0

    monkeypatch.setitem(sys.modules, "pynvml", None)  # nor is nvidia-ml-py needed
    code, lines = doctor(capsys, "--addr", addr(live_server), "--backend", "gloo")
    assert entry(lines, "NVML") == [f"{SKIP} {NVML_CPU}"]
    assert code == 0


def test_nvml_present_through_a_fake_module(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, live_server: LiveServer
) -> None:
    """No NVML can start here, so a stand-in ``pynvml`` module answers the three calls the check
    makes (a narrow seam: only the NVML line depends on it)."""
    calls: list[str] = []
    fake = SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlDeviceGetCount=lambda: 8,
        nvmlShutdown=lambda: calls.append("shutdown"),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    code, lines = doctor(capsys, "--addr", addr(live_server))
    assert entry(lines, "NVML") == ["✔ NVML: driver 550.54.15, 8 GPUs"]
    assert calls == ["init", "shutdown"]
    assert code == 0


# the runner --------------------------------------------------------------------------------------


def test_a_check_that_raises_is_a_fail_line_not_a_traceback() -> None:
    setup = gather(os.environ, addr="127.0.0.1:9")
    checks = run_checks(setup, [("broken", lambda s: {}["missing"])])
    assert checks == [
        Check(
            "broken",
            "fail",
            "the check itself failed (KeyError: 'missing')",
            "a ddpwatch bug: please report this line",
        )
    ]
    assert report(setup, checks)[1:] == [
        "✖ broken: the check itself failed (KeyError: 'missing')",
        "    fix: a ddpwatch bug: please report this line",
        "0 ok, 1 failed, 0 warnings, 0 skipped",
    ]
