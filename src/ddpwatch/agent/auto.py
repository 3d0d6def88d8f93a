"""Zero-code attach (``ddpwatch run``): decide, in any process of a job, whether it is a rank.

A process started by a launcher with a rank in its environment attaches at
once, so its whole startup is watched. Any other process (the launcher itself,
data-loader or compile workers, ranks spawned by Lightning or ``mp.spawn``)
attaches only if and when it calls ``init_process_group``: only ranks do that.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from ddpwatch.agent import early, registry
from ddpwatch.agent.identity import is_rank_process, rank_from_env

log = logging.getLogger("ddpwatch")

AUTO_ENV = "DDPWATCH_AUTO"
LAUNCHERS = (
    "torch.distributed.run",
    "torchrun",
    "torch.distributed.launch",
    "slurmstepd",
    "orted",
    "orterun",
    "mpirun",
    "mpiexec",
    "prted",
    "prterun",
    "hydra_pmi_proxy",
    "pmi_proxy",
    "deepspeed.launcher.launch",
    "accelerate",
)


def parent_command(pid: int | None = None) -> str:
    """The parent's command line ('' where /proc is not available)."""
    try:
        with open(f"/proc/{pid or os.getppid()}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# Python launchers, by the module or script the interpreter runs.
LAUNCHER_MODULES = frozenset(
    {
        "torch.distributed.run",
        "torch.distributed.launch",
        "deepspeed.launcher.runner",
        "deepspeed.launcher.launch",
        "accelerate.commands.launch",
        "accelerate.commands.accelerate_cli",
    }
)
LAUNCHER_SCRIPTS = frozenset({"torchrun", "deepspeed", "ds", "accelerate"})
_PYTHON_OPTIONS_WITH_VALUE = frozenset({"-X", "-W"})


def started_by_launcher(command: str) -> bool:
    return any(name in command for name in LAUNCHERS)


def _what_runs(argv: Sequence[str]) -> tuple[str, str | None]:
    """What an interpreter's command line (``sys.orig_argv``) runs: ("-m", module),
    ("-c", None), ("script", path), or ("", None) for nothing named (a prompt, stdin)."""
    args = list(argv[1:])
    while args and args[0].startswith("-") and args[0] != "-":
        option = args.pop(0)
        if option == "-m":
            return "-m", args[0] if args else None
        if option == "-c":
            return "-c", None
        if option in _PYTHON_OPTIONS_WITH_VALUE and args:
            args.pop(0)
    return ("script", args[0]) if args else ("", None)


def runs_a_launcher(argv: Sequence[str]) -> bool:
    """Whether this interpreter runs a launcher itself (``sys.orig_argv``).

    ``srun torchrun ...`` gives the torchrun process SLURM rank variables: it
    looks like a rank started by a launcher, but its children are the ranks.
    """
    kind, target = _what_runs(argv)
    if kind == "-m":
        return target in LAUNCHER_MODULES
    return kind == "script" and target is not None and os.path.basename(target) in LAUNCHER_SCRIPTS


def script_missing(argv: Sequence[str]) -> bool:
    """Whether this interpreter was given a script that is not there (``sys.orig_argv``):
    Python then says "can't open file" and exits 2 having run nothing, after this boot hook.
    Such a process is no rank: attached, it would report a rank that never started, and end
    it with an exit it did not have; left alone, ``ddpwatch run`` sees a job that did not
    start and says why (``jobs/failure.py``)."""
    kind, target = _what_runs(argv)
    return kind == "script" and target not in (None, "-") and not os.path.exists(target or "")


def hello_early() -> bool:
    """The boot hook's first act, before the user's imports: a process that is a rank for
    sure says so on a thread (``agent/early.py``); whether it did. Never raises."""
    try:
        rank = says_hello_early()
        return rank is not None and early.start(rank)
    except Exception:
        return False


def says_hello_early(
    environ: Mapping[str, str] | None = None,
    parent: Sequence[str] | None = None,
    argv: Sequence[str] | None = None,
    parent_cwd: str | None = None,
) -> int | None:
    """The rank this process should say its early hello as (``agent/early.py``), or None.

    Only processes that are ranks for sure: started by a launcher with a rank in their
    environment (they attach "now"), or a copy of their parent given ``LOCAL_RANK`` (how
    Lightning starts ranks 1.. of a node; they attach only at ``init_process_group``).
    DataLoader and compile workers inherit the rank variables but run another program."""
    env = os.environ if environ is None else environ
    command = argv if argv is not None else sys.orig_argv
    if env.get(AUTO_ENV) != "1" or "--multiprocessing-fork" in command:
        return None
    if runs_a_launcher(command) or script_missing(command) or not is_rank_process(env):
        return None
    rank = rank_from_env(env)
    if rank is None:
        return None
    theirs = parent if parent is not None else parent_argv()
    if started_by_launcher(" ".join(theirs)):
        return rank
    relaunched = "RANK" not in env and "LOCAL_RANK" in env
    cwd = parent_cwd if parent_cwd is not None else _parent_cwd()
    return rank if relaunched and runs_the_same_program(command, theirs, cwd) else None


def parent_argv() -> list[str]:
    """The parent's arguments ([] where /proc is not available)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _parent_cwd() -> str:
    try:
        return os.readlink(f"/proc/{os.getppid()}/cwd")
    except OSError:
        return ""


def runs_the_same_program(argv: Sequence[str], parent: Sequence[str], parent_cwd: str) -> bool:
    """Whether this interpreter runs the module or script its parent runs (its path taken
    from the parent's working directory): a rank re-launched by its rank 0, not a worker."""
    kind, target = _what_runs(argv)
    parent_kind, parent_target = _what_runs(parent)
    if kind != parent_kind or target is None or parent_target is None:
        return False
    if kind == "-m":
        return target == parent_target
    try:
        return kind == "script" and os.path.samefile(
            target, os.path.join(parent_cwd, parent_target)
        )
    except OSError:
        return False


def bootstrap(
    environ: Mapping[str, str] | None = None,
    parent: str | None = None,
    argv: Sequence[str] | None = None,
    *,
    attach: Callable[[], object],
) -> str:
    """Attach now, later, or never; returns which ("now", "deferred", "off") for tests and logs.

    ``attach`` is ``ddpwatch.attach``, handed in by the boot hook: the agent never imports the
    package above it."""
    env = os.environ if environ is None else environ
    command = argv if argv is not None else sys.orig_argv
    if env.get(AUTO_ENV) != "1" or runs_a_launcher(command) or script_missing(command):
        return "off"
    _install_integrations()
    launched = started_by_launcher(parent if parent is not None else parent_command())
    if is_rank_process(env) and launched and "--multiprocessing-fork" not in sys.argv:
        attach()
        return "now"
    after_import("torch.distributed", functools.partial(_attach_at_init, attach=attach))
    return "deferred"


def _install_integrations() -> None:
    """Hooks that need no watcher yet (every Lightning Trainer gets a DDPWatchCallback), from
    the integrations the boot hook registered (it imports ``ddpwatch.integrations``)."""
    try:
        registry.boot()
    except Exception as exc:
        log.debug("ddpwatch: no framework hooks: %r", exc)


def _attach_at_init(dist: Any, attach: Callable[[], object]) -> None:
    """Make the first ``init_process_group`` call attach ddpwatch before it runs."""
    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if dist.init_process_group is init_process_group:
            dist.init_process_group = original
        attach()  # wraps init_process_group again: rendezvous phase, rank from arguments
        return dist.init_process_group(*args, **kwargs)

    dist.init_process_group = init_process_group


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``name`` is first imported (a post-import hook)."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once, and never for our own lookup below
        for finder in sys.meta_path:
            spec = (
                finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            )
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _CallbackLoader(spec.loader, self.callback)
                return spec
        return None


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            self.callback(module)
        except Exception as exc:
            log.warning("ddpwatch: could not prepare automatic attach: %r", exc)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self.inner, name)


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))
