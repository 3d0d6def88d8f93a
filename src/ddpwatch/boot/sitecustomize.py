"""Put on PYTHONPATH by ``ddpwatch run``: attaches ddpwatch in every rank at interpreter start.

Then it runs the ``sitecustomize`` this one shadows, if any, so the user's
environment behaves as before.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _bootstrap() -> None:
    try:
        from ddpwatch.agent.auto import hello_early

        hello_early()  # a rank is known from here on, however long its imports take
    except Exception:
        pass  # a courtesy: the attach below still runs
    try:
        import ddpwatch
        import ddpwatch.integrations  # each framework registers the hooks it boots
        from ddpwatch.agent.auto import bootstrap

        bootstrap(attach=ddpwatch.attach)
    except Exception as exc:  # never break the user's interpreter
        print(f"ddpwatch: automatic attach failed, continuing without it: {exc!r}", file=sys.stderr)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_bootstrap()
_chain()
