"""``port_holder``: the process that holds a port, named from ``/proc`` — a real listener held by
a real subprocess, and made-up ``/proc`` trees for what this machine cannot stage (another
user's socket, an unreadable process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddpwatch.core.port_holder import Holder, find_holder, holder_of, sockets_on
from ddpwatch.core.ports import free_port_pair

pytestmark = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp"
)

HEADER = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
    "timeout inode\n"
)


def row(port: int, state: str, uid: int, inode: int, local: str = "0100007F") -> str:
    return (
        f"   0: {local}:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 "
        f"00000000  {uid:>5}        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )


def test_a_real_listener_is_named_by_pid_and_command(
    http_server: tuple[subprocess.Popen[bytes], int],
) -> None:
    process, port = http_server
    program = os.path.basename(sys.executable)
    assert holder_of(port) == (
        f"pid {process.pid} ({program} -m http.server {port} --bind 127.0.0.1)"
    )
    holder = find_holder(port)
    assert holder is not None and holder.pids == (process.pid,)


def test_a_free_port_has_no_holder() -> None:
    port = free_port_pair()
    assert holder_of(port) is None
    with socket.create_server(("127.0.0.1", port)):
        pass  # closed at once: TIME_WAIT at most, which binds again and is held by no one
    assert holder_of(port) is None


def test_a_listener_of_this_process_is_found_among_its_connections() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            holder = find_holder(port)
    assert holder is not None and holder.pids == (os.getpid(),)


def fake_proc(root: Path, tcp: str = "", tcp6: str = "") -> Path:
    (root / "net").mkdir(parents=True)
    (root / "net" / "tcp").write_text(HEADER + tcp)
    (root / "net" / "tcp6").write_text(HEADER + tcp6)
    return root


def fake_process(proc: Path, pid: int, inode: int, argv: list[str], comm: str = "") -> None:
    fd = proc / str(pid) / "fd"
    fd.mkdir(parents=True)
    (fd / "0").symlink_to("/dev/null")
    (fd / "3").symlink_to(f"socket:[{inode}]")
    (proc / str(pid) / "cmdline").write_text("".join(f"{arg}\0" for arg in argv))
    (proc / str(pid) / "comm").write_text(comm + "\n")


def test_the_listening_socket_is_matched_by_inode(tmp_path: Path) -> None:
    me = os.getuid()
    proc = fake_proc(
        tmp_path,
        tcp=row(29500, "01", me, 111) + row(29501, "0A", me, 222) + row(29500, "06", me, 0),
        tcp6=row(29500, "0A", me, 333, local="00000000000000000000000000000000"),
    )
    fake_process(proc, 40, 111, ["python3", "client.py"])
    fake_process(proc, 1234, 333, ["/usr/bin/python3", "-m", "torch.distributed.run", "x.py"])
    fake_process(proc, 1240, 333, ["/usr/bin/python3", "-u", "x.py"])  # a worker inherited it
    assert holder_of(29500, proc) == (
        "pid 1234 (python3 -m torch.distributed.run x.py) and 1 other process"
    )
    assert holder_of(29502, proc) is None


def test_a_long_command_and_one_without_arguments(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, tcp=row(8080, "0A", os.getuid(), 7) + row(8081, "0A", 0, 8))
    fake_process(proc, 99, 7, ["python3", "-c", "x" * 200])
    fake_process(proc, 100, 8, [], comm="kworker/0:1")
    text = holder_of(8080, proc)
    assert text is not None and text.startswith("pid 99 (python3 -c xxx") and text.endswith("...)")
    assert len(text) == len("pid 99 ()") + 100
    assert holder_of(8081, proc) == "pid 100 ([kworker/0:1])"


def test_another_users_socket_and_an_unknown_one(tmp_path: Path) -> None:
    """Another user's ``/proc/<pid>/fd`` cannot be read, so no pid holds the inode here: the
    socket's uid still tells whose process it is."""
    other = os.getuid() + 4242
    proc = fake_proc(
        tmp_path, tcp=row(29500, "0A", other, 555), tcp6=row(29600, "0A", os.getuid(), 6)
    )
    (proc / "77" / "fd").mkdir(parents=True)
    (proc / "77" / "fd").chmod(0)  # unreadable, as another user's would be
    try:
        assert find_holder(29500, proc) == Holder(other, own_uid=os.getuid())
        assert holder_of(29500, proc) in (
            f"another user's process (uid {other})",
            *(f"another user's process ({name}, uid {other})" for name in _names(other)),
        )
        assert holder_of(29600, proc) == (
            "an unknown process (none readable in /proc here holds it)"
        )
    finally:
        (proc / "77" / "fd").chmod(0o700)


def _names(uid: int) -> list[str]:
    import pwd

    try:
        return [pwd.getpwuid(uid).pw_name]
    except KeyError:
        return []


def test_sockets_on_reads_ports_in_hex_and_skips_junk() -> None:
    table = HEADER + row(80, "0A", 0, 9) + "garbage line\n" + row(0x1F90, "0A", 1, 10)
    assert [s.inode for s in sockets_on(table, 8080)] == [10]
    assert sockets_on(table, 81) == []
