"""The wire protocol (v4): round trips through bytes and real sockets, bytes on the wire, every malformed frame."""

from __future__ import annotations

import io
import json
import socket
import struct
import threading
import time

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ovshard.errors import OvshardError
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
    DTYPES,
    ERROR_CODES,
    KINDS,
    PROTOCOL_VERSION,
    Batch,
    BatchDone,
    BatchRow,
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
    Refusal,
    Reset,
    Result,
    Step,
    Tensor,
    error,
    parse_want,
)

SESSION = "0123456789abcdef" * 2
ids = Tensor.from_array(np.array([[1, 403, 407]], dtype=np.int64))
EXAMPLES: list[Message] = [
    Hello("head", PROTOCOL_VERSION, "sha256:abc", 0, SESSION, "10.0.0.2:7001"),
    Hello("upstream", PROTOCOL_VERSION, "sha256:abc", 2, SESSION),
    HelloOk(2, "sha256:abc", 3),
    Open(7),
    OpenOk(7),
    Reset(7),
    Close(7),
    Step(7, 0, 0, "argmax", ids),
    Step(7, 1, 3, "topk:40", Tensor.from_array(np.ones((1, 1, 64), np.float32))),
    Step(7, 2, 4, "logits@3", ids, {"stage0": 0.001}, rewind=3, compact=True),
    Result(7, 1, Tensor.from_array(np.array([[42]], np.int64)), {"infer": 0.0125, "queue": 0.0}),
    Result(7, 2, Tensor.from_array(np.ones((1, 1, 4), np.float32), "f32"), {},
           indices=Tensor.from_array(np.array([[[5, 9, 2, 1]]], np.int64))),
    Result(7, 3, Tensor.from_array(np.zeros((1, 2, 512), np.float32), "f32"), {"infer": 1.5}),
    Error("bad_version", "peer speaks version 2, this node speaks version 3"),
    Error("position", "position 9, but this stage holds 4 visible positions", 7, 2),
    Ping(12345678901),
    Pong(12345678901),
    Hello("head", PROTOCOL_VERSION, "sha256:abc", 0, SESSION, None, 0),
    HelloOk(1, "sha256:abc", 3, 32, 256),
    Batch(3, [BatchRow(1, 0, 3, "argmax@1", 1), BatchRow(2, 40, 1, "", 2)],
          Tensor.from_array(np.array([1, 2, 3, 4], np.int64)), Tensor.from_array(np.array([0, 1, 2], np.int32)),
          Tensor.from_array(np.array([[0, 1]], np.int32)), {"stage0": 0.01}, [Refusal(4, 0, "position", "too long")]),
    Batch(4, [BatchRow(1, 3, 1, "topk:5@1", 1)], Tensor.from_array(np.ones((1, 64), np.float32)),
          Tensor.from_array(np.array([0], np.int32))),
    BatchDone(3, {"stage0": 0.1, "stage1": 0.2}),
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


STEP = header_of(EXAMPLES[7])  # a valid Step header: ids i64 [1, 3], body ids.data


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_bytes(msg: Message) -> None:
    """decode(encode(m)) == m, and the header is compact JSON: "kind" first, then every field in declaration order."""
    data = encode(msg)
    assert decode(*split(data)) == msg
    header = split(data)[1]
    keys = [key for key, _ in json.loads(header, object_pairs_hook=lambda pairs: pairs)]
    assert keys == ["kind", *type(msg).__struct_fields__]
    assert header == json.dumps(json.loads(header), separators=(",", ":")).encode()


def test_frames_are_these_exact_bytes() -> None:
    """The wire format byte for byte: magic, version 4, kind, flags, the two lengths, the JSON header, the body."""
    assert encode(Ping(1)) == b"OVSH\x04\x00\x0a\x00" + struct.pack("<II", 21, 0) + b'{"kind":10,"nonce":1}'
    header = (b'{"kind":8,"stream":7,"seq":1,"tensor":{"dtype":"i64","shape":[1,1]},'
              b'"timings":{"stage1":0.5},"indices":null}')
    result = Result(7, 1, Tensor.from_array(np.array([[42]], np.int64)), {"stage1": 0.5})
    assert encode(result) == (b"OVSH\x04\x00\x08\x00" + struct.pack("<II", len(header), 8) + header
                              + (42).to_bytes(8, "little"))


def test_a_step_is_these_exact_bytes() -> None:
    """A Step carries counts, not lists: position, rewind and the [1, T] shape; the ids are the body."""
    header = (b'{"kind":6,"stream":7,"seq":0,"position":0,"want":"argmax","tensor":{"dtype":"i64","shape":[1,3]},'
              b'"timings":{},"rewind":0,"compact":false}')
    body = b"".join(t.to_bytes(8, "little") for t in (1, 403, 407))
    assert encode(EXAMPLES[7]) == b"OVSH\x04\x00\x06\x00" + struct.pack("<II", len(header), 24) + header + body


def test_a_hello_is_these_exact_bytes() -> None:
    """A Hello names role, protocol, bundle, stage, session, next hop and the KV blocks asked; it has no auth
    field."""
    header = (b'{"kind":1,"role":"head","protocol":4,"bundle_fingerprint":"sha256:abc","stage":0,'
              b'"session":"0123456789abcdef0123456789abcdef","next_hop":"10.0.0.2:7001","kv_blocks":null}')
    assert encode(EXAMPLES[0]) == b"OVSH\x04\x00\x01\x00" + struct.pack("<II", len(header), 0) + header


def test_prefix_layout_is_sixteen_little_endian_bytes() -> None:
    """The prefix is magic, u16 version, u8 kind, u8 flags, u32 header length, u32 body length, little-endian."""
    data = encode(Ping(1))
    assert data[:4] == b"OVSH"
    assert struct.unpack("<HBBII", data[4:16]) == (PROTOCOL_VERSION, Ping.kind(), 0, len(data) - 16, 0)


def test_the_kind_table_is_the_documented_one() -> None:
    """Kinds 1-6 and 8-12 are the v3 messages; 7 (v1's Rewind) stays retired."""
    assert {k: cls.__name__ for k, cls in KINDS.items()} == {
        1: "Hello", 2: "HelloOk", 3: "Open", 4: "Reset", 5: "Close", 6: "Step", 8: "Result", 9: "Error",
        10: "Ping", 11: "Pong", 12: "OpenOk", 13: "Batch", 14: "BatchDone"}


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
    msg = Step(0, 0, 0, "argmax", Tensor.from_array(hidden, "f32"))
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


def test_a_100k_token_prompt_is_one_small_header_and_the_ids() -> None:
    """A 100,000-token Step has a header under 300 bytes (v2's mask list made it > 64 KiB) and round-trips."""
    tokens = np.random.default_rng(2).integers(0, 32_000, (1, 100_000), dtype=np.int64)
    msg = Step(3, 1, 0, "argmax@1", Tensor.from_array(tokens))
    data = encode(msg)
    header_len = PREFIX.unpack(data[:PREFIX_SIZE])[4]
    assert header_len < 300
    assert len(data) == PREFIX_SIZE + header_len + 800_000
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        writer = threading.Thread(target=write_message, args=(a, msg))
        writer.start()
        got = read_message(b)
        writer.join()
    assert got == msg
    np.testing.assert_array_equal(got.tensor.to_array(), tokens)


def test_a_decode_step_of_one_token_costs_the_activations_plus_a_small_header() -> None:
    """One token of hidden 2048 in f16 is 16 + header + 4096 bytes; the header does not grow with context."""
    hidden = Tensor.from_array(np.ones((1, 1, 2048), np.float32))
    early = encode(Step(3, 17, 10, "argmax", hidden))
    late = encode(Step(3, 100_017, 100_000, "argmax", hidden))
    for data in (early, late):
        header_len = PREFIX.unpack(data[:PREFIX_SIZE])[4]
        assert len(data) == PREFIX_SIZE + header_len + 4096
        assert header_len < 200
    assert len(late) - len(early) == 8  # only the digits of seq and position differ


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


def test_want_is_parsed_and_checked() -> None:
    """Step.want is argmax, logits or topk:K with K >= 1, optionally @R; anything else is refused when built."""
    assert parse_want("argmax") == ("argmax", None, None)
    assert parse_want("logits") == ("logits", None, None)
    assert parse_want("topk:40") == ("topk", 40, None)
    assert parse_want("argmax@5") == ("argmax", None, 5)
    assert parse_want("topk:8@11") == ("topk", 8, 11)
    for bad in ("topk:0", "topk:", "topk:-1", "topk:07", "greedy", "ARGMAX", "logits@0", "logits@", "@3"):
        with pytest.raises(ProtocolError) as e:
            Step(0, 0, 0, bad, ids)
        assert e.value.code == "bad_header"


def test_a_bad_want_on_the_wire_is_bad_header() -> None:
    """A received Step whose want does not parse is refused as bad_header, like any other bad field."""
    assert_refused(frame(6, {**STEP, "want": "greedy"}, ids.data), "bad_header")


def test_error_helper_checks_the_code_and_cuts_the_message() -> None:
    """p.error() takes only ERROR_CODES, keeps stream and seq, and cuts a long message to what the wire allows."""
    made = error("position", "x" * 10_000, 7, 3)
    assert (made.code, made.stream, made.seq, len(made.message)) == ("position", 7, 3, 4096)
    assert decode(*split(encode(made))) == made
    with pytest.raises(ValueError, match="unknown error code"):
        error("stage_failed", "no such code")
    assert len(set(ERROR_CODES)) == len(ERROR_CODES)


def test_protocol_errors_are_ovshard_errors() -> None:
    """The CLI's catch-all for OvshardError also catches wire errors."""
    assert issubclass(ProtocolError, OvshardError) and issubclass(ConnectionClosed, OvshardError)


# Malformed frames: each case gives ProtocolError with the right code.

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
    (6, b'{"stream":1,"seq":1,"position":0,"want":"argmax","tensor":{"dtype":"i64","shape":[1,3]},'
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
    header = {"stream": 1, "seq": 1, "tensor": {"dtype": "f32", "shape": [1, 1, 4]}, "timings": {},
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


# Deadlines: a frame that has begun must arrive whole in time; waiting for one to begin is the caller's.

def test_a_frame_one_byte_short_times_out() -> None:
    """A frame left one byte short is refused as timeout once deadline_s passes, not waited on forever."""
    data = encode(EXAMPLES[7])
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data[:-1])
        start = time.monotonic()
        with pytest.raises(ProtocolError) as e:
            read_message(b, deadline_s=0.5)
        waited = time.monotonic() - start
    assert e.value.code == "timeout"
    assert 0.45 <= waited < 3.0


def dribble(data: bytes, gap_s: float, deadline_s: float) -> tuple[ProtocolError, float]:
    """Send ``data`` one byte every ``gap_s`` over a socket pair while read_message(deadline_s=) reads it:
    the reader's error and how long after the first byte it came."""
    a, b = socket.socketpair()
    stop = threading.Event()
    first = threading.Event()
    started: list[float] = []

    def send() -> None:
        for byte in data:
            try:
                a.send(bytes([byte]))
            except OSError:
                return
            if not first.is_set():
                started.append(time.monotonic())
                first.set()
            if stop.wait(gap_s):
                return

    writer = threading.Thread(target=send)
    with a, b:
        writer.start()
        try:
            with pytest.raises(ProtocolError) as e:
                read_message(b, deadline_s=deadline_s)
            ended = time.monotonic()
        finally:
            stop.set()
            writer.join()
    return e.value, ended - started[0]


def test_a_frame_dribbled_byte_by_byte_cannot_outlast_its_deadline() -> None:
    """A peer sending one byte every 50 ms (each recv in time) is cut off at the deadline, inside the prefix."""
    refused, waited = dribble(encode(Ping(1)), 0.05, 0.5)  # the whole 37-byte frame would take 1.85 s
    assert refused.code == "timeout"
    assert waited < 0.5 + 0.3


def test_the_deadline_counts_from_the_first_byte_of_the_frame() -> None:
    """A frame whose prefix arrives just in time (16 bytes in 0.45 s) must still be whole 0.5 s after its first byte."""
    refused, waited = dribble(encode(Ping(1)), 0.03, 0.5)  # prefix by 0.45 s, whole frame by 1.08 s
    assert refused.code == "timeout"
    assert waited < 0.5 + 0.3


def test_waiting_for_a_frame_to_begin_raises_timeout_error() -> None:
    """With idle_s and nothing sent, read_message raises TimeoutError (the caller's business), not ProtocolError."""
    a, b = socket.socketpair()
    with a, b:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            read_message(b, deadline_s=5, idle_s=0.2)
        waited = time.monotonic() - start
        assert b.gettimeout() == 0.2
    assert not isinstance(e.value, ProtocolError)
    assert 0.15 <= waited < 2.0


# Property tests.

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



def test_activations_that_overflow_f16_travel_as_f32() -> None:
    """Tensor.activations sends f16 when the values fit and f32 when they pass f16's range (a stage's hidden
    states of Gemma do), keeping the values."""
    small = np.full((1, 2, 4), 3.5, np.float32)
    big = np.array([[[7e4, -1.0, 0.5, 2e5]]], np.float32)
    assert Tensor.activations(small).dtype == "f16"
    out = Tensor.activations(big)
    assert out.dtype == "f32" and np.array_equal(out.to_array(), big)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Batch(1, [BatchRow(1, 0, 3, "", 1)], Tensor.from_array(np.arange(2)),
                   Tensor.from_array(np.zeros(1, np.int32))), "N = 3"),
    (lambda: Batch(1, [BatchRow(1, 0, 2, "", 2)], Tensor.from_array(np.arange(2)),
                   Tensor.from_array(np.zeros(1, np.int32))), "i32 \\[2\\]"),
    (lambda: Batch(1, [BatchRow(1, 0, 2, "", 1)], Tensor.from_array(np.arange(2)),
                   Tensor.from_array(np.zeros(1, np.int64))), "i32 \\[1\\]"),
    (lambda: Batch(1, [BatchRow(1, 0, 2, "", 1)], Tensor.from_array(np.arange(2)),
                   Tensor.from_array(np.zeros(1, np.int32)), Tensor.from_array(np.zeros(3, np.int32))), "C, 2"),
    (lambda: BatchRow(1, 0, 2, "argmax@0", 1), "@R"),
])
def test_a_batch_whose_counts_disagree_is_refused(make, match: str) -> None:
    """A Batch's rows, tensor, tables and copies must agree before it is accepted."""
    with pytest.raises((ValueError, ProtocolError), match=match):
        make()
