"""Why a job never started (``launch_failure.py``), in the launcher's own words.

The texts in ``launcher_output/`` are real: recorded from torch 2.13's torchrun on this kind of
machine (CPU, gloo), each by the command named in ``RECORDED`` below.
"""

from __future__ import annotations

import pytest
from conftest import TESTS

from ddpwatch.jobs.failure import not_started_reason, why_not_started

OUTPUT = TESTS / "launcher_output"

# fixture: (the command that printed it, what the reason must say)
RECORDED: dict[str, tuple[str, list[str]]] = {
    "torchrun_missing_script.txt": (
        "torchrun --nproc-per-node 2 missing.py",
        ["the script /tmp/lf/missing.py was not found", "check its path"],
    ),
    "torchrun_port_in_use.txt": (
        "torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port P ok.py, "
        "with P held by python -c 'socket.bind(...); listen(); sleep(60)'",
        [
            "port 56825 is already in use on this node by pid 4242 (python3 holder.py)",
            "--master-port",
        ],
    ),
    "torchrun_unrecognized_argument.txt": (
        "torchrun --nproc-per-node 2 --bogus-flag ok.py",
        [
            "torchrun did not accept its arguments (unrecognized arguments: --bogus-flag)",
            "torchrun --help",
        ],
    ),
    "torchrun_module_not_found.txt": (
        "torchrun --nproc-per-node 2 badimport.py (import no_such_module_for_ddpwatch, line 2)",
        [
            "the import at /tmp/lf/badimport.py, line 2, failed: No module named "
            "'no_such_module_for_ddpwatch'",
            "install it",
        ],
    ),
    "torchrun_cannot_import_name.txt": (
        "torchrun --nproc-per-node 1 badname.py (from os import no_such_name)",
        ["the import at /tmp/lf/badname.py, line 1, failed: cannot import name 'no_such_name'"],
    ),
    "torchrun_missing_module.txt": (
        "torchrun --nproc-per-node 2 -m nosuchmodule_ddpw",
        ["the module nosuchmodule_ddpw (python -m nosuchmodule_ddpw) was not found"],
    ),
    "torchrun_master_unreachable.txt": (
        "torchrun --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port P "
        "--rdzv-conf timeout=5 ok.py, nothing on P",
        [
            "the rendezvous at 127.0.0.1:34611 could not be reached (gave up after 5 s)",
            "start the master node",
        ],
    ),
    "rank_store_unreachable.txt": (
        "torchrun --nproc-per-node 1 refused.py: init_process_group(init_method="
        "'tcp://127.0.0.1:P', rank=1, world_size=2, timeout=3 s), nothing on P",
        ["the rendezvous at 127.0.0.1:55863 could not be reached (gave up after 3 s)"],
    ),
    "torchrun_rendezvous_timeout.txt": (
        "torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint "
        "127.0.0.2:P --rdzv-conf read_timeout=5,join_timeout=5 ok.py (one node of two)",
        ["the rendezvous timed out before enough nodes joined", "--nnodes"],
    ),
    "gloo_connect_timeout.txt": (
        "torchrun --nproc-per-node 2 gloo_refused.py: rank 0's store hands gloo a closed "
        "port for rank 1's address",
        [
            "the ranks could not connect to one another (gloo connectFullMesh: Connect timeout",
            "GLOO_SOCKET_IFNAME",
        ],
    ),
    "torchrun_bad_nnodes.txt": (
        "torchrun --nproc_per_node 2 --nnodes x ok.py",
        ["the launcher failed: ValueError: invalid literal for int() with base 10: 'x'"],
    ),
}


def recorded(name: str) -> list[str]:
    return (OUTPUT / name).read_text().splitlines()


def test_every_recorded_launcher_text_has_its_case() -> None:
    assert {p.name for p in OUTPUT.glob("*.txt")} == set(RECORDED)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_each_recorded_failure_is_told_with_its_fix(name: str) -> None:
    reason = why_not_started(recorded(name), holder_of=lambda port: "pid 4242 (python3 holder.py)")
    assert reason is not None
    for part in RECORDED[name][1]:
        assert part in reason, reason
    assert "\n" not in reason


def test_a_port_whose_holder_cannot_be_told_says_how_to_find_it() -> None:
    reason = why_not_started(recorded("torchrun_port_in_use.txt"), holder_of=lambda port: None)
    assert reason is not None and "port 56825 is already in use on this node, " in reason
    assert "ss -ltnp 'sport = :56825'" in reason


def test_texts_of_other_torch_versions_and_public_reports() -> None:
    # torch 2.0-2.2's c10d bind error; gloo's refusal as public reports quote it (a hostname
    # that /etc/hosts maps to 127.0.1.1); a c10d client refused outright
    older = (
        "RuntimeError: The server socket has failed to listen on any local network address. "
        "The server socket has failed to bind to [::]:29500 (errno: 98 - Address already in use)."
    )
    assert "port 29500 is already in use" in (why_not_started([older]) or "")
    gloo = (
        "RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/"
        "tcp/pair.cc:144] Connection refused, remote=[127.0.1.1]:17308"
    )
    reason = why_not_started([gloo]) or ""
    assert "Connection refused" in reason and "127.0.1.1 is a loopback address" in reason
    client = (
        "torch.distributed.DistNetworkError: The client socket has failed to connect to "
        "[node1]:29500 (errno: 111 - Connection refused)."
    )
    assert "the rendezvous was refused at node1:29500" in (why_not_started([client]) or "")


def test_what_is_not_a_reason() -> None:
    # torchrun's own store ignoring a bind error (TORCHELASTIC_USE_AGENT_STORE) is not a port
    # in use; a usage-like line without argparse's usage block is not an argument error
    ignored = (
        "[E1126 10:21:15.805052225 TCPStore.cpp:277] [c10d] The server socket on 46309 has "
        "failed to bind. TORCHELASTIC_USE_AGENT_STORE is enabled so ignoring the error."
    )
    assert why_not_started([ignored, "main: error: disk full"]) is None
    assert why_not_started([]) is None


def test_with_no_known_reason_the_exit_and_last_line_are_said() -> None:
    lines = ["starting", "\x1b[31mno such dataset: /data/imagenet\x1b[0m", "", "  "]
    assert not_started_reason(lines, 3) == (
        "the launcher exited with code 3; its last line: no such dataset: /data/imagenet"
    )
    assert not_started_reason([], 1) == "the launcher exited with code 1 and printed nothing"
    assert not_started_reason(["x"], -9) == "the launcher was killed by SIGKILL; its last line: x"
    # torchrun's report names the root cause when no traceback does
    report = ["Root Cause (first observed failure):", "[0]:", "  time      : 2026",
              "  rank      : 0 (local_rank: 0)", "  exitcode  : 3 (pid: 17)",
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]  # fmt: skip
    assert not_started_reason(report, 1) == (
        "rank 0 exited with code 3 before it reported (see its output)"
    )
