"""The wire protocol (v4): round trips through bytes and real sockets, the exact bytes on the wire, tensors."""

from __future__ import annotations

import json
import socket
import struct
import threading

import numpy as np
import pytest
from protocol_frames import EXAMPLES, STEP, assert_refused, frame, ids, split

from ovshard.errors import OvshardError
from ovshard.runtime.wire.framing import (
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
    BatchRow,
    ConnectionClosed,
    Message,
    Ping,
    ProtocolError,
    Result,
    Step,
    Tensor,
    error,
    parse_want,
)


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
    assert encode(Ping(1)) == b"OVSH\x05\x00\x0a\x00" + struct.pack("<II", 21, 0) + b'{"kind":10,"nonce":1}'
    header = (b'{"kind":8,"stream":7,"reply_to":1,"tensor":{"dtype":"i64","shape":[1,1]},'
              b'"timings":{"stage1":0.5},"indices":null}')
    result = Result(7, 1, Tensor.from_array(np.array([[42]], np.int64)), {"stage1": 0.5})
    assert encode(result) == (b"OVSH\x05\x00\x08\x00" + struct.pack("<II", len(header), 8) + header
                              + (42).to_bytes(8, "little"))


def test_a_step_is_these_exact_bytes() -> None:
    """A Step carries counts, not lists: position, rewind and the [1, T] shape; the ids are the body."""
    header = (b'{"kind":6,"stream":7,"step":0,"position":0,"want":"argmax","tensor":{"dtype":"i64","shape":[1,3]},'
              b'"timings":{},"rewind":0,"compact":false}')
    body = b"".join(t.to_bytes(8, "little") for t in (1, 403, 407))
    assert encode(EXAMPLES[7]) == b"OVSH\x05\x00\x06\x00" + struct.pack("<II", len(header), 24) + header + body


def test_a_hello_is_these_exact_bytes() -> None:
    """A Hello names role, protocol, bundle, stage, session, next hop and the KV blocks asked; it has no auth
    field."""
    header = (b'{"kind":1,"role":"head","protocol":5,"bundle_fingerprint":"sha256:abc","stage":0,'
              b'"session":"0123456789abcdef0123456789abcdef","next_hop":"10.0.0.2:7001","kv_blocks":null}')
    assert encode(EXAMPLES[0]) == b"OVSH\x05\x00\x01\x00" + struct.pack("<II", len(header), 0) + header


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
    assert (made.code, made.stream, made.reply_to, len(made.message)) == ("position", 7, 3, 4096)
    assert decode(*split(encode(made))) == made
    with pytest.raises(ValueError, match="unknown error code"):
        error("stage_failed", "no such code")
    assert len(set(ERROR_CODES)) == len(ERROR_CODES)


def test_protocol_errors_are_ovshard_errors() -> None:
    """The CLI's catch-all for OvshardError also catches wire errors."""
    assert issubclass(ProtocolError, OvshardError) and issubclass(ConnectionClosed, OvshardError)



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
