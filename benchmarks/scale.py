"""A real server under a 2 Hz heartbeat load of thousands of ranks, with and without relays.

    python benchmarks/scale.py [--sizes 8192,32768,65536] [--modes relay,direct,nodes|none]
        [--seconds 20] [--warmup 10] [--procs 4] [--ranks-per-relay N] [--status-every 5]
        [--publisher-nice 5] [--no-offline] [--profile] [--node-fault dies|slow|late]
        [--pause-server S] [--json FILE]
        [--quick]

For each size, first **in memory**: every rank's heartbeats decoded and applied straight into a
``ServerState`` (no sockets) for 4 s of training and 3 s of a straggler, then ``diagnose``, the
status reply (document + JSON) and the dashboard's model build, timed in CPU time with nothing
else running. Then, for each mode, fresh processes (multiprocessing, spawn):

* **server host**: a real ``Server`` (``server/service.py``) on a free port pair, ``run()`` on a
  thread, as ``ddpwatch serve`` runs it. ``tick()`` is timed (wall and the thread's CPU), and so
  is the status reply built on the server thread (``Collector._reply``). The host's main
  thread samples the process's CPU time (the Python server thread plus libzmq's I/O thread),
  the server thread's own (``/proc/self/task/TID/stat``), VmHWM against the VmRSS baseline
  taken before the server started, and how stale the server's view is (now - ``last_seen``
  over the ranks). "ingest" = the server thread's CPU minus ticks and status replies.
* **publishers** (``--procs``): each simulates ``size / procs`` ranks and sends every rank's
  ``Sample`` at 2 Hz, beats spread uniformly over the 0.5 s period, once per rank per beat
  (the fields of ``ingest.make_frames``' GPU heartbeat: the identity on the first and every
  ``IDENTITY_EVERY``-th beat, step, loss, timings, memory, collective counts with the
  agent's step marks; assembled from pieces encoded once, see ``Beats``). Sends are
  non-blocking like the agent's (``Again``: the beat is dropped at the sender). ``direct``:
  one PUSH socket per process to the server's TCP port (the server sees ``procs``
  connections, not one per rank). ``relay``: the process runs one ``ddpwatch.relay.Relay``
  per ``--ranks-per-relay`` ranks on threads (default: one relay per process, carrying all
  its ranks), its ranks PUSH to them over ``ipc://`` and the relays send ``Batch`` frames to
  the server every beat. Relays stop only once the server has drained its queue.
  ``nodes``: what per-node relays on other machines would send, without running them here:
  every beat, one ``Batch`` per simulated node of ``RANKS_PER_NODE`` ranks (8,192 relays at
  65,536 ranks, each named and sequenced as a relay; its ranks' frames aged over the beat as
  they would have waited in it), each node on a connection of its own, queued as a relay's
  (``UPSTREAM_HWM``, ``UPSTREAM_KERNEL_BYTES``); a batch the server does not take is
  coalesced as a held-back relay does (``NodeBatches``). The server's work, connections and
  queues are those of real per-node relays; the machine running the benchmark is spared
  8,192 relay threads.
* **status prober**: a ``StatusClient`` REQ (``b"status"``, as ``ddpwatch status``) every
  ``--status-every`` s, timed; on a few replies, the dashboard's model build (decode, header
  summary, alert index, history rings, worst-first rows: ``tui/data/model.py``; drawing the
  visible rows is not included, ``tui_tick.py`` measures it).

``--node-fault`` (``nodes`` only) strikes one node half the job away from the culprit's: it
``dies`` (its relay and ranks go silent) 3 s before the straggler's onset, and only
``relay_lost`` or ``silent`` may name its ranks, once it is gone (how soon: "named ... s after
it died"); or it is ``slow`` (every batch it sends arrives 2 s late, all run, its frames'
``ages_us`` saying they waited that long in the relay) or ``late`` (the same 2 s spent in
transit after the relay sent them, which no age tells), and nothing may name its ranks.
Either way the straggler must still be named, and nobody else.

The simulated relays follow the pace the server asks (``server/pace.py``: one batch every
second beat while it is behind), as relays do; ``--no-pace`` has them ignore it.

``--pause-server S`` stops the server's process (SIGSTOP, as a suspended laptop or a
starved host would) for ``S`` seconds, ending ``PAUSE_ENDS_BEFORE_S`` before the straggler's
onset, then lets it go on (SIGCONT): the senders' queues fill, relays are held back, and the
server catches up on what waited. Nothing may be named but the straggler, and its RSS peak is
the one that counts ("also when the server is paused 10 s", #35).

Publishers, relays and the prober run ``--publisher-nice`` steps nicer than the server: they
stand for other machines, so on a small machine the server gets the CPU first.

Ranks train in lockstep (0.25 s steps, one all_reduce per step). After ``--warmup`` s one
random rank stops before its next all_reduce while it keeps sending heartbeats; every other
rank blocks in that all_reduce (``Sample.collective`` with ``since_s``, ``collectives.py``
one ahead of the culprit's). Culprit latency = first tick whose alerts name exactly that rank,
minus the onset; any alert naming another rank during the run is a wrong blame.

One row per (size, mode). Offered = frames the publishers handed to ZeroMQ (their achieved
rate: on a small machine they cannot always offer 2 x ranks per second, which the output
says); accepted/s = ``state.received`` (inner frames of batches count one each) over the
run; drops = offered - received once the server drained its queue.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import itertools
import json
import math
import multiprocessing as mp
import os
import pstats
import random
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ingest import gpu_identity  # benchmarks/ is on the path: these run as scripts

BEAT_S = 0.5  # the agent's heartbeat interval
STEP_S = 0.25  # the simulated job's step time
RANKS_PER_NODE = 8
MAX_RELAYS_PER_PROC = 64  # each Relay has its own ZeroMQ context (an I/O thread) and thread
START_MARGIN_S = 1.0  # between "every process is ready" and the first beat
PAUSE_ENDS_BEFORE_S = 2.0  # ``--pause-server``: the pause ends this long before the onset
NODE_DIES_BEFORE_S = 3.0  # ``--node-fault dies``: the node goes silent this long before onset
SLOW_NODE_S = 2.0  # ``--node-fault slow`` or ``late``: how much later the node's batches arrive
NODE_LOST_KINDS = frozenset({"relay_lost", "silent"})
"""What may name a dead node's ranks (``--node-fault dies``): any other alert naming them is
a wrong blame, as is any alert naming a slow node's."""
DRAIN_MAX_S = 30.0  # after the run: how long the server may take to empty its queue
DRAIN_QUIET_S = 3.0  # drained: nothing new for this long (longer than a tick or a status reply)


# ------------------------------------------------------------------------------ publishers


@dataclass
class PublisherSpec:
    proc: int
    lo: int
    hi: int
    world: int
    mode: str
    upstream: str
    ranks_per_relay: int
    culprit: int
    nice: int = 0
    fault: str | None = None  # ``--node-fault``: "dies" or "slow", for ``fault_node``
    fault_node: int = -1  # the node (first rank // RANKS_PER_NODE) the fault is on
    pace: bool = True  # ``nodes``: follow the server's pace, as relays do (``--no-pace``: not)


@dataclass
class PublisherResult:
    offered: int = 0
    sender_drops: int = 0  # zmq.Again on a non-blocking send: the beat is lost at the sender
    coalesced: int = 0  # left out by a relay (simulated or real) held back, counted by it
    pace_max: int = 1  # the slowest pace the simulated relays were asked for
    paced_beats: int = 0  # node-beats they let pass at the server's pace
    skipped: int = 0  # beats never offered because the process ran more than a beat behind
    intended: int = 0  # beats the schedule asked for
    cpu_s: float = 0.0  # the whole process (publisher loop, relays, ZeroMQ threads)
    relay_cpu_s: float = 0.0  # the relays' Python threads
    relays: int = 0
    relay_received: int = 0
    relay_forwarded: int = 0
    relay_dropped: int = 0
    relay_batches: int = 0
    relay_pending_at_stop: int = 0
    relay_reconnects: int = 0
    relay_detail: list[tuple[str, int, int]] = field(default_factory=list)  # name, batches, fwd


def _step_at(t: float, t0: float) -> int:
    return int((t - t0) / STEP_S) + 1


def _marks(step: int) -> list[tuple[int, int]] | None:
    """The agent's step marks: (step, collectives entered) every MARK_EVERY steps, last 16."""
    from ddpwatch.core.protocol import MARK_EVERY

    last = step // MARK_EVERY
    marks = [(m * MARK_EVERY, m * MARK_EVERY) for m in range(max(1, last - 15), last + 1)]
    return marks or None


class Beats:
    """Builds each rank's heartbeat once per beat: a MessagePack map assembled from pieces,
    the fields all ranks share at a step (encoded once per step), each rank's own and its
    identity (once per rank; the identity goes in every ``IDENTITY_EVERY``-th beat), and the
    send time (and a waiting rank's ``since_s``) packed per frame.
    ``__init__`` checks that each kind decodes to the same message as the ``Sample`` built
    and encoded by msgspec (``sample``)."""

    def __init__(self, spec: PublisherSpec, t0: float, onset: float) -> None:
        import struct

        import msgspec

        from ddpwatch.agent.watcher import IDENTITY_EVERY
        from ddpwatch.core.protocol import PROTOCOL_VERSION, Collective, CollectiveCounts, Sample

        self.spec = spec
        self.t0, self.onset = t0, onset
        self.identity_every = IDENTITY_EVERY
        self.v = PROTOCOL_VERSION
        self.Sample, self.Collective, self.Counts = Sample, Collective, CollectiveCounts
        self.onset_step = _step_at(onset, t0)
        self._counts: dict[int, Any] = {}
        self._enc = msgspec.msgpack.encode
        self._double = struct.Struct(">d").pack
        self._bodies: dict[tuple[int, int], bytes] = {}
        self._tails: dict[int, bytes] = {}
        self._identities: dict[int, tuple[int, bytes]] = {}
        enc = self._enc
        self._head = enc("type") + enc("sample") + enc("v") + enc(self.v) + enc("t") + b"\xcb"
        self._since_key = enc("collective") + b"\x84" + enc("op") + enc("all_reduce")
        self._since_mid = enc("since_s") + b"\xcb"
        self._since_end = enc("source") + enc("py")
        self._check(msgspec.msgpack.decode)

    def _check(self, decode: Any) -> None:
        from ddpwatch.core.protocol import decode as decode_message

        ranks = {self.spec.lo, self.spec.hi - 1, self.spec.culprit}
        for now in (self.t0 + 1.3, self.onset + 1.7):
            for rank, cycle in itertools.product(ranks, (0, 1)):
                fast = decode_message(self.frame(rank, cycle, now))
                slow = decode_message(self._enc(self.sample(rank, cycle, now)))
                if fast != slow:
                    raise AssertionError(f"pre-encoded beat differs: {fast} != {slow}")

    def counts(self, py: int, step: int) -> Any:
        found = self._counts.get(py)
        if found is None:
            found = self._counts[py] = self.Counts(py=py, marks=_marks(step))
        return found

    def identity(self, rank: int) -> dict[str, Any]:
        identity = gpu_identity(
            rank, self.spec.world, host=f"node-{rank // RANKS_PER_NODE}", pid=100_000 + rank
        )
        identity["job_id"] = "bench-scale"
        return identity

    def where(self, rank: int, now: float) -> tuple[int, int, bool]:
        """(step, collectives entered, waiting in all_reduce #step+1) of ``rank`` at ``now``."""
        if now < self.onset:
            step = _step_at(now, self.t0)
            return step, step, False
        step = self.onset_step  # nobody finishes another step
        if rank == self.spec.culprit:  # stopped before its next all_reduce
            return step, step, False
        return step, step + 1, True  # blocked in that all_reduce since the onset

    def shared(self, step: int, py: int) -> dict[str, Any]:
        """The fields every rank at this step sends alike (in ``Sample``'s order)."""
        return dict(
            phase="train",
            step=step,
            loss=2.5 / (1 + step * 1e-3),
            step_time_s=STEP_S,
            avg_step_time_s=STEP_S,
            data_wait_s=0.002,
            collective_time_s=0.03,
            collectives=self.counts(py, step),
            forwards=step,
            mem_reserved_bytes=48_000_000_000,
            mem_peak_bytes=45_000_000_000,
            gpu_mem_used_bytes=50_000_000_000,
            gpu_mem_total_bytes=85_000_000_000,
        )

    @staticmethod
    def own(rank: int) -> dict[str, Any]:
        return dict(mem_allocated_bytes=40_000_000_000 + rank, gpu_pids=[100_000 + rank])

    def sample(self, rank: int, cycle: int, now: float) -> Any:
        """Rank ``rank``'s ``cycle``-th heartbeat, sent at ``now``, as a ``Sample``."""
        identity = self.identity(rank) if cycle % self.identity_every == 0 else {}
        step, py, waiting = self.where(rank, now)
        collective = (
            self.Collective(op="all_reduce", seq=step + 1, since_s=now - self.onset, source="py")
            if waiting
            else None
        )
        return self.Sample(
            v=self.v,
            rank=rank,
            t=now,
            **identity,
            collective=collective,
            **self.shared(step, py),
            **self.own(rank),
        )

    def frame(self, rank: int, cycle: int, now: float, with_identity: bool | None = None) -> bytes:
        """The same heartbeat, assembled from pieces encoded once (with the identity when
        ``with_identity`` says, else on every ``IDENTITY_EVERY``-th beat)."""
        step, py, waiting = self.where(rank, now)
        enc = self._enc
        body = self._bodies.get((step, py))
        if body is None:
            body = b"".join(enc(k) + enc(v) for k, v in self.shared(step, py).items())
            self._bodies[(step, py)] = body
        tail = self._tails.get(rank)
        if tail is None:
            own = {"rank": rank, **self.own(rank)}
            tail = self._tails[rank] = b"".join(enc(k) + enc(v) for k, v in own.items())
        pairs = 3 + 13 + 3  # type, v, t; shared; rank and its own
        parts = [b"", self._head, self._double(now), body, tail]
        if with_identity is None:
            with_identity = cycle % self.identity_every == 0
        if with_identity:
            found = self._identities.get(rank)
            if found is None:
                identity = self.identity(rank)
                encoded = b"".join(enc(k) + enc(v) for k, v in identity.items())
                found = self._identities[rank] = (len(identity), encoded)
            pairs += found[0]
            parts.append(found[1])
        if waiting:
            pairs += 1
            parts += (
                self._since_key,
                enc("seq") + enc(step + 1),
                self._since_mid,
                self._double(now - self.onset),
                self._since_end,
            )
        parts[0] = b"\xde" + pairs.to_bytes(2, "big")  # a map16 header
        return b"".join(parts)

    def alone(self, i: int, cycle: int, now: float) -> tuple[bytes, int]:
        """The ``i``-th rank's heartbeat as a frame of its own (direct, or to a relay)."""
        return self.frame(self.spec.lo + i, cycle, now), 1


class NodeBatches:
    """What a per-node relay on each simulated node sends: every beat, one ``Batch`` of its
    ``RANKS_PER_NODE`` ranks' heartbeats, as ``relay.Relay._send`` builds it. The node's
    ranks beat at phases spread over the beat, so each frame has waited in the relay for
    part of a beat (``ages_us``) and is dated that much earlier (``t``). A batch the server
    does not take (``refused``: its socket is full) is coalesced as the held-back relay
    does: the node's next batch carries its ranks' newest heartbeats, with their identity if
    the refused one had it, and counts the refused ones in ``coalesced``."""

    def __init__(self, beats: Beats, context: Any) -> None:
        from ddpwatch.core.protocol import PROTOCOL_VERSION, Batch, encode
        from ddpwatch.relay_pacer import Pacer

        self.beats = beats
        spec = beats.spec
        self.pacer = Pacer(context, spec.upstream) if spec.pace else None
        """One asker for the process's nodes (a real relay asks for itself: the server's cost
        of answering thousands of relays is measured apart, ``test_pace``)."""
        self.every = 1
        self.pace_max = 1
        self.paced_beats = 0
        self.fault = spec.fault
        self.fault_index = spec.fault_node - spec.lo // RANKS_PER_NODE  # this process's, or not
        self.late: deque[tuple[float, int, bytes]] = deque()  # a slow node's batches, when due
        self.lo, self.hi = beats.spec.lo, beats.spec.hi
        self.count = math.ceil((self.hi - self.lo) / RANKS_PER_NODE)
        self.v, self.Batch, self.encode = PROTOCOL_VERSION, Batch, encode
        self.ages_us = [int(BEAT_S * 1e6 * k / RANKS_PER_NODE) for k in range(RANKS_PER_NODE)]
        self.owed = [0] * self.count  # heartbeats coalesced into the node's next batch
        self.owe_identity = [False] * self.count
        self.seq = [0] * self.count
        self.coalesced = 0  # counted in batches the server took

    def batch(self, node: int, cycle: int, now: float) -> tuple[bytes | None, int]:
        """The node's batch of this beat; None for the faulty node's (``--node-fault``):
        once it died, nothing; slow or late, its batch leaves ``SLOW_NODE_S`` later (``due``),
        its frames' ages saying so (slow: the relay held them) or not (late: in transit). A
        beat the server's pace skips sends nothing: the node's ranks are coalesced into its next
        batch, as a relay at that pace does."""
        if self.every > 1 and cycle % self.every:
            first = self.lo + node * RANKS_PER_NODE
            heartbeats = min(self.hi, first + RANKS_PER_NODE) - first
            self.refused(node, cycle, heartbeats)
            self.paced_beats += 1
            return None, heartbeats
        if node == self.fault_index and self.fault is not None:
            if self.fault == "dies":
                if now >= self.beats.onset - NODE_DIES_BEFORE_S:
                    return None, 0
            else:
                held = SLOW_NODE_S if self.fault == "slow" else 0.0
                frame, heartbeats = self._batch(node, cycle, now, held)
                self.late.append((now + SLOW_NODE_S, node, frame))
                return None, heartbeats
        return self._batch(node, cycle, now)

    def poll_pace(self) -> None:
        """Take the server's pace, if it has answered."""
        if self.pacer is not None:
            self.pacer.poll(time.monotonic())
            self.every = self.pacer.every
            self.pace_max = max(self.pace_max, self.every)

    def due(self, now: float) -> list[tuple[int, bytes]]:
        """The slow node's batches whose time has come."""
        out = []
        while self.late and self.late[0][0] <= now:
            _, node, frame = self.late.popleft()
            out.append((node, frame))
        return out

    def _batch(self, node: int, cycle: int, now: float, held: float = 0.0) -> tuple[bytes, int]:
        first = self.lo + node * RANKS_PER_NODE
        ranks = range(first, min(self.hi, first + RANKS_PER_NODE))
        ages = self.ages_us[: len(ranks)]
        identity = self.owe_identity[node] or cycle % self.beats.identity_every == 0
        frames = [
            self.beats.frame(rank, cycle, now - age / 1e6, identity)
            for rank, age in zip(ranks, ages, strict=True)
        ]
        plain = [] if identity else list(range(len(frames)))  # finite losses: plain but those
        told = [age + int(held * 1e6) for age in ages]  # a relay that held them says how long
        return self._encoded(node, now, frames, told, list(ranks), plain), len(frames)

    def _encoded(
        self,
        node: int,
        now: float,
        frames: list[bytes] | None = None,
        ages: list[int] | None = None,
        ranks: list[int] | None = None,
        plain: list[int] | None = None,
    ) -> bytes:
        """Node ``node``'s next batch, named and sequenced as its relay's, with what it owes
        and, as a relay says them, its frames' ranks and plain heartbeats (``Batch.plain``)."""
        name = f"node-{(self.lo + node * RANKS_PER_NODE) // RANKS_PER_NODE}"
        batch = self.Batch(
            v=self.v, relay=f"{name}:1", t=now, host=name, seq=self.seq[node],
            frames=frames or [], ages_us=ages or [], coalesced=self.owed[node],
            ranks=ranks or [], plain=plain or [], every=self.every,
        )  # fmt: skip
        return self.encode(batch)

    def taken(self, node: int) -> None:
        self.seq[node] += 1
        self.coalesced += self.owed[node]
        self.owed[node], self.owe_identity[node] = 0, False

    def refused(self, node: int, cycle: int, heartbeats: int) -> None:
        self.owed[node] += heartbeats
        self.owe_identity[node] |= cycle % self.beats.identity_every == 0

    def flush(self, sockets: list[Any], deadline: float) -> None:
        """After the run, what the nodes still owe leaves in an empty batch each (a relay
        sends what it holds until it stops)."""
        import zmq

        for node in range(self.count):
            while self.owed[node] and time.time() < deadline:
                try:
                    sockets[node].send(self._encoded(node, time.time()), zmq.NOBLOCK)
                except zmq.Again:
                    sockets[node].poll(100, zmq.POLLOUT)
                    continue
                self.taken(node)


def publisher(conn: Connection, spec: PublisherSpec) -> None:
    """Child process: ready its sockets (and relays), then beat every rank until told times."""
    import zmq

    from ddpwatch.relay import Relay

    os.nice(spec.nice)
    result = PublisherResult()
    context = zmq.Context()
    n = spec.hi - spec.lo
    sockets: list[Any] = []
    relays: list[tuple[Any, threading.Thread, list[float]]] = []
    stop = threading.Event()
    directory = tempfile.mkdtemp(prefix="ddpwatch-scale-")
    try:
        if spec.mode == "relay":
            for k, first in enumerate(range(spec.lo, spec.hi, spec.ranks_per_relay)):
                listen = f"ipc://{directory}/relay-{k}.sock"
                relay = Relay(spec.upstream, listen, beat_s=BEAT_S, host=f"node-{first // 8}")
                cpu: list[float] = []
                thread = threading.Thread(target=_run_relay, args=(relay, stop, cpu), daemon=True)
                thread.start()
                relays.append((relay, thread, cpu))
                sockets.append(_push(context, listen, spec.ranks_per_relay))
            per_socket = spec.ranks_per_relay
        elif spec.mode == "nodes":  # a connection per node, as a relay's: its queues, its share
            nodes = math.ceil(n / RANKS_PER_NODE)
            context.set(zmq.MAX_SOCKETS, nodes + 64)
            sockets.extend(_push(context, spec.upstream, 0, relay=True) for _ in range(nodes))
            per_socket = 1
        else:
            sockets.append(_push(context, spec.upstream, n))
            per_socket = n
        conn.send("ready")
        t0, onset, end = conn.recv()
        beats = Beats(spec, t0, onset)
        build: Callable[[int, int, float], tuple[bytes | None, int]] = beats.alone
        units = n
        batches = None
        if spec.mode == "nodes":
            batches = NodeBatches(beats, context)
            build, units = batches.batch, batches.count
            result.relays = units
        cpu0 = time.process_time()
        sent = _beat_loop(units, build, sockets, per_socket, t0, end, result, batches)
        if batches is not None:
            batches.flush(sockets, time.time() + 10.0)
            result.coalesced = batches.coalesced
            result.pace_max, result.paced_beats = batches.pace_max, batches.paced_beats
            if batches.pacer is not None:
                batches.pacer.close()
            result.sender_drops += sum(batches.owed)  # never taken, even after the run
        deadline = time.time() + 5.0  # let frames in flight reach their relay and leave it
        while relays and time.time() < deadline:
            taken = all(r.stats.received >= s for (r, _, _), s in zip(relays, sent, strict=True))
            if taken and not any(r._pending for r, _, _ in relays):
                break
            time.sleep(0.05)
        result.cpu_s = time.process_time() - cpu0
        conn.send("flushed")
        conn.recv()  # the server has drained its queue: the relays may stop
        stop.set()
        for relay, thread, cpu in relays:
            thread.join(10)
            result.relays += 1
            result.relay_cpu_s += cpu[0] if cpu else math.nan
            result.relay_received += relay.stats.received
            result.relay_forwarded += relay.stats.forwarded
            result.relay_dropped += relay.stats.dropped
            result.coalesced += relay.stats.coalesced
            result.relay_batches += relay.stats.batches
            result.relay_pending_at_stop += len(relay._pending)
            result.relay_reconnects += relay.stats.reconnects
            result.relay_detail.append((relay.name, relay.stats.batches, relay.stats.forwarded))
    finally:
        for sock in sockets:
            sock.close(linger=2000)
        for relay, _, _ in relays:
            relay.close()
        context.term()
        shutil.rmtree(directory, ignore_errors=True)
    conn.send(asdict(result))


def _push(context: Any, endpoint: str, ranks: int, relay: bool = False) -> Any:
    """A sender's socket: a rank's or a process's (a second of its ranks' beats queued), or
    with ``relay`` a simulated node's relay's, queued as a relay's are."""
    import zmq

    from ddpwatch.relay import UPSTREAM_HWM, UPSTREAM_KERNEL_BYTES

    sock = context.socket(zmq.PUSH)
    if relay:
        sock.setsockopt(zmq.SNDHWM, UPSTREAM_HWM)
        sock.setsockopt(zmq.SNDBUF, UPSTREAM_KERNEL_BYTES)
    else:
        sock.setsockopt(zmq.SNDHWM, max(1000, 2 * ranks))
    sock.connect(endpoint)
    return sock


def _run_relay(relay: Any, stop: threading.Event, cpu: list[float]) -> None:
    """``Relay.run`` on this thread, then note the thread's CPU time (for the relay's cost)."""
    try:
        relay.run(stop)
    finally:
        cpu.append(time.thread_time())


def _beat_loop(
    units: int,
    build: Callable[[int, int, float], tuple[bytes | None, int]],
    sockets: list[Any],
    per_socket: int,
    t0: float,
    end: float,
    result: PublisherResult,
    nodes: NodeBatches | None = None,
) -> list[int]:
    """Send unit i's beat (a rank's heartbeat, or a node's batch: ``build(i, cycle, now)``
    gives the frame and the heartbeats in it) g = cycle * units + i at t0 + g * BEAT_S /
    units: every unit once per beat, uniformly spread; more than one beat behind, skip
    ahead (counted in ``skipped``, in units). A frame the socket does not take is lost at
    the sender (``sender_drops``), or for ``nodes`` coalesced into the node's next batch.
    Returns the frames each socket took."""
    import zmq

    noblock = zmq.NOBLOCK
    n = units
    sent = [0] * len(sockets)
    g = 0
    while True:
        now = time.time()
        if now >= end:
            break
        due = int((now - t0) / BEAT_S * n) + 1 if now >= t0 else 0
        if due - g > n:
            result.skipped += due - n - g
            g = due - n
        chunk_end = min(due, g + 2000)  # look at the clock again every 2,000 frames
        if nodes is not None:
            nodes.poll_pace()
        if nodes is not None and nodes.late:
            for i, frame in nodes.due(now):  # a slow node's batches, late
                try:
                    sockets[i].send(frame, noblock)
                    sent[i] += 1
                except zmq.Again:
                    result.sender_drops += RANKS_PER_NODE
        while g < chunk_end:
            cycle, i = divmod(g, n)
            frame, heartbeats = build(i, cycle, now)
            if frame is None:  # the faulty node: dead, or its batch leaves later
                result.offered += heartbeats
                g += 1
                continue
            k = i // per_socket
            try:
                sockets[k].send(frame, noblock)
                sent[k] += 1
                if nodes is not None:
                    nodes.taken(i)
            except zmq.Again:
                if nodes is not None:
                    nodes.refused(i, cycle, heartbeats)
                else:
                    result.sender_drops += heartbeats
            result.offered += heartbeats
            g += 1
        if g >= due:
            time.sleep(min(0.005, max(0.0, t0 + (g + 1) * BEAT_S / n - time.time())))
    result.intended = int((end - t0) / BEAT_S * n)
    return sent


# ------------------------------------------------------------------------------ server host


def _proc_status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _thread_cpu(tid: int) -> float:
    """utime + stime of one thread of this process, in seconds (clock ticks)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_host(conn: Connection, profile: bool = False) -> None:
    """Child process: a real Server on a thread, instrumented; answers the orchestrator.
    ``profile``: run the server thread under cProfile and send back its top functions."""
    from ddpwatch.core.ports import free_port_pair
    from ddpwatch.server.service import Server

    class TimedServer(Server):
        """Times each diagnosis tick and notes every alert when it first appears."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.ticks: list[tuple[float, float, float, int]] = []  # (end, wall, cpu, ranks)
            self.first_alerts: dict[tuple[str, tuple[int, ...]], tuple[float, str]] = {}
            self.answers: list[tuple[float, float, float]] = []  # (end, wall, cpu)
            reply = self.collector._reply

            def timed_reply(request: bytes) -> bytes:  # status replies, not the relays' pace
                c0, w0 = time.thread_time(), time.perf_counter()
                answer = reply(request)
                if request.strip() == b"status":
                    self.answers.append(
                        (time.time(), time.perf_counter() - w0, time.thread_time() - c0)
                    )
                return answer

            self.collector._reply = timed_reply  # type: ignore[method-assign]

        def tick(self) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            changes = super().tick()
            wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
            now = time.time()
            self.ticks.append((now, wall, cpu, len(self.state.ranks)))
            for alert in self.alerts:
                if alert.key not in self.first_alerts:
                    self.first_alerts[alert.key] = (now, alert.severity)
            return changes

    baseline = _proc_status("VmRSS")
    port = free_port_pair()
    server = TimedServer(port=port)
    profiler = cProfile.Profile() if profile else None
    target = server.run if profiler is None else lambda: profiler.runcall(server.run)
    thread = threading.Thread(target=target, name="ddpwatch-server", daemon=True)
    thread.start()
    conn.send(("ready", port))
    t0, end = conn.recv()
    view_age: list[tuple[float, float, float]] = []  # (time, median, max) of now - last_seen
    marks: dict[str, tuple[float, float, float, int]] = {}
    tid = thread.native_id or 0

    def mark(name: str) -> None:
        marks[name] = (time.time(), _process_cpu(), _thread_cpu(tid), server.state.received)

    next_age = t0 + 2.0
    while time.time() < t0:
        time.sleep(min(0.05, max(0.0, t0 - time.time())))
    mark("start")
    while time.time() < end:
        time.sleep(min(0.2, max(0.0, end - time.time())))
        now = time.time()
        if now >= next_age and now < end - 0.5:
            next_age = now + 2.0
            with contextlib.suppress(RuntimeError):  # the dict grew meanwhile: next time
                ages = [now - r.last_seen for r in list(server.state.ranks.values())]
                if ages:
                    view_age.append((now, statistics.median(ages), max(ages)))
    mark("end")
    conn.recv()  # the publishers are done: wait for the server to empty its queue
    started, changed = time.time(), time.time()
    last = server.state.received
    while time.time() - started < DRAIN_MAX_S and time.time() - changed < DRAIN_QUIET_S:
        time.sleep(0.25)
        if server.state.received != last:
            last, changed = server.state.received, time.time()
    drained_s = changed - marks["end"][0]
    server.stop()
    thread.join(10)
    state = server.state
    rss, hwm = _proc_status("VmRSS"), _proc_status("VmHWM")
    alerts = [
        (kind, list(ranks), first, severity)
        for (kind, ranks), (first, severity) in server.first_alerts.items()
    ]
    ticks, answers = list(server.ticks), list(server.answers)
    offline = _offline_costs(server, marks["end"][0])
    profiled = ""
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        profiled = text.getvalue()
    conn.send(
        {
            "port": port,
            "baseline_rss": baseline,
            "rss": rss,
            "hwm": hwm,
            "offline": offline,
            "profile": profiled,
            "marks": marks,
            "received": state.received,
            "rejected": state.rejected,
            "shed": state.shed,
            "ranks_known": len(state.ranks),
            "relays_known": len(state.relays),
            "relay_lost_batches": sum(r.lost_batches for r in state.relays.values()),
            "relay_dropped": sum(r.dropped for r in state.relays.values()),
            "relay_detail": [
                (r.name, r.batches, r.frames, r.next_seq, r.lost_batches)
                for r in state.relays.values()
            ],
            "ticks": ticks,
            "answers": answers,
            "alerts": alerts,
            "view_age": view_age,
            "drained_s": drained_s,
        }
    )


def _offline_costs(server: Any, frozen: float, reps: int = 3) -> dict[str, float]:
    """CPU time of a diagnosis tick and of a status reply on the final state, with the
    server stopped (nothing else on its thread) and its clock frozen at the end of the run
    (diagnosis sees the state as it was then); medians of ``reps``."""
    server.engine.clock = lambda: frozen
    tick, status = [], []
    for _ in range(reps):
        c0 = time.thread_time()
        server.tick()
        tick.append(time.thread_time() - c0)
        c0 = time.thread_time()
        server.status_json()
        status.append(time.thread_time() - c0)
    return {"tick_cpu_s": statistics.median(tick), "status_cpu_s": statistics.median(status)}


# ------------------------------------------------------------------------------ status prober


def prober(conn: Connection, port: int, every: float, models: int, nice: int) -> None:
    """Child process: time status requests; build the dashboard's model on a few replies."""
    os.nice(nice)
    from ddpwatch.status.client import StatusClient
    from ddpwatch.status.query import Query

    client = StatusClient("127.0.0.1", port, timeout=60.0)
    history = _new_history()
    t0, end = conn.recv()
    latencies: list[tuple[float, float, int]] = []  # (time, seconds, reply bytes)
    summaries: list[float] = []  # seconds
    model: list[float] = []
    failed = 0
    next_at = t0 + min(2.0, every)
    n = 0
    while True:
        now = time.time()
        if now < next_at:
            time.sleep(max(0.0, min(next_at, end) - now))  # none after the end: stop then
        if time.time() >= end:
            break
        started = time.perf_counter()
        reply = client.request()
        elapsed = time.perf_counter() - started
        next_at = max(next_at + every, time.time() + 0.1)
        if reply is None:
            failed += 1
            continue
        latencies.append((time.time(), elapsed, len(reply)))
        started = time.perf_counter()
        if client.request(Query.parse("view=summary")) is not None:  # as ddpwatch status --summary
            summaries.append(time.perf_counter() - started)
        n += 1
        if len(model) < models and n % 2 == 0:
            model.append(_model_build(reply, history))
    client.close()
    conn.send({"latencies": latencies, "summaries": summaries, "model": model, "failed": failed})


# ------------------------------------------------------------------------------ one run


@dataclass
class Row:
    ranks: int
    mode: str
    relays: int
    ranks_per_relay: int | None
    seconds: float
    target_rate: float
    offered_rate: float
    accepted_rate: float
    offered: int
    received: int
    drops: int
    sender_drops: int
    coalesced: int
    skipped: int
    rejected: int
    shed: int  # of received: counted from their head, the server far behind
    server_cores: float
    thread_cores: float
    ingest_cores: float
    tick_median_ms: float
    tick_p99_ms: float
    tick_cpu_median_ms: float
    tick_gap_s: float  # the longest time without a diagnosis tick
    ticks_in_window: int
    ticks: int
    tick_cores: float
    status_ms: float | None
    summary_ms: float | None  # a status?view=summary request, as ddpwatch status --summary
    status_build_ms: float | None
    status_mb: float | None
    status_failed: int
    model_ms: float | None
    rss_mib: float
    baseline_mib: float
    hwm_mib: float
    offline_tick_ms: float
    offline_status_ms: float
    us_per_frame: float | None  # server-thread CPU per accepted frame, ticks and status aside
    view_age_median_s: float | None
    view_age_max_s: float | None
    publisher_cores: float
    relay_cores: float
    relay_dropped: int
    relay_lost_batches: int
    relay_received: int
    relay_forwarded: int
    relay_pending_at_stop: int
    relay_reconnects: int
    relay_short: list[str]
    drained_s: float
    culprit: int
    culprit_latency_s: float | None
    culprit_late_s: float | None  # named only after the run ended: this long after the onset
    culprit_kind: str | None
    wrong: dict[str, list[int]] = field(default_factory=dict)
    wrong_at: dict[str, float] = field(default_factory=dict)
    fault: str | None = None  # ``--node-fault``
    paused_s: float = 0.0  # ``--pause-server``: how long the server's process was stopped
    pace_max: int = 1  # ``nodes``: the slowest pace the server asked of the simulated relays
    paced_beats: int = 0  # node-beats left out at that pace (their ranks coalesced)
    fault_named_s: float | None = None  # the dead node named (relay_lost, silent) after it died
    view_ages: list[tuple[float, float, float]] = field(default_factory=list)
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    profile: str = ""


def _percentile(values: list[float], q: float) -> float:
    data = sorted(values)
    if not data:
        return math.nan
    return data[min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))]


def pick_culprit(size: int, seed: int) -> int:
    return random.Random(seed * 1_000_003 + size).randrange(size)


def fault_node(size: int, culprit: int) -> int:
    """The node ``--node-fault`` strikes: half the job away from the culprit's."""
    nodes = math.ceil(size / RANKS_PER_NODE)
    return (culprit // RANKS_PER_NODE + nodes // 2) % nodes


def fault_ranks(size: int, culprit: int) -> list[int]:
    first = fault_node(size, culprit) * RANKS_PER_NODE
    return list(range(first, min(size, first + RANKS_PER_NODE)))


def run_one(
    size: int,
    mode: str,
    args: argparse.Namespace,
    ctx: Any,
) -> Row:
    procs = max(1, min(args.procs, size))
    per_proc = math.ceil(size / procs)
    rpr = args.ranks_per_relay or per_proc
    culprit = pick_culprit(size, args.seed)

    host_end, host_child = ctx.Pipe()
    host = ctx.Process(target=server_host, args=(host_child, args.profile), daemon=True)
    host.start()
    _, port = host_end.recv()
    upstream = f"tcp://127.0.0.1:{port}"

    pubs = []
    for p in range(procs):
        lo, hi = p * per_proc, min(size, (p + 1) * per_proc)
        if lo >= hi:
            break
        spec = PublisherSpec(
            p, lo, hi, size, mode, upstream, rpr, culprit, args.publisher_nice,
            args.node_fault, fault_node(size, culprit) if args.node_fault else -1, args.pace,
        )  # fmt: skip
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=publisher, args=(child, spec), daemon=True)
        proc.start()
        pubs.append((proc, parent))
    probe_end, probe_child = ctx.Pipe()
    probe = ctx.Process(
        target=prober,
        args=(probe_child, port, args.status_every, args.models, args.publisher_nice),
        daemon=True,
    )
    probe.start()
    try:
        for _, parent in pubs:
            if parent.recv() != "ready":
                raise RuntimeError("a publisher failed to start")
        t0 = time.time() + START_MARGIN_S
        onset, end = t0 + args.warmup, t0 + args.seconds
        host_end.send((t0, end))
        probe_end.send((t0, end))
        for _, parent in pubs:
            parent.send((t0, onset, end))
        pause = None
        if args.pause_server:
            pause = threading.Thread(
                target=_pause_process,
                args=(host.pid, onset - PAUSE_ENDS_BEFORE_S - args.pause_server, args.pause_server),
                daemon=True,
            )
            pause.start()
        for _, parent in pubs:
            if parent.recv() != "flushed":
                raise RuntimeError("a publisher failed")
        load = os.getloadavg()
        if pause is not None:
            pause.join()
        host_end.send("drain")
        server = host_end.recv()
        for _, parent in pubs:
            parent.send("stop")
        results = [PublisherResult(**parent.recv()) for _, parent in pubs]
        probed = probe_end.recv()
    finally:
        for proc, _ in pubs:
            proc.join(10)
        host.join(10)
        probe.join(10)
        for proc in [p for p, _ in pubs] + [host, probe]:
            if proc.is_alive():
                proc.kill()
    return summarize_run(size, mode, args, rpr, culprit, onset, results, server, probed, load)


def _pause_process(pid: int | None, at: float, seconds: float) -> None:
    """``--pause-server``: SIGSTOP the server's process at ``at`` (wall clock), SIGCONT it
    ``seconds`` later."""
    if pid is None:
        return
    time.sleep(max(0.0, at - time.time()))
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def summarize_run(
    size: int,
    mode: str,
    args: argparse.Namespace,
    rpr: int,
    culprit: int,
    onset: float,
    results: list[PublisherResult],
    server: dict[str, Any],
    probed: dict[str, Any],
    load: tuple[float, float, float],
) -> Row:
    (t_start, cpu_start, thread_start, recv_start) = server["marks"]["start"]
    (t_end, cpu_end, thread_end, recv_end) = server["marks"]["end"]
    wall = t_end - t_start
    offered = sum(r.offered for r in results)
    window = [t for t in server["ticks"] if t_start <= t[0] <= t_end]
    stamps = [t_start, *(t[0] for t in window), t_end]
    tick_gap = max(b - a for a, b in itertools.pairwise(stamps))
    full = [t for t in window if t[3] >= 0.99 * size]  # ticks after (almost) every rank reported
    tick_ms = [t[1] * 1e3 for t in full]
    tick_cpu = sum(t[2] for t in window)
    answers = [a for a in server["answers"] if t_start <= a[0] <= t_end]
    answer_cpu = sum(a[2] for a in answers)
    thread_cpu = thread_end - thread_start
    latencies = [x for x in probed["latencies"] if x[0] >= t_start + 2.0] or probed["latencies"]
    ages = server["view_age"]
    named = [first for _, ranks, first, _ in server["alerts"] if ranks == [culprit]]
    right = [first for first in named if onset <= first <= t_end]
    late = [first for first in named if first > t_end]  # while the server drained, after the run
    culprit_kind = next(
        (
            kind
            for kind, ranks, first, _ in server["alerts"]
            if ranks == [culprit] and first >= onset
        ),
        None,
    )
    wrong: dict[str, list[int]] = {}
    wrong_at: dict[str, float] = {}  # the first such alert of each kind, seconds into the run
    faulty = set(fault_ranks(size, culprit)) if args.node_fault else set()
    allowed = NODE_LOST_KINDS if args.node_fault == "dies" else frozenset()
    died = onset - NODE_DIES_BEFORE_S
    fault_named = [
        first
        for kind, ranks, first, _ in server["alerts"]
        if kind in allowed and ranks and set(ranks) <= faulty and died <= first <= t_end
    ]
    for kind, ranks, first, _ in server["alerts"]:
        others = [r for r in ranks if r != culprit and not (r in faulty and kind in allowed)]
        if others and first <= t_end:
            wrong.setdefault(kind, []).extend(others)
            wrong_at[kind] = min(wrong_at.get(kind, math.inf), first - t_start)
    mib = 1 / (1 << 20)
    return Row(
        ranks=size,
        mode=mode,
        relays=sum(r.relays for r in results),
        ranks_per_relay=rpr if mode == "relay" else RANKS_PER_NODE if mode == "nodes" else None,
        seconds=wall,
        target_rate=2.0 * size,
        offered_rate=offered / wall,
        accepted_rate=(recv_end - recv_start) / wall,
        offered=offered,
        received=server["received"],
        drops=offered - server["received"],
        sender_drops=sum(r.sender_drops for r in results),
        coalesced=sum(r.coalesced for r in results),
        skipped=sum(r.skipped for r in results),
        rejected=server["rejected"],
        shed=server["shed"],
        server_cores=(cpu_end - cpu_start) / wall,
        thread_cores=thread_cpu / wall,
        ingest_cores=max(0.0, thread_cpu - tick_cpu - answer_cpu) / wall,
        tick_median_ms=statistics.median(tick_ms) if tick_ms else math.nan,
        tick_p99_ms=_percentile(tick_ms, 0.99),
        tick_cpu_median_ms=statistics.median(t[2] * 1e3 for t in full) if full else math.nan,
        tick_gap_s=tick_gap,
        ticks_in_window=len(window),
        ticks=len(tick_ms),
        tick_cores=tick_cpu / wall,
        status_ms=statistics.median(x[1] for x in latencies) * 1e3 if latencies else None,
        summary_ms=(statistics.median(probed["summaries"]) * 1e3 if probed["summaries"] else None),
        status_build_ms=statistics.median(a[1] for a in answers) * 1e3 if answers else None,
        status_mb=statistics.median(x[2] for x in latencies) / 1e6 if latencies else None,
        status_failed=probed["failed"],
        model_ms=statistics.median(probed["model"]) * 1e3 if probed["model"] else None,
        rss_mib=(server["hwm"] - server["baseline_rss"]) * mib,
        baseline_mib=server["baseline_rss"] * mib,
        hwm_mib=server["hwm"] * mib,
        offline_tick_ms=server["offline"]["tick_cpu_s"] * 1e3,
        offline_status_ms=server["offline"]["status_cpu_s"] * 1e3,
        us_per_frame=(thread_cpu - tick_cpu - answer_cpu) / (recv_end - recv_start) * 1e6
        if recv_end > recv_start
        else None,
        view_age_median_s=statistics.median(a[1] for a in ages) if ages else None,
        view_age_max_s=max(a[2] for a in ages) if ages else None,
        publisher_cores=sum(r.cpu_s - (r.relay_cpu_s or 0.0) for r in results) / wall,
        relay_cores=sum(r.relay_cpu_s for r in results) / wall,
        relay_dropped=sum(r.relay_dropped for r in results),
        relay_received=sum(r.relay_received for r in results),
        relay_forwarded=sum(r.relay_forwarded for r in results),
        relay_pending_at_stop=sum(r.relay_pending_at_stop for r in results),
        relay_reconnects=sum(r.relay_reconnects for r in results),
        relay_short=_relay_short(results, server["relay_detail"]),
        relay_lost_batches=server["relay_lost_batches"],
        drained_s=server["drained_s"],
        culprit=culprit,
        culprit_latency_s=min(right) - onset if right else None,
        fault=args.node_fault,
        paused_s=args.pause_server,
        pace_max=max((r.pace_max for r in results), default=1),
        paced_beats=sum(r.paced_beats for r in results),
        fault_named_s=min(fault_named) - died if fault_named else None,
        culprit_late_s=min(late) - onset if late and not right else None,
        culprit_kind=culprit_kind,
        wrong={k: sorted(set(v)) for k, v in wrong.items()},
        wrong_at=wrong_at,
        view_ages=[(round(t - t_start, 2), round(a, 2), round(m, 2)) for t, a, m in ages],
        load=load,
        profile=server["profile"],
    )


def _relay_short(results: list[PublisherResult], seen: list[tuple[Any, ...]]) -> list[str]:
    """Relays whose forwarded frames the server did not all count: how many batches and
    frames it is short, and the sequence number it expected next."""
    server = {name: (batches, frames, next_seq) for name, batches, frames, next_seq, _ in seen}
    short = []
    for result in results:
        for name, batches, forwarded in result.relay_detail:
            got_batches, got_frames, next_seq = server.get(name, (0, 0, 0))
            if got_frames != forwarded:
                short.append(
                    f"{name}: sent {batches} batches/{forwarded} frames, the server counted "
                    f"{got_batches}/{got_frames} (next seq {next_seq})"
                )
    return short


# ------------------------------------------------------------------------------ in memory


@dataclass
class Offline:
    """Diagnosis and status on a state built in memory: no sockets, nothing else running."""

    ranks: int
    build_us_per_frame: float
    tick_ms: float  # one ``diagnose``: every rule
    ticking_ms: tuple[float, float, float]  # ``Diagnosis`` as the server ticks: median, mean, max
    status_ms: float
    status_mb: float
    model_ms: float
    culprit: int
    alerts: list[tuple[str, int]]  # (kind, how many ranks it names)
    right: bool
    rules: list[tuple[str, float]] = field(default_factory=list)  # ms each, in diagnose's order


def offline(size: int, culprit: int, reps: int = 3) -> Offline:
    """Feed every rank's heartbeats straight into a ``ServerState`` (decode + apply, as the
    collector does, without sockets) for 4 s of training and 3 s of the straggler, then time
    (CPU) ``diagnose``, the status document (built and JSON-encoded, as a reply is) and the
    dashboard's model build on it; medians of ``reps``."""
    import msgspec

    from ddpwatch.core.protocol import decode
    from ddpwatch.diagnosis.alerts import Thresholds
    from ddpwatch.diagnosis.facts import Facts
    from ddpwatch.diagnosis.rules import RULES, diagnose
    from ddpwatch.server.document import status_document
    from ddpwatch.state.state import ServerState

    t0 = 1.7e9
    onset, now = t0 + 4.0, t0 + 7.0
    beats = Beats(PublisherSpec(0, 0, size, size, "direct", "", size, culprit), t0, onset)
    state = ServerState(started=t0 - 1.0)
    apply = state.apply
    frames = 0
    c0 = time.process_time()
    for cycle in range(int((now - t0) / BEAT_S)):
        for i in range(size):
            at = t0 + (cycle + i / size) * BEAT_S
            apply(decode(beats.frame(i, cycle, at)), at)
            frames += 1
    build = (time.process_time() - c0) / frames * 1e6
    th = Thresholds()
    ticks, docs, models = [], [], []
    history = _new_history()
    alerts: list[Any] = []
    payload = b""
    for _ in range(reps):
        c0 = time.process_time()
        alerts = diagnose(state, now, th)
        ticks.append(time.process_time() - c0)
        c0 = time.process_time()
        payload = msgspec.json.encode(status_document(state, alerts, now, th, []))
        docs.append(time.process_time() - c0)
        models.append(_model_build(payload, history))
    per_rule: dict[str, list[float]] = {}
    gc.collect()
    gc.disable()  # a collection would land on whichever rule allocates when it is due
    try:
        for _ in range(reps):
            facts = Facts(state, now, th)  # shared as in diagnose: the first asker pays
            for rule in RULES:
                c0 = time.process_time()
                rule(state, now, th, facts)
                name = getattr(rule, "__name__", "?")
                per_rule.setdefault(name, []).append((time.process_time() - c0) * 1e3)
    finally:
        gc.enable()
    rules = [(name, statistics.median(ms)) for name, ms in per_rule.items()]
    ticking = _ticking(state, beats, size, now, th)
    return Offline(
        ranks=size,
        build_us_per_frame=build,
        tick_ms=statistics.median(ticks) * 1e3,
        ticking_ms=ticking,
        status_ms=statistics.median(docs) * 1e3,
        status_mb=len(payload) / 1e6,
        model_ms=statistics.median(models) * 1e3,
        culprit=culprit,
        alerts=[(a.kind, len(a.ranks)) for a in alerts],
        right=[a.ranks for a in alerts] == [(culprit,)],
        rules=rules,
    )


def _ticking(
    state: Any, beats: Beats, size: int, now: float, th: Any, ticks: int = 40
) -> tuple[float, float, float]:
    """``Diagnosis`` as the server runs it (``server/rules``: tick rules every call, the
    paced rules when due): CPU ms per tick over ``ticks`` ticks 0.25 s apart, half the ranks'
    heartbeats applied between two ticks (2 Hz), the straggler still hanging. The cyclic
    garbage collector as in the server: paused while heartbeats are applied, running during
    ticks, the records frozen (``collector.FREEZE_AFTER_RANKS``). Median, mean, max; the
    first four ticks (everything due at once) left out."""
    from ddpwatch.core.protocol import decode
    from ddpwatch.diagnosis.rules import Diagnosis
    from ddpwatch.server.collector import freeze_new_records

    diagnosis = Diagnosis()
    spent = []
    t0 = beats.t0
    first_cycle = int((now - t0) / BEAT_S)
    frozen = freeze_new_records(len(state.ranks), 0)
    try:
        for tick in range(ticks):
            at_tick = now + tick * 0.25
            cycle = first_cycle + tick // 2
            half = range(0, size // 2) if tick % 2 == 0 else range(size // 2, size)
            gc.disable()
            for i in half:
                at = t0 + (cycle + i / size) * BEAT_S
                state.apply(decode(beats.frame(i, cycle, at)), min(at, at_tick))
            gc.enable()
            c0 = time.process_time()
            diagnosis(state, at_tick, th)
            spent.append((time.process_time() - c0) * 1e3)
    finally:
        gc.enable()
        if frozen:
            gc.unfreeze()
    kept = spent[4:]
    return statistics.median(kept), statistics.mean(kept), max(kept)


def _model_build(payload: bytes, history: Any = None) -> float:
    """CPU seconds the dashboard spends turning a status reply into its table's rows:
    decode, header summary, alert index, history rings, worst-first order (``tui/data/model.py``;
    drawing the visible rows is not included: ``tui_tick.py`` measures it)."""
    import msgspec

    from ddpwatch.status.schema import StatusDocument, SummaryReply
    from ddpwatch.tui.data.model import TableQuery, index_alerts, select_rows
    from ddpwatch.tui.data.sparklines import History
    from ddpwatch.tui.widgets.header import summarize

    history = History() if history is None else history
    c0 = time.process_time()
    kind = SummaryReply if b'"summary":' in payload else StatusDocument  # as the source asked
    document = msgspec.json.decode(payload, type=kind)
    summarize(document)
    index = index_alerts(document.alerts)
    history.update(document.ranks)
    select_rows(document.ranks, TableQuery(), index)
    return time.process_time() - c0


def _new_history() -> Any:
    from ddpwatch.tui.data.sparklines import History

    return History()


OFFLINE_HEADER = (
    f"{'ranks':>6} {'diagnose ms':>11} {'tick ms med/mean/max':>20} {'status ms':>9}"
    f" {'status MB':>9} {'dashboard ms':>12} {'apply us/frame':>14}  alerts"
)


def offline_line(o: Offline) -> str:
    alerts = ", ".join(f"{kind} ({n} rank{'s' if n != 1 else ''})" for kind, n in o.alerts)
    verdict = "names exactly the culprit" if o.right else "NOT exactly the culprit"
    ticking = "/".join(f"{ms:.0f}" for ms in o.ticking_ms)
    return (
        f"{o.ranks:>6} {o.tick_ms:>11.0f} {ticking:>20} {o.status_ms:>9.0f} {o.status_mb:>9.1f}"
        f" {o.model_ms:>12.0f} {o.build_us_per_frame:>14.1f}  {alerts or 'none'}: {verdict}"
    )


# ------------------------------------------------------------------------------ report


def _fmt(value: float | None, spec: str, none: str = "-") -> str:
    return (
        none
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (format(value, spec))
    )


def culprit_text(row: Row) -> str:
    text = f"{row.culprit_latency_s:.2f} s" if row.culprit_latency_s is not None else "missed"
    if row.culprit_late_s is not None:
        text += f" (named {row.culprit_late_s:.0f} s after the onset, after the run)"
    if row.wrong:
        named = sum(len(v) for v in row.wrong.values())
        kinds = ",".join(sorted(row.wrong))
        text += f"; wrong: {named} ranks ({kinds})"
    return text


HEADER = (
    f"{'ranks':>6} {'mode':<6} {'relays':>6} {'offered/s':>10} {'(target)':>9}"
    f" {'accepted/s':>10} {'drops':>8} {'srv cores':>9} {'ingest':>6}"
    f" {'tick med/p99 ms':>16} {'(cpu)':>6} {'status ms':>9} {'summary':>7} {'RSS MiB':>8}  culprit"
)


def table_line(row: Row) -> str:
    return (
        f"{row.ranks:>6} {row.mode:<6} {row.relays if row.mode != 'direct' else '-':>6}"
        f" {row.offered_rate:>10.0f} {row.target_rate:>9.0f} {row.accepted_rate:>10.0f}"
        f" {row.drops:>8} {row.server_cores:>9.2f} {row.ingest_cores:>6.2f}"
        f" {_fmt(row.tick_median_ms, '.0f'):>7}/{_fmt(row.tick_p99_ms, '.0f'):<8}"
        f" {_fmt(row.tick_cpu_median_ms, '.0f'):>6}"
        f" {_fmt(row.status_ms, '.0f'):>9} {_fmt(row.summary_ms, '.0f'):>7}"
        f" {row.rss_mib:>8.0f}  {culprit_text(row)}"
    )


def detail_line(row: Row) -> str:
    short = row.offered_rate < 0.95 * row.target_rate
    parts = [
        f"  {row.ranks} {row.mode}:",
        f"offered {row.offered_rate / row.target_rate:.0%} of the target"
        + (" (PUBLISHERS SHORT)" if short else ""),
        f"sender drops {row.sender_drops}, beats skipped {row.skipped}, rejected {row.rejected},"
        f" shed {row.shed}, coalesced by relays {row.coalesced} (of {row.received} received)",
        f"server thread {row.thread_cores:.2f} cores (ticks {row.tick_cores:.2f},"
        f" ingest {row.ingest_cores:.2f}); {row.ticks_in_window} ticks, {row.ticks} of them with"
        f" every rank known; longest time without a tick {row.tick_gap_s:.1f} s",
        f"status reply {_fmt(row.status_mb, '.1f')} MB, built in"
        f" {_fmt(row.status_build_ms, '.0f')} ms on the server thread,"
        f" {row.status_failed} unanswered; dashboard model {_fmt(row.model_ms, '.0f')} ms",
        f"RSS peak {row.hwm_mib:.0f} MiB (baseline {row.baseline_mib:.0f})",
        f"on the final state, server stopped: tick {row.offline_tick_ms:.0f} ms CPU,"
        f" status reply {row.offline_status_ms:.0f} ms CPU;"
        f" ingest {_fmt(row.us_per_frame, '.1f')} us CPU per accepted frame",
        f"server view age median {_fmt(row.view_age_median_s, '.2f')} s,"
        f" max {_fmt(row.view_age_max_s, '.2f')} s; drained {row.drained_s:.1f} s after the end",
        f"publishers {row.publisher_cores:.2f} cores",
    ]
    if row.mode == "relay":
        parts.append(
            f"relays {row.relay_cores:.2f} cores ({row.ranks_per_relay} ranks per relay),"
            f" relays took {row.relay_received}, forwarded {row.relay_forwarded}, dropped"
            f" {row.relay_dropped}, {row.relay_pending_at_stop} pending at stop; the server"
            f" counted {row.relay_lost_batches} lost batches; {row.relay_reconnects} reconnects"
        )
        parts.extend(f"SHORT {text}" for text in row.relay_short)
    if row.fault is not None:
        named = _fmt(row.fault_named_s, ".2f", "never")
        parts.append(
            f"node fault: {row.fault} on ranks {_ranks_text(fault_ranks(row.ranks, row.culprit))}"
            + (f", named {named} s after it died" if row.fault == "dies" else "")
        )
    if row.mode == "nodes":
        parts.append(
            f"pace: up to one batch every {row.pace_max} beats asked,"
            f" {row.paced_beats} node-beats left out for it"
        )
    if row.paused_s:
        parts.append(
            f"server process stopped for {row.paused_s:g} s, until"
            f" {PAUSE_ENDS_BEFORE_S:g} s before the onset"
        )
    parts.append(
        f"culprit rank {row.culprit} ({row.culprit_kind or 'not named'}); load {row.load[0]:.1f}"
    )
    if row.wrong:
        parts.append(
            "wrong blames: "
            + "; ".join(
                f"{k} from {row.wrong_at[k]:.1f} s: {_ranks_text(v)}"
                for k, v in sorted(row.wrong.items())
            )
        )
    return "\n    ".join([parts[0] + " " + parts[1], *parts[2:]])


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:6])) + (f" ... ({len(ranks)} ranks)" if len(ranks) > 6 else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="8192,32768,65536", help="comma-separated rank counts")
    parser.add_argument(
        "--modes",
        default="relay,direct",
        help="relay, direct, nodes (any of them, comma-separated) or none (in memory only)",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="run length per row (20)")
    parser.add_argument("--warmup", type=float, default=10.0, help="straggler onset (10 s)")
    parser.add_argument("--procs", type=int, default=4, help="publisher processes (4)")
    parser.add_argument(
        "--ranks-per-relay", type=int, default=None, help="default: one relay per publisher"
    )
    parser.add_argument("--status-every", type=float, default=5.0, help="status REQ period (5)")
    parser.add_argument("--models", type=int, default=3, help="dashboard model builds per row")
    parser.add_argument(
        "--publisher-nice",
        type=int,
        default=5,
        help="niceness added to publishers, relays and the prober (5): they stand for other "
        "machines, so the server gets the CPU first",
    )
    parser.add_argument(
        "--no-offline",
        dest="offline",
        action="store_false",
        help="skip the in-memory diagnosis/status measurement per size",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the server thread")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument(
        "--node-fault",
        choices=("dies", "slow", "late"),
        default=None,
        help=f"nodes mode: one node, away from the culprit's, dies {NODE_DIES_BEFORE_S:.0f} s "
        f"before the straggler's onset (relay and ranks silent), or its batches arrive "
        f"{SLOW_NODE_S:.0f} s late all run: slow (the relay held them, their ages say so) or "
        "late (in transit after it sent them, their ages do not)",
    )
    parser.add_argument(
        "--pause-server",
        type=float,
        default=0.0,
        metavar="S",
        help=f"stop the server's process (SIGSTOP) for S seconds, until "
        f"{PAUSE_ENDS_BEFORE_S:g} s before the straggler's onset",
    )
    parser.add_argument(
        "--no-pace",
        dest="pace",
        action="store_false",
        help="nodes mode: the simulated relays ignore the pace the server asks for",
    )
    parser.add_argument("--quick", action="store_true", help="512 ranks, 6 s, 2 processes")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.seconds, args.warmup, args.procs = "512", 6.0, 2.0, 2
        args.status_every = 1.0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip() not in ("", "none")]
    if any(m not in ("relay", "direct", "nodes") for m in modes):
        parser.error("--modes takes relay, direct and/or nodes")
    if args.node_fault and modes != ["nodes"]:
        parser.error("--node-fault needs --modes nodes")
    if args.pause_server and args.warmup < args.pause_server + PAUSE_ENDS_BEFORE_S + 2.0:
        parser.error("--warmup must leave 2 s before the pause (--pause-server + 4 s at least)")
    if args.warmup + 2.5 > args.seconds:
        parser.error("--seconds must leave at least 2.5 s after --warmup (the collective limit)")
    for size in sizes:
        per_proc = math.ceil(size / max(1, min(args.procs, size)))
        rpr = args.ranks_per_relay or per_proc
        if "relay" in modes and math.ceil(per_proc / rpr) > MAX_RELAYS_PER_PROC:
            parser.error(
                f"{size} ranks: {math.ceil(per_proc / rpr)} relays per process, over"
                f" {MAX_RELAYS_PER_PROC}; raise --ranks-per-relay or --procs"
            )

    ctx = mp.get_context("spawn")
    print(
        f"scale: {BEAT_S:g} s heartbeats per rank, {args.procs} publisher processes, "
        f"{args.seconds:g} s per row, straggler at {args.warmup:g} s, status every "
        f"{args.status_every:g} s; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows: list[Row] = []
    offlines: list[Offline] = []
    for size in sizes:
        if args.offline:
            o = offline(size, pick_culprit(size, args.seed))
            offlines.append(o)
            top = sorted(o.rules, key=lambda r: -r[1])[:5]
            print(
                f"  {size} in memory: {offline_line(o).strip()}\n    costliest rules: "
                + ", ".join(f"{name.removeprefix('rule_')} {ms:.0f} ms" for name, ms in top),
                flush=True,
            )
        for mode in modes:
            row = run_one(size, mode, args, ctx)
            rows.append(row)
            print(detail_line(row), flush=True)
            if row.profile:
                print(row.profile, flush=True)
    print("live: a real server, publisher processes, the straggler injected")
    print(HEADER)
    for row in rows:
        print(table_line(row))
    if offlines:
        print("in memory: diagnosis, status reply and dashboard model alone (CPU, median of 3)")
        print(OFFLINE_HEADER)
        for o in offlines:
            print(offline_line(o))
    for row in rows:
        short = "publishers short" if row.offered_rate < 0.95 * row.target_rate else "full rate"
        print(
            f"RATIO scale {row.ranks} {row.mode}: accepted/offered = "
            f"{row.received / max(1, row.offered):.4f} ({short}), drops={row.drops}, "
            f"server_cores={row.server_cores:.2f}, tick_p99_ms={_fmt(row.tick_p99_ms, '.0f')}, "
            f"rss_mib={row.rss_mib:.0f}, culprit={culprit_text(row)}"
            + (
                f", node_{row.fault}_named_s={_fmt(row.fault_named_s, '.2f', 'never')}"
                if row.fault
                else ""
            )
            + (f", paused_s={row.paused_s:g}" if row.paused_s else "")
            + (f", pace_max={row.pace_max}" if row.mode == "nodes" else "")
            + (f", wrong={sum(len(v) for v in row.wrong.values())}" if row.wrong else "")
        )
    for o in offlines:
        print(
            f"RATIO scale {o.ranks} in memory: tick_ms={o.tick_ms:.0f}, "
            f"status_ms={o.status_ms:.0f}, culprit={'right' if o.right else 'WRONG'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"live": [asdict(r) for r in rows], "in_memory": [asdict(o) for o in offlines]},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
