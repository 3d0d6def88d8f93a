"""One reading of where a rank sends (``core/ports.py``): ``resolve_endpoint`` for the agent,
``ddpwatch run``, ``relay`` and ``doctor``, and the ``--addr`` flag that checks the same port
the ranks will use."""

from __future__ import annotations

import argparse

import pytest

from ddpwatch.commands._args import _addr
from ddpwatch.core.ports import host_port, named_port, resolve_endpoint


@pytest.mark.parametrize(
    ("addr", "endpoint"),
    [
        ("node1", "tcp://node1:5599"),
        ("node1:7000", "tcp://node1:7000"),
        ("[::1]:7000", "tcp://[::1]:7000"),
        ("[::1]", "tcp://[::1]:5599"),
        ("::1", "tcp://::1:5599"),  # the last colon belongs to the address
        ("fe80::1", "tcp://fe80::1:5599"),
        ("node1:abc", "tcp://node1:abc:5599"),  # not a port: the whole is the host
        ("tcp://node1", "tcp://node1"),  # a ZeroMQ endpoint is taken as given
    ],
)
def test_an_address_as_the_ranks_read_it(addr: str, endpoint: str) -> None:
    assert resolve_endpoint(addr, {}) == endpoint


def test_the_environment_in_order() -> None:
    env = {"DDPWATCH_ADDR": "10.0.0.5:6000", "MASTER_ADDR": "master"}
    assert resolve_endpoint(None, env) == "tcp://10.0.0.5:6000"
    assert resolve_endpoint(None, {"MASTER_ADDR": "master"}) == "tcp://master:5599"
    assert resolve_endpoint(None, {}) == "tcp://127.0.0.1:5599"


@pytest.mark.parametrize("addr", ["node1:7000", "tcp://[::1]:6000", "node1", "[fe80::1]", "::1"])
def test_the_flag_checks_the_port_the_ranks_will_use(addr: str) -> None:
    """What ``--addr`` accepts, the ranks read to the same host and port."""
    assert _addr(addr) == addr
    given = addr.removeprefix("tcp://")
    named = named_port(given)
    expected = (named[0], int(named[1])) if named else (given, 5599)
    assert host_port(resolve_endpoint(addr, {})) == expected


@pytest.mark.parametrize("addr", ["node1:0", "node1:65535", "tcp://node1:x"])
def test_the_flag_refuses_a_port_the_ranks_could_not_use(addr: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="the port must"):
        _addr(addr)
