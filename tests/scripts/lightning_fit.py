"""A tiny Lightning fit on CPU: ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``.

Run it as ``python lightning_fit.py``: Lightning starts the second rank itself (it re-runs
this script with ``LOCAL_RANK=1``). Give it ``MASTER_ADDR``/``MASTER_PORT`` and, for
ddpwatch, ``DDPWATCH_ADDR``. Environment:

* ``LIGHTNING_FIT_MODE``: ``callback`` (default) passes ``DDPWatchCallback()`` to the Trainer;
  ``auto`` calls ``install_auto_callback()`` as ``ddpwatch run`` does (run it under
  ``ddpwatch.jobs.launch.job_environment`` so the ranks attach at ``init_process_group``).
* ``LIGHTNING_FIT_SLEEP_RANK`` / ``LIGHTNING_FIT_SLEEP_S``: that rank sleeps in
  ``LightningModule.setup`` (a startup hang).
* ``LIGHTNING_FIT_TRACE``: a folder; each rank writes ``rank<N>.json`` there at the end with
  the phases it went through and its counts.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

MODE = os.environ.get("LIGHTNING_FIT_MODE", "callback")
PHASES: list[str] = []
STEP_S = float(os.environ.get("LIGHTNING_FIT_STEP_S", "0.05"))


def trace_phases() -> None:
    """Record every phase the agent enters (the test checks their order)."""
    from ddpwatch.agent.progress import Progress

    original = Progress.set_phase

    def set_phase(self: Progress, name: str) -> None:
        if not PHASES or PHASES[-1] != name:
            PHASES.append(name)
        original(self, name)

    Progress.set_phase = set_phase  # type: ignore[method-assign]


if os.environ.get("LIGHTNING_FIT_TRACE"):
    trace_phases()
if MODE == "auto":
    from ddpwatch.integrations.lightning import install_auto_callback

    install_auto_callback()  # before Lightning is imported: the post-import hook path

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class TinyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def setup(self, stage: str) -> None:
        if str(self.trainer.global_rank) == os.environ.get("LIGHTNING_FIT_SLEEP_RANK"):
            time.sleep(float(os.environ.get("LIGHTNING_FIT_SLEEP_S", "30")))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        time.sleep(STEP_S)  # long enough for heartbeats to see the steps
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ckpt-dir", default="checkpoints")
    args = parser.parse_args()
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=5, save_top_k=-1)
    ]
    if MODE == "callback":
        from ddpwatch.integrations.lightning import DDPWatchCallback

        callbacks.append(DDPWatchCallback())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        accumulate_grad_batches=2,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.ckpt_dir,
        callbacks=callbacks,
    )
    trainer.fit(TinyModel(), loader(), loader())
    trace = os.environ.get("LIGHTNING_FIT_TRACE")
    if trace:
        import ddpwatch

        watcher = ddpwatch.current()
        report = {
            "rank": trainer.global_rank,
            "phases": PHASES,
            "global_step": trainer.global_step,
            "step": watcher.progress.step if watcher else None,
            "loss": watcher.progress.loss.value if watcher else None,
            "callbacks": [type(c).__name__ for c in trainer.callbacks],
        }
        Path(trace, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
