"""Frames: how one wire message (protocol.py) becomes bytes on a connection, and back.

Every message is one frame. All integers are little-endian.

    offset  size  field
    0       4     magic            b"OVSH"
    4       2     version     u16  PROTOCOL_VERSION (2); any other version is refused
    6       1     kind        u8   message kind (the table in protocol.py)
    7       1     flags       u8   reserved, must be 0
    8       4     header_len  u32  bytes of JSON header that follow
    12      4     body_len    u32  bytes of raw body that follow the header
    16      header_len             UTF-8 JSON object: the message's fields, keys sorted
    ...     body_len               the message's tensors' bytes, C order, little-endian, in field order

The 16-byte prefix keeps this layout in every future version, so a node can always read a peer's version
and refuse it clearly. A reader checks magic, version, kind and both lengths *before* reading the payload:
the header may hold at most ``MAX_HEADER_BYTES`` and header + body at most ``max_frame_bytes``
(``DEFAULT_MAX_FRAME``, 256 MiB), so a hostile length cannot make a node allocate.

A tensor field appears in the header as ``{"dtype": "f16"|"f32"|"i64"|"i32", "shape": [...]}`` and its
data in the body; the body is exactly the concatenation of the tensors, nothing more.

Decoding is strict: unknown, missing or repeated fields, wrong types, unknown dtypes and shape/body
mismatches are refused with a ``ProtocolError``; a peer that stops sending raises ``ConnectionClosed``.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from dataclasses import fields
from typing import Any, BinaryIO, cast

from ovshard.runtime.protocol import (
    DTYPES,
    KINDS,
    PROTOCOL_VERSION,
    ConnectionClosed,
    Message,
    MessageBase,
    ProtocolError,
    Tensor,
    show,
)

MAGIC = b"OVSH"
PREFIX = struct.Struct("<4sHBBII")  # magic, version, kind, flags, header_len, body_len
PREFIX_SIZE = PREFIX.size  # 16
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_FRAME = 256 * 1024 * 1024  # header + body
_READ_CHUNK = 1 << 20

Stream = socket.socket | BinaryIO  # what frames are read from and written to


def encode(msg: Message) -> bytes:
    """One frame holding ``msg``."""
    if type(msg) not in KINDS.values():
        raise TypeError(f"expected a wire message, found {type(msg).__name__}")
    header: dict[str, Any] = {}
    data: list[bytes] = []
    for f in fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, Tensor):
            header[f.name] = {"dtype": value.dtype, "shape": list(value.shape)}
            data.append(value.data)
        else:
            header[f.name] = value
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    body_len = sum(len(d) for d in data)
    if len(text) > MAX_HEADER_BYTES or body_len > 0xFFFFFFFF:
        raise ProtocolError("oversized", f"{type(msg).__name__} needs a {len(text)}-byte header and a "
                                         f"{body_len}-byte body; limits {MAX_HEADER_BYTES} and 2**32-1")
    return b"".join([PREFIX.pack(MAGIC, PROTOCOL_VERSION, msg.KIND, 0, len(text), body_len), text, *data])


def parse_prefix(prefix: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME) -> tuple[type[MessageBase], int, int]:
    """(message class, header length, body length) from a frame's 16-byte prefix, checking every field."""
    if len(prefix) != PREFIX_SIZE:
        raise ProtocolError("truncated", f"expected a {PREFIX_SIZE}-byte prefix, found {len(prefix)} bytes")
    magic, version, kind, flags, header_len, body_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError("bad_magic", f"expected magic {MAGIC!r}, found {magic!r}: the peer is not an "
                                         "ovshard node")
    if version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"peer speaks wire protocol version {version}, this node speaks "
                                           f"version {PROTOCOL_VERSION}: run the same ovshard on every node")
    if flags != 0:
        raise ProtocolError("bad_header", f"expected reserved flags 0, found {flags:#04x}")
    if kind not in KINDS:
        raise ProtocolError("unknown_kind", f"expected a message kind in {sorted(KINDS)}, found {kind}")
    if header_len > MAX_HEADER_BYTES or header_len + body_len > max_frame_bytes:
        raise ProtocolError("oversized", f"{KINDS[kind].__name__} frame announces a {header_len}-byte header "
                                         f"and a {body_len}-byte body; limits are {MAX_HEADER_BYTES} for the "
                                         f"header and {max_frame_bytes} for both")
    return KINDS[kind], header_len, body_len


def _reject_constant(name: str) -> Any:
    raise ProtocolError("bad_header", f"expected finite JSON numbers, found {name}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ProtocolError("bad_header", f"header repeats the key {key!r}")
        obj[key] = value
    return obj


def _parse_header(cls: type[MessageBase], header: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(header.decode("utf-8"), object_pairs_hook=_unique_keys,
                         parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ProtocolError("bad_header", f"{cls.__name__} header is not UTF-8 JSON: {e}") from e
    if type(obj) is not dict:
        raise ProtocolError("bad_header", f"{cls.__name__} header: expected a JSON object, found {show(obj)}")
    expected = {f.name for f in fields(cls)}
    if obj.keys() != expected:
        raise ProtocolError("bad_header", f"{cls.__name__} header: expected fields {sorted(expected)}, "
                                          f"missing {sorted(expected - obj.keys())}, "
                                          f"unknown {sorted(obj.keys() - expected)}")
    return obj


def _take_tensor(where: str, spec: Any, body: bytes, offset: int) -> Tensor:
    if type(spec) is not dict or spec.keys() != {"dtype", "shape"}:
        raise ProtocolError("bad_tensor", f"{where}: expected {{dtype, shape}}, found {show(spec)}")
    dtype, shape = spec["dtype"], spec["shape"]
    if dtype not in DTYPES:
        raise ProtocolError("bad_tensor", f"{where}: expected a dtype in {sorted(DTYPES)}, found {show(dtype)}")
    if type(shape) is not list:
        raise ProtocolError("bad_tensor", f"{where}: expected a shape list, found {show(shape)}")
    end = offset + math.prod(d if type(d) is int and d >= 0 else 0 for d in shape) * DTYPES[dtype].itemsize
    if end > len(body):
        raise ProtocolError("bad_tensor", f"{where}: {dtype}{shape} needs bytes {offset}..{end} of the body, "
                                          f"which has {len(body)}")
    return Tensor(dtype, tuple(shape), body[offset:end])


def decode(prefix: bytes, header: bytes, body: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME) -> Message:
    """The message in one frame, given as its prefix, JSON header and body."""
    cls, header_len, body_len = parse_prefix(prefix, max_frame_bytes)
    if len(header) != header_len or len(body) != body_len:
        raise ProtocolError("truncated", f"prefix announces a {header_len}-byte header and a {body_len}-byte "
                                         f"body, found {len(header)} and {len(body)} bytes")
    values = _parse_header(cls, header)
    offset = 0
    for f in fields(cls):
        value = values[f.name]
        if str(f.type).startswith("Tensor") and value is not None:
            values[f.name] = _take_tensor(f"{cls.__name__}.{f.name}", value, body, offset)
            offset += len(values[f.name].data)
        elif type(value) is list and f.type == "tuple[int, ...]":
            values[f.name] = tuple(value)
    if offset != len(body):
        raise ProtocolError("bad_tensor", f"{cls.__name__}: the header describes {offset} bytes of tensors, "
                                          f"the body has {len(body)}")
    return cast(Message, cls(**values))


def _read_exactly(stream: Stream, n: int, what: str, *, frame_start: bool = False) -> bytes:
    """``n`` bytes from a socket (recv) or binary file (read); ConnectionClosed if the peer stops first."""
    read = stream.recv if isinstance(stream, socket.socket) else stream.read
    chunks: list[bytes] = []
    got = 0
    while got < n:
        try:
            chunk = read(min(n - got, _READ_CHUNK))
        except ConnectionResetError as e:
            raise ConnectionClosed(f"connection reset after {got} of {n} bytes of {what}", clean=False) from e
        if not chunk:
            clean = frame_start and got == 0
            where = "between frames" if clean else f"after {got} of {n} bytes of {what}"
            raise ConnectionClosed(f"peer closed the connection {where}", clean=clean)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_message(stream: Stream, max_frame_bytes: int = DEFAULT_MAX_FRAME) -> Message:
    """Read one frame from a socket or binary file; lengths are checked before the payload is read.

    A socket timeout propagates as TimeoutError: the caller knows which peer and stage it was waiting on.
    """
    prefix = _read_exactly(stream, PREFIX_SIZE, "a frame prefix", frame_start=True)
    cls, header_len, body_len = parse_prefix(prefix, max_frame_bytes)
    header = _read_exactly(stream, header_len, f"a {cls.__name__} header")
    body = _read_exactly(stream, body_len, f"a {cls.__name__} body")
    return decode(prefix, header, body, max_frame_bytes=max_frame_bytes)


def write_message(stream: Stream, msg: Message) -> None:
    """Send one frame with a single sendall (or write, for a file)."""
    frame = encode(msg)
    if isinstance(stream, socket.socket):
        stream.sendall(frame)
    else:
        stream.write(frame)
