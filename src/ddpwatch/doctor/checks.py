"""The checks of ``ddpwatch doctor``: each a function from the gathered ``Setup`` to one
``Check``, a line with its fix. They read nothing of the machine themselves (``gather.py``
did), so any of them runs on a ``Setup`` made by hand, on a machine without a GPU or torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ddpwatch.agent.identity import identity_from_env
from ddpwatch.core.devices import parse_cuda_visible_devices
from ddpwatch.core.port_holder import Holder
from ddpwatch.core.protocol import DEFAULT_PORT
from ddpwatch.core.security import CLIENT_KEY_FILE_ENV, SERVER_KEY_ENV, is_loopback
from ddpwatch.core.vocabulary import RankState
from ddpwatch.doctor.gather import TORCHRUN_MASTER, Setup, TorchInfo, describe
from ddpwatch.status.client import no_answer
from ddpwatch.status.schema import StatusDocument

Status = Literal["ok", "warn", "fail", "skip"]
ORDINAL = "'invalid device ordinal'"


@dataclass(frozen=True)
class Check:
    """One line of the report: what was found and, unless it is fine, what to do."""

    name: str
    status: Status
    what: str
    fix: str = ""


CheckFn = Callable[[Setup], Check]


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


# torch, NVML and the GPUs ------------------------------------------------------------------------


def check_torch(s: Setup) -> Check:
    """torch's version, its CUDA and how many GPUs it sees."""
    info = s.torch
    if info.version is None:
        return Check(
            "torch",
            "skip",
            f"not importable ({info.error}): CUDA devices, NCCL and gloo not checked",
            "run doctor with the job's Python (the environment torchrun uses)",
        )
    if info.error is not None:
        return Check(
            "torch",
            "fail",
            f"{info.version} imports, but reading its CUDA and backends failed ({info.error})",
            "a broken install: reinstall torch (pip install --force-reinstall torch)",
        )
    if info.cuda is None:
        return Check("torch", "ok", f"{info.version}, a CPU build (no CUDA)")
    seen = plural(info.gpus, "GPU") + " visible" if info.gpus else "no GPU visible"
    return Check("torch", "ok", f"{info.version}, CUDA {info.cuda}, {seen}")


def _backends(info: TorchInfo) -> str:
    """``torch has NCCL 2.21.5 and gloo``, ``torch has gloo, not nccl``."""
    nccl = f"NCCL {info.nccl_version}" if info.nccl_version else "nccl"
    have = [name for name, there in ((nccl, info.nccl), ("gloo", info.gloo)) if there]
    lack = [name for name, there in (("nccl", info.nccl), ("gloo", info.gloo)) if not there]
    text = f"torch has {' and '.join(have)}" if have else "torch has neither nccl nor gloo"
    return text + (f", not {lack[0]}" if have and lack else "")


def check_backend(s: Setup) -> Check:
    """The job's backend exists in this torch; the NCCL version and gloo."""
    info, backend = s.torch, s.backend
    if not info.usable:
        return Check("backend", "skip", f"{backend} ({s.backend_source}) not checked without torch")
    if not info.distributed:
        return Check(
            "backend",
            "fail",
            f"torch {info.version} has no torch.distributed",
            "install a torch build with distributed support (the pytorch.org wheels have it)",
        )
    available = info.nccl if backend == "nccl" else info.gloo
    if not available:
        fix = (
            "NCCL comes with CUDA builds of torch on Linux: install one, or train on CPU with gloo"
            if backend == "nccl"
            else "use nccl, or a torch build with gloo"
        )
        return Check("backend", "fail", f"{backend} is not in torch {info.version}", fix)
    return Check("backend", "ok", f"{backend} ({s.backend_source}) is available; {_backends(info)}")


def cpu_job(s: Setup) -> str | None:
    """Why the job is taken to run on CPU (no GPU expected), or None when it may use GPUs:
    nccl, a GPU visible, or an NVIDIA device on this machine (a GPU the driver cannot show)."""
    if s.backend == "nccl" or s.gpus or s.nvidia_device:
        return None
    return f"{s.backend}, no NVIDIA GPU on this machine"


def check_nvml(s: Setup) -> Check:
    """NVML answers: what the agent reads device UUIDs, memory and processes from. A CPU job
    has no GPU to read: a missing NVML is no problem there, and no driver is to be installed."""
    on_cpu = cpu_job(s)
    nvml = s.nvml
    if on_cpu and nvml.failed in ("import", "init"):
        return Check(
            "NVML", "skip", f"not needed: the job runs on CPU ({on_cpu}), GPU checks skipped"
        )
    if nvml.failed == "import":
        return Check(
            "NVML",
            "warn",
            f"nvidia-ml-py not importable ({nvml.error}): "
            "GPU UUIDs, memory and processes will read as null",
            "pip install nvidia-ml-py",
        )
    if nvml.failed == "init":
        return Check(
            "NVML",
            "warn",
            f"cannot start ({nvml.error})",
            "install the NVIDIA driver; in a container, expose the GPUs with the NVIDIA "
            "container toolkit (--gpus all) so libnvidia-ml.so.1 is there",
        )
    if nvml.failed == "read":
        return Check(
            "NVML",
            "warn",
            f"starts, but reading the driver and GPUs failed ({nvml.error})",
            "check the driver with nvidia-smi",
        )
    return Check("NVML", "ok", f"driver {nvml.driver}, {plural(nvml.gpus, 'GPU')}")


def _local_ranks(first: int, last: int) -> str:
    return f"local rank {first}" if first == last else f"local ranks {first}-{last}"


def check_gpus(s: Setup) -> Check:
    """Ranks per node against visible GPUs: the 5-ranks-on-4-GPUs ``invalid device ordinal``."""
    if s.gpus is None:
        return Check(
            "GPUs",
            "skip",
            "cannot count visible GPUs: torch is not importable and NVML is unavailable",
            "run doctor with the job's Python, or pip install nvidia-ml-py",
        )
    seen = plural(s.gpus, "GPU") + " visible"
    if s.nproc is None:
        return Check(
            "GPUs",
            "skip",
            f"{seen}; ranks per node unknown ({s.nproc_source}): not compared",
            "pass --nproc-per-node N as given to torchrun",
        )
    ranks = f"{s.nproc} ranks per node" if s.nproc > 1 else "1 rank per node"
    if s.nproc <= s.gpus:
        idle = f", {s.gpus - s.nproc} left idle" if s.gpus > s.nproc else ""
        return Check("GPUs", "ok", f"{ranks}, {seen}{idle}")
    if s.backend != "nccl" and s.gpus == 0:
        return Check("GPUs", "ok", f"{ranks} on CPU ({s.backend}, no GPU visible)")
    failing = _local_ranks(s.gpus, s.nproc - 1)
    what = f"{ranks} but {seen}: {failing} would fail with {ORDINAL}"
    if s.backend != "nccl":
        what += " if they use cuda:LOCAL_RANK"
    if s.gpus == 0:
        fix = "NCCL needs a GPU per rank: run on a GPU node (check the job's GPU allocation and "
        fix += "CUDA_VISIBLE_DEVICES), or train on CPU with gloo"
    else:
        fix = f"use --nproc-per-node {s.gpus}, or make {s.nproc} GPUs visible "
        fix += "(the job's GPU allocation, CUDA_VISIBLE_DEVICES)"
    return Check("GPUs", "fail" if s.backend == "nccl" else "warn", what, fix)


def _cvd_problem(value: str) -> tuple[str, int] | None:
    """Where CUDA's reading of ``CUDA_VISIBLE_DEVICES`` goes wrong: ("repeat", i) when entry i
    repeats an earlier one, ("stop", i) when CUDA stops reading at entry i; None when it takes
    every entry. Found by feeding the agent's parser longer and longer prefixes."""
    entries = value.split(",")
    taken = 0
    for index in range(len(entries)):
        parsed = parse_cuda_visible_devices(",".join(entries[: index + 1])) or []
        if not parsed and taken:
            return "repeat", index
        if len(parsed) == taken:
            last = index == len(entries) - 1 and index > 0
            return None if last and not entries[index].strip() else ("stop", index)  # "0,1,"
        taken = len(parsed)
    return None


def check_cuda_visible_devices(s: Setup) -> Check:
    """``CUDA_VISIBLE_DEVICES`` read exactly as CUDA reads it: repeats, ignored entries, and
    enough GPUs listed for the ranks per node."""
    name = "CUDA_VISIBLE_DEVICES"
    raw = s.env.get(name)
    if raw is None:
        return Check(name, "ok", "unset: CUDA shows every GPU")
    parsed = parse_cuda_visible_devices(raw) or []
    entries = raw.split(",")
    problem = _cvd_problem(raw)
    if problem is not None and problem[0] == "repeat":
        repeated = entries[problem[1]].strip()
        return Check(
            name,
            "fail",
            f"{raw} repeats {repeated}: CUDA then shows no GPU at all",
            "list each GPU once",
        )
    count = len(parsed)
    listed = f"{raw!r} hides every GPU" if count == 0 else f"{raw} lists {plural(count, 'GPU')}"
    too_few: Status = "fail" if s.backend == "nccl" else "warn"
    if s.nproc is not None and count < s.nproc and (count or s.backend == "nccl"):
        example = ",".join(str(i) for i in range(s.nproc)) if s.nproc <= 8 else "0,1,...,N-1"
        ranks = plural(s.nproc, "rank")
        return Check(
            name,
            too_few,
            f"{listed} for {ranks} per node" if count else f"{listed}: {ranks} per node need one",
            f"list one GPU per local rank (e.g. CUDA_VISIBLE_DEVICES={example}), or lower "
            "--nproc-per-node",
        )
    if count == 0:
        if s.backend == "nccl":
            return Check(name, "warn", listed, "NCCL needs GPUs: unset it or list the GPUs to use")
        return Check(name, "ok", f"{listed} (a CPU run with {s.backend})")
    if problem is not None:
        entry = entries[problem[1]].strip()
        shown = ",".join(str(item) for item in parsed)
        return Check(
            name,
            "warn",
            f"{raw}: CUDA stops reading at {entry!r} and shows only {shown}",
            f"remove or correct {entry!r}: every entry after it is ignored",
        )
    return Check(name, "ok", listed)


def check_local_rank(s: Setup) -> Check:
    """The local rank (inside a rank) within the ranks per node, ``CUDA_VISIBLE_DEVICES`` and
    the visible GPUs: ``cuda:LOCAL_RANK`` past them is ``invalid device ordinal``."""
    raw = s.env.get("LOCAL_RANK")
    local = identity_from_env(s.env).local_rank
    if local is None:
        if raw is not None:
            return Check(
                "LOCAL_RANK",
                "fail",
                f"{raw!r} is not a non-negative integer",
                "unset it: the launcher sets LOCAL_RANK in each rank",
            )
        return Check(
            "LOCAL_RANK",
            "skip",
            "not set here: the launcher sets it in each rank",
            "to check a rank's view, run doctor as one (srun ddpwatch doctor, or under mpirun)",
        )
    bad: Status = "fail" if s.backend == "nccl" else "warn"
    if s.nproc is not None and local >= s.nproc:
        return Check(
            "LOCAL_RANK",
            "fail",
            f"{local} but {s.nproc} ranks per node (local ranks 0-{s.nproc - 1})",
            "make --nproc-per-node match the ranks the launcher starts on each node",
        )
    fix = "give each rank a GPU of its own: list them all in CUDA_VISIBLE_DEVICES, or with "
    fix += "one GPU per rank (Slurm's --gpus-per-task) use cuda:0"
    visible = s.env.get("CUDA_VISIBLE_DEVICES")
    parsed = parse_cuda_visible_devices(visible)
    if visible is not None and parsed is not None and parsed and local >= len(parsed):
        return Check(
            "LOCAL_RANK",
            bad,
            f"{local} but CUDA_VISIBLE_DEVICES={visible} shows {plural(len(parsed), 'GPU')}: "
            f"cuda:{local} would fail with {ORDINAL}",
            fix,
        )
    if s.gpus is None:
        return Check("LOCAL_RANK", "skip", f"{local}: not compared, the GPU count is unknown")
    if local < s.gpus:
        return Check("LOCAL_RANK", "ok", f"{local}: cuda:{local} is one of {s.gpus} visible")
    if s.gpus == 0 and s.backend != "nccl":
        return Check("LOCAL_RANK", "ok", f"{local}, on CPU ({s.backend}, no GPU visible)")
    seen = plural(s.gpus, "GPU") + " visible" if s.gpus else "no GPU visible"
    return Check(
        "LOCAL_RANK", bad, f"{local} but {seen}: cuda:{local} would fail with {ORDINAL}", fix
    )


# the master and the server -----------------------------------------------------------------------


def check_master_addr(s: Setup) -> Check:
    """``MASTER_ADDR`` resolves (an unresolvable master hangs every rank in rendezvous)."""
    host = s.master_addr
    if not host:
        return Check(
            "MASTER_ADDR",
            "skip",
            "unset: nothing to resolve (torchrun takes --master-addr or --rdzv-endpoint)",
        )
    try:
        lookup = s.master.get()
    except OSError as exc:
        return Check(
            "MASTER_ADDR",
            "fail",
            f"{host} does not resolve ({exc.strerror or exc})",
            "use a host name or IP address every node can resolve (in Slurm: the first of "
            "scontrol show hostnames $SLURM_JOB_NODELIST)",
        )
    where = "this host" if lookup.local else "another host"
    addresses = lookup.addresses
    shown = ", ".join(addresses[:3]) + (", ..." if len(addresses) > 3 else "")
    return Check("MASTER_ADDR", "ok", f"{host} resolves to {shown} ({where})")


def _stop_holder(holder: Holder | None, port: int) -> str:
    """How to free ``port`` from what holds it, as far as this host can tell."""
    if holder is not None and holder.pids:
        return f"stop pid {holder.pids[0]} if it is left over from an earlier run"
    if holder is not None and holder.other_user:
        return "ask its owner to stop it"
    return f"stop what holds it (ss -ltnp 'sport = :{port}' shows it)"


def check_master_port(s: Setup) -> Check:
    """The port the rendezvous store listens on is free on the master (a leftover job holding
    it: ``Address already in use``), naming the process that holds it: $MASTER_PORT for a
    launch that reads it, else what torchrun will do with its options (its default 29500, the
    ``--master-port`` given, or no port at all where it picks a free one: ``--standalone``,
    or one node without ``--master-port``). Only this host's ports can be tried, so another
    master's is left to it."""
    raw, port, rendezvous = s.master_port_raw, s.master_port, s.rendezvous
    if rendezvous is not None and port is None:
        ignored = f" (it ignores MASTER_PORT={raw}: it sets it for its ranks)" if raw else ""
        return Check(
            "MASTER_PORT",
            "ok",
            f"torchrun picks a free port{ignored}: {rendezvous.why}, a c10d rendezvous on "
            "localhost:0",
        )
    if port is None:
        return Check(
            "MASTER_PORT",
            "fail",
            f"{raw!r} is not a port number",
            "set MASTER_PORT to a free port between 1024 and 65535",
        )
    named = _port_named(s, port)
    if s.port_use is None:  # not tried: the master is not this host
        try:
            s.master.get()
        except OSError:
            return Check(
                "MASTER_PORT", "skip", f"{named} not checked: MASTER_ADDR does not resolve"
            )
        host = s.master_addr or TORCHRUN_MASTER
        return Check(
            "MASTER_PORT",
            "skip",
            f"{named} not checked: MASTER_ADDR {host} is another host, "
            "the port check applies on that host",
            f"run ddpwatch doctor on {host}",
        )
    use = s.port_use.get()
    if use.error is None:
        return Check("MASTER_PORT", "ok", f"{named} is free on this host")
    holder, spare = use.holder, use.spare
    held = f": held by {holder}" if holder is not None else ""
    return Check(
        "MASTER_PORT",
        "fail",
        f"{named} is in use on this host ({use.error}){held}",
        f"{_other_port(s, spare)}, or {_stop_holder(holder, port)}",
    )


def _port_named(s: Setup, port: int) -> str:
    """The port checked and whose it is: "29500 (unset: torchrun's default)"."""
    rendezvous = s.rendezvous
    if rendezvous is None:
        return str(port)
    if rendezvous.why == "torchrun's default --master-port":
        return f"{port} (unset: torchrun's default)"
    return f"{port} ({rendezvous.why})"


def _other_port(s: Setup, spare: int | None) -> str:
    """How to take another port, as the launch in use takes one."""
    rendezvous = s.rendezvous
    if spare is None:
        return "pick a free one"
    if rendezvous is None:
        return f"pick a free one (MASTER_PORT={spare})"
    if rendezvous.why == "--rdzv-endpoint":
        return f"pick a free one (--rdzv-endpoint HOST:{spare})"
    return f"pick a free one (torchrun --master-port {spare}; on one node --standalone picks one)"


def check_curve(s: Setup) -> Check:
    """The CurveZMQ keys the agent would use: well-formed, readable, and not half set."""
    host = s.server_host
    if s.curve_error is not None:
        return Check(
            "CURVE",
            "fail",
            s.curve_error,
            f"{SERVER_KEY_ENV} is the server's public key (ddpwatch keygen prints it), "
            f"{CLIENT_KEY_FILE_ENV} a client's .key_secret file (docs/security.md)",
        )
    server_key = s.curve_env.get(SERVER_KEY_ENV, "").strip()
    client_file = s.curve_env.get(CLIENT_KEY_FILE_ENV, "").strip()
    if server_key:
        client = f"client key {client_file}" if client_file else "a fresh client key per socket"
        return Check("CURVE", "ok", f"on: the server key is valid, {client}")
    if client_file:
        return Check(
            "CURVE",
            "warn",
            f"{CLIENT_KEY_FILE_ENV} is set but {SERVER_KEY_ENV} is not: "
            "the client key is unused and traffic is plain TCP",
            f"export {SERVER_KEY_ENV}='<the server's public key>' (ddpwatch keygen printed it)",
        )
    if is_loopback(host):
        return Check("CURVE", "ok", f"off: plain TCP to {host}, which only this host can reach")
    return Check(
        "CURVE",
        "warn",
        f"off: plain TCP to {host}: anyone on the path can read stacks and tracebacks",
        f"ddpwatch keygen, serve with --curve-secret-file, export {SERVER_KEY_ENV} "
        "(docs/security.md)",
    )


def _ranks_seen(document: StatusDocument) -> str:
    connected = sum(1 for r in document.ranks if r.state != RankState.NOT_CONNECTED)
    world = document.world_size
    if world is not None:
        return f"{connected} of {plural(world, 'rank')} connected"
    return f"{plural(connected, 'rank')} connected" if connected else "no rank connected yet"


def _server_fix(s: Setup, host: str, port: int) -> str:
    local = is_loopback(host)
    serve = "ddpwatch serve" + ("" if local else " --host 0.0.0.0")
    serve += "" if port == DEFAULT_PORT else f" --port {port}"
    fix = f"start it: {serve}" + ("" if local else f" on {host}, ports {port}-{port + 1} open")
    if s.curve_env.get(SERVER_KEY_ENV, "").strip():
        fix += f"; with {SERVER_KEY_ENV} set, it must run with --curve-secret-file of that key"
    else:
        fix += f"; a server with --curve-secret-file answers only with {SERVER_KEY_ENV} set"
    if not s.server_explicit:
        fix += "; without one the ranks train as before, unwatched"
    return fix


def check_server(s: Setup) -> Check:
    """The ddpwatch server the ranks will report to answers its status query (port + 1)."""
    host, port = s.server_host, s.server_port
    bad: Status = "fail" if s.server_explicit else "warn"
    if port is None:
        return Check(
            "server",
            bad,
            f"cannot read a host:port from {s.server} ({s.server_source})",
            "give it as HOST:PORT, e.g. --addr node0:5599",
        )
    where = f"{host}:{port} ({s.server_source})"
    if s.answer is None:  # not asked: the CURVE key is unusable
        return Check("server", "skip", f"{where} not asked: the CURVE key is unusable")
    answer = s.answer.get()
    if answer.unresolved is not None:
        exc = answer.unresolved
        return Check(
            "server",
            bad,
            f"{where}: {host} does not resolve ({exc.strerror or exc})",
            "use a host name or IP address this host can resolve",
        )
    if answer.document is None:
        return Check(
            "server",
            bad,
            f"{where}: {no_answer(host, port, s.timeout)}",
            _server_fix(s, host, port),
        )
    return Check("server", "ok", f"{where} answered: {_ranks_seen(answer.document)}")


CHECKS: tuple[tuple[str, CheckFn], ...] = (
    ("torch", check_torch),
    ("backend", check_backend),
    ("NVML", check_nvml),
    ("GPUs", check_gpus),
    ("CUDA_VISIBLE_DEVICES", check_cuda_visible_devices),
    ("LOCAL_RANK", check_local_rank),
    ("MASTER_ADDR", check_master_addr),
    ("MASTER_PORT", check_master_port),
    ("CURVE", check_curve),
    ("server", check_server),
)


def run_checks(setup: Setup, checks: Sequence[tuple[str, CheckFn]] = CHECKS) -> list[Check]:
    """Every check in order; one that raises becomes a fail line with the exception's text."""
    results = []
    for name, check in checks:
        try:
            results.append(check(setup))
        except Exception as exc:
            results.append(
                Check(
                    name,
                    "fail",
                    f"the check itself failed ({describe(exc)})",
                    "a ddpwatch bug: please report this line",
                )
            )
    return results


def exit_code(checks: Sequence[Check]) -> int:
    """1 if any check failed; warnings and skips do not fail."""
    return 1 if any(c.status == "fail" for c in checks) else 0
