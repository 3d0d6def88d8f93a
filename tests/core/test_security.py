"""CurveZMQ keys, encryption and authentication, over real sockets on 127.0.0.1."""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from conftest import ROOT, as_json, free_port_pair, poll_status, wait_listening

from ddpwatch.agent.publisher import Publisher
from ddpwatch.cli import fetch_status, main
from ddpwatch.core.protocol import Sample, encode
from ddpwatch.core.security import (
    CLIENT_KEY_FILE_ENV,
    SERVER_KEY_ENV,
    CurveKeyError,
    ServerCurve,
    apply_client_curve,
    client_curve_keys,
    generate_keys,
    is_loopback,
    load_key_file,
)
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.server.service import Server


class Running:
    """A real ``Server`` with CURVE on a background thread."""

    def __init__(self, port: int, curve: ServerCurve | None) -> None:
        self.port = port
        self.server = Server("127.0.0.1", port, Thresholds(), curve=curve)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def wait_for(self, predicate, timeout: float) -> dict[str, Any]:
        """The status document once ``predicate`` holds for it."""
        return poll_status(
            self.server, lambda status: status if predicate(status) else None, timeout
        )

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(5)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    _, server_secret, server_key = generate_keys(tmp_path / "server")
    _, client_secret, _ = generate_keys(tmp_path / "client", name="alice")
    _, stranger_secret, _ = generate_keys(tmp_path / "stranger", name="mallory")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "alice.key").write_bytes((tmp_path / "client" / "alice.key").read_bytes())
    return {
        "server_key": server_key,
        "server_secret": server_secret,
        "client_secret": client_secret,
        "stranger_secret": stranger_secret,
        "allowed": allowed,
    }


@pytest.fixture
def curve_server(keys: dict[str, Any]):
    running = Running(free_port_pair(), ServerCurve.from_files(keys["server_secret"]))
    yield running
    running.stop()


def frame(rank: int, step: int = 1) -> bytes:
    return encode(Sample(v=1, rank=rank, t=time.time(), world_size=4, step=step))


def push(port: int, frames: list[bytes], env: dict[str, str] | None, wait: float = 1.0) -> None:
    """Send from a PUSH socket configured from ``env`` (None: plain TCP); linger ``wait``."""
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, int(wait * 1000))
    if env is not None:
        assert apply_client_curve(sock, env)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for data in frames:
        with contextlib.suppress(zmq.Again):  # not connected (refused): queued nowhere
            sock.send(data, zmq.NOBLOCK)
    time.sleep(wait)
    sock.close()
    context.term()


# --------------------------------------------------------------------------- keygen


def test_keygen_writes_a_key_pair_with_a_private_secret(tmp_path: Path, capsys) -> None:
    target = tmp_path / "keys"
    assert main(["keygen", str(target)]) == 0
    out = capsys.readouterr().out
    secret, public = target / "ddpwatch.key_secret", target / "ddpwatch.key"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    public_key, none = load_key_file(public, secret=False)
    assert none is None and len(public_key) == 40
    assert load_key_file(secret, secret=True)[0] == public_key
    assert "secret-key" not in public.read_text()
    assert public_key.decode() in out
    assert f"export {SERVER_KEY_ENV}='{public_key.decode()}'" in out
    assert "--curve-secret-file" in out


def test_keygen_refuses_to_overwrite_unless_forced(tmp_path: Path, capsys) -> None:
    assert main(["keygen", str(tmp_path)]) == 0
    first = (tmp_path / "ddpwatch.key").read_text()
    assert main(["keygen", str(tmp_path)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "ddpwatch.key").read_text() == first
    assert main(["keygen", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "ddpwatch.key").read_text() != first
    assert stat.S_IMODE((tmp_path / "ddpwatch.key_secret").stat().st_mode) == 0o600


def test_keygen_secret_is_private_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        _, secret, _ = generate_keys(tmp_path, name="client")
    finally:
        os.umask(old)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_bad_keys_are_clear_errors(tmp_path: Path, keys: dict[str, Any]) -> None:
    with pytest.raises(CurveKeyError, match="40-character"):
        client_curve_keys({SERVER_KEY_ENV: "short"})
    with pytest.raises(CurveKeyError, match="Z85"):
        client_curve_keys({SERVER_KEY_ENV: "~" * 40})
    with pytest.raises(CurveKeyError, match="no secret key"):
        ServerCurve.from_files(tmp_path / "server" / "ddpwatch.key")
    with pytest.raises(CurveKeyError, match="cannot read"):
        ServerCurve.from_files(tmp_path / "missing.key_secret")
    (tmp_path / "junk").write_text("hello\n")
    with pytest.raises(CurveKeyError, match="not a ZeroMQ key file"):
        ServerCurve.from_files(tmp_path / "junk")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CurveKeyError, match="no client public keys"):
        ServerCurve.from_files(keys["server_secret"], empty)
    assert client_curve_keys({}) is None
    server, public, secret = client_curve_keys({SERVER_KEY_ENV: keys["server_key"]})
    assert server == keys["server_key"].encode() and len(public) == len(secret) == 40
    fixed = client_curve_keys(
        {SERVER_KEY_ENV: keys["server_key"], CLIENT_KEY_FILE_ENV: str(keys["client_secret"])}
    )
    assert fixed[1:] == load_key_file(keys["client_secret"], secret=True)


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "*", "10.0.0.1", "192.168.1.5", "localhost.example.com", "eth0"):
        assert not is_loopback(host), host


# --------------------------------------------------------------------------- encryption


def test_encrypted_publish_arrives(curve_server: Running, keys: dict[str, Any]) -> None:
    push(curve_server.port, [frame(0), frame(1)], {SERVER_KEY_ENV: keys["server_key"]})
    status = curve_server.wait_for(lambda s: s["stats"]["received"] == 2, 10)
    assert {r["rank"] for r in status["ranks"] if r["state"] != "not_connected"} == {0, 1}
    assert status["stats"]["refused"] == 0


@pytest.mark.parametrize("client", ["no key", "wrong server key"])
def test_unauthenticated_publishers_are_refused_and_counted(
    curve_server: Running, keys: dict[str, Any], client: str
) -> None:
    env = None if client == "no key" else {SERVER_KEY_ENV: stranger_key()}
    push(curve_server.port, [frame(0), frame(1)], env, wait=1.5)
    status = curve_server.wait_for(lambda s: s["stats"]["refused"] >= 1, 10)
    assert status["stats"]["received"] == 0 and status["stats"]["rejected"] == 0
    assert status["ranks"] == []  # its messages never arrived
    # an authenticated publisher still gets through afterwards
    push(curve_server.port, [frame(2)], {SERVER_KEY_ENV: keys["server_key"]})
    curve_server.wait_for(lambda s: s["stats"]["received"] == 1, 10)


def test_a_zmtp1_peer_cannot_slip_past_curve(curve_server: Running) -> None:
    """Legacy ZMTP 1.0 framing has no security handshake: a CURVE server must not take it."""
    message = frame(5)
    legacy = b"\x01\x00" + bytes([0xFF]) + struct.pack(">Q", len(message) + 1) + b"\x00" + message
    with socket.create_connection(("127.0.0.1", curve_server.port), timeout=2) as conn:
        conn.sendall(legacy)
        time.sleep(0.5)
    time.sleep(0.3)
    status = as_json(curve_server.server.status())
    assert status["stats"]["received"] == 0 and status["ranks"] == []
    assert curve_server.thread.is_alive()


def stranger_key() -> str:
    """A valid Z85 public key that belongs to no server here."""
    return zmq.curve_keypair()[0].decode()


def test_agent_publisher_encrypts_with_the_server_key(
    curve_server: Running, keys: dict[str, Any], monkeypatch
) -> None:
    monkeypatch.setenv(SERVER_KEY_ENV, keys["server_key"])
    beats = [0]

    def heartbeat():
        beats[0] += 1
        return [Sample(v=1, rank=3, t=time.time(), world_size=4, step=beats[0])]

    publisher = Publisher(f"tcp://127.0.0.1:{curve_server.port}", 0.1, heartbeat)
    publisher.start()
    try:
        status = curve_server.wait_for(lambda s: s["stats"]["received"] >= 3, 10)
    finally:
        publisher.stop()
    assert [r["rank"] for r in status["ranks"] if r["state"] != "not_connected"] == [3]
    assert status["stats"]["refused"] == 0


def test_agent_with_a_bad_key_degrades_to_not_publishing(
    curve_server: Running, monkeypatch, caplog
) -> None:
    monkeypatch.setenv(SERVER_KEY_ENV, "not-a-key")
    calls = [0]

    def heartbeat():
        calls[0] += 1
        return [Sample(v=1, rank=0, t=time.time(), step=1)]

    publisher = Publisher(f"tcp://127.0.0.1:{curve_server.port}", 0.05, heartbeat)
    with caplog.at_level(logging.WARNING, logger="ddpwatch"):
        publisher.start()
        started = time.monotonic()
        for step in range(1000):  # the training thread's calls never block or raise
            publisher.publish(Sample(v=1, rank=0, t=time.time(), step=step))
        publisher.flush(0.5)  # returns at once: nothing waits for a socket
        publisher.stop()
        assert time.monotonic() - started < 1.0
    faults = [r for r in caplog.records if "DDPWATCH_SERVER_KEY" in r.getMessage()]
    assert len(faults) == 1, caplog.text
    time.sleep(0.5)
    status = as_json(curve_server.server.status())
    assert status["stats"]["received"] == 0 and status["stats"]["refused"] == 0
    assert publisher.sent == 0


def test_status_query_needs_the_key(curve_server: Running, keys, monkeypatch, capsys) -> None:
    push(curve_server.port, [frame(0)], {SERVER_KEY_ENV: keys["server_key"]})
    curve_server.wait_for(lambda s: s["stats"]["received"] == 1, 10)
    monkeypatch.delenv(SERVER_KEY_ENV, raising=False)
    assert fetch_status("127.0.0.1", curve_server.port, 0.5) is None
    # the failed handshake reaches the collector through its monitor socket, in its own time
    curve_server.wait_for(lambda s: s["stats"]["refused"] >= 1, 10)
    monkeypatch.setenv(SERVER_KEY_ENV, keys["server_key"])
    assert main(["status", "--port", str(curve_server.port), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["stats"]["received"] == 1 and document["stats"]["refused"] >= 1
    monkeypatch.setenv(SERVER_KEY_ENV, stranger_key())
    assert main(["status", "--port", str(curve_server.port), "--timeout", "0.5"]) == 1
    assert "--curve-secret-file" in capsys.readouterr().err
    monkeypatch.setenv(SERVER_KEY_ENV, "bad")
    assert main(["status", "--port", str(curve_server.port)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "40-character" in err


def test_curve_clients_allows_only_listed_keys(keys: dict[str, Any]) -> None:
    running = Running(
        free_port_pair(), ServerCurve.from_files(keys["server_secret"], keys["allowed"])
    )
    try:
        alice = {
            SERVER_KEY_ENV: keys["server_key"],
            CLIENT_KEY_FILE_ENV: str(keys["client_secret"]),
        }
        mallory = {
            SERVER_KEY_ENV: keys["server_key"],
            CLIENT_KEY_FILE_ENV: str(keys["stranger_secret"]),
        }
        anyone = {SERVER_KEY_ENV: keys["server_key"]}  # ephemeral client key
        push(running.port, [frame(0)], alice)
        running.wait_for(lambda s: s["stats"]["received"] == 1, 10)
        for env in (mallory, anyone):
            before = as_json(running.server.status())["stats"]["refused"]
            push(running.port, [frame(1)], env, wait=1.0)
            running.wait_for(lambda s, b=before: s["stats"]["refused"] > b, 10)
        status = as_json(running.server.status())
        assert status["stats"]["received"] == 1
        assert [r["rank"] for r in status["ranks"] if r["state"] != "not_connected"] == [0]
    finally:
        running.stop()


# --------------------------------------------------------------------------- binding


def _serve(port: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(port), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip


def _stderr_after_start(proc: subprocess.Popen[str], port: int) -> str:
    wait_listening(port, proc)  # its imports took more than a fixed 1.5 s under load
    time.sleep(0.5)  # its signal handlers come just after its sockets
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    return err


def test_non_loopback_bind_without_key_warns_once(keys: dict[str, Any]) -> None:
    port = free_port_pair()
    err = _stderr_after_start(_serve(port, "--host", "0.0.0.0"), port)
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "without authentication" in warnings[0], err
    port = free_port_pair()
    secret = str(keys["server_secret"])
    err = _stderr_after_start(
        _serve(port, "--host", "0.0.0.0", "--curve-secret-file", secret), port
    )
    assert "warning" not in err, err
    port = free_port_pair()
    err = _stderr_after_start(_serve(port), port)
    assert "warning" not in err and "127.0.0.1" in err, err


def test_serve_with_a_bad_key_file_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "x.key_secret").write_text("nonsense\n")
    result = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(free_port_pair()),
         "--curve-secret-file", str(tmp_path / "x.key_secret")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "key file" in result.stderr


# --------------------------------------------------------------------------- read-only


def test_nothing_is_ever_unpickled() -> None:
    banned = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
    for path in (ROOT / "src" / "ddpwatch").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            assert not banned & set(names), f"{path}: imports {names}"
            if isinstance(node, ast.Attribute) and node.attr in ("recv_pyobj", "recv_serialized"):
                raise AssertionError(f"{path}: uses {node.attr}")


def test_query_endpoint_is_read_only() -> None:
    port = free_port_pair()
    running = Running(port, None)
    try:
        context = zmq.Context()
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port + 1}")
        for request in (frame(0), msgspec.msgpack.encode({"set": "world_size"}), b"status\x00x"):
            sock.send(request)
            assert sock.poll(2000)
            assert "error" in json.loads(sock.recv())
        sock.close()
        context.term()
        status = as_json(running.server.status())
        assert status["stats"] | {"lag_s": 0} == {
            "received": 0,
            "rejected": 0,
            "shed": 0,
            "failed": 0,
            "refused": 0,
            "lag_s": 0,
            "pace": 1,
        }
        assert status["ranks"] == []
    finally:
        running.stop()


def test_dashboard_client_uses_the_server_key(curve_server: Running, keys, monkeypatch) -> None:
    from ddpwatch.tui.app import run_client
    from ddpwatch.tui.data.sources import RemoteSource

    push(curve_server.port, [frame(0)], {SERVER_KEY_ENV: keys["server_key"]})
    curve_server.wait_for(lambda s: s["stats"]["received"] == 1, 10)
    monkeypatch.setenv(SERVER_KEY_ENV, keys["server_key"])
    source = RemoteSource("127.0.0.1", curve_server.port, 2.0)
    try:
        document = source.fetch()
    finally:
        source.close()
    assert document is not None and document.stats.received == 1
    monkeypatch.setenv(SERVER_KEY_ENV, "bad")
    assert run_client("127.0.0.1", curve_server.port) == 1  # a clear error, not a blank dashboard
