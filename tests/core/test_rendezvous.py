"""What torchrun does for its rendezvous, from its options (``core/rendezvous.py``): the cases
of torch 2.13's ``torch/distributed/run.py`` (checked for real: ``tests/doctor``)."""

from __future__ import annotations

from ddpwatch.core.rendezvous import (
    TorchrunOptions,
    is_generated_run_id,
    options_from,
    parse_torchrun,
    plan,
)


def test_torchruns_decision_from_its_options() -> None:
    one_node = TorchrunOptions()
    assert plan(one_node, True).kind == "standalone" and plan(one_node, True).port is None
    assert plan(one_node, False).port == 29500  # an older torchrun takes its default
    assert plan(TorchrunOptions(master_port=29501), True).port == 29501
    assert plan(TorchrunOptions(master_port=29501), True).kind == "static"
    assert plan(TorchrunOptions(nnodes="2"), True).port == 29500
    assert plan(TorchrunOptions(nnodes="1:4"), True).port == 29500
    assert plan(TorchrunOptions(standalone=True, master_port=29501), True).port is None
    c10d = TorchrunOptions(rdzv_backend="c10d", rdzv_endpoint="node0:29400", nnodes="2")
    assert (plan(c10d, True).kind, plan(c10d, True).port) == ("c10d", 29400)


def test_options_come_from_the_command_line_then_pet_variables_never_master_port() -> None:
    argv = ["/usr/bin/python3", "/venv/bin/torchrun", "--nproc-per-node", "2",
            "--max-restarts=1", "--rdzv_backend", "c10d", "--rdzv-endpoint=n0:29400",
            "train.py", "--standalone", "--master-port", "1"]  # fmt: skip
    values = parse_torchrun(argv)
    assert values == {"rdzv_backend": "c10d", "rdzv_endpoint": "n0:29400"}  # not the script's
    assert parse_torchrun(["python", "-m", "torch.distributed.run", "--standalone", "x.py"]) == {
        "standalone": True
    }
    assert parse_torchrun(["python", "train.py"]) is None
    env = {"PET_MASTER_PORT": "29600", "MASTER_PORT": "29700", "PET_NNODES": "2"}
    options = options_from({}, env)
    assert options.master_port == 29600 and options.max_nodes == 2
    assert options_from({}, {"MASTER_PORT": "29700"}).master_port is None
    assert options_from({"master_port": "29800"}, env).master_port == 29800


def test_a_run_id_torchrun_made_tells_a_rendezvous_on_a_free_port() -> None:
    assert is_generated_run_id("82c9f893-fae5-45cd-9193-abc9a7e179b9")  # seen: one node
    assert not is_generated_run_id("none")  # torchrun's default --rdzv-id, a static rendezvous
    assert not is_generated_run_id("my-job-7")
    assert not is_generated_run_id(None)
