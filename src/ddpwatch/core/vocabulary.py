"""Names the agent, the integrations, the server and the views share: strings that are
contracts between modules, defined once here and imported everywhere they are used. Each is
an Enum of ``Word``s, whose members are the strings themselves; the tuples beside them are
its members in order.

* ``Phase``: the phases a rank reports (``STARTUP_PHASES`` in order, ``RUN_PHASES``).
* ``RankState``: the one word the server gives a rank, ``RANK_STATES`` worst first.
* ``Severity``: an alert's severity, ``SEVERITIES`` most severe first.
* ``EventKind``: the kinds of protocol events the agent sends and the server reads.
* ``AlertKind``: the kinds of alerts diagnosis may raise.
* ``HistoryEvent``: what happened to an alert, in the status document's ``history``.
* ``CollectiveSource``: which counter a collective's number comes from.
* ``JobStop``: what stopped a job ``ddpwatch run`` launched (the status document's
  ``job_end.stopped_by``).
* ``Rendezvous``: how torchrun's ranks found each other (``core/rendezvous.py``).

Importable anywhere (the server included): no torch, no third-party package. The agent and
the integrations set only these phases (a user's ``ddpwatch.phase(name)`` may set any);
``tests/core/test_vocabulary.py`` checks that each one they can set is known to the server, that
the agent sends only these event kinds, and that each table keyed by one of these names
covers every name.
"""

from __future__ import annotations

from enum import Enum, unique
from typing import Final


class Word(str, Enum):
    """A contract string: each member IS its string (``Phase.TRAIN == "train"``, a dict key
    either way), and prints, formats and encodes (json, msgspec) as the plain value, so the
    wire and the status JSON carry exactly what they did. ``repr`` is the string's too: a
    message that quotes a name (argparse's choices, ``!r``) reads as it always did."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    def __repr__(self) -> str:
        return str.__repr__(self)


@unique
class Phase(Word):
    """Phase names, as they travel in samples and events: the startup phases in the order a
    rank goes through them, up to ``TRAIN``, then those past startup."""

    # startup, in the order a rank goes through them
    STARTING = "starting"  # the early hello: the interpreter runs, the agent not attached yet
    STARTED = "started"
    RENDEZVOUS = "rendezvous"  # init_process_group
    SETUP = "setup"  # the process group exists; Lightning: prepare_data, setup hooks
    CONFIGURE_MODEL = "configure_model"  # Lightning: this rank's setup hooks are done
    DEVICE = "device"  # torch.cuda.set_device
    STRATEGY_SETUP = "strategy_setup"  # Lightning: strategy.setup (device, wrap, optim)
    MODEL_WRAP = "model_wrap"  # DistributedDataParallel / FSDP construction
    DEEPSPEED_INIT = "deepspeed_init"  # inside deepspeed.initialize
    ZERO_PARTITION = "zero_partition"  # deepspeed.initialize builds the ZeRO optimizer
    FIT_START = "fit_start"  # Lightning: on_fit_start hooks, restoring the state
    SANITY_CHECK = "sanity_check"  # Lightning: validation sanity check
    FIRST_STEP = "first_step"  # the training loop, before its first step
    TRAIN = "train"

    # past startup: what a training rank is doing between and around its steps
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    DATA = "data"
    VALIDATION = "validation"  # Lightning
    TEST = "test"  # Lightning
    PREDICT = "predict"  # Lightning
    EVALUATION = "evaluation"  # Hugging Face Trainer
    CHECKPOINT = "checkpoint"  # Lightning: trainer.save_checkpoint
    COMPILING = "compiling"  # inside torch.compile: dynamo, AOT autograd, inductor, a build


_PHASES: tuple[str, ...] = tuple(Phase)

STARTUP_PHASES: Final = _PHASES[: _PHASES.index(Phase.TRAIN) + 1]
"""Startup phases in order: the server's ``startup_hang`` names the ranks furthest behind."""

RUN_PHASES: Final = _PHASES[len(STARTUP_PHASES) :]
"""Phases of a rank past startup (the server counts them as training, even before a step)."""

PHASES: Final[frozenset[str]] = frozenset(Phase)
"""Every phase the agent and the integrations may set."""


@unique
class RankState(Word):
    """The one word the server gives each rank (the status document's ``state``), worst first.

    Diagnosis works it out (``diagnosis.facts.ranks.rank_state``; ``not_connected`` for a rank
    below the world size that never reported); the views, the summary and Prometheus read it.
    """

    CRASHED = "crashed"  # raised an exception
    SILENT = "silent"  # no heartbeat
    STALLED = "stalled"  # no progress for the stall threshold
    NOT_CONNECTED = "not_connected"  # below the world size, never reported
    BUSY = "busy"  # no step for the stall threshold, but its stack moves or it compiles
    WAITING = "waiting"  # inside a collective
    RUNNING = "running"
    STOPPED = "stopped"  # ended by SIGTERM/SIGINT/SIGHUP from outside
    EXITED = "exited"  # ended on its own (``exit_code`` says how)


RANK_STATES: Final[tuple[str, ...]] = tuple(RankState)
"""Every rank state, worst first: the order of ``status.order.STATE_ORDER``."""


@unique
class Severity(Word):
    """An alert's severity, most severe first. No rule raises ``info`` today; the contract
    and the views allow it."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


SEVERITIES: Final[tuple[str, ...]] = tuple(Severity)
"""Every severity, most severe first (how ``diagnose`` orders alerts)."""


@unique
class EventKind(Word):
    """The ``event`` of a protocol ``Event`` (``docs/protocol.md``): what the agent sends, what
    the server reads. The wire leaves kinds open: the server ignores a kind it does not know."""

    PHASE = "phase"  # entered a new phase
    CRASH = "crash"  # dying of an exception
    EXIT = "exit"  # the process is ending
    STACK = "stack"  # the current Python stack, captured when it stalls
    CHECKPOINT = "checkpoint"  # wrote a checkpoint to ``path``
    LOG = "log"  # lines the rank printed


EVENT_KINDS: Final[tuple[str, ...]] = tuple(EventKind)
"""Every event kind the agent sends, in ``docs/protocol.md``'s order."""


@unique
class AlertKind(Word):
    """An alert's ``kind`` (``docs/status.md``, "Alert kinds"): what diagnosis may raise."""

    STRAGGLER = "straggler"
    STALLED = "stalled"
    SILENT = "silent"
    CRASHED = "crashed"
    EXITED = "exited"
    NOT_CONNECTED = "not_connected"
    STARTUP_HANG = "startup_hang"
    DUPLICATE_DEVICE = "duplicate_device"
    DEVICE_ORDINAL = "device_ordinal"
    LOCAL_RANK_MISMATCH = "local_rank_mismatch"
    UNEVEN_MEMORY = "uneven_memory"
    FOREIGN_MEMORY = "foreign_memory"
    STEP_SKEW = "step_skew"
    COLLECTIVE_MISMATCH = "collective_mismatch"
    NAN_LOSS = "nan_loss"
    CHECKPOINT_CONFLICT = "checkpoint_conflict"
    SLOW_RANK = "slow_rank"
    RELAY_LOST = "relay_lost"
    SERVER_BEHIND = "server_behind"
    HOST_MEMORY = "host_memory"
    CONFIG_MISMATCH = "config_mismatch"
    DUPLICATE_RANK = "duplicate_rank"
    SEND_RECV_DEADLOCK = "send_recv_deadlock"


ALERT_KINDS: Final[tuple[str, ...]] = tuple(AlertKind)
"""Every alert kind, in ``docs/status.md``'s order: a rule declaring another fails at import."""


@unique
class HistoryEvent(Word):
    """The ``event`` of a ``history`` entry (``docs/status.md``): what happened to an alert."""

    RAISED = "raised"
    ESCALATED = "escalated"  # more severe than before, about the same ranks, in one tick
    UPDATED = "updated"  # the same episode about other ranks (some of them the same)
    CLEARED = "cleared"


@unique
class CollectiveSource(Word):
    """A ``Collective``'s ``source`` (``docs/protocol.md``): the counter its ``seq`` comes from.
    Numbers of different sources never compare."""

    FR = "fr"  # the flight recorder's sequence, per process group (DDP's all-reduces too)
    PY = "py"  # the agent's count of Python-level torch.distributed calls


@unique
class JobStop(Word):
    """What asked a job that ``ddpwatch run`` launched to stop (``job_end.stopped_by`` in
    ``docs/status.md``): the verdict tells a stop the user asked for from a failure."""

    DASHBOARD = "dashboard"  # "Stop the job" in ``run --tui``'s quit question
    CTRL_C = "ctrl_c"  # Ctrl-C in the terminal of ``ddpwatch run``
    SIGTERM = "sigterm"  # a SIGTERM to ``ddpwatch run`` (a scheduler, ``kill``)


@unique
class Rendezvous(Word):
    """How torchrun's ranks found each other: what a fix for a rendezvous problem must name
    (``core/rendezvous.py``). A backend torchrun knows beyond these travels as its own name."""

    STATIC = "static"  # a TCP store at --master-addr:--master-port (29500 by default)
    STANDALONE = "standalone"  # c10d on a free port of this node: --standalone, or one node
    # without --master-port where torchrun does that (2.13 does: pytorch/pytorch#175699)
    C10D = "c10d"  # c10d at --rdzv-endpoint, several nodes
