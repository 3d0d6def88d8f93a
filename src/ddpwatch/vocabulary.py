"""Names the agent, the integrations and the server share: the phases a rank reports.

Importable anywhere (the server included): no torch, no third-party package. The agent and
the integrations set only these phases (a user's ``ddpwatch.phase(name)`` may set any);
``tests/test_vocabulary.py`` checks that each one they can set is known to the server.
"""

from __future__ import annotations

from typing import Final


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
