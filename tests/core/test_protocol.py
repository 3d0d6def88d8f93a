"""The wire protocol (version 1): round trips, the frames it rejects, and fuzzing.

The contract under test: ``protocol.decode`` returns a validated message or raises
``ProtocolError``, never anything else, so one bad publisher can never take the
collector down. Frames are built here the way a non-Python publisher would build
them: a plain MessagePack map, no msgspec structs.
"""

from __future__ import annotations

import contextlib
import math
import random
import struct
from datetime import timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpwatch.core.protocol import (
    DEFAULT_PORT,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Collective,
    CollectiveCounts,
    ErrorInfo,
    Event,
    Hello,
    ProtocolError,
    Sample,
    decode,
    encode,
)

BASE: dict[str, Any] = {"v": 1, "type": "sample", "rank": 0, "t": 1_700_000_000.25}

IDENTITY: dict[str, Any] = {
    "local_rank": 1,
    "world_size": 4,
    "local_world_size": 2,
    "node_rank": 1,
    "host": "node-a",
    "pid": 4242,
    "launcher": "torchrun",
    "job_id": "job-17",
    "backend": "nccl",
    "torch_version": "2.13.0",
    "cuda_visible_devices": "0,1",
    "device": "cuda:1",
    "device_index": 1,
    "device_name": "NVIDIA H100 80GB HBM3",
    "device_uuid": "GPU-5c1e7a3b-0000-0000-0000-000000000001",
    "device_pci_bus_id": "00000000:19:00.0",
    "device_count": 2,
    "pg_timeout_s": 1800.0,
    "restart_count": 1,
    "rendezvous": "standalone",
    "simulated": True,
    "master_addr": "node-a",
    "master_port": "29500",
    "init_method": "env://",
    "run_id": "job-17",
    "script": "/home/ann/train.py",
    "script_hash": "9f2c4e1a7b3d5f60",
    "cuda_version": "12.8",
    "nccl_version": "2.27.3",
    "box": "3-4242-0123456789abcdef.box",
}

FULL_HELLO = Hello(v=1, rank=3, t=1_700_000_000.0, **IDENTITY)

FULL_SAMPLE = Sample(
    v=1,
    rank=3,
    t=1_700_000_000.5,
    **IDENTITY,
    phase="train",
    cpu_s=41.5,
    step=120,
    loss=0.4375,
    step_time_s=0.25,
    avg_step_time_s=0.2,
    data_wait_s=0.01,
    collective_time_s=0.05,
    input_wait_s=0.02,
    compute_s=0.15,
    grad_wait_s=0.03,
    forwards=1234,
    compile_reason="tensor 'x' size mismatch at index 0. expected 4, actual 8",
    collective=Collective(
        op="all_reduce",
        seq=987,
        since_s=12.5,
        source="fr",
        group="1",
        shape=[8, 4],
        dtype="float32",
    ),
    collectives=CollectiveCounts(py=40, fr={"0": 986, "1": 987}),
    batch_marks=[(112, 113), (120, 121)],
    backward_marks=[(112, 113), (120, 121)],
    eval_sync_marks=[(112, 3), (120, 3)],
    nan_step=118,
    grad_nan_step=117,
    mem_allocated_bytes=3 << 30,
    mem_reserved_bytes=4 << 30,
    mem_peak_bytes=5 << 30,
    gpu_mem_used_bytes=41 << 30,
    gpu_mem_total_bytes=80 << 30,
    gpu_pids=[4242, 4243, 999],
    host_rss_bytes=3 << 30,
    workers_rss_bytes=1 << 30,
    host_available_bytes=100 << 30,
    host_total_bytes=128 << 30,
    cgroup_limit_bytes=64 << 30,
    cgroup_used_bytes=20 << 30,
)

EVENTS = {
    "phase": Event(v=1, rank=2, t=1.0, event="phase", phase="eval", step=7),
    "crash": Event(
        v=1,
        rank=2,
        t=2.0,
        event="crash",
        phase="train",
        step=8,
        error=ErrorInfo(
            type="RuntimeError",
            message="CUDA out of memory. Tried to allocate 2.00 GiB",
            traceback='Traceback (most recent call last):\n  File "train.py", line 9\n',
        ),
        stack='  File "train.py", line 9, in <module>\n    loss.backward()\n',
        collective=Collective(op="all_gather", seq=40, source="py", shape=[5], dtype="float32"),
    ),
    "exit": Event(v=1, rank=2, t=3.0, event="exit", signal="SIGTERM", exit_code=-15),
    "stack": Event(
        v=1, rank=2, t=4.0, event="stack", stack='  File "distributed_c10d.py", in wait\n'
    ),
    "checkpoint": Event(v=1, rank=2, t=5.0, event="checkpoint", step=9, path="/ckpt/step9.pt"),
    "log": Event(v=1, rank=2, t=6.0, event="log", text="warmup done ✓"),
}


def frame(**fields: Any) -> bytes:
    """A frame as any MessagePack library would write it: a plain map, no structs."""
    return msgspec.msgpack.encode({**BASE, **fields})


def padded(size: int) -> bytes:
    """A valid sample frame of exactly ``size`` bytes (``size`` over 64 KiB)."""
    overhead = len(frame(pad="x" * 100_000)) - 100_000
    data = frame(pad="x" * (size - overhead))
    assert len(data) == size
    return data


def without(key: str, base: dict[str, Any] | None = None) -> bytes:
    return msgspec.msgpack.encode({k: v for k, v in (base or BASE).items() if k != key})


def assert_rejected(data: bytes) -> ProtocolError:
    """``decode`` must refuse ``data`` with ``ProtocolError`` and nothing else."""
    try:
        message = decode(data)
    except ProtocolError as exc:
        return exc
    pytest.fail(f"accepted an invalid frame as {message!r}")


def decode_or_reject(data: bytes) -> None:
    """Either outcome is fine; any exception other than ``ProtocolError`` escapes."""
    with contextlib.suppress(ProtocolError):
        decode(data)


# --- constants -----------------------------------------------------------------


def test_constants_are_the_documented_ones() -> None:
    assert PROTOCOL_VERSION == 1
    assert DEFAULT_PORT == 5599
    assert MAX_FRAME_BYTES == 1 << 20
    assert issubclass(ProtocolError, ValueError)


# --- round trips -----------------------------------------------------------------


def test_fixtures_set_every_field() -> None:
    """Guard: a field added to the protocol must be added to these fixtures too."""
    for name in Sample.__struct_fields__:
        assert getattr(FULL_SAMPLE, name) not in (None, False), name
    for name in Hello.__struct_fields__:
        assert getattr(FULL_HELLO, name) not in (None, False), name
    for name in Event.__struct_fields__:
        assert any(getattr(e, name) is not None for e in EVENTS.values()), name


@pytest.mark.parametrize(
    "message",
    [FULL_HELLO, FULL_SAMPLE, *EVENTS.values()],
    ids=["hello", "sample", *(f"event-{kind}" for kind in EVENTS)],
)
def test_round_trip(message: Hello | Sample | Event) -> None:
    data = encode(message)
    assert isinstance(data, bytes)
    decoded = decode(data)
    assert type(decoded) is type(message)
    assert decoded == message


def test_round_trip_keeps_nested_structs() -> None:
    sample = decode(encode(FULL_SAMPLE))
    assert isinstance(sample, Sample)
    assert sample.collective == FULL_SAMPLE.collective
    assert sample.collective is not None and sample.collective.shape == [8, 4]
    assert sample.collectives == CollectiveCounts(py=40, fr={"0": 986, "1": 987})
    assert sample.gpu_pids == [4242, 4243, 999]
    crash = decode(encode(EVENTS["crash"]))
    assert isinstance(crash, Event)
    assert crash.error is not None
    assert crash.error.type == "RuntimeError"
    assert crash.error.traceback.startswith("Traceback")


def test_minimal_messages_round_trip() -> None:
    for message in (
        Hello(v=1, rank=0, t=0.0),
        Sample(v=1, rank=0, t=0.0),
        Event(v=1, rank=0, t=0.0, event="log"),
        Sample(v=1, rank=3, t=1.0, collective=Collective(op="barrier")),
    ):
        assert decode(encode(message)) == message


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_round_trips(value: float) -> None:
    sample = decode(encode(Sample(v=1, rank=0, t=1.0, step=5, loss=value)))
    assert isinstance(sample, Sample)
    assert sample.loss is not None
    if math.isnan(value):
        assert math.isnan(sample.loss)
    else:
        assert sample.loss == value


def test_wire_shape_is_a_plain_map() -> None:
    """What a non-Python consumer sees: a map with the common keys; unset fields omitted."""
    raw = msgspec.msgpack.decode(encode(Sample(v=1, rank=3, t=2.5, host="h", step=None)))
    assert raw == {"v": 1, "type": "sample", "rank": 3, "t": 2.5, "host": "h"}
    raw = msgspec.msgpack.decode(encode(EVENTS["exit"]))
    assert raw["type"] == "event"
    assert raw["event"] == "exit"
    assert raw["signal"] == "SIGTERM"
    raw = msgspec.msgpack.decode(encode(FULL_SAMPLE))
    assert raw["collective"] == {
        "op": "all_reduce",
        "seq": 987,
        "since_s": 12.5,
        "source": "fr",
        "group": "1",
        "shape": [8, 4],
        "dtype": "float32",
    }
    assert raw["collectives"] == {"py": 40, "fr": {"0": 986, "1": 987}}


# --- frames from other publishers ----------------------------------------------------


def test_plain_map_sample_is_accepted() -> None:
    data = frame(
        rank=1,
        **IDENTITY,
        phase="train",
        step=120,
        loss=0.4375,
        step_time_s=0.25,
        collective={"op": "all_reduce", "seq": 987, "since_s": 12.5},
        mem_allocated_bytes=3 << 30,
        gpu_pids=[4242, 4243, 999],
    )
    message = decode(data)
    assert isinstance(message, Sample)
    assert message.rank == 1
    assert message.host == "node-a"
    assert message.collective == Collective(op="all_reduce", seq=987, since_s=12.5)
    assert message.gpu_pids == [4242, 4243, 999]


def test_plain_map_events_are_accepted() -> None:
    crash = decode(
        msgspec.msgpack.encode(
            {
                "t": 2.0,
                "event": "crash",
                "rank": 2,
                "error": {"type": "ValueError", "message": "bad", "traceback": "tb"},
                "type": "event",
                "v": 1,
            }
        )
    )
    assert crash == Event(
        v=1, rank=2, t=2.0, event="crash", error=ErrorInfo("ValueError", "bad", "tb")
    )
    hello = decode(frame(type="hello", host="h", pid=7))
    assert hello == Hello(v=1, rank=0, t=BASE["t"], host="h", pid=7)


def test_explicit_nulls_are_accepted() -> None:
    nulls = {name: None for name in Sample.__struct_fields__ if name not in ("v", "rank", "t")}
    nulls["simulated"] = False
    message = decode(frame(**nulls))
    assert message == Sample(v=1, rank=0, t=BASE["t"])


def test_hand_written_frame_with_float32_is_accepted() -> None:
    """MessagePack libraries may pick float32 and the smallest int encodings."""
    data = (
        b"\x85"
        + b"\xa1v\x01"
        + b"\xa4type\xa6sample"
        + b"\xa4rank\xcc\xc8"  # uint8 200
        + b"\xa1t\xca"
        + struct.pack(">f", 1.5)
        + b"\xa4loss\xca"
        + struct.pack(">f", 0.25)
    )
    message = decode(data)
    assert isinstance(message, Sample)
    assert (message.rank, message.t, message.loss) == (200, 1.5, 0.25)


def test_ints_accepted_where_floats_expected() -> None:
    message = decode(
        frame(t=1_700_000_000, loss=2, step_time_s=1, collective={"op": "barrier", "since_s": 3})
    )
    assert isinstance(message, Sample)
    assert message.t == 1_700_000_000.0
    assert isinstance(message.t, float)
    assert message.loss == 2.0
    assert isinstance(message.loss, float)
    assert message.collective is not None
    assert message.collective.since_s == 3.0


def test_unknown_fields_are_ignored() -> None:
    message = decode(
        frame(
            future_field={"nested": [1, 2.5, None, b"\x00", {"deep": True}]},
            another=msgspec.msgpack.Ext(7, b"ext"),
            collective={"op": "all_gather", "seq": 1, "new_in_v1_5": "x"},
        )
    )
    assert isinstance(message, Sample)
    assert message.collective == Collective(op="all_gather", seq=1)
    assert not hasattr(message, "future_field")
    event = decode(
        frame(type="event", event="crash", error={"type": "E", "extra": 1}, also_extra=[])
    )
    assert isinstance(event, Event)
    assert event.error == ErrorInfo(type="E")


def test_unknown_event_kind_is_accepted() -> None:
    """Event kinds are open: a newer agent's kind reaches an older server, which ignores it."""
    event = decode(frame(type="event", event="gradient_norm", text="12.5"))
    assert isinstance(event, Event)
    assert event.event == "gradient_norm"


def test_frame_of_exactly_max_size_is_accepted() -> None:
    assert isinstance(decode(padded(MAX_FRAME_BYTES)), Sample)


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_bytes_like_frames_are_accepted(kind: type) -> None:
    assert decode(kind(encode(FULL_SAMPLE))) == FULL_SAMPLE


# --- rejections ----------------------------------------------------------------------

_rng = random.Random(20240601)

REJECTED: dict[str, bytes] = {
    # not MessagePack at all
    "empty": b"",
    "reserved-opcode": b"\xc1",
    "json": b'{"v": 1, "type": "sample", "rank": 0, "t": 1.0}',
    "text": b"status",
    "random-bytes-1": _rng.randbytes(64),
    "random-bytes-2": _rng.randbytes(512),
    "trailing-bytes": frame() + b"\x00",
    "two-messages": frame() + frame(),
    # MessagePack, but not a map
    "list": msgspec.msgpack.encode([1, "sample", 0, 1.0]),
    "int": msgspec.msgpack.encode(1),
    "string": msgspec.msgpack.encode("sample"),
    "nil": msgspec.msgpack.encode(None),
    "float": msgspec.msgpack.encode(1.0),
    "bool": msgspec.msgpack.encode(True),
    "bin": msgspec.msgpack.encode(b"\x81\xa1v\x01"),
    "empty-map": msgspec.msgpack.encode({}),
    # required fields missing
    "missing-v": without("v"),
    "missing-type": without("type"),
    "missing-rank": without("rank"),
    "missing-t": without("t"),
    "missing-event-kind": frame(type="event"),
    "collective-without-op": frame(collective={"seq": 3}),
    "error-without-type": frame(type="event", event="crash", error={"message": "m"}),
    # wrong types
    "rank-string": frame(rank="1"),
    "rank-negative": frame(rank=-1),
    "rank-float": frame(rank=1.0),
    "rank-bool": frame(rank=True),
    "rank-null": frame(rank=None),
    "t-string": frame(t="x"),
    "t-null": frame(t=None),
    "t-timestamp-ext": frame(t=msgspec.msgpack.Ext(-1, b"\x00\x00\x00\x01")),
    "step-string": frame(step="abc"),
    "step-float": frame(step=1.5),
    "loss-string": frame(loss="nan"),
    "cpu-negative": frame(cpu_s=-0.5),
    "cpu-string": frame(cpu_s="1.5"),
    "collective-not-map": frame(collective="all_reduce"),
    "collective-list": frame(collective=["all_reduce", 1, 0.5]),
    "collective-op-int": frame(collective={"op": 3}),
    "gpu-pids-not-list": frame(gpu_pids=1234),
    "gpu-pids-of-strings": frame(gpu_pids=["1234"]),
    "host-bytes": frame(host=b"node-a"),
    "simulated-int": frame(simulated=1),
    "error-not-map": frame(type="event", event="crash", error="boom"),
    "event-kind-int": frame(type="event", event=3),
    "hello-bad-pid": frame(type="hello", pid="42"),
    "non-string-key": msgspec.msgpack.encode({**BASE, 5: "x"}),
    # unknown type, wrong version
    "type-unknown": frame(type="heartbeat"),
    "type-empty": frame(type=""),
    "type-int": frame(type=1),
    "type-null": frame(type=None),
    "type-case": frame(type="Sample"),
    "v-2": frame(v=2),
    "v-0": frame(v=0),
    "v-string": frame(v="1"),
    "v-float": frame(v=1.0),
    "v-null": frame(v=None),
    "v-2-event": frame(v=2, type="event", event="log"),
    # too big
    "oversized-valid-map": frame(pad="x" * MAX_FRAME_BYTES),
    "oversized-garbage": b"\xff" * (MAX_FRAME_BYTES + 1),
}


@pytest.mark.parametrize("data", list(REJECTED.values()), ids=list(REJECTED))
def test_rejected(data: bytes) -> None:
    assert_rejected(data)


def test_version_error_names_the_version() -> None:
    assert "2" in str(assert_rejected(frame(v=2)))


def test_oversized_frame_is_refused_before_parsing() -> None:
    assert "over" in str(assert_rejected(padded(MAX_FRAME_BYTES + 1)))


@pytest.mark.parametrize(
    "message",
    [FULL_HELLO, FULL_SAMPLE, EVENTS["crash"], EVENTS["exit"]],
    ids=["hello", "sample", "crash", "exit"],
)
def test_every_truncation_is_rejected(message: Hello | Sample | Event) -> None:
    data = encode(message)
    for end in range(len(data)):
        assert_rejected(data[:end])


# --- invalid UTF-8 and deep nesting are rejected like any other bad frame ----------


def _bad_utf8(data: bytes, placeholder: str = "\x01\x02") -> bytes:
    """Replace the 2-byte string ``placeholder`` in ``data`` with invalid UTF-8."""
    encoded = b"\xa2" + placeholder.encode()
    assert data.count(encoded) == 1
    return data.replace(encoded, b"\xa2\xff\xfe")


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(_bad_utf8(frame(host="\x01\x02")), id="host"),
        pytest.param(_bad_utf8(frame(type="\x01\x02")), id="type-tag"),
        pytest.param(_bad_utf8(frame(collective={"op": "\x01\x02"})), id="collective-op"),
        pytest.param(
            _bad_utf8(frame(type="event", event="crash", error={"type": "\x01\x02"})),
            id="error-type",
        ),
        pytest.param(frame(x=None)[:-1] + b"\x91" * 5_000 + b"\xc0", id="deep-list"),
        pytest.param(
            frame(x=None)[:-1] + b"\x81\xa1k" * 5_000 + b"\xc0",
            id="deep-map",
        ),
    ],
)
def test_hostile_frames_raise_only_protocol_error(data: bytes) -> None:
    assert len(data) < 20_000  # small frames, far under MAX_FRAME_BYTES
    assert_rejected(data)


def test_invalid_utf8_in_an_unknown_field_is_skipped() -> None:
    data = _bad_utf8(frame(extra="\x01\x02"))
    assert isinstance(decode(data), Sample)


# --- fuzzing -------------------------------------------------------------------------

FUZZ = settings(
    max_examples=400,
    deadline=timedelta(seconds=2),  # a decode that takes this long counts as a hang
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8))
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=10) | st.integers(-5, 5), children, max_size=5)
    ),
    max_leaves=25,
)
field_names = st.sampled_from(
    sorted({*Sample.__struct_fields__, *Event.__struct_fields__, "type"})
) | st.text(max_size=10)
type_tags = st.sampled_from(["hello", "sample", "event", "bogus"])


@pytest.mark.fuzz
@pytest.mark.timeout(120)
@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    decode_or_reject(data)


@pytest.mark.fuzz
@pytest.mark.timeout(120)
@FUZZ
@given(st.binary(max_size=64))
def test_fuzz_bytes_after_a_valid_prefix(tail: bytes) -> None:
    """Arbitrary bytes where the decoder has already committed to a message."""
    decode_or_reject(frame(x=None)[:-1] + tail)
    decode_or_reject(encode(FULL_SAMPLE)[:-4] + tail)


@pytest.mark.fuzz
@pytest.mark.timeout(120)
@FUZZ
@given(values)
def test_fuzz_arbitrary_msgpack_values(value: Any) -> None:
    decode_or_reject(msgspec.msgpack.encode(value))


@pytest.mark.fuzz
@pytest.mark.timeout(120)
@FUZZ
@given(st.dictionaries(field_names, values, max_size=6), type_tags, st.booleans())
def test_fuzz_fields_of_a_valid_frame(fields: dict[str, Any], tag: str, keep_base: bool) -> None:
    """Arbitrary values in known and unknown fields reach the typed validation."""
    base = {**BASE, "type": tag, "event": "log"} if keep_base else {}
    data = msgspec.msgpack.encode({**base, **fields})
    decode_or_reject(data)


@pytest.mark.fuzz
@pytest.mark.timeout(120)
@FUZZ
@given(values)
def test_fuzz_unknown_field_never_matters(value: Any) -> None:
    message = decode(frame(**{"x-unknown": value}))
    assert message == Sample(v=1, rank=0, t=BASE["t"])


@pytest.mark.timeout(120)
@FUZZ
@given(
    st.sampled_from([encode(FULL_SAMPLE), encode(EVENTS["crash"]), encode(FULL_HELLO)]),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
)
@pytest.mark.fuzz
def test_fuzz_mutated_valid_frames(data: bytes, edits: list[tuple[int, int]]) -> None:
    mutated = bytearray(data)
    for position, byte in edits:
        mutated[position % len(mutated)] = byte
    decode_or_reject(bytes(mutated))
