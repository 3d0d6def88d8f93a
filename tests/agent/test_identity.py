"""Rank identity from each launcher's environment, and from a real process group."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from functools import partial
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpwatch.agent.identity import (
    RankIdentity,
    identity_from_env,
    init_method_of,
    is_rank_process,
    parse_tasks_per_node,
    read_rendezvous_env,
    refresh_from_torch,
)
from ddpwatch.core.protocol import Hello, Identity, Sample, decode, encode

# Environments as the launchers write them (variable names checked against their sources).
TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "5",
    "ROLE_NAME": "default",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job-42",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}
SLURM_STEP = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "3",
    "SLURM_NTASKS": "7",
    "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
    "SLURM_NNODES": "4",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_COMM_WORLD_NODE_RANK": "3",
}
MPICH = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
DEEPSPEED = {  # deepspeed.launcher.launch on node 1 of 2, 4 GPUs each
    "RANK": "6",
    "LOCAL_RANK": "2",
    "WORLD_SIZE": "8",
    "CROSS_RANK": "1",
    "CROSS_SIZE": "2",
    "LOCAL_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
LIGHTNING = {  # lightning's _SubprocessScriptLauncher child on node 0
    "LOCAL_RANK": "2",
    "NODE_RANK": "0",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "41234",
}


def test_torchrun() -> None:
    ident = identity_from_env(TORCHRUN)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.local_world_size) == (5, 1, 8, 4)
    assert ident.node_rank == 1
    assert ident.launcher == "torchrun"
    assert ident.job_id == "job-42"
    assert ident.cuda_visible_devices == "0,1,2,3"
    assert ident.pid == os.getpid()
    assert ident.host
    assert ident.backend is None  # only the process group knows
    assert is_rank_process(TORCHRUN)


def test_torchrun_default_run_id_is_not_a_job_id() -> None:
    assert identity_from_env({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}).job_id is None


def test_slurm_step_with_compressed_tasks_per_node() -> None:
    ident = identity_from_env(SLURM_STEP)
    assert ident.launcher == "slurm"
    assert (ident.rank, ident.local_rank, ident.world_size, ident.node_rank) == (6, 0, 7, 3)
    assert ident.local_world_size == 1  # the fourth node of "2(x3),1"
    assert ident.job_id == "123456"
    assert identity_from_env({**SLURM_STEP, "SLURM_NODEID": "1"}).local_world_size == 2
    assert is_rank_process(SLURM_STEP)


def test_slurm_ntasks_per_node_when_the_list_is_missing() -> None:
    env = {**SLURM_STEP, "SLURM_NTASKS_PER_NODE": "2"}
    del env["SLURM_TASKS_PER_NODE"], env["SLURM_STEP_TASKS_PER_NODE"]
    assert identity_from_env(env).local_world_size == 2


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2(x3),1", [2, 2, 2, 1]),
        ("4", [4]),
        ("4(x2)", [4, 4]),
        ("1,3", [1, 3]),
        ("", None),
        (None, None),
        ("2(x)", None),
        ("two", None),
        ("2(x99999999999)", None),
    ],
)
def test_parse_tasks_per_node(value: str | None, expected: list[int] | None) -> None:
    assert parse_tasks_per_node(value) == expected


@pytest.mark.parametrize("step_id", [None, "-5", "4294967291", "4294967290", "4294967292"])
def test_slurm_batch_interactive_and_extern_steps_are_not_ranks(step_id: str | None) -> None:
    # a batch script carries SLURM_PROCID=0 and the job's task count: not a rank of that job
    env = {**SLURM_STEP, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}
    del env["SLURM_STEP_ID"]
    if step_id is not None:
        env["SLURM_STEP_ID"] = step_id
    ident = identity_from_env(env)
    assert (ident.rank, ident.world_size, ident.launcher) == (None, None, None)
    assert ident.job_id == "123456"
    assert not is_rank_process(env)


def test_torchrun_under_srun_prefers_torch_variables() -> None:
    # srun starts one torchrun per node: SLURM_PROCID is the node's index, not the rank
    env = {**SLURM_STEP, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", **TORCHRUN}
    ident = identity_from_env(env)
    assert (ident.rank, ident.world_size, ident.local_world_size) == (5, 8, 4)
    assert ident.launcher == "torchrun"
    assert ident.job_id == "123456"  # the scheduler's id names the job on every rank


def test_openmpi() -> None:
    ident = identity_from_env(OPENMPI)
    assert ident.launcher == "openmpi"
    assert (ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == (3, 4, 3, 4)
    assert ident.node_rank == 0  # every rank on one node
    assert is_rank_process(OPENMPI)


def test_openmpi_node_rank_is_not_the_node_index() -> None:
    # OMPI_COMM_WORLD_NODE_RANK counts processes on a node; the node index is not exported
    env = {**OPENMPI, "OMPI_COMM_WORLD_SIZE": "8"}
    assert identity_from_env(env).node_rank is None


def test_mpirun_inside_a_slurm_allocation_beats_the_inherited_slurm_procid() -> None:
    env = {**SLURM_STEP, "SLURM_PROCID": "0", **OPENMPI}
    ident = identity_from_env(env)
    assert (ident.launcher, ident.rank) == ("openmpi", 3)


def test_mpich_hydra() -> None:
    ident = identity_from_env(MPICH)
    assert ident.launcher == "mpich"
    assert (ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == (5, 8, 1, 4)
    assert ident.node_rank is None
    assert is_rank_process(MPICH)


def test_srun_pmi_is_labelled_slurm() -> None:
    env = {**SLURM_STEP, "PMI_RANK": "6", "PMI_SIZE": "7"}
    ident = identity_from_env(env)
    assert (ident.launcher, ident.rank, ident.world_size) == ("slurm", 6, 7)
    assert (ident.local_rank, ident.local_world_size, ident.node_rank) == (0, 1, 3)


def test_deepspeed_launcher() -> None:
    ident = identity_from_env(DEEPSPEED)
    assert ident.launcher == "deepspeed"
    assert (ident.rank, ident.local_rank, ident.world_size) == (6, 2, 8)
    assert (ident.local_world_size, ident.node_rank) == (4, 1)
    assert is_rank_process(DEEPSPEED)


def test_rank_copied_from_mpi_names_the_real_launcher() -> None:
    # deepspeed's MPI discovery copies OMPI_COMM_WORLD_RANK into RANK inside the process
    env = {**OPENMPI, "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4"}
    ident = identity_from_env(env)
    assert (ident.launcher, ident.rank, ident.world_size) == ("openmpi", 3, 4)


def test_lightning_subprocess_launcher() -> None:
    ident = identity_from_env(LIGHTNING)
    assert ident.launcher == "lightning"
    assert (ident.rank, ident.local_rank, ident.world_size, ident.node_rank) == (2, 2, 4, 0)
    assert is_rank_process(LIGHTNING)


def test_lightning_on_a_later_node_leaves_the_rank_to_the_process_group() -> None:
    ident = identity_from_env({**LIGHTNING, "NODE_RANK": "1", "WORLD_SIZE": "8"})
    assert (ident.launcher, ident.rank, ident.node_rank) == ("lightning", None, 1)


def test_no_launcher() -> None:
    ident = identity_from_env({})
    assert (ident.rank, ident.world_size, ident.launcher, ident.job_id) == (None, None, None, None)
    assert ident.pid == os.getpid()
    assert not is_rank_process({})


def test_garbage_values_become_none() -> None:
    env = {
        "RANK": "abc",
        "LOCAL_RANK": "-1",
        "WORLD_SIZE": "0",
        "LOCAL_WORLD_SIZE": "2.0",
        "GROUP_RANK": "\u00b3",  # a digit to str.isdigit, not to int()
        "TORCHELASTIC_RUN_ID": "",
    }
    ident = identity_from_env(env)
    assert ident.launcher == "torchrun"
    assert ident.rank is ident.local_rank is ident.world_size is None
    assert ident.local_world_size is ident.node_rank is ident.job_id is None
    assert is_rank_process(env)  # a rank variable is present, even if unreadable


def test_whitespace_around_numbers_is_accepted() -> None:
    assert identity_from_env({"RANK": " 2 ", "WORLD_SIZE": "4\n"}).rank == 2


KEYS = sorted({*TORCHRUN, *SLURM_STEP, *OPENMPI, *MPICH, *DEEPSPEED, *LIGHTNING})


@given(st.dictionaries(st.sampled_from(KEYS), st.text(max_size=12)))
def test_any_environment_gives_an_identity_without_raising(env: dict[str, str]) -> None:
    ident = identity_from_env(env)
    for value in (ident.rank, ident.local_rank, ident.node_rank):
        assert value is None or value >= 0
    for value in (ident.world_size, ident.local_world_size):
        assert value is None or value > 0
    assert isinstance(is_rank_process(env), bool)
    Identity(v=1, rank=ident.rank or 0, t=0.0, **ident.as_fields())  # always a valid message


def test_as_fields_feeds_the_protocol() -> None:
    ident = identity_from_env(TORCHRUN)
    fields = ident.as_fields()
    assert set(fields) <= set(Identity.__struct_fields__)
    assert "rank" not in fields  # the message header's field, passed separately
    covered = set(RankIdentity.__dataclass_fields__) - {"rank"}
    assert set(fields) == covered
    sample = Sample(v=1, rank=ident.rank or 0, t=1.0, **fields)
    decoded = decode(encode(sample))
    assert isinstance(decoded, Sample)
    assert (decoded.rank, decoded.local_rank, decoded.launcher) == (5, 1, "torchrun")


def test_refresh_from_torch_without_a_process_group_keeps_the_identity() -> None:
    ident = identity_from_env(TORCHRUN)
    assert refresh_from_torch(ident) == ident


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_refresh_from_torch_with_a_real_gloo_group() -> None:
    import torch.distributed as dist

    port = _free_port()
    ident = identity_from_env({})  # e.g. mp.spawn: nothing in the environment
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        refreshed = refresh_from_torch(ident)
    finally:
        dist.destroy_process_group()
    assert (refreshed.rank, refreshed.world_size, refreshed.backend) == (0, 1, "gloo")
    assert refreshed.torch_version
    assert ident.rank is None  # a new identity; the old one is untouched
    assert refresh_from_torch(ident) is ident  # destroyed: nothing to read


def test_identity_and_probes_without_torch_installed() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        from importlib import metadata

        sys.modules["torch"] = None  # import torch now raises ImportError
        real_version = metadata.version

        def version(name):
            if name == "torch":
                raise metadata.PackageNotFoundError(name)
            return real_version(name)

        metadata.version = version
        from ddpwatch.agent.identity import identity_from_env, refresh_from_torch
        from ddpwatch.agent.probes import device_info, memory_info

        ident = refresh_from_torch(identity_from_env({"RANK": "1", "WORLD_SIZE": "2"}))
        device = device_info()
        print(json.dumps({
            "rank": ident.rank,
            "torch_version": ident.torch_version,
            "backend": ident.backend,
            "device": device.device,
            "memory": list(vars(memory_info(device)).values()),
        }))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["rank"] == 1
    assert out["torch_version"] is None and out["backend"] is None
    assert out["device"] == "cpu"
    assert out["memory"] == [None] * 6


def test_accelerate_launch_is_named() -> None:
    ident = identity_from_env({**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "no"})
    assert ident.launcher == "accelerate"
    assert (ident.rank, ident.local_rank, ident.world_size) == (5, 1, 8)


def test_the_rendezvous_of_a_torchrun_rank_from_its_command_line_and_run_id() -> None:
    from ddpwatch.agent.identity import torchrun_rendezvous

    uuid = {"TORCHELASTIC_RUN_ID": "82c9f893-fae5-45cd-9193-abc9a7e179b9"}
    torchrun = ["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node=2"]
    assert torchrun_rendezvous(uuid, [*torchrun, "train.py"]) == "standalone"
    assert torchrun_rendezvous({"TORCHELASTIC_RUN_ID": "none"}, [*torchrun, "t.py"]) == "static"
    assert torchrun_rendezvous(uuid, [*torchrun, "--standalone", "t.py"]) == "standalone"
    assert torchrun_rendezvous(uuid, [*torchrun, "--master-port", "29501", "t.py"]) == "static"
    c10d = [*torchrun, "--rdzv-backend=c10d", "--rdzv-endpoint=n0:29400", "--nnodes=2", "t.py"]
    assert torchrun_rendezvous({"TORCHELASTIC_RUN_ID": "job7"}, c10d) == "c10d"
    assert torchrun_rendezvous(uuid, ["python", "train.py"]) is None  # not torchrun's child


def _new_exit(known: list[int], status: dict[str, Any]) -> int | None:
    """The pid of a rank that exited with 0 and is none of ``known``."""
    ranks = status["ranks"]
    return next((r["pid"] for r in ranks if r["exit_code"] == 0 and r["pid"] not in known), None)


@pytest.mark.e2e
def test_a_torchrun_rank_tells_the_server_its_rendezvous(tmp_path: Any, live_server: Any) -> None:
    """Real torchrun: --standalone, one node without a port, and --master-port."""
    from conftest import free_port_pair

    script = tmp_path / "rank.py"
    script.write_text(
        "import time, torch.distributed as d, ddpwatch\n"
        "ddpwatch.attach(); d.init_process_group('gloo'); d.barrier(); time.sleep(1.5)\n"
        "d.destroy_process_group()\n"
    )
    env = {**os.environ, "DDPWATCH_ADDR": f"127.0.0.1:{live_server.port}", "OMP_NUM_THREADS": "1"}
    seen = []
    for options in (["--standalone"], [], [f"--master-port={free_port_pair()}"]):
        job = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", *options,
             str(script)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert job.returncode == 0, job.stderr[-2000:]
        pid = live_server.wait_for(partial(_new_exit, [p for p, _ in seen]), timeout=20)
        seen.append((pid, live_server.server.engine.state.ranks[0].rendezvous))
    assert [rendezvous for _, rendezvous in seen] == ["standalone", "standalone", "static"]


# ----------------------------------------------------------------------- the launch configuration


def test_the_rendezvous_environment_and_the_script_travel_with_the_identity(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    monkeypatch.setattr(sys, "argv", [str(script), "--lr", "0.1"])
    ident = identity_from_env(TORCHRUN)
    assert (ident.master_addr, ident.master_port, ident.run_id) == ("10.0.0.1", "29500", "job-42")
    assert ident.script == str(script)
    assert ident.script_hash == hashlib.sha256(b"print('hello')\n").hexdigest()[:16]
    assert ident.init_method is None  # known once the rank calls init_process_group
    fields = Hello(v=1, rank=5, t=0.0, **ident.as_fields())
    assert decode(encode(fields)).script_hash == ident.script_hash  # type: ignore[union-attr]


@pytest.mark.parametrize("argv0", ["-c", "", "/no/such/train.py"])
def test_no_script_where_the_interpreter_runs_none(
    argv0: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", [argv0])
    ident = identity_from_env({})
    assert (ident.script, ident.script_hash) == (None, None)


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({}, "env://"),
        ({"init_method": "env://"}, "env://"),
        ({"init_method": "tcp://10.0.0.1:23456?rank=3&world_size=8"}, "tcp://10.0.0.1:23456"),
        ({"init_method": "file:///shared/rdzv"}, "file:///shared/rdzv"),
        ({"store": object()}, "store"),
    ],
)
def test_init_method_as_the_rank_called_it(arguments: dict[str, Any], expected: str) -> None:
    assert init_method_of(arguments) == expected


def test_a_port_the_script_sets_before_init_is_the_one_read() -> None:
    """mp.spawn scripts set os.environ['MASTER_PORT'] in the child: env:// reads it then."""
    ident = identity_from_env({"MASTER_PORT": "29500"})
    read_rendezvous_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "12355"}, ident)
    assert (ident.master_addr, ident.master_port) == ("127.0.0.1", "12355")
    read_rendezvous_env({}, ident)  # unset later: what was read stays
    assert ident.master_port == "12355"
