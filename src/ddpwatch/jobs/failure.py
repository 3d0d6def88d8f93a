"""Why a job never started, in the launcher's own words: one plain sentence with the fix.

``ddpwatch run`` keeps the last lines the job printed (``jobs/output.py``); when the launcher
ends before any rank reported, ``why_not_started`` reads them. Pure: text in, text out
(``holder_of``, which names the process on a port, is passed in).

The texts matched are torchrun's, Python's and c10d/gloo's own, as recorded from real runs in
``tests/launcher_output/`` (torch 2.13); each matcher names what it reads.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Sequence

MAX_SHOWN = 160  # characters of a quoted line

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07")

# c10d: "The server socket has failed to listen on any local network address. port: 29500,
# useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"; older
# torch: "... failed to bind to [::]:29500 (errno: 98 - Address already in use)"
_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
_IN_USE_PORT = re.compile(r"\bport:? (\d+)|:(\d+) \(errno: 98")
# Python: "/usr/bin/python3: can't open file '/x/train.py': [Errno 2] No such file or directory"
_CANT_OPEN = re.compile(r"can't open file '(.+)': \[Errno (\d+)\] (.+)")
# Python: "/usr/bin/python3: No module named mypkg.train" (python -m, the module itself)
_NO_MAIN_MODULE = re.compile(r"^\S*python[\d.]*: No module named (\S+)")
# argparse: "usage: torchrun [-h] ...", then "torchrun: error: unrecognized arguments: --x"
_USAGE_ERROR = re.compile(r"^([\w.\-]+): error: (.+)$")
# a traceback's last line: "ModuleNotFoundError: No module named 'foo'"
_IMPORT_ERROR = re.compile(r"^(ModuleNotFoundError|ImportError): (.+)$")
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+)')
# gloo: "Gloo connectFullMesh failed with [.../pair.h:311] Connect timeout [none]",
# "... failed with [...] Connection refused, remote=[127.0.1.1]:17308"
_FULL_MESH = re.compile(r"Gloo connectFullMesh failed with (?:\[[^\]]*\] ?)?(.*)")
_LOOPBACK_REMOTE = re.compile(r"remote=\[(127\.[\d.]+)\]")
# c10d TCPStore client: "The client socket has timed out after 5000ms while trying to connect
# to (127.0.0.1, 34611)."; "... has failed to connect to [host]:29500 (errno: 111 - Connection
# refused)"
_STORE_TIMEOUT = re.compile(
    r"client socket has timed out after (\d+)ms while trying to connect to \(([^,]+), (\d+)\)"
)
_REFUSED = re.compile(r"Connection refused|ECONNREFUSED", re.IGNORECASE)
_ENDPOINT = (  # "[node1]:29500 (errno", "(127.0.0.1, 29500)"
    re.compile(r"\[?([\w.\-:]+?)\]?:(\d+) \(errno"),
    re.compile(r"\(([\w.\-]+), (\d+)\)"),
)
_RDZV_TIMEOUT = re.compile(r"\bRendezvousTimeoutError\b")
_RDZV_CONNECTION = re.compile(r"\bRendezvousConnectionError\b:? ?(.*)")
# torchrun's failure report: "Root Cause (first observed failure):", then "rank      : 0
# (local_rank: 0)" and "exitcode  : 2 (pid: 5396)"
_ROOT_RANK = re.compile(r"^\s*rank\s*: (\d+)")
_ROOT_CODE = re.compile(r"^\s*exitcode\s*: (-?\d+)")
# any traceback's last line, e.g. "torch.distributed.DistNetworkError: ..."
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception))\b:?\s*(.*)$")
_WRAPPERS = frozenset({"ChildFailedError"})  # torchrun's "a child failed": says nothing itself


def clean(lines: Sequence[str]) -> list[str]:
    """The lines as a terminal shows them: no colour codes, only what follows the last
    carriage return (a progress bar's last state), no line ends."""
    shown = []
    for line in lines:
        text = _ANSI.sub("", line).rstrip("\r\n")
        parts = [part for part in text.split("\r") if part.strip()]
        shown.append(parts[-1] if parts else "")
    return shown


def why_not_started(
    lines: Sequence[str], holder_of: Callable[[int], str | None] | None = None
) -> str | None:
    """Why the job did not start, from the launcher's last output ``lines``, as one sentence
    with the fix; None when they say nothing known. ``holder_of(port)``: which process holds a
    port on this node ("pid 1234 (python3 ...)"), where that can be told."""
    text = clean(lines)
    for reason in _REASONS:
        found = reason(text, holder_of)
        if found is not None:
            return found
    return None


def not_started_reason(
    lines: Sequence[str],
    returncode: int,
    holder_of: Callable[[int], str | None] | None = None,
) -> str:
    """``why_not_started``, or else what is certain: how the launcher ended and its last line."""
    found = why_not_started(lines, holder_of)
    if found is not None:
        return found
    ended = _ended(returncode)
    last = next((line.strip() for line in reversed(clean(lines)) if line.strip()), None)
    if last is None:
        return f"the launcher {ended} and printed nothing"
    return f"the launcher {ended}; its last line: {_short(last)}"


def _ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _short(text: str) -> str:
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 1] + "…"


Reason = Callable[[list[str], Callable[[int], str | None] | None], str | None]


def _usage_error(lines: list[str], _: object) -> str | None:
    """argparse refused the command line (torchrun's own, or the script's before init)."""
    if not any(line.startswith("usage:") for line in lines):
        return None
    for line in reversed(lines):
        found = _USAGE_ERROR.match(line)
        if found:
            program, error = found.groups()
            return (
                f"{program} did not accept its arguments ({_short(error)}): "
                f"fix the command line (see {program} --help)"
            )
    return None


def _port_in_use(lines: list[str], holder_of: Callable[[int], str | None] | None) -> str | None:
    """The rendezvous store (torchrun's, or rank 0's TCPStore) could not listen: EADDRINUSE."""
    for line in lines:
        if not _IN_USE.search(line):
            continue
        numbers = _IN_USE_PORT.search(line)
        if numbers is None:
            return (
                f"an address the job listens on is already in use ({_short(line.strip())}): "
                "stop the process that holds it, or choose another port "
                "(torchrun --master-port, or MASTER_PORT)"
            )
        port = int(numbers.group(1) or numbers.group(2))
        holder = holder_of(port) if holder_of is not None else None
        by = f" by {holder}" if holder else ""
        find = "" if holder else f" (to see which process holds it: ss -ltnp 'sport = :{port}')"
        return (
            f"port {port} is already in use on this node{by}, so the rendezvous store could "
            f"not listen there{find}: stop that process or choose a free port "
            "(torchrun --master-port or MASTER_PORT; torchrun --standalone picks one on a "
            "single node)"
        )
    return None


def _script_not_found(lines: list[str], _: object) -> str | None:
    """Python could not open the script it was given (torchrun starts ``python SCRIPT``)."""
    for line in lines:
        found = _CANT_OPEN.search(line)
        if found:
            path, errno, why = found.groups()
            if errno == "2":
                return f"the script {path} was not found: check its path"
            return f"the script {path} could not be opened ({why}): check its permissions"
    for line in lines:
        found = _NO_MAIN_MODULE.search(line)
        if found:
            module = found.group(1)
            return (
                f"the module {module} (python -m {module}) was not found: check its name, "
                "the working directory and the job's Python environment"
            )
    return None


def _import_failed(lines: list[str], _: object) -> str | None:
    """The script raised ImportError while importing, before any rank reported."""
    for index, line in enumerate(lines):
        found = _IMPORT_ERROR.match(line)
        if not found:
            continue
        kind, message = found.groups()
        where = "an import"
        for before in reversed(lines[max(0, index - 40) : index]):
            frame = _FRAME.match(before)
            if frame:  # the innermost frame: the import statement that failed
                where = f"the import at {frame.group(1)}, line {frame.group(2)},"
                break
        fix = (
            "install it in the job's Python environment"
            if kind == "ModuleNotFoundError"
            else "fix the import, or install the version that has it"
        )
        return f"{where} failed: {_short(message)}: {fix}"
    return None


def _ranks_unreachable(lines: list[str], _: object) -> str | None:
    """gloo's ranks could not connect to one another (``connectFullMesh``)."""
    for line in lines:
        found = _FULL_MESH.search(line)
        if not found:
            continue
        what = found.group(1).strip() or "no detail"
        loopback = _LOOPBACK_REMOTE.search(line)
        hint = (
            f"; {loopback.group(1)} is a loopback address: the node's hostname resolves to it "
            "(/etc/hosts)"
            if loopback
            else ""
        )
        return (
            f"the ranks could not connect to one another (gloo connectFullMesh: "
            f"{_short(what)}){hint}: every node must reach the others on the address its "
            "hostname resolves to; set GLOO_SOCKET_IFNAME to the interface they share"
        )
    return None


def _store_unreachable(lines: list[str], _: object) -> str | None:
    """A TCPStore client (a rank, or torchrun on a node other than the master) found nothing
    listening at the rendezvous address, and gave up."""
    fix = (
        "start the master node (node rank 0) first and check --master-addr/--master-port "
        "(MASTER_ADDR/MASTER_PORT), and that no firewall is in the way"
    )
    for line in lines:
        found = _STORE_TIMEOUT.search(line)
        if found:
            ms, host, port = found.groups()
            return (
                f"the rendezvous at {host}:{port} could not be reached (gave up after "
                f"{int(ms) / 1000:g} s): {fix}"
            )
    for line in lines:
        if _REFUSED.search(line):
            endpoints = (pattern.search(line) for pattern in _ENDPOINT)
            endpoint = next((found for found in endpoints if found), None)
            at = f" at {endpoint.group(1)}:{endpoint.group(2)}" if endpoint else ""
            return f"the rendezvous was refused{at} (nothing listened there): {fix}"
    return None


def _rendezvous_failed(lines: list[str], _: object) -> str | None:
    """torchrun's elastic rendezvous (``--rdzv-backend c10d``) ended without a world."""
    for line in lines:
        if _RDZV_TIMEOUT.search(line):
            return (
                "the rendezvous timed out before enough nodes joined: start every node "
                "(--nnodes) with the same --rdzv-endpoint and --rdzv-id"
            )
        found = _RDZV_CONNECTION.search(line)
        if found:
            detail = f" ({_short(found.group(1).strip())})" if found.group(1).strip() else ""
            return (
                f"the rendezvous backend could not be reached{detail}: check --rdzv-endpoint, "
                "and that the node hosting it runs"
            )
    return None


def _last_error(lines: list[str], _: object) -> str | None:
    """The last error a traceback ended with, else the rank torchrun names as the root cause."""
    for line in reversed(lines):
        found = _ERROR_LINE.match(line.strip())
        if found and found.group(1) not in _WRAPPERS and line[:1] not in " \t":
            kind, message = found.groups()
            said = f"{kind}: {message}" if message else kind
            return f"the launcher failed: {_short(said)}"
    for index, line in enumerate(lines):
        if line.startswith("Root Cause"):
            rank = code = None
            for after in lines[index + 1 : index + 10]:
                rank_found, code_found = _ROOT_RANK.match(after), _ROOT_CODE.match(after)
                rank = rank_found.group(1) if rank_found and rank is None else rank
                code = code_found.group(1) if code_found and code is None else code
            if rank is not None and code is not None:
                return f"rank {rank} exited with code {code} before it reported (see its output)"
    return None


_REASONS: tuple[Reason, ...] = (
    _usage_error,
    _port_in_use,
    _script_not_found,
    _import_failed,
    _ranks_unreachable,
    _store_unreachable,
    _rendezvous_failed,
    _last_error,
)
