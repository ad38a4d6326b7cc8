"""Frames: how one wire message (protocol.py) becomes bytes on a connection, and back.

Every message is one frame. All integers are little-endian.

    offset  size  field
    0       4     magic            b"OVSH"
    4       2     version     u16  PROTOCOL_VERSION (5); any other version is refused
    6       1     kind        u8   message kind (the table in protocol.py)
    7       1     flags       u8   reserved, must be 0
    8       4     header_len  u32  bytes of JSON header that follow
    12      4     body_len    u32  bytes of raw body that follow the header
    16      header_len             UTF-8 JSON object: the message's fields and its "kind" tag
    ...     body_len               the message's tensors' bytes, C order, little-endian, in field order

The 16-byte prefix keeps this layout in every version, so a node can always read a peer's version and
refuse it clearly. A reader checks magic, version, kind and both lengths *before* reading the payload:
the header may hold at most ``MAX_HEADER_BYTES`` and header + body at most the reader's
``max_frame_bytes`` (a few KiB before a connection's handshake is done, ``DEFAULT_MAX_FRAME`` after), so
a hostile length cannot make a node allocate. A frame that has begun must arrive whole before its
deadline (``deadline_s``), so a peer cannot hold a reader with a frame left one byte short.

A tensor field appears in the header as ``{"dtype": "f16"|"f32"|"i64"|"i32", "shape": [...]}`` and its
data in the body; the body is exactly the concatenation of the tensors, nothing more.

Decoding is strict (msgspec): unknown or missing fields, wrong types, out-of-range integers, unknown
dtypes and shape/body mismatches are refused with a ``ProtocolError``; a peer that stops sending raises
``ConnectionClosed``.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import BinaryIO, cast

import msgspec

from ovshard.runtime.wire.protocol import (
    KINDS,
    PROTOCOL_VERSION,
    TENSOR_FIELDS,
    ConnectionClosed,
    Message,
    MessageBase,
    ProtocolError,
    Tensor,
)

MAGIC = b"OVSH"
PREFIX = struct.Struct("<4sHBBII")  # magic, version, kind, flags, header_len, body_len
PREFIX_SIZE = PREFIX.size  # 16
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_FRAME = 256 * 1024 * 1024  # header + body
MIN_RATE = 1 << 20  # bytes/s a frame's deadline allows on top of deadline_s
_READ_CHUNK = 1 << 20
_ENCODER = msgspec.json.Encoder()
_DECODERS = {cls: msgspec.json.Decoder(cls) for cls in KINDS.values()}

Stream = socket.socket | BinaryIO  # what frames are read from and written to


def encode(msg: Message) -> bytes:
    """One frame holding ``msg``."""
    cls = type(msg)
    if cls not in TENSOR_FIELDS:
        raise TypeError(f"expected a wire message, found {cls.__name__}")
    data: list[bytes] = []
    bare: dict[str, Tensor] = {}
    for name in TENSOR_FIELDS[cls]:
        tensor = getattr(msg, name)
        if tensor is not None:
            data.append(tensor.check().data)
            bare[name] = Tensor(tensor.dtype, tensor.shape)  # the header holds dtype and shape only
    text = _ENCODER.encode(msgspec.structs.replace(msg, **bare) if bare else msg)
    body_len = sum(len(d) for d in data)
    if len(text) > MAX_HEADER_BYTES or body_len > 0xFFFFFFFF:
        raise ProtocolError("oversized", f"{cls.__name__} needs a {len(text)}-byte header and a "
                                         f"{body_len}-byte body; limits {MAX_HEADER_BYTES} and 2**32-1")
    return b"".join([PREFIX.pack(MAGIC, PROTOCOL_VERSION, cls.kind(), 0, len(text), body_len), text, *data])


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


def decode(prefix: bytes, header: bytes, body: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME) -> Message:
    """The message in one frame, given as its prefix, JSON header and body."""
    cls, header_len, body_len = parse_prefix(prefix, max_frame_bytes)
    if len(header) != header_len or len(body) != body_len:
        raise ProtocolError("truncated", f"prefix announces a {header_len}-byte header and a {body_len}-byte "
                                         f"body, found {len(header)} and {len(body)} bytes")
    try:
        msg = _DECODERS[cls].decode(header)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ProtocolError("bad_header", f"{cls.__name__} header: {e}") from e
    except (ValueError, RecursionError) as e:  # a check in __post_init__ that msgspec did not wrap
        raise ProtocolError("bad_header", f"{cls.__name__} header: {e}") from e
    offset, filled = 0, {}
    for name in TENSOR_FIELDS[cls]:
        spec = getattr(msg, name)
        if spec is None:
            continue
        if spec.data:
            raise ProtocolError("bad_tensor", f"{cls.__name__}.{name}: tensor bytes travel in the body, "
                                              "not in the header")
        end = offset + spec.nbytes
        if end > len(body):
            raise ProtocolError("bad_tensor", f"{cls.__name__}.{name}: {spec.dtype}{list(spec.shape)} needs "
                                              f"bytes {offset}..{end} of the body, which has {len(body)}")
        filled[name] = Tensor(spec.dtype, spec.shape, body[offset:end])
        offset = end
    if offset != len(body):
        raise ProtocolError("bad_tensor", f"{cls.__name__}: the header describes {offset} bytes of tensors, "
                                          f"the body has {len(body)}")
    return cast(Message, msgspec.structs.replace(msg, **filled) if filled else msg)


class _Reader:
    """Exact reads from a socket (recv) or binary file (read) against one frame's deadline."""

    def __init__(self, stream: Stream, deadline_s: float | None) -> None:
        self.stream, self.deadline_s = stream, deadline_s
        self.read = stream.recv if isinstance(stream, socket.socket) else stream.read
        self.deadline: float | None = None
        self.begun: float | None = None

    def start(self, extra_bytes: int = 0) -> None:
        """The frame has begun (its first byte came): it must be whole within deadline_s of that byte,
        plus extra_bytes at MIN_RATE once the prefix has announced its size."""
        if self.deadline_s is not None and isinstance(self.stream, socket.socket):
            self.begun = self.begun or time.monotonic()
            self.deadline = self.begun + self.deadline_s + extra_bytes / MIN_RATE
            self.stream.settimeout(self.deadline_s)

    def exactly(self, n: int, what: str, *, frame_start: bool = False) -> bytes:
        """``n`` bytes; ConnectionClosed if the peer stops first, ProtocolError past the deadline."""
        chunks: list[bytes] = []
        got = 0
        while got < n:
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise ProtocolError("timeout", f"{what} not complete within {self.deadline_s} s "
                                               f"({got} of {n} bytes)")
            try:
                chunk = self.read(min(n - got, _READ_CHUNK))
            except ConnectionResetError as e:
                raise ConnectionClosed(f"connection reset after {got} of {n} bytes of {what}", clean=False) from e
            except TimeoutError:
                if frame_start and got == 0 and self.deadline is None:
                    raise  # idle between frames: the caller decides
                raise ProtocolError("timeout", f"{what} stalled for {self.deadline_s} s "
                                               f"({got} of {n} bytes)") from None
            if not chunk:
                clean = frame_start and got == 0
                where = "between frames" if clean else f"after {got} of {n} bytes of {what}"
                raise ConnectionClosed(f"peer closed the connection {where}", clean=clean)
            if frame_start and got == 0 and self.deadline is None:
                self.start()
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)


def read_message(stream: Stream, max_frame_bytes: int = DEFAULT_MAX_FRAME, *, deadline_s: float | None = None,
                 idle_s: float | None = None) -> Message:
    """Read one frame from a socket or binary file; lengths are checked before the payload is read.

    ``idle_s``: how long to wait for a frame to begin (None: forever); a socket timeout then propagates
    as TimeoutError, the caller knows which peer it was waiting on. ``deadline_s``: once a frame has
    begun, it must be whole within this many seconds (plus its size at MIN_RATE), else ProtocolError
    "timeout". The socket's timeout is left as ``idle_s`` after the frame.
    """
    reader = _Reader(stream, deadline_s)
    if isinstance(stream, socket.socket):
        stream.settimeout(idle_s)
    try:
        prefix = reader.exactly(PREFIX_SIZE, "a frame prefix", frame_start=True)
        cls, header_len, body_len = parse_prefix(prefix, max_frame_bytes)
        if reader.deadline is not None:
            reader.start(header_len + body_len)
        header = reader.exactly(header_len, f"a {cls.__name__} header")
        body = reader.exactly(body_len, f"a {cls.__name__} body")
    finally:
        if isinstance(stream, socket.socket) and reader.deadline is not None:
            try:
                stream.settimeout(idle_s)
            except OSError:
                pass  # closed meanwhile
    return decode(prefix, header, body, max_frame_bytes=max_frame_bytes)


def write_message(stream: Stream, msg: Message) -> None:
    """Send one frame with a single sendall (or write, for a file)."""
    frame = encode(msg)
    if isinstance(stream, socket.socket):
        stream.sendall(frame)
    else:
        stream.write(frame)
