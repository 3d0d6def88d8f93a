"""Names the agent, the integrations, the server and the views share: strings that are
contracts between modules, defined once here and imported everywhere they are used.

* ``Phase``: the phases a rank reports (``STARTUP_PHASES`` in order, ``RUN_PHASES``).
* ``RankState``: the one word the server gives a rank, ``RANK_STATES`` worst first.
* ``Severity``: an alert's severity, ``SEVERITIES`` most severe first.
* ``EventKind``: the kinds of protocol events the agent sends and the server reads.
* ``AlertKind``: the kinds of alerts diagnosis may raise.

Importable anywhere (the server included): no torch, no third-party package. The agent and
the integrations set only these phases (a user's ``ddpwatch.phase(name)`` may set any);
``tests/core/test_vocabulary.py`` checks that each one they can set is known to the server, that
the agent sends only these event kinds, and that each table keyed by one of these names
covers every name.
"""

from __future__ import annotations

from typing import Final, Literal


class Phase:
    """Phase names (plain strings, as they travel in samples and events)."""

    # startup, in the order a rank goes through them
    STARTED: Final = "started"
    RENDEZVOUS: Final = "rendezvous"  # init_process_group
    SETUP: Final = "setup"  # the process group exists; Lightning: prepare_data, setup hooks
    CONFIGURE_MODEL: Final = "configure_model"  # Lightning: this rank's setup hooks are done
    DEVICE: Final = "device"  # torch.cuda.set_device
    STRATEGY_SETUP: Final = "strategy_setup"  # Lightning: strategy.setup (device, wrap, optim)
    MODEL_WRAP: Final = "model_wrap"  # DistributedDataParallel / FSDP construction
    DEEPSPEED_INIT: Final = "deepspeed_init"  # inside deepspeed.initialize
    ZERO_PARTITION: Final = "zero_partition"  # deepspeed.initialize builds the ZeRO optimizer
    FIT_START: Final = "fit_start"  # Lightning: on_fit_start hooks, restoring the state
    SANITY_CHECK: Final = "sanity_check"  # Lightning: validation sanity check
    FIRST_STEP: Final = "first_step"  # the training loop, before its first step
    TRAIN: Final = "train"

    # past startup: what a training rank is doing between and around its steps
    FORWARD: Final = "forward"
    BACKWARD: Final = "backward"
    OPTIMIZER: Final = "optimizer"
    DATA: Final = "data"
    VALIDATION: Final = "validation"  # Lightning
    TEST: Final = "test"  # Lightning
    PREDICT: Final = "predict"  # Lightning
    EVALUATION: Final = "evaluation"  # Hugging Face Trainer
    CHECKPOINT: Final = "checkpoint"  # Lightning: trainer.save_checkpoint


STARTUP_PHASES: Final = (
    Phase.STARTED,
    Phase.RENDEZVOUS,
    Phase.SETUP,
    Phase.CONFIGURE_MODEL,
    Phase.DEVICE,
    Phase.STRATEGY_SETUP,
    Phase.MODEL_WRAP,
    Phase.DEEPSPEED_INIT,
    Phase.ZERO_PARTITION,
    Phase.FIT_START,
    Phase.SANITY_CHECK,
    Phase.FIRST_STEP,
    Phase.TRAIN,
)
"""Startup phases in order: the server's ``startup_hang`` names the ranks furthest behind."""

RUN_PHASES: Final = (
    Phase.FORWARD,
    Phase.BACKWARD,
    Phase.OPTIMIZER,
    Phase.DATA,
    Phase.VALIDATION,
    Phase.TEST,
    Phase.PREDICT,
    Phase.EVALUATION,
    Phase.CHECKPOINT,
)
"""Phases of a rank past startup (the server counts them as training, even before a step)."""

PHASES: Final = frozenset(STARTUP_PHASES + RUN_PHASES)
"""Every phase the agent and the integrations may set."""


class RankState:
    """The one word the server gives each rank (the status document's ``state``).

    Diagnosis works it out (``diagnosis.rules.facts.rank_state``; ``not_connected`` for a rank
    below the world size that never reported); the views, the summary and Prometheus read it.
    """

    RUNNING: Final = "running"
    WAITING: Final = "waiting"  # inside a collective
    STALLED: Final = "stalled"  # no progress for the stall threshold
    BUSY: Final = "busy"  # no step for the stall threshold, but its stack moves: working
    SILENT: Final = "silent"  # no heartbeat
    CRASHED: Final = "crashed"  # raised an exception
    STOPPED: Final = "stopped"  # ended by SIGTERM/SIGINT/SIGHUP from outside
    EXITED: Final = "exited"  # ended on its own (``exit_code`` says how)
    NOT_CONNECTED: Final = "not_connected"  # below the world size, never reported


RANK_STATES: Final = (
    RankState.CRASHED,
    RankState.SILENT,
    RankState.STALLED,
    RankState.NOT_CONNECTED,
    RankState.BUSY,
    RankState.WAITING,
    RankState.RUNNING,
    RankState.STOPPED,
    RankState.EXITED,
)
"""Every rank state, worst first: the dashboard's order (``tui.model.STATE_SCORE``)."""

SeverityName = Literal["error", "warning", "info"]
"""The type of an alert's ``severity``: one of ``SEVERITIES``."""


class Severity:
    """An alert's severity. No rule raises ``info`` today; the contract and the views allow it."""

    ERROR: Final = "error"
    WARNING: Final = "warning"
    INFO: Final = "info"


SEVERITIES: Final[tuple[SeverityName, ...]] = (Severity.ERROR, Severity.WARNING, Severity.INFO)
"""Every severity, most severe first (how ``diagnose`` orders alerts)."""


class EventKind:
    """The ``event`` of a protocol ``Event`` (``docs/protocol.md``): what the agent sends, what
    the server reads. The wire leaves kinds open: the server ignores a kind it does not know."""

    PHASE: Final = "phase"  # entered a new phase
    CRASH: Final = "crash"  # dying of an exception
    EXIT: Final = "exit"  # the process is ending
    STACK: Final = "stack"  # the current Python stack, captured when it stalls
    CHECKPOINT: Final = "checkpoint"  # wrote a checkpoint to ``path``
    LOG: Final = "log"  # lines the rank printed


EVENT_KINDS: Final = (
    EventKind.PHASE,
    EventKind.CRASH,
    EventKind.EXIT,
    EventKind.STACK,
    EventKind.CHECKPOINT,
    EventKind.LOG,
)
"""Every event kind the agent sends, in ``docs/protocol.md``'s order."""


class AlertKind:
    """An alert's ``kind`` (``docs/status.md``, "Alert kinds"): what diagnosis may raise."""

    STRAGGLER: Final = "straggler"
    STALLED: Final = "stalled"
    SILENT: Final = "silent"
    CRASHED: Final = "crashed"
    EXITED: Final = "exited"
    NOT_CONNECTED: Final = "not_connected"
    STARTUP_HANG: Final = "startup_hang"
    DUPLICATE_DEVICE: Final = "duplicate_device"
    DEVICE_ORDINAL: Final = "device_ordinal"
    LOCAL_RANK_MISMATCH: Final = "local_rank_mismatch"
    UNEVEN_MEMORY: Final = "uneven_memory"
    FOREIGN_MEMORY: Final = "foreign_memory"
    STEP_SKEW: Final = "step_skew"
    COLLECTIVE_MISMATCH: Final = "collective_mismatch"
    NAN_LOSS: Final = "nan_loss"
    CHECKPOINT_CONFLICT: Final = "checkpoint_conflict"
    SLOW_RANK: Final = "slow_rank"
    RELAY_LOST: Final = "relay_lost"
    SERVER_BEHIND: Final = "server_behind"
    HOST_MEMORY: Final = "host_memory"


ALERT_KINDS: Final = (
    AlertKind.STRAGGLER,
    AlertKind.STALLED,
    AlertKind.SILENT,
    AlertKind.CRASHED,
    AlertKind.EXITED,
    AlertKind.NOT_CONNECTED,
    AlertKind.STARTUP_HANG,
    AlertKind.DUPLICATE_DEVICE,
    AlertKind.DEVICE_ORDINAL,
    AlertKind.LOCAL_RANK_MISMATCH,
    AlertKind.UNEVEN_MEMORY,
    AlertKind.FOREIGN_MEMORY,
    AlertKind.STEP_SKEW,
    AlertKind.COLLECTIVE_MISMATCH,
    AlertKind.NAN_LOSS,
    AlertKind.CHECKPOINT_CONFLICT,
    AlertKind.SLOW_RANK,
    AlertKind.RELAY_LOST,
    AlertKind.SERVER_BEHIND,
    AlertKind.HOST_MEMORY,
)
"""Every alert kind, in ``docs/status.md``'s order: a rule declaring another fails at import."""
