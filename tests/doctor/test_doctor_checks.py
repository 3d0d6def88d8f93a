"""``ddpwatch doctor``'s checks on a ``Setup`` made by hand: no torch, GPU, port or server is
read, so the lines of a GPU machine, a held port or a far server are checked here on any
machine (``test_doctor.py`` runs the real thing)."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

from ddpwatch.core.port_holder import Holder
from ddpwatch.doctor.checks import (
    Check,
    check_local_rank,
    check_master_addr,
    check_master_port,
    check_nvml,
    check_server,
    check_torch,
    exit_code,
    run_checks,
)
from ddpwatch.doctor.gather import (
    Lookup,
    NvmlInfo,
    Outcome,
    PortUse,
    ServerAnswer,
    Setup,
    TorchInfo,
    attempt,
)
from ddpwatch.doctor.report import ASCII_MARKS, MARKS, report
from ddpwatch.status.schema import StatusDocument

NCCL_TORCH = TorchInfo(
    version="2.13.0", cuda="12.8", gpus=8, distributed=True, gloo=True, nccl=True
)


def made(**changes: Any) -> Setup:
    """An 8-GPU node running 8 ranks with nccl, its master this host, the server answering."""
    setup = Setup(
        env={},
        hostname="node0",
        torch=NCCL_TORCH,
        nvml=NvmlInfo(driver="550.54.15", gpus=8),
        nvidia_device=True,
        gpus=8,
        nproc=8,
        nproc_source="--nproc-per-node",
        backend="nccl",
        backend_source="--backend",
        master_addr="node0",
        master=Outcome(Lookup(("10.0.0.1",), local=True)),
        master_port_raw="29501",
        master_port=29501,
        rendezvous=None,
        port_use=Outcome(PortUse(None)),
        server="tcp://node0:5599",
        server_source="--addr",
        server_explicit=True,
        server_host="node0",
        server_port=5599,
        curve_env={},
        curve_error=None,
        answer=Outcome(ServerAnswer(document=StatusDocument(server_time=0.0, world_size=8))),
        timeout=2.0,
    )
    return dataclasses.replace(setup, **changes)


def test_a_healthy_gpu_node_reads_as_such() -> None:
    checks = run_checks(made())
    assert exit_code(checks) == 0
    assert report(made(), checks) == [
        "ddpwatch doctor on node0: 8 ranks per node (--nproc-per-node), backend nccl (--backend)",
        "✔ torch: 2.13.0, CUDA 12.8, 8 GPUs visible",
        "✔ backend: nccl (--backend) is available; torch has nccl and gloo",
        "✔ NVML: driver 550.54.15, 8 GPUs",
        "✔ GPUs: 8 ranks per node, 8 GPUs visible",
        "✔ CUDA_VISIBLE_DEVICES: unset: CUDA shows every GPU",
        f"{MARKS['skip']} LOCAL_RANK: not set here: the launcher sets it in each rank",
        "    fix: to check a rank's view, run doctor as one (srun ddpwatch doctor, or under mpirun)",
        "✔ MASTER_ADDR: node0 resolves to 10.0.0.1 (this host)",
        "✔ MASTER_PORT: 29501 is free on this host",
        "⚠ CURVE: off: plain TCP to node0: anyone on the path can read stacks and tracebacks",
        "    fix: ddpwatch keygen, serve with --curve-secret-file, export DDPWATCH_SERVER_KEY "
        "(docs/security.md)",
        "✔ server: node0:5599 (--addr) answered: 0 of 8 ranks connected",
        "8 ok, 0 failed, 1 warning, 1 skipped",
    ]


def test_a_broken_torch_is_a_failure_not_a_skip() -> None:
    broken = TorchInfo(version="2.13.0", error="RuntimeError: no libcudart")
    assert check_torch(made(torch=broken)) == Check(
        "torch",
        "fail",
        "2.13.0 imports, but reading its CUDA and backends failed (RuntimeError: no libcudart)",
        "a broken install: reinstall torch (pip install --force-reinstall torch)",
    )


def test_nvml_lines_by_the_step_that_failed() -> None:
    missing = NvmlInfo(failed="init", error="NVMLError_LibraryNotFound: not found")
    assert check_nvml(made(nvml=missing)).status == "warn"
    cpu = made(nvml=missing, backend="gloo", gpus=0, nvidia_device=False)
    assert check_nvml(cpu) == Check(
        "NVML",
        "skip",
        "not needed: the job runs on CPU (gloo, no NVIDIA GPU on this machine), GPU checks skipped",
    )
    unreadable = NvmlInfo(failed="read", error="NVMLError_Unknown: Unknown Error")
    assert check_nvml(dataclasses.replace(cpu, nvml=unreadable)) == Check(
        "NVML",
        "warn",
        "starts, but reading the driver and GPUs failed (NVMLError_Unknown: Unknown Error)",
        "check the driver with nvidia-smi",
    )


def test_a_rank_past_the_visible_gpus() -> None:
    rank = made(env={"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, nproc=4)
    line = check_local_rank(rank)
    assert (line.status, line.what) == (
        "fail",
        "3 but CUDA_VISIBLE_DEVICES=0,1 shows 2 GPUs: cuda:3 would fail with 'invalid device "
        "ordinal'",
    )
    assert check_local_rank(made(env={"LOCAL_RANK": "3"})).what == ("3: cuda:3 is one of 8 visible")


def test_a_held_master_port_names_its_holder_and_a_spare() -> None:
    holder = Holder(uid=1000, pids=(4242,), command="python train.py")
    held = PortUse("Address already in use", holder, spare=29502)
    assert check_master_port(made(port_use=Outcome(held))) == Check(
        "MASTER_PORT",
        "fail",
        "29501 is in use on this host (Address already in use): held by pid 4242 (python train.py)",
        "pick a free one (MASTER_PORT=29502), or stop pid 4242 if it is left over from an "
        "earlier run",
    )
    default = made(master_port_raw=None, port_use=Outcome(PortUse("Address already in use")))
    assert check_master_port(default).fix == (
        "pick a free one, or stop what holds it (ss -ltnp 'sport = :29501' shows it)"
    )


def test_a_master_elsewhere_is_left_to_its_host() -> None:
    far = made(master=Outcome(Lookup(("10.0.0.2",), local=False)), port_use=None)
    assert check_master_addr(far).what == "node0 resolves to 10.0.0.2 (another host)"
    assert check_master_port(far) == Check(
        "MASTER_PORT",
        "skip",
        "29501 not checked: MASTER_ADDR node0 is another host, the port check applies on that host",
        "run ddpwatch doctor on node0",
    )


def test_a_probe_that_raised_is_the_fail_line_of_each_check_reading_it() -> None:
    """A lookup that failed in a way no check foresaw (not an ``OSError``): both checks that
    read it fail with its text, as when each looked the name up itself."""

    def look_up() -> Lookup:
        raise KeyError("boom")

    odd = made(master=attempt(look_up), port_use=None)
    assert [(c.name, c.status, c.what) for c in run_checks(odd)[6:8]] == [
        ("MASTER_ADDR", "fail", "the check itself failed (KeyError: 'boom')"),
        ("MASTER_PORT", "fail", "the check itself failed (KeyError: 'boom')"),
    ]
    unresolved = made(
        master=Outcome[Lookup](error=socket.gaierror(-2, "Name or service not known"))
    )
    assert check_master_addr(unresolved).what == (
        "node0 does not resolve (Name or service not known)"
    )


def test_server_lines() -> None:
    gone = OSError(-2, "Name or service not known")
    assert check_server(made(answer=Outcome(ServerAnswer(unresolved=gone)))) == Check(
        "server",
        "fail",
        "node0:5599 (--addr): node0 does not resolve (Name or service not known)",
        "use a host name or IP address this host can resolve",
    )
    silent = made(answer=Outcome(ServerAnswer()), server_explicit=False)
    line = check_server(silent)
    assert line.status == "warn"
    assert line.fix.startswith("start it: ddpwatch serve --host 0.0.0.0 on node0, ports 5599-5600")
    assert check_server(made(answer=None, curve_error="bad key")).what == (
        "node0:5599 (--addr) not asked: the CURVE key is unusable"
    )
    assert check_server(made(server_port=None, answer=None)).what == (
        "cannot read a host:port from tcp://node0:5599 (--addr)"
    )


def test_ascii_marks() -> None:
    lines = report(made(), [Check("x", "fail", "broken", "mend it")], ASCII_MARKS)
    assert lines[1:] == [
        "[FAIL] x: broken",
        "    fix: mend it",
        "0 ok, 1 failed, 0 warnings, 0 skipped",
    ]


def test_the_port_line_says_what_torchrun_will_do_with_it() -> None:
    """Issue #33: ``doctor --nproc-per-node 2`` failed "29500 (unset: torchrun's default) is in
    use" where torchrun (2.13) on one node without --master-port picks a free port."""
    from ddpwatch.core.rendezvous import Plan

    free = made(
        master_port_raw=None,
        master_port=None,
        rendezvous=Plan("standalone", None, "one node and no --master-port"),
        port_use=None,
    )
    assert check_master_port(free) == Check(
        "MASTER_PORT",
        "ok",
        "torchrun picks a free port: one node and no --master-port, a c10d rendezvous on "
        "localhost:0",
    )
    ignored = dataclasses.replace(free, master_port_raw="29500")
    assert "(it ignores MASTER_PORT=29500: it sets it for its ranks)" in check_master_port(
        ignored
    ).what
    held = Outcome(PortUse("Address already in use", None, spare=29502))
    static = made(
        master_port_raw=None,
        master_port=29500,
        rendezvous=Plan("static", 29500, "torchrun's default --master-port"),
        port_use=held,
    )
    line = check_master_port(static)
    assert line.status == "fail"
    assert line.what.startswith("29500 (unset: torchrun's default) is in use on this host")
    assert line.fix is not None and line.fix.startswith(
        "pick a free one (torchrun --master-port 29502; on one node --standalone picks one)"
    )
    given = dataclasses.replace(static, rendezvous=Plan("static", 29500, "--master-port"))
    assert check_master_port(given).what.startswith("29500 (--master-port) is in use")
