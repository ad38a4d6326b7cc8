"""The wire protocol: round trips through bytes and real sockets, bytes on the wire, every malformed frame."""

from __future__ import annotations

import io
import json
import socket
import struct
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ovshard.errors import OvshardError
from ovshard.runtime.framing import (
    MAX_HEADER_BYTES,
    PREFIX,
    PREFIX_SIZE,
    decode,
    encode,
    read_message,
    write_message,
)
from ovshard.runtime.protocol import (
    DTYPES,
    PROTOCOL_VERSION,
    Close,
    ConnectionClosed,
    Error,
    Hello,
    HelloOk,
    Message,
    Open,
    Ping,
    Pong,
    ProtocolError,
    Reset,
    Result,
    Step,
    Tensor,
    parse_want,
)

ids = Tensor.from_array(np.array([[1, 403, 407]], dtype=np.int64))
EXAMPLES: list[Message] = [
    Hello("head", PROTOCOL_VERSION, "sha256:abc", 0),
    Hello("upstream", PROTOCOL_VERSION, "sha256:abc", 2, auth={"scheme": "token", "token": "t0k"}),
    HelloOk(2, "sha256:abc", 3),
    Open(7),
    Reset(7),
    Close(7),
    Step(7, 0, 0, (1, 1, 1), "argmax", ids),
    Step(7, 1, 3, (1,), "topk:40", Tensor.from_array(np.ones((1, 1, 64), np.float32))),
    Step(7, 2, 4, (1,) * 5, "logits@5", ids, {"stage0": 0.001}, rewind=3, compact=True),
    Result(7, 1, Tensor.from_array(np.array([[42]], np.int64)), {"infer": 0.0125, "queue": 0}),
    Result(7, 2, Tensor.from_array(np.ones((1, 1, 4), np.float32), "f32"), {},
           indices=Tensor.from_array(np.array([[[5, 9, 2, 1]]], np.int64))),
    Result(7, 3, Tensor.from_array(np.zeros((1, 2, 512), np.float32), "f32"), {"infer": 1.5}),
    Error("bad_version", "peer speaks version 2, this node speaks version 1", None),
    Error("stage_failed", "infer failed on stream 7", 7),
    Ping(12345678901),
    Pong(12345678901),
]


def split(frame: bytes) -> tuple[bytes, bytes, bytes]:
    """A frame's prefix, header and body, cut where the prefix says."""
    _, _, _, _, header_len, _ = PREFIX.unpack(frame[:PREFIX_SIZE])
    return frame[:PREFIX_SIZE], frame[PREFIX_SIZE:PREFIX_SIZE + header_len], frame[PREFIX_SIZE + header_len:]


def frame(kind: int, header: bytes | dict, body: bytes = b"", *, version: int = PROTOCOL_VERSION,
          magic: bytes = b"OVSH", flags: int = 0) -> bytes:
    """A hand-built frame, so malformed ones can be made."""
    if isinstance(header, dict):
        header = json.dumps(header).encode()
    return PREFIX.pack(magic, version, kind, flags, len(header), len(body)) + header + body


def header_of(msg: Message) -> dict:
    return json.loads(split(encode(msg))[1])


def assert_refused(data: bytes, code: str) -> ProtocolError:
    """Both decode() and read_message() refuse ``data`` with ``code``."""
    with pytest.raises(ProtocolError) as from_read:
        read_message(io.BytesIO(data))
    assert from_read.value.code == code, str(from_read.value)
    with pytest.raises(ProtocolError) as from_decode:
        decode(*split(data))
    assert from_decode.value.code == code
    return from_read.value


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_bytes(msg: Message) -> None:
    """decode(encode(m)) == m, and the header is canonical JSON with sorted keys."""
    data = encode(msg)
    assert decode(*split(data)) == msg
    header = split(data)[1]
    assert header == json.dumps(json.loads(header), sort_keys=True, separators=(",", ":")).encode()


def test_frames_are_these_exact_bytes() -> None:
    """The wire format byte for byte: magic, version 2, kind, flags, the two lengths, sorted JSON, the body."""
    assert encode(Ping(1)) == b"OVSH\x02\x00\x0a\x00" + struct.pack("<II", 11, 0) + b'{"nonce":1}'
    header = (b'{"indices":null,"seq":1,"stream":7,"tensor":{"dtype":"i64","shape":[1,1]},'
              b'"timings":{"stage1":0.5}}')
    result = Result(7, 1, Tensor.from_array(np.array([[42]], np.int64)), {"stage1": 0.5})
    assert encode(result) == (b"OVSH\x02\x00\x08\x00" + struct.pack("<II", len(header), 8) + header
                              + (42).to_bytes(8, "little"))


def test_every_message_round_trips_through_a_socket_pair() -> None:
    """All example messages written back to back to a real socket pair are read back in order."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        writer = threading.Thread(target=lambda: [write_message(a, m) for m in EXAMPLES])
        writer.start()
        got = [read_message(b) for _ in EXAMPLES]
        writer.join()
    assert got == EXAMPLES


def test_a_large_tensor_crosses_loopback_tcp() -> None:
    """A 16 MiB prefill activation arrives intact over a real TCP connection (many recv calls)."""
    hidden = np.random.default_rng(0).standard_normal((1, 2048, 2048)).astype(np.float32)
    msg = Step(0, 0, 0, (1,) * 2048, "argmax", Tensor.from_array(hidden, "f32"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            conn.settimeout(10)
            writer = threading.Thread(target=write_message, args=(client, msg))
            writer.start()
            got = read_message(conn)
            writer.join()
    assert got == msg
    np.testing.assert_array_equal(got.tensor.to_array(), hidden)


@pytest.mark.parametrize("wire", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 5), (1, 1, 7), (2, 3, 4)])
def test_tensors_of_every_dtype_and_shape_round_trip(wire: str, shape: tuple[int, ...]) -> None:
    """Every wire dtype, scalars and empty shapes included, comes back with its dtype, shape and values."""
    array = (np.arange(int(np.prod(shape))) - 3).reshape(shape).astype(DTYPES[wire])
    msg = Result(1, 2, Tensor.from_array(array, wire), {})
    got = decode(*split(encode(msg))).tensor.to_array()
    assert got.dtype == DTYPES[wire] and got.shape == shape
    np.testing.assert_array_equal(got, array)


def test_activations_are_f16_on_the_wire_by_default_and_f32_on_request() -> None:
    """f32 activations lose precision as f16 (within f16 rounding) and are exact when sent as f32."""
    hidden = np.random.default_rng(1).standard_normal((1, 3, 64)).astype(np.float32)
    half = Tensor.from_array(hidden)
    assert half.dtype == "f16" and len(half.data) == hidden.size * 2
    back = half.to_array(np.float32)
    assert not np.array_equal(back, hidden)
    np.testing.assert_allclose(back, hidden, rtol=2**-11, atol=2**-24)
    np.testing.assert_array_equal(Tensor.from_array(hidden, "f32").to_array(), hidden)


def test_token_ids_keep_their_integer_dtype_and_narrowing_is_checked() -> None:
    """i64 ids stay i64; i64 -> i32 is allowed when values fit and refused when they do not."""
    assert Tensor.from_array(np.array([1, 2], np.int64)).dtype == "i64"
    assert Tensor.from_array(np.array([1, 2], np.int64), "i32").to_array().tolist() == [1, 2]
    with pytest.raises(ProtocolError, match="cannot send int64 values as i32"):
        Tensor.from_array(np.array([2**40], np.int64), "i32")
    with pytest.raises(ProtocolError, match="cannot send float32 values as i64"):
        Tensor.from_array(np.ones(2, np.float32), "i64")


def test_activations_that_overflow_f16_are_refused() -> None:
    """A value beyond f16's range is an error naming f32, not a silent inf on the wire."""
    with pytest.raises(ProtocolError, match="send them as f32"):
        Tensor.from_array(np.array([1e6], np.float32))


def test_a_decode_step_of_one_token_costs_the_activations_plus_a_small_header() -> None:
    """One token of hidden 2048 in f16 is 16 + header + 4096 bytes; the header does not grow with context."""
    hidden = Tensor.from_array(np.ones((1, 1, 2048), np.float32))
    early = encode(Step(3, 17, 10, (1,), "argmax", hidden))
    late = encode(Step(3, 100_017, 100_000, (1,), "argmax", hidden))
    for data in (early, late):
        header_len = PREFIX.unpack(data[:PREFIX_SIZE])[4]
        assert len(data) == PREFIX_SIZE + header_len + 4096
        assert header_len < 200
    assert len(late) - len(early) == 8  # only the digits of seq and position differ


def test_want_is_parsed_and_checked() -> None:
    """Step.want is argmax, logits or topk:K with K >= 1; anything else is refused when built."""
    assert parse_want("argmax") == ("argmax", None, None)
    assert parse_want("logits") == ("logits", None, None)
    assert parse_want("topk:40") == ("topk", 40, None)
    assert parse_want("argmax@5") == ("argmax", None, 5)
    assert parse_want("topk:8@11") == ("topk", 8, 11)
    for bad in ("topk:0", "topk:", "topk:-1", "topk:07", "greedy", "ARGMAX", "logits@0", "logits@", "@3"):
        with pytest.raises(ProtocolError) as e:
            Step(0, 0, 0, (1,), bad, ids)
        assert e.value.code == "bad_header"


def test_protocol_errors_are_ovshard_errors() -> None:
    """The CLI's catch-all for OvshardError also catches wire errors."""
    assert issubclass(ProtocolError, OvshardError) and issubclass(ConnectionClosed, OvshardError)


# Malformed frames: each case gives ProtocolError with the right code.

def test_bad_magic_is_refused() -> None:
    """A frame not starting with OVSH is refused as bad_magic (e.g. an HTTP client)."""
    assert_refused(b"GET / HTTP/1.1\r\n\r\n", "bad_magic")


def test_another_protocol_version_is_refused_with_both_numbers() -> None:
    """A frame of version 2 is refused, naming the peer's version and ours."""
    error = assert_refused(frame(10, {"nonce": 1}, version=PROTOCOL_VERSION + 1), "bad_version")
    assert f"version {PROTOCOL_VERSION + 1}" in str(error) and f"version {PROTOCOL_VERSION}" in str(error)


def test_unknown_kind_is_refused() -> None:
    """Kind 0 and kinds past the table are refused as unknown_kind."""
    assert_refused(frame(0, {}), "unknown_kind")
    assert_refused(frame(200, {}), "unknown_kind")


def test_nonzero_reserved_flags_are_refused() -> None:
    """The reserved flags byte must be 0."""
    assert_refused(frame(10, {"nonce": 1}, flags=1), "bad_header")


@pytest.mark.parametrize("header_len,body_len", [(MAX_HEADER_BYTES + 1, 0), (10, 2**32 - 1), (2**32 - 1, 0)])
def test_oversized_lengths_are_refused_before_the_payload_is_read(header_len: int, body_len: int) -> None:
    """A hostile length is refused after the 16-byte prefix, without waiting for or allocating the payload."""
    prefix = PREFIX.pack(b"OVSH", PROTOCOL_VERSION, 6, 0, header_len, body_len)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(prefix)  # and nothing else: reading on would block until the timeout
        b.settimeout(5)
        with pytest.raises(ProtocolError) as e:
            read_message(b)
    assert e.value.code == "oversized"
    stream = io.BytesIO(prefix + b"x" * 100)
    with pytest.raises(ProtocolError):
        read_message(stream)
    assert stream.tell() == PREFIX_SIZE


def test_max_frame_bytes_is_the_callers_limit() -> None:
    """A frame within the default limit is refused by a reader with a smaller max_frame_bytes."""
    data = encode(Step(0, 0, 0, (1,), "argmax", Tensor.from_array(np.ones((1, 1, 2048), np.float32))))
    with pytest.raises(ProtocolError) as e:
        read_message(io.BytesIO(data), max_frame_bytes=4096)
    assert e.value.code == "oversized"
    assert read_message(io.BytesIO(data), max_frame_bytes=len(data)).position == 0


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe{}", b"[1, 2]", b'"nonce"', b"[" * 50_000,
                                    b'{"nonce": NaN}', b'{"nonce": 1, "nonce": 2}', b""])
def test_a_header_that_is_not_a_json_object_is_refused(header: bytes) -> None:
    """Non-JSON, non-UTF-8, non-object, deeply nested, NaN and repeated-key headers are bad_header."""
    assert_refused(frame(10, header), "bad_header")


@pytest.mark.parametrize("header,words", [
    ({"nonce": 1, "extra": 2}, "unknown ['extra']"),
    ({}, "missing ['nonce']"),
    ({"nonce": "1"}, "Ping.nonce: expected an int"),
    ({"nonce": 1.0}, "Ping.nonce: expected an int"),
    ({"nonce": True}, "Ping.nonce: expected an int"),
    ({"nonce": -1}, "Ping.nonce: expected an int"),
    ({"nonce": 2**63}, "Ping.nonce: expected an int"),
])
def test_unknown_missing_and_mistyped_fields_are_refused(header: dict, words: str) -> None:
    """Field names must match exactly and each value must have its declared type."""
    assert words in str(assert_refused(frame(10, header), "bad_header"))


def test_mistyped_fields_of_every_kind_are_refused() -> None:
    """Replacing any one field of any example by a value of the wrong type is refused."""
    for msg in EXAMPLES:
        data = encode(msg)
        for name, value in json.loads(split(data)[1]).items():
            wrong = [1] if value is None else "x" if not isinstance(value, str) else 5
            header = json.dumps({**json.loads(split(data)[1]), name: wrong}).encode()
            with pytest.raises(ProtocolError) as e:
                decode(*split(frame(msg.KIND, header, split(data)[2])))
            assert e.value.code in ("bad_header", "bad_tensor"), (msg, name)


def test_semantic_checks_refuse_impossible_values() -> None:
    """Unknown role, stage past num_stages, mask entries other than 0/1 and empty error codes are refused."""
    hello = header_of(EXAMPLES[0])
    assert_refused(frame(1, {**hello, "role": "admin"}), "bad_header")
    assert_refused(frame(2, {"stage": 3, "bundle_fingerprint": "f", "num_stages": 3}), "bad_header")
    step = header_of(EXAMPLES[6])
    assert_refused(frame(6, {**step, "mask_delta": [1, 2, 1]}, ids.data), "bad_header")
    assert_refused(frame(9, {"code": "", "message": "m", "stream": None}), "bad_header")
    assert_refused(frame(8, {"stream": 1, "seq": 1, "tensor": {"dtype": "f32", "shape": [1]},
                             "timings": {"infer": float("inf")}, "indices": None}, b"\0" * 4), "bad_header")


def test_unknown_dtype_is_refused() -> None:
    """A tensor dtype outside f16/f32/i64/i32 is bad_tensor."""
    step = header_of(EXAMPLES[6])
    assert_refused(frame(6, {**step, "tensor": {"dtype": "f64", "shape": [1, 3]}}, b"\0" * 24), "bad_tensor")


@pytest.mark.parametrize("shape,body", [([1, 3], b"\0" * 23), ([1, 3], b"\0" * 25), ([1, -3], b""),
                                        ([1, 2.5], b"\0" * 16), ([2**62, 2**62], b"\0" * 8), ("1,3", b"")])
def test_shape_and_body_length_must_agree(shape: object, body: bytes) -> None:
    """Body length must be exactly product(shape) * itemsize, with a shape of non-negative ints."""
    step = header_of(EXAMPLES[6])
    assert_refused(frame(6, {**step, "tensor": {"dtype": "i64", "shape": shape}}, body), "bad_tensor")


def test_a_body_on_a_message_without_tensors_is_refused() -> None:
    """Bytes after the header of a tensor-less message are bad_tensor, not ignored."""
    assert_refused(frame(10, {"nonce": 1}, b"junk"), "bad_tensor")


def test_result_indices_must_match_the_values() -> None:
    """Top-k ids must be integers of the values' shape."""
    values = Tensor.from_array(np.ones((1, 1, 4), np.float32), "f32")
    with pytest.raises(ProtocolError) as e:
        Result(1, 1, values, {}, indices=Tensor.from_array(np.array([[1, 2, 3]], np.int64)))
    assert e.value.code == "bad_tensor"


def test_decode_refuses_a_header_or_body_shorter_than_announced() -> None:
    """decode() given fewer bytes than the prefix announces is truncated."""
    prefix, header, body = split(encode(EXAMPLES[6]))
    with pytest.raises(ProtocolError) as e:
        decode(prefix, header, body[:-1])
    assert e.value.code == "truncated"


def test_a_peer_closing_mid_frame_is_an_unclean_close() -> None:
    """EOF inside a frame raises ConnectionClosed(clean=False), at every cut point, over a real socket."""
    data = encode(EXAMPLES[6])
    for cut in (1, PREFIX_SIZE - 1, PREFIX_SIZE, PREFIX_SIZE + 5, len(data) - 1):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(data[:cut])
            a.close()
            with pytest.raises(ConnectionClosed) as e:
                read_message(b)
        assert not e.value.clean, cut


def test_a_peer_closing_between_frames_is_a_clean_close() -> None:
    """EOF right after a whole frame reads the frame, then raises ConnectionClosed(clean=True)."""
    a, b = socket.socketpair()
    with a, b:
        write_message(a, Ping(1))
        a.close()
        assert read_message(b) == Ping(1)
        with pytest.raises(ConnectionClosed) as e:
            read_message(b)
    assert e.value.clean


# Property tests.

def _tensors() -> st.SearchStrategy[Tensor]:
    shapes = st.lists(st.integers(0, 4), max_size=4).map(tuple)
    return st.builds(lambda dtype, shape, seed: Tensor(
        dtype, shape, np.random.default_rng(seed).bytes(int(np.prod(shape)) * DTYPES[dtype].itemsize)),
        st.sampled_from(sorted(DTYPES)), shapes, st.integers(0, 2**32 - 1))


_ints = st.integers(0, 2**63 - 1)
_text = st.text(max_size=20)
_json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _text
_messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, st.sampled_from(["head", "upstream"]), _ints, _text, _ints,
              st.none() | st.dictionaries(_text, _json_scalars | st.lists(_json_scalars, max_size=3), max_size=4)),
    st.integers(1, 64).flatmap(lambda n: st.builds(HelloOk, st.integers(0, n - 1), _text, st.just(n))),
    st.builds(Open, _ints), st.builds(Reset, _ints), st.builds(Close, _ints),
    st.builds(Step, _ints, _ints, _ints, st.lists(st.sampled_from([0, 1]), max_size=8).map(tuple),
              st.sampled_from(["argmax", "logits", "topk:1", "topk:40", "logits@9", "argmax@2"]), _tensors(),
              st.just({}), _ints, st.booleans()),
    st.builds(Result, _ints, _ints, _tensors(),
              st.dictionaries(_text, st.floats(allow_nan=False, allow_infinity=False) | _ints, max_size=4)),
    st.builds(Error, _text.filter(bool), _text, st.none() | _ints),
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
@given(_messages, st.data())
def test_corrupted_frames_only_raise_protocol_errors(msg: Message, data: st.DataObject) -> None:
    """A valid frame with bytes flipped past the version field is decoded or refused, never crashes."""
    frame_bytes = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(6, len(frame_bytes) - 1))
        frame_bytes[at] = data.draw(st.integers(0, 255))
    try:
        read_message(io.BytesIO(bytes(frame_bytes)))
    except (ProtocolError, ConnectionClosed):
        pass


@settings(max_examples=200)
@given(st.sampled_from(EXAMPLES), st.recursive(
    _json_scalars | st.floats(), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=10), st.data())
def test_any_json_in_a_field_is_accepted_only_if_well_typed(msg: Message, value: object, data: st.DataObject) -> None:
    """Putting arbitrary JSON in any field yields a message or a ProtocolError, nothing else."""
    prefix, header, body = split(encode(msg))
    fields = json.loads(header)
    fields[data.draw(st.sampled_from(sorted(fields)))] = value
    try:
        decode(*split(frame(msg.KIND, json.dumps(fields).encode(), body)))
    except ProtocolError:
        pass


def test_prefix_layout_is_sixteen_little_endian_bytes() -> None:
    """The prefix is magic, u16 version, u8 kind, u8 flags, u32 header length, u32 body length, little-endian."""
    data = encode(Ping(1))
    assert data[:4] == b"OVSH"
    assert struct.unpack("<HBBII", data[4:16]) == (PROTOCOL_VERSION, Ping.KIND, 0, len(data) - 16, 0)
