"""``ddpwatch run`` under every launcher the issue names, each run for real on this machine.

Open MPI, MPICH (Hydra), Slurm and ``munge`` come from Debian's packages, which
``.ci/run`` installs; there ``CI_REQUIRE_LAUNCHERS=1`` turns a missing launcher
into a failure instead of a skip. DeepSpeed and Accelerate come with the test extra.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import SCRIPTS, LiveServer, as_json, ddpwatch_run, free_port_pair
from slurm_cluster import SlurmCluster
from slurm_cluster import missing as slurm_missing

# a launcher's job takes 1-2 min alone, 2.5 min and more on a loaded machine (ddpwatch_run: 300 s)
pytestmark = [
    pytest.mark.launcher,
    pytest.mark.timeout(360),
    pytest.mark.xdist_group("launchers"),  # one test Slurm cluster, on one worker
]

PYTHON = sys.executable
REQUIRED = os.environ.get("CI_REQUIRE_LAUNCHERS") == "1"


def need(reason: str | None) -> None:
    if reason is None:
        return
    if REQUIRED:
        pytest.fail(f"CI_REQUIRE_LAUNCHERS=1 but {reason}")
    pytest.skip(reason)


def need_command(name: str, package: str) -> str:
    path = shutil.which(name)
    need(None if path else f"{name} is not installed (apt-get install {package})")
    return path or name


def check_ranks(
    server: LiveServer,
    result: subprocess.CompletedProcess[str],
    launcher: str,
    steps: int,
    logs: str = "",
) -> None:
    """The job succeeded; exactly ranks 0 and 1 reported, each attached from interpreter start
    (its output from before ``init_process_group`` is in its log tail), each finished."""
    assert result.returncode == 0, result.stdout + result.stderr + logs
    status = as_json(server.server.status())
    ranks = {r["rank"]: r for r in status["ranks"]}
    assert set(ranks) == {0, 1}, status["ranks"]
    for number, rank in ranks.items():
        assert (rank["launcher"], rank["world_size"], rank["local_rank"]) == (launcher, 2, number)
        assert rank["step"] == steps and rank["state"] == "exited", rank
        assert any("loading data" in line for line in rank["log_tail"]), rank["log_tail"]
        phases = [name for name, _ in server.server.state.ranks[number].phases]
        assert "rendezvous" in phases and "first_step" in phases, phases
        assert phases.index("rendezvous") < phases.index("first_step"), phases
    assert status["alerts"] == []


def test_run_under_open_mpi(live_server: LiveServer) -> None:
    mpirun = need_command("mpirun.openmpi", "openmpi-bin")
    result = ddpwatch_run(
        live_server, mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
        PYTHON, str(SCRIPTS / "launcher_variables.py"), str(free_port_pair()),
    )  # fmt: skip
    check_ranks(live_server, result, "openmpi", steps=20)


def test_run_under_mpich_hydra(live_server: LiveServer) -> None:
    mpiexec = need_command("mpiexec.hydra", "mpich")
    result = ddpwatch_run(
        live_server, mpiexec, "-n", "2",
        PYTHON, str(SCRIPTS / "launcher_variables.py"), str(free_port_pair()),
    )  # fmt: skip
    check_ranks(live_server, result, "mpich", steps=20)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    need(slurm_missing())
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except Exception as exc:
        cluster.stop()
        need(f"the test Slurm cluster did not start: {exc}")
    yield cluster
    cluster.stop()


def test_run_under_srun(live_server: LiveServer, slurm: SlurmCluster) -> None:
    result = ddpwatch_run(
        live_server, "srun", "--ntasks=2", "--overcommit",
        PYTHON, str(SCRIPTS / "launcher_variables.py"), str(free_port_pair()),
        env=slurm.env,
    )  # fmt: skip
    check_ranks(live_server, result, "slurm", steps=20, logs=slurm.log())


def test_run_srun_then_torchrun_reports_the_ranks_not_the_torchrun_agent(
    live_server: LiveServer, slurm: SlurmCluster
) -> None:
    """The torchrun process carries SLURM_PROCID=0 from its step, but only its children are ranks."""
    result = ddpwatch_run(
        live_server, "srun", "--ntasks=1",
        PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={free_port_pair()}", str(SCRIPTS / "unmodified.py"),
        env=slurm.env,
    )  # fmt: skip
    check_ranks(live_server, result, "torchrun", steps=48, logs=slurm.log())


def test_run_under_the_deepspeed_launcher(live_server: LiveServer) -> None:
    deepspeed = need_command("deepspeed", "deepspeed (the test extra)")
    result = ddpwatch_run(
        live_server, deepspeed,
        "--num_gpus=2", f"--master_port={free_port_pair()}", str(SCRIPTS / "unmodified.py"),
    )  # fmt: skip
    check_ranks(live_server, result, "deepspeed", steps=48)


def test_run_under_accelerate_launch(live_server: LiveServer) -> None:
    accelerate = need_command("accelerate", "accelerate (the test extra)")
    result = ddpwatch_run(
        live_server, accelerate, "launch", "--multi_gpu", "--num_processes=2",
        "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
        f"--main_process_port={free_port_pair()}", str(SCRIPTS / "unmodified.py"),
    )  # fmt: skip
    check_ranks(live_server, result, "accelerate", steps=48)
