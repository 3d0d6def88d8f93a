"""Ports: finding a free port pair on loopback (the collector uses a port and the next one),
and reading one out of a ``tcp://HOST:PORT`` endpoint."""

from __future__ import annotations

import socket

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


def host_port(endpoint: str) -> tuple[str, int | None]:
    """``[tcp://]HOST:PORT`` as (HOST, PORT); (the rest, None) when it names no port."""
    rest = endpoint.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        return rest, None
    return host, int(port)
