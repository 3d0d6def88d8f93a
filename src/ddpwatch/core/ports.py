"""Ports and endpoints: where a rank sends (``resolve_endpoint``, the one reading of
``HOST``, ``HOST:PORT`` and ``tcp://HOST:PORT`` that the agent, ``ddpwatch run``, ``relay``,
``doctor`` and the ``--addr`` flags share), reading the port back out of an endpoint, and
finding a free port pair on loopback (the collector uses a port and the next one)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from ddpwatch.core.protocol import DEFAULT_PORT


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A port P, chosen by the OS, such that P and P+1 are free on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < 65535 and port_free(port + 1):
            return port
    raise RuntimeError("no free port pair on 127.0.0.1")


def pick_port(preferred: int = DEFAULT_PORT) -> int:
    """``preferred`` if it and the next port are free, else any free pair."""
    if port_free(preferred) and port_free(preferred + 1):
        return preferred
    return free_port_pair()


def named_port(addr: str) -> tuple[str, str] | None:
    """``HOST:PORT`` as (HOST, PORT as written); None when ``addr`` names no port: a bare host,
    IPv6 ones included (``::1``, ``[::1]``), whose last colon is part of the address."""
    host, sep, port = addr.rpartition(":")
    if not sep or host.endswith(":") or "]" in port:
        return None
    return host, port


def resolve_endpoint(addr: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The ZeroMQ endpoint a rank sends to: ``addr``, else ``$DDPWATCH_ADDR``, else
    ``$MASTER_ADDR`` (or 127.0.0.1); a ``tcp://`` one as given, a host without a numeric port
    on port 5599."""
    env = os.environ if environ is None else environ
    addr = addr or env.get("DDPWATCH_ADDR") or env.get("MASTER_ADDR") or "127.0.0.1"
    if addr.startswith("tcp://"):
        return addr
    named = named_port(addr)
    if named is None or not named[1].isdigit():
        return f"tcp://{addr}:{DEFAULT_PORT}"
    return f"tcp://{addr}"


def host_port(endpoint: str) -> tuple[str, int | None]:
    """``[tcp://]HOST:PORT`` as (HOST, PORT); (the rest, None) when it names no port."""
    rest = endpoint.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        return rest, None
    return host, int(port)
