"""Wire messages and frames for the protocol tests: one example of every message, hand-built frames."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from ovshard.runtime.wire.framing import (
    PREFIX,
    PREFIX_SIZE,
    decode,
    encode,
    read_message,
)
from ovshard.runtime.wire.protocol import (
    PROTOCOL_VERSION,
    Batch,
    BatchDone,
    BatchRow,
    Close,
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
