"""What the training thread records and the publisher thread reads.

The training thread only assigns attributes and reads ``perf_counter`` (and, at a
collective, stores into the black box's memory mapping): no locks, no system calls, no
device synchronisation. Single attribute writes are atomic
under the GIL, and the publisher tolerates reading a step that is half-updated
(it reports it on the next heartbeat).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from ddpwatch.agent.grads import GradCheck
from ddpwatch.agent.loss import LossReader
from ddpwatch.core.protocol import MARK_EVERY, Collective
from ddpwatch.core.vocabulary import CollectiveSource, Phase

if TYPE_CHECKING:
    from ddpwatch.agent.blackbox import BlackBox

EMA_WEIGHT = 0.1
MARKS_KEPT = 16  # 128 steps of marks between two heartbeats: enough for 4 ms steps
WINDOW_CALLS = 256
"""Calls kept per window between two marks (``Progress.calls``): every rank keeps the same
first ones, so their digests still compare; more only count (``collective_seq``)."""
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})
"""The wrapped collectives that take a reduce op: ``SUM`` where none is given."""
P2P_PENDING_S = 1.0
"""How old a ``batch_isend_irecv`` request must be, not completed, before the rank counts as
waiting in it (a pipeline stage's receive completes within its peer's micro-batch)."""
P2P_POSTED_KEPT = 64
"""Requests of ``isend``/``irecv`` kept between two moves of the rank (a pipeline schedule
posts a few a micro-batch; the first ones pending are what a wait is for)."""
DRAWN_KEPT = 8  # DataLoader iterators counted at once (training, evaluation, a new epoch's)
_FORWARD: Final = Phase.FORWARD  # a global: an Enum member off its class is slower (hooks.py)
_EVALUATION: Final = Phase.EVALUATION


class Progress:
    """Step, loss, phase and collective timing of one rank."""

    collective_reduce_op: Any = None  # the collective in flight's, as the call gave it
    collective_root: Any = None  # its src or dst, as given
    collective_peer: tuple[Any, Any] | None = None  # a blocking send/recv's (peer, tag)
    backwards = 0  # backward passes so far (counted by the backward wrapper, ``agent/hooks``)
    eval_syncs: int | None = None
    """Evaluation forwards so far through an attached DDP model that broadcasts its buffers
    (``hooks.ModelHooks``); None while no such model is attached."""
    _p2p_seen: tuple[float, int] | None = None  # (posted, op) last reported pending
    p2p_batch: tuple[float, list[tuple[str, Any, Any]], list[Any]] | None = None
    """The last ``batch_isend_irecv``: when, its ops (op, peer, tag) and weak references to the
    requests it returned, which the publisher asks whether they completed."""

    def __init__(self) -> None:
        now = time.perf_counter()
        self.step: int | None = None
        self.forwards = 0
        self.step_mode: str | None = None  # "explicit", "optimizer" or "forward"
        self.last_step_end: float | None = None
        self.step_time_s: float | None = None
        self.avg_step_time_s: float | None = None
        self.data_wait_s: float | None = None
        self.phase: str = Phase.STARTED
        self.pinned = 0  # depth of user phase() blocks (and of a compilation: ``compiling``)
        self.compile_reason: str | None = None  # why torch recompiles, while ``compiling``
        self.phase_changed = now
        self.last_progress = now
        self.collective_op: str | None = None
        self.collective_seq = 0
        self.collective_start = 0.0
        self.collective_depth = 0
        self.collective_counted = True
        self.collective_tensor: Any = None
        self.p2p_ops: dict[Any, int] = {}
        """Point-to-point ops posted so far, by process group (None: the default group): gloo's
        flight recorder counts them with the group's collectives (``p2p_counts``)."""
        self.marks: deque[tuple[int, int]] = deque(maxlen=MARKS_KEPT)
        self.calls: list[tuple[str, Any, Any, Any, Any]] = []
        """This window's default-group calls so far, the first ``WINDOW_CALLS``: (op, dtype,
        element count, reduce op, root) as given: digested by the publisher once the window is
        closed (``windows``); a single call is read back earlier, by its number, through
        ``window`` (``CallDigests.call``: a call, once made, never changes)."""
        # where each collective entered is also written, to outlive the process: a memory
        # store into a shared file mapping (``agent/blackbox.py``)
        self.box: BlackBox | None = None
        self.window_start = 0  # ``collective_seq`` when the window opened
        self.window: tuple[int, list[tuple[str, Any, Any, Any, Any]]] = (0, self.calls)
        """(``window_start``, ``calls``) as one, for the publisher: set in one assignment."""
        self.windows: deque[tuple[int, int, list[tuple[str, Any, Any, Any, Any]]]] = deque(
            maxlen=MARKS_KEPT
        )
        """(step, the count the window started at, its calls) for each mark in ``marks``: what
        the ranks called between two marks, which every rank should have called alike."""
        self.drawn: dict[int, int] = {}  # batches drawn, per DataLoader iterator (by id)
        self.drawn_from: int | None = None  # the iterator of the last batch drawn
        self.batch_marks: deque[tuple[int, int]] = deque(maxlen=MARKS_KEPT)
        self.backward_marks: deque[tuple[int, int]] = deque(maxlen=MARKS_KEPT)
        self.eval_sync_marks: deque[tuple[int, int]] = deque(maxlen=MARKS_KEPT)
        self.collective_time_step = 0.0
        self.collective_time_s: float | None = None
        self.failed_collective: Collective | None = None  # the collective an exception left
        self.waiting_for_data = False
        # where the step goes (``agent/split.py``): this step's parts so far, and totals
        self.input_time_step = 0.0  # in DataLoader iterators
        self.grad_wait_step = 0.0  # in DDP's gradient all-reduce, after own gradients
        self.grad_ready_at = 0.0  # this backward's last own gradient, until backward ends
        self.input_seen = False  # a DataLoader batch was timed
        self.grad_hooked = False  # a DDP model's gradients are timed
        self.split: tuple[int, float, float, float, float] = (0, 0.0, 0.0, 0.0, 0.0)
        """Totals over the timed steps: (steps, step time, input wait, gradient wait,
        collective wait); one tuple, assigned whole, so the publisher reads it at once."""
        self.loss = LossReader(self)
        self.grads = GradCheck(self.loss)  # this rank's own gradients, before DDP's all-reduce
        self.on_step: Callable[[], object] | None = None  # e.g. note the CUDA device, now and then
        self._step_owner: weakref.ref[Any] | None = None  # the integration that counts steps

    # training thread -------------------------------------------------------
    def set_phase(self, name: str) -> None:
        if name != self.phase:
            self.phase = name
            self.phase_changed = time.perf_counter()

    def auto_phase(self, name: str) -> None:
        """A phase set by hooks (forward, backward, ...); a user's ``phase()`` block wins."""
        if not self.pinned and name != self.phase:
            self.phase = name
            self.phase_changed = time.perf_counter()

    def end_step(self, loss: Any = None, mode: str = "explicit") -> None:
        """Count one step. The first mode seen wins, so hooks don't double count."""
        if self.step_mode is None:
            self.step_mode = mode
        elif mode != self.step_mode:
            if mode != "explicit":
                return
            self.step_mode = mode  # an explicit call overrides counting by hooks,
            if self.step:  # and ends the step they counted already: step(loss) N is step N
                self.step -= 1
        self.grads.close()  # the ending step's gradients: in the ring before the next loss
        if loss is not None:
            # first: a heartbeat never pairs step N with loss N-1; it is the ending step's
            self.loss.submit(loss, 1 if self.step is None else self.step + 1)
        now = time.perf_counter()
        if self.last_step_end is not None:
            elapsed = now - self.last_step_end
            self.step_time_s = elapsed
            avg = self.avg_step_time_s
            self.avg_step_time_s = elapsed if avg is None else avg + EMA_WEIGHT * (elapsed - avg)
            n, total, inputs, grads, waits = self.split
            self.split = (
                n + 1,
                total + elapsed,
                inputs + self.input_time_step,
                grads + self.grad_wait_step,
                waits + self.collective_time_step,
            )
        self.input_time_step = 0.0
        self.grad_wait_step = 0.0
        self.step = 1 if self.step is None else self.step + 1
        self.last_step_end = now
        self.last_progress = now
        self.collective_time_s = self.collective_time_step
        self.collective_time_step = 0.0
        if self.step % MARK_EVERY == 0 and self.step_mode != "forward":
            # forward passes are no step count to compare ranks by (evaluation on one rank)
            self._mark(self.step)
        self.waiting_for_data = True
        if self.on_step is not None and self.step % 64 == 1:
            with contextlib.suppress(Exception):
                self.on_step()

    def _mark(self, step: int) -> None:
        """The end of a marked step: what every rank counts alike by then (collectives, their
        calls, batches drawn, backward passes), one append each (atomic)."""
        self.marks.append((step, self.collective_seq))
        self.windows.append((step, self.window_start, self.calls))
        self.calls = []  # a new list: the publisher reads the old one, no longer written
        self.window_start = self.collective_seq
        self.window = (self.window_start, self.calls)
        source = self.drawn_from
        if source is not None:  # the training loader: its batch came last before the step
            self.batch_marks.append((step, self.drawn.get(source, 0)))
        if self.backwards:
            self.backward_marks.append((step, self.backwards))
        if self.eval_syncs is not None:
            self.eval_sync_marks.append((step, self.eval_syncs))

    def count_steps_explicitly(self) -> None:
        """From now on steps come from ``end_step(mode="explicit")``: the optimizer and
        forward hooks stop counting (what the first explicit step does, set before it)."""
        self.step_mode = "explicit"

    def prefer_optimizer_steps(self) -> None:
        """An optimizer step after steps were counted by forward passes: optimizer steps
        are the better count, and the step the last forward pass ended is this one."""
        if self.step_mode == "forward":
            self.step_mode = None
            self.step = None if self.step is None else self.step - 1

    def claim_steps(self, owner: Any) -> bool:
        """Whether ``owner`` counts the steps: the first to ask does, until it is gone or
        calls ``release_steps``. Not weak-referenceable: it counts."""
        try:
            ref = self._step_owner
            current = ref() if ref is not None else None
            if current is None:
                self._step_owner = weakref.ref(owner)
                return True
            return current is owner
        except TypeError:
            return True

    def release_steps(self, owner: Any) -> None:
        ref = self._step_owner
        if ref is not None and ref() is owner:
            self._step_owner = None

    def note_draw(self, iterator: int) -> None:
        """A batch was drawn from the DataLoader iterator ``iterator`` (its id): counted per
        iterator, so an evaluation loader drawn between two steps does not count for the
        training one. A rank that skips a batch (a caught exception) has drawn one more by
        the same step from then on, with no other trace (PyTorch #44353)."""
        drawn = self.drawn
        if iterator not in drawn and len(drawn) >= DRAWN_KEPT:
            drawn.clear()  # iterators come and go (one per epoch): keep a few
        drawn[iterator] = drawn.get(iterator, 0) + 1
        self.drawn_from = iterator

    def note_forward(self) -> None:
        """Count a forward pass that is no training step (an evaluation batch) as progress:
        the server's ``stalled`` rule reads it."""
        self.forwards += 1
        self.last_progress = time.perf_counter()

    def evaluation_forward(self) -> None:
        """A forward without gradients (``ModelHooks``): progress, and phase ``evaluation``;
        no data wait (it is no step's input)."""
        self.forwards += 1
        self.last_progress = time.perf_counter()
        self.auto_phase(_EVALUATION)

    def forward_started(self) -> None:
        """Count a forward pass (progress even without steps, as in evaluation) and
        measure the time since the end of the last step: data loading."""
        now = time.perf_counter()
        self.forwards += 1
        self.last_progress = now
        if self.waiting_for_data and self.last_step_end is not None:
            self.data_wait_s = now - self.last_step_end
            self.waiting_for_data = False
        if not self.pinned and self.phase != _FORWARD:  # ``auto_phase``, inline: every step
            self.phase = _FORWARD
            self.phase_changed = now

    def enter_collective(
        self,
        op: str,
        tensor: Any = None,
        counted: bool = True,
        reduce_op: Any = None,
        root: Any = None,
    ) -> None:
        """Enter a Python-level collective. ``tensor``: what this rank contributes (its shape
        and dtype are read later, off the training thread); ``counted``: it runs on the
        default group, so its number compares across ranks; ``reduce_op``, ``root``: its
        reduce op and src/dst as the call gave them (named off the training thread).

        A counted call is also kept in this window's ``calls``, its dtype and element count
        read now (the tensor is not kept past the call): one tuple and one append."""
        self.collective_depth += 1
        if self.collective_depth == 1:
            box = self.box
            if counted:
                seq = self.collective_seq = self.collective_seq + 1
                kept = seq - self.window_start <= WINDOW_CALLS
                if kept or box is not None:
                    if tensor is None:  # barrier, *_object: no dtype or size
                        call = (op, None, None, reduce_op, root)
                    else:
                        try:
                            call = (op, tensor.dtype, tensor.numel(), reduce_op, root)
                        except Exception:  # not a tensor (raising costs: only here)
                            call = (op, None, None, reduce_op, root)
                    if kept:
                        self.calls.append(call)
                    if box is not None:
                        box.enter(seq, call, self.step, self.phase)
            elif box is not None:
                box.enter(0, (op, None, None, reduce_op, root), self.step, self.phase)
            self.collective_counted = counted
            self.collective_op = op
            self.collective_tensor = tensor
            self.collective_reduce_op = reduce_op
            self.collective_root = root
            self.collective_start = time.perf_counter()

    def count_p2p(self, group: Any, ops: int = 1) -> None:
        """``ops`` point-to-point ops are about to be posted on ``group``: counted before torch
        enqueues them, so that a count read meanwhile errs towards "not entered yet"."""
        counts = self.p2p_ops
        try:
            counts[group] = counts.get(group, 0) + ops
        except TypeError:  # a group that is no ProcessGroup (unhashable): not counted
            pass

    def enter_p2p(self, op: str, peer: Any, tag: Any, group: Any = None) -> None:
        """Enter a blocking point-to-point op (``send``, ``recv``): in flight with its peer and
        tag, not counted among the collectives (no collective every rank makes)."""
        self.count_p2p(group)
        self.collective_depth += 1
        if self.collective_depth == 1:
            self.collective_counted = False
            self.collective_op = op
            self.collective_peer = (peer, tag)
            self.collective_start = time.perf_counter()

    def note_p2p_batch(self, ops: list[tuple[str, Any, Any]], works: Any) -> None:
        """A ``batch_isend_irecv`` posted ``ops`` and returned ``works`` (its requests)."""
        refs = [weakref.ref(work) for work in works] if works else []
        self.p2p_batch = (time.perf_counter(), ops, refs)

    def note_p2p_posted(self, op: str, peer: Any, tag: Any, work: Any) -> None:
        """An ``isend``/``irecv`` posted alone returned ``work``: it joins the requests posted
        since the rank last moved (a new tuple each time: the publisher reads it whole), up
        to ``P2P_POSTED_KEPT``; else it starts a new set."""
        ref = weakref.ref(work)
        now = time.perf_counter()
        batch = self.p2p_batch
        if batch is not None:
            posted, ops, refs = batch
            still = max(self.last_progress, self.phase_changed) <= posted
            if still and len(ops) == len(refs) and len(ops) < P2P_POSTED_KEPT:
                self.p2p_batch = (posted, [*ops, (op, peer, tag)], [*refs, ref])
                return
        self.p2p_batch = (now, [(op, peer, tag)], [ref])

    def exit_collective(self, failed: bool = False) -> None:
        if failed and self.collective_depth == 1 and self.failed_collective is None:
            self.failed_collective = self.in_flight()
        self.collective_depth -= 1
        if self.collective_depth == 0:
            if self.box is not None:
                self.box.leave()
            self.collective_time_step += time.perf_counter() - self.collective_start
            self.collective_op = None
            self.collective_tensor = None
            self.collective_reduce_op = None
            self.collective_root = None
            self.collective_peer = None

    # publisher thread ------------------------------------------------------
    def in_flight(self, dying: bool = False) -> Collective | None:
        """The Python-level collective the training thread is inside, if any, or the request
        of its last ``batch_isend_irecv`` it waits for; ``dying``: the rank is ending, and a
        request seen pending that has completed since (with the error it dies of) counts."""
        op = self.collective_op
        if op is None:
            return self._pending_p2p(dying)
        peer = self.collective_peer
        if peer is not None:
            return Collective(
                op=op,
                since_s=time.perf_counter() - self.collective_start,
                source=CollectiveSource.PY,
                peer=rank_number(peer[0]),
                tag=rank_number(peer[1], lowest=-(2**31)),
            )
        shape, dtype = _describe(self.collective_tensor)
        reduce_op, root = self.collective_reduce_op, self.collective_root
        return Collective(
            op=op,
            seq=self.collective_seq if self.collective_counted else None,
            since_s=time.perf_counter() - self.collective_start,
            source=CollectiveSource.PY,
            shape=shape,
            dtype=dtype,
            reduce_op=reduce_op_name(op, reduce_op),
            root=root_number(root),
        )

    def p2p_counts(self, name_of: Callable[[Any], str | None]) -> dict[str, int]:
        """Point-to-point ops posted so far per process group, by the flight recorder's name
        for the group (``name_of``; None: a group it does not name, left out)."""
        counts: dict[str, int] = {}
        for group, ops in list(self.p2p_ops.items()):  # one C-level copy: the GIL holds it
            name = "0" if group is None else name_of(group)
            if name is not None:
                counts[name] = counts.get(name, 0) + ops
        return counts

    def _pending_p2p(self, dying: bool = False) -> Collective | None:
        """The first op of the last ``batch_isend_irecv`` whose request has not completed,
        once ``P2P_PENDING_S`` old, while the training thread has not moved since it posted
        them: waiting for it (a rank that posts a receive and computes meanwhile has moved
        on: a forward or a phase since). ``dying``: also the one last seen pending, now
        completed: a request that failed (a timeout) completes too, and what tells a failed
        one from a done one (``Work.is_success``) prints a deprecation warning."""
        batch = self.p2p_batch
        if batch is None:
            return None
        posted, ops, refs = batch
        age = time.perf_counter() - posted
        if not refs or age < P2P_PENDING_S or max(self.last_progress, self.phase_changed) > posted:
            return None
        seen = self._p2p_seen
        for at, (op, peer, tag) in enumerate(ops):
            work = refs[at if len(refs) == len(ops) else 0]()
            try:
                ended = work is None or work.is_completed()  # freed (waited for), or done
                if ended and not (dying and seen == (posted, at)):
                    continue
            except Exception:
                continue
            self._p2p_seen = (posted, at)
            return Collective(
                op=op,
                since_s=age,
                source=CollectiveSource.PY,
                peer=rank_number(peer),
                tag=rank_number(tag, lowest=-(2**31)),
            )
        return None

    def idle_for(self) -> float:
        """Seconds since the rank last moved: a step ended or its phase changed."""
        return time.perf_counter() - max(self.last_progress, self.phase_changed)


class SplitReader:
    """The publisher's view of ``Progress.split``: per-step averages over the steps since its
    last read, the last ones again while no step ended (slow steps, a pause).

    ``device_waits`` (``GradReady.collect``), called on every read: the gradient waits the
    device has timed since the last call, in seconds; they are added to the steps that ended
    since the last read (a step's device marks may complete a heartbeat after the step)."""

    def __init__(self, progress: Progress, device_waits: Callable[[], float] | None = None) -> None:
        self._progress = progress
        self._device_waits = device_waits
        self._device_wait = 0.0  # device waits collected, not yet spread over steps
        self._last: tuple[int, float, float, float, float] = (0, 0.0, 0.0, 0.0, 0.0)
        self.input_wait_s: float | None = None
        self.compute_s: float | None = None
        self.grad_wait_s: float | None = None

    def read(self) -> tuple[float | None, float | None, float | None]:
        """(input wait, compute, gradient wait) per step: the input wait once a DataLoader
        batch was timed, the other two once a DDP model's gradients are (else the compute
        would hold the gradient wait)."""
        progress = self._progress
        if self._device_waits is not None:
            self._device_wait += self._device_waits()
        totals, last = progress.split, self._last
        steps = totals[0] - last[0]
        if steps > 0:
            self._last = totals
            step, inputs, grads, waits = (
                (a - b) / steps for a, b in zip(totals[1:], last[1:], strict=True)
            )
            grads += self._device_wait / steps
            self._device_wait = 0.0
            timed = progress.grad_hooked
            self.input_wait_s = inputs if progress.input_seen else None
            self.grad_wait_s = grads if timed else None
            self.compute_s = max(0.0, step - inputs - grads - waits) if timed else None
        return self.input_wait_s, self.compute_s, self.grad_wait_s


def reduce_op_name(op: str, reduce_op: Any) -> str | None:
    """The reduce op a call gave, as torch names it in lower case (``sum``, ``avg``,
    ``premul_sum``): ``sum`` for a reducing collective that gave none (torch's default, so
    that ``op=SUM`` and no ``op`` compare alike), None for one that takes no reduce op."""
    if reduce_op is None:
        return "sum" if op in REDUCING else None
    name = getattr(reduce_op, "name", None)  # a ``RedOpType``: ReduceOp.SUM, ReduceOp.MAX
    if name is None:  # a ``ReduceOp`` made for one call (premul_sum): its type is ``op``
        name = getattr(getattr(reduce_op, "op", None), "name", None)
    return str(name).lower() if name is not None else str(reduce_op)[:40]


def root_number(root: Any) -> int | None:
    """A call's src or dst as an int (the rank given), None when it gave none or not one."""
    if root is None:
        return None
    try:
        return int(root)
    except (TypeError, ValueError):
        return None


def rank_number(value: Any, lowest: int = 0) -> int | None:
    """A peer rank or a tag as an int on the wire, None where it is none or out of range."""
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if lowest <= number < 2**31 else None


def _describe(tensor: Any) -> tuple[list[int] | None, str | None]:
    """Shape and dtype of a tensor a collective was given; (None, None) for anything else."""
    try:
        return [int(n) for n in tensor.shape], str(tensor.dtype).removeprefix("torch.")
    except Exception:
        return None, None
