"""Property tests of the wire protocol: any message round trips, any bytes raise only protocol errors."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_frames import EXAMPLES, frame, split

from ovshard.runtime.wire.framing import (
    decode,
    encode,
    read_message,
)
from ovshard.runtime.wire.protocol import (
    DTYPES,
    KINDS,
    Close,
    ConnectionClosed,
    Error,
    Hello,
    HelloOk,
    Message,
    Open,
    OpenOk,
    Ping,
    Pong,
    ProtocolError,
    Reset,
    Result,
    Step,
    Tensor,
)


def _tensors(shapes: st.SearchStrategy[tuple[int, ...]] | None = None,
             dtypes: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[Tensor]:
    shapes = shapes if shapes is not None else st.lists(st.integers(0, 4), max_size=4).map(tuple)
    return st.builds(lambda dtype, shape, seed: Tensor(
        dtype, shape, np.random.default_rng(seed).bytes(int(np.prod(shape)) * DTYPES[dtype].itemsize)),
        dtypes if dtypes is not None else st.sampled_from(sorted(DTYPES)), shapes, st.integers(0, 2**32 - 1))


_ints = st.integers(0, 2**63 - 1)
_text = st.text(max_size=20)
_sessions = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)
_seconds = st.floats(min_value=0, allow_nan=False, allow_infinity=False)
_timings = st.dictionaries(_text, _seconds, max_size=4)
_step_shapes = st.tuples(st.just(1), st.integers(1, 4)) | st.tuples(st.just(1), st.integers(1, 4), st.integers(0, 8))
_wants = st.sampled_from(["argmax", "logits", "topk:1", "topk:40", "logits@9", "argmax@2", "topk:5@3"])
_messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, st.sampled_from(["head", "upstream"]), _ints, _text, _ints, _sessions, st.none() | _text),
    st.integers(1, 64).flatmap(lambda n: st.builds(HelloOk, st.integers(0, n - 1), _text, st.just(n))),
    st.builds(Open, _ints), st.builds(OpenOk, _ints), st.builds(Reset, _ints), st.builds(Close, _ints),
    st.builds(Step, _ints, _ints, _ints, _wants, _tensors(_step_shapes), _timings, _ints, st.booleans()),
    st.builds(Result, _ints, _ints, _tensors(), _timings),
    st.builds(Error, st.text(min_size=1, max_size=32), _text, st.none() | _ints, st.none() | _ints),
    st.builds(Ping, _ints), st.builds(Pong, _ints),
)


@given(_messages)
def test_any_message_round_trips(msg: Message) -> None:
    """Any valid message survives encode -> read_message unchanged."""
    assert read_message(io.BytesIO(encode(msg))) == msg


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_protocol_errors(data: bytes) -> None:
    """Arbitrary bytes never raise anything but ProtocolError or ConnectionClosed."""
    try:
        read_message(io.BytesIO(data))
    except (ProtocolError, ConnectionClosed):
        pass
    try:
        decode(data[:16], data[16:40], data[40:])
    except ProtocolError:
        pass


@settings(max_examples=300)
@given(st.binary(max_size=200), st.sampled_from(sorted(KINDS)))
def test_random_headers_behind_a_valid_prefix_only_raise_protocol_errors(header: bytes, kind: int) -> None:
    """Arbitrary header bytes behind a well-formed prefix of any kind reach the JSON decoder and only raise ProtocolError."""
    try:
        read_message(io.BytesIO(frame(kind, header)))
    except ProtocolError:
        pass


@settings(max_examples=300)
@given(_messages, st.data())
def test_corrupted_frames_only_raise_protocol_errors(msg: Message, data: st.DataObject) -> None:
    """A valid frame with bytes replaced past the version field is decoded or refused, never crashes."""
    frame_bytes = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(6, len(frame_bytes) - 1))
        frame_bytes[at] = data.draw(st.integers(0, 255))
    try:
        read_message(io.BytesIO(bytes(frame_bytes)))
    except (ProtocolError, ConnectionClosed):
        pass


@settings(max_examples=200)
@given(_messages, st.data())
def test_truncated_frames_only_raise_connection_closed(msg: Message, data: st.DataObject) -> None:
    """Any strict prefix of a valid frame is an unclean ConnectionClosed (or clean, when empty)."""
    encoded = encode(msg)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ConnectionClosed) as e:
        read_message(io.BytesIO(encoded[:cut]))
    assert e.value.clean == (cut == 0)


@settings(max_examples=200)
@given(st.sampled_from(EXAMPLES), st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | _text | st.floats(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3), max_leaves=10), st.data())
def test_any_json_in_a_field_is_accepted_only_if_well_typed(msg: Message, value: object, data: st.DataObject) -> None:
    """Putting arbitrary JSON in any field yields a message or a ProtocolError, nothing else."""
    prefix, header, body = split(encode(msg))
    fields = json.loads(header)
    fields[data.draw(st.sampled_from(sorted(fields)))] = value
    try:
        decode(*split(frame(type(msg).kind(), json.dumps(fields).encode(), body)))
    except ProtocolError:
        pass
