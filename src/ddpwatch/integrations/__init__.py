"""Framework integrations: ddpwatch never requires Lightning, DeepSpeed or HF.

Importing this package imports each module in it, and each integration module registers
itself (``ddpwatch.agent.registry``): the objects it recognises, by the names of their
classes, and the hooks it installs. Nothing here imports a framework the training script has
not imported itself. ``ddpwatch.attach`` and the ``ddpwatch run`` boot hook import this
package; the agent itself never imports an integration. A new framework is one new module
here that calls ``register``, using the agent through ``WatcherSurface`` only
(``ddpwatch.agent.api``); callback code frameworks share is in ``shared``.

``adapt(watcher, obj)`` is called by ``Watcher.add_model`` for every object given to
``attach``/``add_model``; ``install(watcher)`` adds post-import hooks for what happens before
any object exists (the phases of ``deepspeed.initialize``, a ``DDPWatchCallback`` in every
Lightning ``Trainer``).
"""

from __future__ import annotations

import importlib
import pkgutil

from ddpwatch.agent.registry import adapt, framework_of, install

__all__ = ["adapt", "framework_of", "install"]

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")  # each registers its framework
