"""End to end: a real torchrun job whose loss is compiled with torch.compile (issue #32)."""

from __future__ import annotations

from conftest import SCRIPTS, LiveServer


def test_compiling_ranks_are_not_stalled_and_a_lone_recompile_is_the_straggler(
    live_server: LiveServer, jobs
) -> None:
    """Every rank compiles for 6 s at step 1 (its forward counted it; over the 4 s stall
    threshold): no ``stalled`` alert (before #32: "rank 1 has made no progress for 4.0 s at
    step 1"; checked by turning ``is_compiling`` off). At
    step 20 rank 1 alone recompiles (its batch is one short) while rank 0 waits in DDP's
    all-reduce: the straggler is rank 1, compiling, for the reason torch gives."""
    args = ["--compile-s", "6", "--recompile-at", "20", "--rank", "1"]
    job = jobs(str(SCRIPTS / "compiled_loss.py"), 2, args, live_server.port)
    rc, out = job.wait(150)
    assert rc == 0, out
    assert live_server.raised("stalled") == []
    stragglers = live_server.raised("straggler")
    late = [a for a in stragglers if "recompiles" in a["message"]]
    assert late, stragglers
    assert late[0]["ranks"] == [1] and late[0]["waiting"] == [0]
    assert (
        "it is compiling (torch.compile recompiles: tensor 'out' size mismatch"
        in (late[0]["message"])
    )
    assert "expected 32, actual 31" in late[0]["message"]
    ranks = live_server.server.state.ranks
    for r in (0, 1):
        assert "compiling" in [name for name, _ in ranks[r].phases], ranks[r].phases
