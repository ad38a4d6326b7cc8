"""Malformed frames: each refused with a ProtocolError of the right code, before its payload is trusted."""

from __future__ import annotations

import io
import json
import socket

import msgspec
import numpy as np
import pytest
from protocol_frames import EXAMPLES, SESSION, STEP, assert_refused, frame, header_of, ids, split

from ovshard.runtime.wire.framing import (
    MAX_HEADER_BYTES,
    PREFIX,
    PREFIX_SIZE,
    decode,
    encode,
    read_message,
    write_message,
)
from ovshard.runtime.wire.protocol import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    Ping,
    ProtocolError,
    Result,
    Step,
    Tensor,
)


def test_bad_magic_is_refused() -> None:
    """A frame not starting with OVSH is refused as bad_magic (e.g. an HTTP client)."""
    assert_refused(b"GET / HTTP/1.1\r\n\r\n", "bad_magic")


@pytest.mark.parametrize("version", [2, PROTOCOL_VERSION + 1])
def test_another_protocol_version_is_refused_with_both_numbers(version: int) -> None:
    """A v2 or v4 frame is refused, naming the peer's version and ours."""
    refused = assert_refused(frame(10, {"nonce": 1}, version=version), "bad_version")
    assert f"version {version}" in str(refused) and f"version {PROTOCOL_VERSION}" in str(refused)


@pytest.mark.parametrize("kind", [0, 7, 15, 200])
def test_unknown_kind_is_refused(kind: int) -> None:
    """Kind 0, the retired kind 7 and kinds past the table are refused as unknown_kind."""
    assert_refused(frame(kind, {}), "unknown_kind")


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
    """A frame within the default limit is refused by a reader with a smaller max_frame_bytes (a pre-auth Hello cap)."""
    data = encode(Step(0, 0, 0, "argmax", Tensor.from_array(np.ones((1, 1, 2048), np.float32))))
    with pytest.raises(ProtocolError) as e:
        read_message(io.BytesIO(data), max_frame_bytes=4096)
    assert e.value.code == "oversized"
    assert read_message(io.BytesIO(data), max_frame_bytes=len(data) - PREFIX_SIZE).position == 0


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe{}", b"[1, 2]", b'"nonce"', b"[" * 50_000,
                                    b'{"nonce": NaN}', b'{"nonce": Infinity}', b""])
def test_a_header_that_is_not_a_json_object_is_refused(header: bytes) -> None:
    """Non-JSON, non-UTF-8, non-object, deeply nested, NaN/Infinity and empty headers are bad_header."""
    assert_refused(frame(10, header), "bad_header")


def test_a_repeated_key_keeps_the_last_value() -> None:
    """v3 accepts a repeated JSON key and keeps its last value (msgspec's rule; v2 refused it)."""
    assert decode(*split(frame(10, b'{"nonce": 1, "nonce": 2}'))) == Ping(2)


@pytest.mark.parametrize("header,words", [
    ({"nonce": 1, "extra": 2}, "unknown field `extra`"),
    ({}, "missing required field `nonce`"),
    ({"nonce": "1"}, "Expected `int`, got `str` - at `$.nonce`"),
    ({"nonce": 1.0}, "Expected `int`, got `float` - at `$.nonce`"),
    ({"nonce": True}, "Expected `int`, got `bool` - at `$.nonce`"),
    ({"nonce": None}, "Expected `int`, got `null` - at `$.nonce`"),
    ({"nonce": -1}, "Expected `int` >= 0 - at `$.nonce`"),
    ({"nonce": 2**63}, "Expected `int` <= 9223372036854775807 - at `$.nonce`"),
])
def test_unknown_missing_and_mistyped_fields_are_refused(header: dict, words: str) -> None:
    """Field names must match exactly and each value must have its declared type and range."""
    assert words in str(assert_refused(frame(10, header), "bad_header"))


def test_the_kind_in_the_header_must_agree_with_the_prefix() -> None:
    """A header tagged as another kind than the prefix says is refused; the tag may be left out."""
    assert "Invalid value 11 - at `$.kind`" in str(assert_refused(frame(10, {"kind": 11, "nonce": 1}), "bad_header"))
    assert decode(*split(frame(10, {"nonce": 1}))) == Ping(1)


def test_mistyped_fields_of_every_kind_are_refused() -> None:
    """Replacing any one field of any example (the kind tag included) by a value of the wrong type is refused."""
    for msg in EXAMPLES:
        prefix, header, body = split(encode(msg))
        for name, value in json.loads(header).items():
            wrong = [1] if value is None else "x" if not isinstance(value, str) else 5
            bad = json.dumps({**json.loads(header), name: wrong}).encode()
            with pytest.raises(ProtocolError) as e:
                decode(*split(frame(type(msg).kind(), bad, body)))
            assert e.value.code in ("bad_header", "bad_tensor"), (msg, name)


@pytest.mark.parametrize("kind,header,body", [
    (6, {**STEP, "stream": 2**63}, ids.data),
    (6, {**STEP, "rewind": -1}, ids.data),
    (6, {**STEP, "tensor": {"dtype": "i64", "shape": [1, 2**31]}}, b""),
    (6, {**STEP, "tensor": {"dtype": "i64", "shape": [1] * 9}}, b"\0" * 8),
    (6, {**STEP, "want": "argmax" * 6}, ids.data),
    (6, {**STEP, "timings": {f"s{i}": 0.0 for i in range(65)}}, ids.data),
    (6, {**STEP, "timings": {"s": -0.5}}, ids.data),
    (6, {**STEP, "timings": {"s" * 257: 0.5}}, ids.data),
    (6, b'{"stream":1,"step":1,"position":0,"want":"argmax","tensor":{"dtype":"i64","shape":[1,3]},'
        b'"timings":{"s":1e400}}', ids.data),
    (9, {"code": "", "message": "m"}, b""),
    (9, {"code": "c" * 33, "message": "m"}, b""),
    (9, {"code": "failed", "message": "m" * 4097}, b""),
    (2, {"stage": 3, "bundle_fingerprint": "f", "num_stages": 3}, b""),
    (2, {"stage": 0, "bundle_fingerprint": "f" * 257, "num_stages": 3}, b""),
], ids=["stream", "rewind", "dim", "ndim", "want", "timings-count", "timings-negative", "timings-key",
        "timings-overflow", "empty-code", "long-code", "long-message", "stage-past-num-stages", "long-fingerprint"])
def test_out_of_range_values_are_refused(kind: int, header: bytes | dict, body: bytes) -> None:
    """Integers, string lengths, dict sizes and float ranges beyond what the wire allows are bad_header."""
    assert_refused(frame(kind, header, body), "bad_header")


@pytest.mark.parametrize("field,value", [
    ("role", "admin"), ("session", "0123456789ABCDEF" * 2), ("session", "0123456789abcdef"), ("session", None),
    ("session", "0123456789abcdef" * 2 + "0"), ("protocol", -1), ("next_hop", "h" * 257)])
def test_a_hello_with_a_bad_role_or_session_is_refused(field: str, value: object) -> None:
    """Role is head|upstream; the session is exactly 32 lowercase hex characters."""
    assert_refused(frame(1, {**header_of(EXAMPLES[0]), field: value}), "bad_header")


@pytest.mark.parametrize("fields", [{"auth": {"scheme": "token", "token": "t0k"}}, {"auth": None}])
def test_v2_fields_are_unknown_in_v3(fields: dict) -> None:
    """Hello's v2 auth field is unknown now, so a v2-shaped Hello is bad_header (v3 dropped it)."""
    assert "unknown field `auth`" in str(assert_refused(frame(1, {**header_of(EXAMPLES[0]), **fields}), "bad_header"))


def test_a_v2_step_with_a_mask_list_is_refused() -> None:
    """Step's v2 mask_delta list is an unknown field in v3 (every new token is visible)."""
    refused = assert_refused(frame(6, {**STEP, "mask_delta": [1, 1, 1]}, ids.data), "bad_header")
    assert "unknown field `mask_delta`" in str(refused)


def test_a_session_with_a_trailing_newline_is_refused() -> None:
    """A session is exactly 32 hex characters: one followed by a newline (33 characters) is bad_header."""
    assert_refused(frame(1, {**header_of(EXAMPLES[0]), "session": SESSION + "\n"}), "bad_header")


def test_a_hello_without_a_session_is_refused() -> None:
    """The session is required: a Hello without one is bad_header."""
    hello = header_of(EXAMPLES[0])
    del hello["session"]
    assert "missing required field `session`" in str(assert_refused(frame(1, hello), "bad_header"))


@pytest.mark.parametrize("shape,body", [([3], 24), ([2, 3], 48), ([1, 0], 0), ([0, 3], 0), ([2, 1, 64], 256),
                                        ([1, 1, 1, 64], 128), ([], 8)],
                         ids=["1-D", "batch-2", "no-tokens", "batch-0", "batch-2-activations", "4-D", "scalar"])
def test_a_step_tensor_must_be_one_batch_of_at_least_one_token(shape: list[int], body: int) -> None:
    """A Step tensor is ids [1, T] or activations [1, T, H] with T >= 1; any other shape is bad_header."""
    dtype = "f16" if len(shape) == 3 else "i64"
    refused = assert_refused(frame(6, {**STEP, "tensor": {"dtype": dtype, "shape": shape}}, b"\0" * body), "bad_header")
    assert "batch 1" in str(refused)


def test_a_step_tensor_of_a_bad_shape_cannot_be_built() -> None:
    """The same check holds when a Step is built in Python: a batch-2 Step is a ValueError, never sent."""
    with pytest.raises(ValueError, match="batch 1"):
        Step(0, 0, 0, "argmax", Tensor.from_array(np.ones((2, 3), np.int64)))


@pytest.mark.parametrize("tensor", [{"dtype": "f64", "shape": [1, 3]}, {"dtype": "i64", "shape": "1,3"},
                                    {"dtype": "i64", "shape": [1, -3]}, {"dtype": "i64", "shape": [1, 2.5]},
                                    {"dtype": "i64", "shape": [1, 3], "strides": [24, 8]}, {"shape": [1, 3]}])
def test_a_tensor_spec_outside_the_schema_is_refused(tensor: dict) -> None:
    """An unknown dtype, a shape that is not a list of non-negative ints, or an extra key is bad_header."""
    assert_refused(frame(6, {**STEP, "tensor": tensor}, ids.data), "bad_header")


def test_tensor_bytes_in_the_header_are_refused() -> None:
    """A tensor's data travels in the body; data in the header (base64) is bad_tensor."""
    tensor = {"dtype": "i64", "shape": [1, 3], "data": msgspec.json.encode(ids.data).decode().strip('"')}
    refused = assert_refused(frame(6, {**STEP, "tensor": tensor}), "bad_tensor")
    assert "travel in the body" in str(refused)


@pytest.mark.parametrize("shape,body", [([1, 3], b"\0" * 23), ([1, 3], b"\0" * 25), ([1, 3], b""),
                                        ([1, 2**30], b"\0" * 8), ([1, 2**31 - 1, 2**31 - 1], b"\0" * 8)])
def test_shape_and_body_length_must_agree(shape: list[int], body: bytes) -> None:
    """Body length must be exactly product(shape) * itemsize: short, long and astronomically large shapes are bad_tensor."""
    dtype = "f16" if len(shape) == 3 else "i64"
    assert_refused(frame(6, {**STEP, "tensor": {"dtype": dtype, "shape": shape}}, body), "bad_tensor")


def test_a_body_on_a_message_without_tensors_is_refused() -> None:
    """Bytes after the header of a tensor-less message are bad_tensor, not ignored."""
    assert_refused(frame(10, {"nonce": 1}, b"junk"), "bad_tensor")


def test_result_indices_must_match_the_values() -> None:
    """Top-k ids must be integers of the values' shape: refused when built, and as bad_header when received."""
    values = Tensor.from_array(np.ones((1, 1, 4), np.float32), "f32")
    wrong = Tensor.from_array(np.array([[1, 2, 3]], np.int64))
    with pytest.raises(ValueError, match="Result.indices"):
        Result(1, 1, values, {}, indices=wrong)
    header = {"stream": 1, "reply_to": 1, "tensor": {"dtype": "f32", "shape": [1, 1, 4]}, "timings": {},
              "indices": {"dtype": "i64", "shape": [1, 3]}}
    assert_refused(frame(8, header, values.data + wrong.data), "bad_header")


def test_decode_refuses_a_header_or_body_shorter_than_announced() -> None:
    """decode() given fewer bytes than the prefix announces is truncated."""
    prefix, header, body = split(encode(EXAMPLES[7]))
    with pytest.raises(ProtocolError) as e:
        decode(prefix, header, body[:-1])
    assert e.value.code == "truncated"


def test_a_peer_closing_mid_frame_is_an_unclean_close() -> None:
    """EOF inside a frame raises ConnectionClosed(clean=False), at every cut point, over a real socket."""
    data = encode(EXAMPLES[7])
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
