"""Wire protocol shared by the agent and the server (version 1).

One ZeroMQ frame per message: a MessagePack map with at least ``v``, ``type``,
``rank`` and ``t``. Typed ``msgspec`` structs validate every frame on decode, so
the server never has to trust what arrives; unknown fields are ignored, which
lets newer agents talk to older servers. See ``docs/protocol.md``.
"""

from __future__ import annotations

import math
from typing import Annotated, TypeVar

import msgspec

PROTOCOL_VERSION = 1
DEFAULT_PORT = 5599
MAX_FRAME_BYTES = 1 << 20  # larger frames are refused by the socket itself
MAX_QUERY_BYTES = 4096  # a status request: "status", or "status?" and a query string

MAX_RANKS = 1 << 20

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
RankId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
RankCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]


# Every struct here is ``gc=False``: decoded data never forms a reference cycle, and the
# server keeps some on every rank's record, so Python's cyclic collector is spared scanning
# them (what that scan cost at scale: docs/performance.md, section 7).


class CallSeen(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One way a rank called a Python-level collective, and its number: in a window between two
    marks, the first such call; as a ``Collective.before``, the call just before the one in
    flight. ``[seq, op, dtype, numel, reduce_op, root]``."""

    seq: NonNegInt
    op: str
    dtype: str | None = None
    numel: NonNegInt | None = None  # None where sizes may differ by rank (all_gather)
    reduce_op: str | None = None
    root: int | None = None


class Collective(msgspec.Struct, omit_defaults=True, gc=False):
    """A collective a rank is in: blocked in it right now (samples) or failed in (crash events).

    ``source`` says which counter ``seq`` belongs to (``vocabulary.CollectiveSource``): ``"fr"``
    the flight recorder's per-group sequence (it counts DDP's own all-reduces too), ``"py"``
    the agent's count of Python-level ``torch.distributed`` calls. Sequence numbers of
    different sources never compare.
    """

    op: str
    seq: int | None = None
    since_s: float = 0.0
    source: str | None = None
    group: str | None = None  # flight-recorder process-group name; None: the default group
    shape: list[int] | None = None  # the tensor this rank contributes (its first one)
    dtype: str | None = None
    reduce_op: str | None = None  # "sum", "max", "avg", ...: collectives that reduce
    root: int | None = None  # the src or dst rank of a broadcast, reduce, gather or scatter
    py_seq: int | None = None
    """A flight recorder's collective that is a Python-level call too: that call's number in
    the agent's own count (``source`` "py"'s), which ``before`` compares with."""
    before: CallSeen | None = None
    """The last Python-level default-group call this rank made before this collective (for a
    Python-level one, number ``seq - 1``), so that ranks that got past a collective the others
    hang in still say how they called it."""
    peer: NonNegInt | None = None
    """A point-to-point op (``send``, ``recv``, and the ``isend``/``irecv`` of a
    ``batch_isend_irecv``): the global rank it sends to or receives from; None for a
    collective, or a ``recv`` from any source."""
    tag: int | None = None  # a point-to-point op's tag, which its peer's must match


class CallWindow(msgspec.Struct, omit_defaults=True, gc=False):
    """The distinct calls a rank made between the mark before ``step`` and ``step``'s
    (``CollectiveCounts.digests`` tells that ranks differ there; this, how)."""

    step: NonNegInt
    calls: list[CallSeen] = []


class CollectiveCounts(msgspec.Struct, omit_defaults=True, gc=False):
    """How far a rank has got through its collectives: the evidence that it has (or has not)
    entered collective #N, whatever it is doing now."""

    py: NonNegInt = 0  # Python-level collectives entered so far (the agent's wrappers)
    fr: dict[str, int] | None = None  # flight recorder: last enqueued seq per process group
    marks: list[tuple[NonNegInt, NonNegInt]] | None = None
    """(step, py) at the end of recent steps that are multiples of ``MARK_EVERY``: every rank
    marks the same steps, so ranks that call different numbers of collectives show it."""
    digests: list[tuple[NonNegInt, NonNegInt]] | None = None
    """(step, digest) at the same marks: a 32-bit digest of the Python-level default-group
    calls since the mark before (op, dtype, element count, reduce op, root, in order), so
    ranks that make the same number of calls with other arguments show it too."""
    window: CallWindow | None = None
    """The distinct calls of the latest window: what differs, where digests do."""
    earlier: list[CallWindow] | None = None
    """The windows closed since the previous heartbeat before the latest, oldest first: a
    step faster than heartbeats closes several between two, and ranks describe each."""


MARK_EVERY = 8


class ErrorInfo(msgspec.Struct, omit_defaults=True, gc=False):
    """An exception a rank died with."""

    type: str
    message: str = ""
    traceback: str = ""


class Message(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True, gc=False):
    """Fields every message carries."""

    v: int
    rank: RankId
    t: float


class Identity(Message):
    """Who and where a rank is. Heartbeats repeat it when it changed, after each new connection
    and every 10th beat; the server keeps the last known value of each field."""

    local_rank: NonNegInt | None = None
    world_size: RankCount | None = None
    local_world_size: RankCount | None = None
    node_rank: NonNegInt | None = None
    host: str | None = None
    pid: NonNegInt | None = None
    launcher: str | None = None
    job_id: str | None = None
    backend: str | None = None
    torch_version: str | None = None
    cuda_visible_devices: str | None = None
    device: str | None = None
    device_index: NonNegInt | None = None
    device_name: str | None = None
    device_uuid: str | None = None
    device_pci_bus_id: str | None = None
    device_count: NonNegInt | None = None
    pg_timeout_s: float | None = None  # the default process group's collective timeout
    restart_count: NonNegInt | None = None  # the launcher's restarts so far (torchrun's)
    rendezvous: str | None = None  # torchrun's: static, standalone, c10d (core/rendezvous.py)
    simulated: bool = False
    # what the rank's rendezvous and build depend on, compared across ranks (config_mismatch)
    master_addr: str | None = None  # $MASTER_ADDR as the rank saw it
    master_port: str | None = None  # $MASTER_PORT, as written (a typo is a value too)
    init_method: str | None = None  # init_process_group's: "env://", "tcp://…", "file://…"
    run_id: str | None = None  # $TORCHELASTIC_RUN_ID (torchrun's --rdzv-id)
    script: str | None = None  # the script the interpreter runs (its absolute path)
    script_hash: str | None = None  # the first 16 hex digits of its SHA-256
    cuda_version: str | None = None  # torch.version.cuda
    nccl_version: str | None = None  # the NCCL torch loaded (nccl ranks only)
    box: str | None = None
    """The file name of the rank's black box (``agent/blackbox.py``): what a ddpwatch process
    on its host reads once the rank is late, to learn how it died."""


IDENTITY_FIELDS = tuple(n for n in Identity.__struct_fields__ if n not in ("v", "rank", "t"))
"""The fields that say who a rank is: heartbeats repeat them only when they change."""


class Hello(Identity, tag="hello"):
    """Sent once when an agent starts."""


class Sample(Identity, tag="sample"):
    """The heartbeat: identity plus the rank's latest measurements."""

    phase: str | None = None
    cpu_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """The process's CPU time so far (user + system, every thread): a rank whose CPU time
    grows is working (importing, preparing), not hung, even before it reports a step."""
    step: NonNegInt | None = None
    loss: float | None = None
    step_time_s: float | None = None
    avg_step_time_s: float | None = None
    data_wait_s: float | None = None
    collective_time_s: float | None = None
    # where a step goes, per step over the steps since the last heartbeat (``agent/split.py``)
    input_wait_s: float | None = None  # in DataLoader iterators
    compute_s: float | None = None  # the rest of the step, less the waits
    grad_wait_s: float | None = None  # in DDP's gradient all-reduce, after its own gradients
    collective: Collective | None = None
    collectives: CollectiveCounts | None = None
    batch_marks: list[tuple[NonNegInt, NonNegInt]] | None = None
    backward_marks: list[tuple[NonNegInt, NonNegInt]] | None = None
    eval_sync_marks: list[tuple[NonNegInt, NonNegInt]] | None = None
    """(step, evaluation forwards so far through an attached DDP model that broadcasts its
    buffers) at the same marked steps: each such forward is a broadcast from rank 0 every rank
    must make (BatchNorm's running statistics), so a rank that evaluates alone through the
    wrapper differs from the others at one. Nil where no such model is attached."""
    """(step, backward passes so far) at the end of recent steps that are multiples of
    ``MARK_EVERY``: a rank that runs another number of backwards per step (a micro-batch more
    under ``no_sync``, a step skipped after its backward) differs from the others at one."""
    """[step, batches drawn from the training DataLoader's iterator] at recent marked steps."""
    nan_step: NonNegInt | None = None  # the first step whose loss was not finite (exact)
    grad_nan_step: NonNegInt | None = None
    """The first step whose own gradients, before DDP's all-reduce, were not finite (exact)."""
    forwards: NonNegInt | None = None
    compile_reason: str | None = None
    """While ``phase`` is ``compiling``: why torch compiles again (a guard failure, as torch
    words it); None on a first compile or where torch does not say."""
    mem_allocated_bytes: NonNegInt | None = None
    mem_reserved_bytes: NonNegInt | None = None
    mem_peak_bytes: NonNegInt | None = None
    gpu_mem_used_bytes: NonNegInt | None = None
    gpu_mem_total_bytes: NonNegInt | None = None
    gpu_pids: list[NonNegInt] | None = None
    # host memory (``agent/hostmem.py``, from /proc and the cgroup): a leak the OOM killer ends
    host_rss_bytes: NonNegInt | None = None  # the rank's resident set
    workers_rss_bytes: NonNegInt | None = None  # its child processes' (DataLoader workers)
    host_available_bytes: NonNegInt | None = None  # the node's MemAvailable
    host_total_bytes: NonNegInt | None = None  # the node's MemTotal
    cgroup_limit_bytes: NonNegInt | None = None  # the rank's memory cgroup's limit, if any
    cgroup_used_bytes: NonNegInt | None = None  # that cgroup's usage


class Event(Message, tag="event"):
    """Something that happened once: a phase change, a crash, an exit, a captured stack.

    ``event`` is open-ended (phase, crash, exit, stack, checkpoint, log, ...): the
    server ignores kinds it does not know, so agents can add new ones.
    """

    event: str
    phase: str | None = None
    step: NonNegInt | None = None
    error: ErrorInfo | None = None
    stack: str | None = None
    signal: str | None = None
    exit_code: int | None = None
    path: str | None = None
    text: str | None = None
    collective: Collective | None = None  # crash: the collective the rank failed in


AnyMessage = Hello | Sample | Event

MAX_BATCH_FRAMES = 65_536


MAX_PACE = 4
"""The most beats a relay lets pass between its batches at the server's request."""
PACE_REQUEST = b"pace"
"""What a relay sends on the server's query port (port + 1) to learn its pace."""


class PaceReply(msgspec.Struct, gc=False):
    """The server's answer to ``pace`` (JSON): one batch every ``every`` beats, and how far
    behind its queue it is (``server/pace.py``)."""

    every: int
    lag_s: float


class Batch(
    msgspec.Struct, tag="batch", tag_field="type", kw_only=True, omit_defaults=True, gc=False
):
    """A per-node relay's frame: its ranks' frames since its last beat, in arrival order.

    ``frames`` are whole version-1 messages, each validated (and counted, and recorded) by
    the server as if it had come alone; a batch inside a batch is rejected. The relay sends
    one every beat, empty or not: it is also the relay's heartbeat.
    """

    v: int
    relay: str  # "host:pid" of the relay process: the same relay across its batches
    t: float
    host: str | None = None
    seq: NonNegInt = 0  # batches sent by this relay so far (a gap: batches lost on the way)
    frames: Annotated[list[bytes], msgspec.Meta(max_length=MAX_BATCH_FRAMES)] = []
    ages_us: Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_BATCH_FRAMES)] = []
    """How long each frame waited in the relay, in microseconds (the server dates each frame
    by its arrival at the relay, so ranks' messages of one batch keep their order in time)."""
    rejected: NonNegInt = 0  # frames the relay took in that were not valid messages
    dropped: NonNegInt = 0  # frames the relay could not forward (the server away too long)
    coalesced: NonNegInt = 0
    """Heartbeats the relay left out since its last batch, each superseded by a newer one of
    the same rank while the server was not taking more (``keeps_news`` said so): taken in,
    like those the server coalesces itself when behind, not lost."""
    ranks: Annotated[list[RankId], msgspec.Meta(max_length=MAX_BATCH_FRAMES)] = []
    """Each frame's rank, as the relay read it (empty from relays that do not say)."""
    plain: Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_BATCH_FRAMES)] = []
    """The positions of the frames that are plain heartbeats (``plain_beat``). With
    ``ranks``, they let a server behind leave out, undecoded, what a newer batch of the same
    relay supersedes (``server/ingest.py``), the way it coalesces a backlog anyway."""
    every: Annotated[int, msgspec.Meta(ge=1, le=MAX_PACE)] = 1
    """The relay's pace: one batch every this many beats, as the server asked (``pace`` on the
    query port) while it was behind; between them the relay keeps each rank's newest
    heartbeat (``coalesced``). The server allows its ranks and itself that much longer."""


WireMessage = Hello | Sample | Event | Batch


def keeps_news(superseded: Sample, newer: Sample) -> bool:
    """Whether a heartbeat that a newer one of its rank supersedes still says something the
    newer leaves out: a loss that is not finite (a NaN gone by the next beat), or an identity
    (a new pid or device). Coalescing, by a server behind or a relay held back, never leaves
    such a one out; any other only loses what the newer one overwrites."""
    if superseded.loss is not None and not math.isfinite(superseded.loss):
        return True
    return tells_identity(superseded) and not tells_identity(newer)


def plain_beat(message: AnyMessage) -> bool:
    """A heartbeat that a newer one of its rank supersedes whatever the newer says
    (``keeps_news`` is False for it): a finite loss or none, and no identity."""
    if type(message) is not Sample:
        return False
    loss = message.loss
    return (loss is None or math.isfinite(loss)) and not tells_identity(message)


def tells_identity(sample: Sample) -> bool:
    """Whether a heartbeat repeats the identity, by the fields every identity has in practice
    (four attribute reads: this runs for most frames of a backlog)."""
    return (
        sample.pid is not None
        or sample.host is not None
        or sample.world_size is not None
        or sample.device is not None
    )


class ProtocolError(ValueError):
    """A frame that is not a valid version-1 message."""


_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)
_M = TypeVar("_M", AnyMessage, WireMessage)
_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyMessage] = msgspec.msgpack.Decoder(AnyMessage)
_wire_decoder: msgspec.msgpack.Decoder[WireMessage] = msgspec.msgpack.Decoder(WireMessage)


def encode(message: AnyMessage | Batch) -> bytes:
    """Encode one message as a single MessagePack frame."""
    return _encoder.encode(message)


def decode(frame: bytes) -> AnyMessage:
    """Decode and validate one frame; raise ``ProtocolError`` for anything else."""
    return _checked(_decoder, frame)


def decode_wire(frame: bytes) -> WireMessage:
    """Decode a frame off the server's socket: a rank's message or a relay's batch."""
    return _checked(_wire_decoder, frame)


def _checked(decoder: msgspec.msgpack.Decoder[_M], frame: bytes) -> _M:
    """One set of checks for both decoders: size, shape and version."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes is over {MAX_FRAME_BYTES}")
    try:
        message = decoder.decode(frame)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"{type(exc).__name__}: {exc}") from None
    if message.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {message.v} is not {PROTOCOL_VERSION}")
    return message
