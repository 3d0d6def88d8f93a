"""What torchrun does for its rendezvous, from its options: one decision for ``doctor`` (before
a launch, from the options it is given) and the agent (inside a rank, from its launcher's
command line), so a port check and a fix name the rendezvous that is really in use (#33).

torchrun (``torch/distributed/run.py``, checked on 2.13, pytorch/pytorch#175699):

* ``--standalone``: a c10d rendezvous on ``localhost:0``, a free port;
* the default static backend with no ``--rdzv-endpoint`` and no ``--master-port`` (nor
  ``$PET_MASTER_PORT``) on one node (``--nnodes`` 1, its default): the same, where this torch
  does it (``picks_free_port``; older ones take 29500);
* otherwise static: a TCP store on the master at ``--master-port`` (29500 by default);
* another backend (c10d, etcd) at ``--rdzv-endpoint``.

torchrun reads its options from ``$PET_<OPTION>`` too, and never ``$MASTER_PORT``: it sets that
for its ranks. Importable anywhere: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from ddpwatch.core.vocabulary import Rendezvous

TORCHRUN_PORT: Final = 29500  # torchrun's --master-port where it takes one
_FLAGS: Final = frozenset(
    {"--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path",
     "--run_path", "--virtual-local-rank", "--virtual_local_rank"}
)  # fmt: skip
"""torchrun's options that take no value (every other option takes one)."""
_OPTIONS: Final = {
    "--standalone": "standalone",
    "--rdzv-backend": "rdzv_backend",
    "--rdzv_backend": "rdzv_backend",
    "--rdzv-endpoint": "rdzv_endpoint",
    "--rdzv_endpoint": "rdzv_endpoint",
    "--master-port": "master_port",
    "--master_port": "master_port",
    "--nnodes": "nnodes",
}
_UUID: Final = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@dataclass(frozen=True)
class TorchrunOptions:
    """The options of a torchrun launch that decide its rendezvous, as torchrun reads them."""

    standalone: bool = False
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    master_port: int | None = None  # None: not given (0 < port < 65536 otherwise)
    nnodes: str = "1"

    @property
    def max_nodes(self) -> int:
        """``--nnodes 2`` or ``--nnodes 1:4``: the most nodes (1 where it cannot be read)."""
        last = self.nnodes.rsplit(":", 1)[-1].strip()
        return int(last) if last.isascii() and last.isdigit() else 1


@dataclass(frozen=True)
class Plan:
    """What torchrun will do: its rendezvous (a ``Rendezvous``, or another backend's name), the
    port its store listens on (on the master for static, on the endpoint's host for c10d;
    None: a free port it picks, or none named), and why, in torchrun's words."""

    kind: str
    port: int | None
    why: str


def options_from(values: Mapping[str, str | bool], env: Mapping[str, str]) -> TorchrunOptions:
    """torchrun's options from the command line's ``values`` (keys as ``TorchrunOptions``'
    fields), else ``$PET_<NAME>`` as torchrun reads them, else its defaults."""

    def get(name: str) -> str | bool | None:
        if name in values:
            return values[name]
        return env.get(f"PET_{name.upper()}")

    standalone = get("standalone")
    port = str(get("master_port") or "").strip()
    return TorchrunOptions(
        standalone=standalone is True or (isinstance(standalone, str) and standalone != ""),
        rdzv_backend=str(get("rdzv_backend") or "static"),
        rdzv_endpoint=str(get("rdzv_endpoint") or ""),
        master_port=int(port) if port.isascii() and port.isdigit() else None,
        nnodes=str(get("nnodes") or "1"),
    )


def parse_torchrun(argv: Sequence[str]) -> dict[str, str | bool] | None:
    """The rendezvous options on a torchrun command line (``torchrun ...`` or ``python -m
    torch.distributed.run ...``) up to its script; None when ``argv`` runs no torchrun."""
    args = list(argv)
    start = next(
        (i + 1 for i, arg in enumerate(args)
         if arg in ("torch.distributed.run", "torch.distributed.launch")
         or arg.replace("\\", "/").rsplit("/", 1)[-1] == "torchrun"),
        None,
    )  # fmt: skip
    if start is None:
        return None
    found: dict[str, str | bool] = {}
    rest = iter(args[start:])
    for arg in rest:
        if not arg.startswith("-"):
            break  # the script: what follows is its own
        name, equals, value = arg.partition("=")
        if name in _FLAGS:
            if name in _OPTIONS:
                found[_OPTIONS[name]] = True
            continue
        if not equals:
            value = next(rest, "")
        if name in _OPTIONS:
            found[_OPTIONS[name]] = value
    return found


def plan(
    options: TorchrunOptions, picks_free_port: bool, default_port: int = TORCHRUN_PORT
) -> Plan:
    """What torchrun does with ``options``; ``picks_free_port``: this torchrun takes a free
    port on one node without ``--master-port`` (2.13 does)."""
    if options.standalone:
        return Plan(Rendezvous.STANDALONE, None, "--standalone")
    backend, endpoint = options.rdzv_backend, options.rdzv_endpoint
    if backend == "static" and not endpoint:
        if options.master_port is not None:
            return Plan(Rendezvous.STATIC, options.master_port, "--master-port")
        if options.max_nodes == 1 and picks_free_port:
            return Plan(Rendezvous.STANDALONE, None, "one node and no --master-port")
        return Plan(Rendezvous.STATIC, default_port, "torchrun's default --master-port")
    port = endpoint.rsplit(":", 1)[-1] if ":" in endpoint else ""
    named = int(port) if port.isdigit() and 0 < int(port) < 65536 else None
    kind = Rendezvous.C10D if backend == "c10d" else backend
    why = "--rdzv-endpoint" if named is not None else f"--rdzv-backend {backend}"
    return Plan(kind, named, why)


def is_generated_run_id(run_id: str | None) -> bool:
    """torchrun's own run id (a uuid4): it made one for a c10d rendezvous on a free port
    (``--standalone``, or one node without ``--master-port``); a static one keeps "none"."""
    return run_id is not None and _UUID.match(run_id.strip().lower()) is not None
