"""The early hello: a rank says who it is at interpreter start, before the user's imports.

A rank attaches once torch is imported (started by a launcher) or only at
``init_process_group`` (ranks Lightning starts itself). On a loaded machine importing
Lightning takes many seconds, and until then the server knew nothing of a rank that runs:
rank 0, waiting in rendezvous, was told to wait for ranks that "never connected". The boot
hook (``boot/sitecustomize.py``) calls ``start`` in a process that will be a rank
(``auto.says_hello_early``); a hello and then a heartbeat every ``INTERVAL_S`` go out in phase
'starting', with the process's CPU time, so the server sees a rank that works, not one missing.

Training pays only for a thread start: the thread imports ZeroMQ and the protocol itself, and
any error ends it silently. The agent's ``Watcher`` takes over (``hand_over``) as soon as its
own publisher runs; the server keeps 'starting' only as a process's first phase, so a late
early beat never puts a rank back.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpwatch.agent.publisher import Publisher
    from ddpwatch.core.protocol import AnyMessage

INTERVAL_S = 0.5  # the agent's own heartbeat interval (``attach``'s default)
EXIT_FLUSH_S = 0.5  # the most an exit before the agent attached waits for its report

_lock = threading.Lock()
_sender: EarlySender | None = None


class EarlySender:
    """Sends the hello and 'starting' heartbeats of one rank until handed over."""

    def __init__(self, rank: int, environ: Mapping[str, str]) -> None:
        self.rank = rank
        self.pid = os.getpid()
        self.environ = dict(environ)
        self.publisher: Publisher | None = None
        self._identity: dict[str, Any] = {}
        self._over = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._open, name="ddpwatch-early", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """The process ends before the agent attached (an import failed, or the script ran
        without ``init_process_group``): say it exited, rather than leave a rank that went
        silent. Bounded by ``EXIT_FLUSH_S``; a forked child (not our thread) says nothing."""
        with self._lock:
            publisher = None if self._over else self.publisher
            self._over = True
        if publisher is None or os.getpid() != self.pid:
            return
        try:
            from ddpwatch.core.protocol import PROTOCOL_VERSION, Event
            from ddpwatch.core.vocabulary import EventKind, Phase

            publisher.publish(
                Event(
                    v=PROTOCOL_VERSION,
                    rank=self.rank,
                    t=time.time(),
                    event=EventKind.EXIT,
                    phase=Phase.STARTING,
                )
            )
            publisher.stop(timeout=EXIT_FLUSH_S)
        except Exception:
            pass

    def stop(self) -> None:
        """Stop sending; never waits (what is queued goes out on the sender's own thread)."""
        atexit.unregister(self._at_exit)
        with self._lock:
            self._over = True
            publisher = self.publisher
        if publisher is not None:
            publisher.stop(timeout=0)

    def _open(self) -> None:
        """On the early thread: everything that costs (imports, the socket) happens here."""
        try:
            from ddpwatch.agent.identity import identity_from_env
            from ddpwatch.agent.publisher import Publisher
            from ddpwatch.core.ports import resolve_endpoint
            from ddpwatch.core.protocol import PROTOCOL_VERSION, Hello

            fields = identity_from_env(self.environ, torch_version=False).as_fields()
            self._identity = {k: v for k, v in fields.items() if v is not None}
            endpoint = resolve_endpoint(self.environ.get("DDPWATCH_ADDR"))
            publisher = Publisher(endpoint, INTERVAL_S, self._beat)
            publisher.publish(
                Hello(v=PROTOCOL_VERSION, rank=self.rank, t=time.time(), **self._identity)
            )
            with self._lock:
                if self._over:
                    return  # the agent attached first: it says hello itself
                self.publisher = publisher
                publisher.start()
        except Exception:
            pass  # never a word into the user's job: the agent still attaches as before

    def _beat(self) -> list[AnyMessage]:
        """A heartbeat: who the rank is, phase 'starting', and its CPU time so far."""
        from ddpwatch.core.protocol import PROTOCOL_VERSION, Sample
        from ddpwatch.core.vocabulary import Phase

        return [
            Sample(
                v=PROTOCOL_VERSION,
                rank=self.rank,
                t=time.time(),
                phase=Phase.STARTING,
                cpu_s=time.process_time(),
                **self._identity,
            )
        ]


def start(rank: int, environ: Mapping[str, str] | None = None) -> bool:
    """Say hello as ``rank`` from a background thread; False (and nothing sent) on any error."""
    global _sender
    try:
        with _lock:
            if _sender is not None:
                return False
            sender = EarlySender(rank, os.environ if environ is None else environ)
            sender.start()
            _sender = sender
        return True
    except Exception:
        return False


def hand_over() -> None:
    """The agent's own publisher runs: stop the early sender, if this process has one."""
    global _sender
    with _lock:
        sender, _sender = _sender, None
    if sender is not None:
        with contextlib.suppress(Exception):
            sender.stop()
