"""The wire protocol between ovshard nodes: versioned, length-prefixed binary frames.

Every message is one frame. All integers are little-endian.

    offset  size  field
    0       4     magic            b"OVSH"
    4       2     version     u16  PROTOCOL_VERSION (2); any other version is refused
    6       1     kind        u8   message kind (table below)
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
data in the body; the body is exactly the concatenation of the tensors, nothing more. Activations travel
as f16 by default (``ACTIVATION_WIRE_DTYPE``; f32 on request), token ids as i64.

    kind  message   fields                                         meaning
    1     Hello     role ("head"|"upstream"), protocol,            first frame on a connection: who calls,
                    bundle_fingerprint, stage, auth (object|null), which bundle and stage it expects; from
                    next_hop (str|null)                            the head, next_hop is the next stage's
                                                                   host:port (auth: reserved)
    2     HelloOk   stage, bundle_fingerprint, num_stages          the handshake is accepted
    3     Open      stream                                         start a stream (empty KV cache and mask)
    4     Reset     stream                                         empty a stream's KV cache and mask
    5     Close     stream                                         forget a stream
    6     Step      stream, seq, position, mask_delta, want,       run the new tokens: tensor is input_ids
                    tensor, timings, rewind, compact               i64 [B,T] or hidden_states [B,T,H];
                                                                   position = first new position id;
                                                                   mask_delta = the mask entries appended
                                                                   for the new tokens (never the whole
                                                                   mask); want = what the last stage
                                                                   returns: "argmax" (every row) |
                                                                   "topk:K" | "logits" (the last row),
                                                                   "@R" appended = the last R rows;
                                                                   timings: name -> seconds spent by the
                                                                   stages it passed (per-hop accounting);
                                                                   before running, every stage hides its
                                                                   newest `rewind` visible cached positions
                                                                   (mask zeroing) and, if `compact`, drops
                                                                   hidden positions from its cache
    7     (retired: v1's Rewind; rewinds ride on Step so they stay ordered with it along the chain)
    8     Result    stream, seq, tensor, timings, indices          the last stage's answer to Step `seq`:
                                                                   argmax ids i64 [B,T]; top-k values
                                                                   [B,T,K] with their ids in `indices`
                                                                   (i64, same shape); or logits [B,T,V].
                                                                   timings: name -> seconds
    9     Error     code, message, stream (int|null)               a refusal or failure; the sender may
                                                                   close the connection after it
    10    Ping      nonce                                          liveness check
    11    Pong      nonce                                          answer to Ping with the same nonce

All integers in the header are in [0, 2**63). Decoding is strict: unknown, missing or repeated fields, wrong
types, unknown dtypes and shape/body mismatches are refused with a ``ProtocolError`` whose ``code`` is one
of ``PROTOCOL_ERROR_CODES``. A peer that closes the connection raises ``ConnectionClosed`` (``clean`` is
true when it closed between frames).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, BinaryIO, ClassVar, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ovshard.errors import OvshardError

MAGIC = b"OVSH"
PROTOCOL_VERSION = 2
PREFIX = struct.Struct("<4sHBBII")  # magic, version, kind, flags, header_len, body_len
PREFIX_SIZE = PREFIX.size  # 16
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_FRAME = 256 * 1024 * 1024  # header + body
MAX_NDIM = 8
ACTIVATION_WIRE_DTYPE = "f16"
DTYPES: dict[str, np.dtype[Any]] = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4"), "i64": np.dtype("<i8"), "i32": np.dtype("<i4")}
ROLES = ("head", "upstream")
PROTOCOL_ERROR_CODES = ("bad_magic", "bad_version", "unknown_kind", "oversized", "bad_header", "bad_tensor",
                        "truncated")
_INT_LIMIT = 2**63
_READ_CHUNK = 1 << 20
_WANT = re.compile(r"(argmax|logits|topk:([1-9][0-9]{0,8}))(?:@([1-9][0-9]{0,8}))?")


class ProtocolError(OvshardError):
    """A frame broke the wire protocol; ``code`` says how (one of PROTOCOL_ERROR_CODES)."""

    def __init__(self, code: str, message: str) -> None:
        if code not in PROTOCOL_ERROR_CODES:
            raise ValueError(f"unknown protocol error code {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code


class ConnectionClosed(OvshardError):
    """The peer closed the connection: between frames (``clean``) or in the middle of one."""

    def __init__(self, message: str, *, clean: bool) -> None:
        super().__init__(message)
        self.clean = clean


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Tensor:
    """One tensor on the wire: dtype name, shape, and its bytes (C order, little-endian)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ProtocolError("bad_tensor", f"expected a dtype in {sorted(DTYPES)}, found {_show(self.dtype)}")
        if (type(self.shape) is not tuple or len(self.shape) > MAX_NDIM
                or any(type(d) is not int or d < 0 for d in self.shape)):
            raise ProtocolError("bad_tensor", f"expected a shape of at most {MAX_NDIM} non-negative ints, "
                                              f"found {_show(self.shape)}")
        if type(self.data) is not bytes:
            raise ProtocolError("bad_tensor", f"expected bytes of data, found {type(self.data).__name__}")
        if len(self.data) != self.nbytes:
            raise ProtocolError("bad_tensor", f"{self.dtype}{list(self.shape)} needs {self.nbytes} bytes, "
                                              f"found {len(self.data)}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @classmethod
    def from_array(cls, array: np.ndarray, wire_dtype: str | None = None) -> Tensor:
        """Wrap an array; floats go as ACTIVATION_WIRE_DTYPE unless ``wire_dtype`` says otherwise."""
        array = np.asarray(array)
        if wire_dtype is None:
            wire_dtype = {"f": ACTIVATION_WIRE_DTYPE, "i": f"i{array.dtype.itemsize * 8}"}.get(array.dtype.kind)
            if wire_dtype not in DTYPES:
                raise ProtocolError("bad_tensor", f"no default wire dtype for {array.dtype}; pass wire_dtype")
        if wire_dtype not in DTYPES:
            raise ProtocolError("bad_tensor", f"expected a wire dtype in {sorted(DTYPES)}, found {wire_dtype!r}")
        target = DTYPES[wire_dtype]
        if not _castable(array, target):
            raise ProtocolError("bad_tensor", f"cannot send {array.dtype} values as {wire_dtype}")
        with np.errstate(over="ignore"):  # overflow is detected just below
            out = array.astype(target, copy=False)
        if target.kind == "f" and np.count_nonzero(~np.isfinite(out)) != np.count_nonzero(~np.isfinite(array)):
            raise ProtocolError("bad_tensor", f"values overflow {wire_dtype} (max {np.finfo(target).max}); "
                                              "send them as f32")
        return cls(wire_dtype, tuple(int(d) for d in out.shape), out.tobytes())

    def to_array(self, dtype: npt.DTypeLike | None = None) -> np.ndarray:
        """The tensor as an array: a read-only view of the data, or a copy cast to ``dtype``."""
        array = np.frombuffer(self.data, dtype=DTYPES[self.dtype]).reshape(self.shape)
        if dtype is not None:
            return array.astype(dtype)
        return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _castable(array: np.ndarray, target: np.dtype[Any]) -> bool:
    """Floats cast to floats; integers to integers only when every value fits."""
    if array.dtype.kind == "f":
        return target.kind == "f"
    if array.dtype.kind not in "iu" or target.kind != "i":
        return False
    info = np.iinfo(target)
    return array.size == 0 or (int(array.min()) >= info.min and int(array.max()) <= info.max)


# Field checks, keyed by the annotation string of each message field.

def _fail(where: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError("bad_header", f"{where}: expected {expected}, found {_show(value)}")


def _check_int(where: str, value: Any) -> None:
    if type(value) is not int or not 0 <= value < _INT_LIMIT:
        raise _fail(where, "an int in [0, 2**63)", value)


def _check_str(where: str, value: Any) -> None:
    if type(value) is not str:
        raise _fail(where, "a string", value)


def _check_bool(where: str, value: Any) -> None:
    if type(value) is not bool:
        raise _fail(where, "true or false", value)


def _check_opt_str(where: str, value: Any) -> None:
    if value is not None:
        _check_str(where, value)


def _check_opt_int(where: str, value: Any) -> None:
    if value is not None:
        _check_int(where, value)


def _check_tensor(where: str, value: Any) -> None:
    if type(value) is not Tensor:
        raise _fail(where, "a Tensor", value)


def _check_opt_tensor(where: str, value: Any) -> None:
    if value is not None:
        _check_tensor(where, value)


def _check_int_tuple(where: str, value: Any) -> None:
    if type(value) is not tuple:
        raise _fail(where, "a list of ints", value)
    for i, item in enumerate(value):
        _check_int(f"{where}[{i}]", item)


def _check_timings(where: str, value: Any) -> None:
    if type(value) is not dict:
        raise _fail(where, "an object of name -> seconds", value)
    for key, item in value.items():
        if type(key) is not str or type(item) not in (int, float) or not math.isfinite(item):
            raise _fail(f"{where}[{key!r}]", "a finite number under a string key", item)


def _check_opt_object(where: str, value: Any) -> None:
    if value is None:
        return
    try:
        same = type(value) is dict and json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError, RecursionError):
        same = False
    if not same:
        raise _fail(where, "null or a JSON object that round-trips exactly", value)


_CHECKS = {
    "int": _check_int,
    "str": _check_str,
    "bool": _check_bool,
    "int | None": _check_opt_int,
    "str | None": _check_opt_str,
    "Tensor": _check_tensor,
    "Tensor | None": _check_opt_tensor,
    "tuple[int, ...]": _check_int_tuple,
    "dict[str, float]": _check_timings,
    "dict[str, Any] | None": _check_opt_object,
}
_KINDS: dict[int, type[_Message]] = {}


@dataclass(frozen=True)
class _Message:
    """Base of every wire message: checks each field's type when built (sent or received)."""

    KIND: ClassVar[int] = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            _CHECKS[str(f.type)](f"{type(self).__name__}.{f.name}", getattr(self, f.name))
        self._check()

    def _check(self) -> None:
        """Facts beyond field types; overridden where a message has some."""


_M = TypeVar("_M", bound=_Message)


def _message(kind: int) -> Callable[[type[_M]], type[_M]]:
    """Register a message class under its wire kind, checking that every field has a wire type."""

    def register(cls: type[_M]) -> type[_M]:
        unknown = [f"{f.name}: {f.type}" for f in fields(cls) if str(f.type) not in _CHECKS]
        if unknown or kind in _KINDS:
            raise TypeError(f"{cls.__name__}: kind {kind} taken or fields of unknown wire type {unknown}")
        cls.KIND = kind
        _KINDS[kind] = cls
        return cls
    return register


@_message(1)
@dataclass(frozen=True)
class Hello(_Message):
    role: str  # "head" | "upstream"
    protocol: int
    bundle_fingerprint: str
    stage: int  # the stage the caller expects this node to serve
    auth: dict[str, Any] | None = None  # reserved for authentication (a later issue)
    next_hop: str | None = None  # from the head: "host:port" of the next stage (None for the last)

    def _check(self) -> None:
        if self.role not in ROLES:
            raise _fail("Hello.role", f"one of {ROLES}", self.role)


@_message(2)
@dataclass(frozen=True)
class HelloOk(_Message):
    stage: int
    bundle_fingerprint: str
    num_stages: int

    def _check(self) -> None:
        if not self.stage < self.num_stages:
            raise _fail("HelloOk.stage", f"less than num_stages={self.num_stages}", self.stage)


@_message(3)
@dataclass(frozen=True)
class Open(_Message):
    stream: int


@_message(4)
@dataclass(frozen=True)
class Reset(_Message):
    stream: int


@_message(5)
@dataclass(frozen=True)
class Close(_Message):
    stream: int


@_message(6)
@dataclass(frozen=True)
class Step(_Message):
    stream: int
    seq: int
    position: int  # first position id of the new tokens
    mask_delta: tuple[int, ...]  # mask entries appended for the new tokens (never the whole mask)
    want: str  # "argmax" | "topk:K" | "logits", optionally "@R" (the last R rows)
    tensor: Tensor  # input_ids i64 [B,T] or hidden_states [B,T,H]
    timings: dict[str, float] = field(default_factory=dict)  # seconds each earlier stage spent on it
    rewind: int = 0  # newest visible cached positions to hide before running (rejected drafts)
    compact: bool = False  # drop hidden positions from the cache before running

    def _check(self) -> None:
        if any(entry not in (0, 1) for entry in self.mask_delta):
            raise _fail("Step.mask_delta", "entries 0 or 1", self.mask_delta)
        parse_want(self.want)


@_message(8)
@dataclass(frozen=True)
class Result(_Message):
    stream: int
    seq: int
    tensor: Tensor  # argmax ids i64 [B,T] | top-k values [B,T,K] | logits [B,T,V]
    timings: dict[str, float]
    indices: Tensor | None = None  # the top-k ids (i64 or i32), same shape as tensor; else None

    def _check(self) -> None:
        if self.indices is not None and (self.indices.dtype not in ("i64", "i32")
                                         or self.indices.shape != self.tensor.shape):
            raise ProtocolError("bad_tensor", f"Result.indices: expected integer ids of shape "
                                              f"{list(self.tensor.shape)}, found {self.indices}")


@_message(9)
@dataclass(frozen=True)
class Error(_Message):
    code: str
    message: str
    stream: int | None = None

    def _check(self) -> None:
        if not self.code:
            raise _fail("Error.code", "a non-empty string", self.code)


@_message(10)
@dataclass(frozen=True)
class Ping(_Message):
    nonce: int


@_message(11)
@dataclass(frozen=True)
class Pong(_Message):
    nonce: int


Message = Hello | HelloOk | Open | Reset | Close | Step | Result | Error | Ping | Pong


def parse_want(want: str) -> tuple[str, int | None, int | None]:
    """(mode, K, rows) from a Step's ``want``: mode "argmax" | "logits" | "topk" (K its k, else None);
    rows = the last R rows asked for, None for the default (every row for argmax, the last for others)."""
    match = _WANT.fullmatch(want)
    if match is None:
        raise _fail("Step.want", '"argmax", "logits" or "topk:K" with K >= 1, optionally "@R" with R >= 1', want)
    mode, k, rows = match.groups()
    return ("topk" if k else mode), (int(k) if k else None), (int(rows) if rows else None)


def encode(msg: Message) -> bytes:
    """One frame holding ``msg``."""
    if type(msg) not in _KINDS.values():
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


def parse_prefix(prefix: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME) -> tuple[type[_Message], int, int]:
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
    if kind not in _KINDS:
        raise ProtocolError("unknown_kind", f"expected a message kind in {sorted(_KINDS)}, found {kind}")
    if header_len > MAX_HEADER_BYTES or header_len + body_len > max_frame_bytes:
        raise ProtocolError("oversized", f"{_KINDS[kind].__name__} frame announces a {header_len}-byte header "
                                         f"and a {body_len}-byte body; limits are {MAX_HEADER_BYTES} for the "
                                         f"header and {max_frame_bytes} for both")
    return _KINDS[kind], header_len, body_len


def _reject_constant(name: str) -> Any:
    raise ProtocolError("bad_header", f"expected finite JSON numbers, found {name}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ProtocolError("bad_header", f"header repeats the key {key!r}")
        obj[key] = value
    return obj


def _parse_header(cls: type[_Message], header: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(header.decode("utf-8"), object_pairs_hook=_unique_keys,
                         parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ProtocolError("bad_header", f"{cls.__name__} header is not UTF-8 JSON: {e}") from e
    if type(obj) is not dict:
        raise _fail(f"{cls.__name__} header", "a JSON object", obj)
    expected = {f.name for f in fields(cls)}
    if obj.keys() != expected:
        raise ProtocolError("bad_header", f"{cls.__name__} header: expected fields {sorted(expected)}, "
                                          f"missing {sorted(expected - obj.keys())}, "
                                          f"unknown {sorted(obj.keys() - expected)}")
    return obj


def _take_tensor(where: str, spec: Any, body: bytes, offset: int) -> Tensor:
    if type(spec) is not dict or spec.keys() != {"dtype", "shape"}:
        raise ProtocolError("bad_tensor", f"{where}: expected {{dtype, shape}}, found {_show(spec)}")
    dtype, shape = spec["dtype"], spec["shape"]
    if dtype not in DTYPES:
        raise ProtocolError("bad_tensor", f"{where}: expected a dtype in {sorted(DTYPES)}, found {_show(dtype)}")
    if type(shape) is not list:
        raise ProtocolError("bad_tensor", f"{where}: expected a shape list, found {_show(shape)}")
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


def _read_exactly(stream: Any, n: int, what: str, *, frame_start: bool = False) -> bytes:
    """``n`` bytes from a socket (recv) or binary file (read); ConnectionClosed if the peer stops first."""
    read = stream.recv if hasattr(stream, "recv") else stream.read
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


def read_message(stream: Any, max_frame_bytes: int = DEFAULT_MAX_FRAME) -> Message:
    """Read one frame from a socket or binary file; lengths are checked before the payload is read.

    A socket timeout propagates as TimeoutError: the caller knows which peer and stage it was waiting on.
    """
    prefix = _read_exactly(stream, PREFIX_SIZE, "a frame prefix", frame_start=True)
    cls, header_len, body_len = parse_prefix(prefix, max_frame_bytes)
    header = _read_exactly(stream, header_len, f"a {cls.__name__} header")
    body = _read_exactly(stream, body_len, f"a {cls.__name__} body")
    return decode(prefix, header, body, max_frame_bytes=max_frame_bytes)


def write_message(sock: Any | BinaryIO, msg: Message) -> None:
    """Send one frame with a single sendall (or write, for a file)."""
    frame = encode(msg)
    if hasattr(sock, "sendall"):
        sock.sendall(frame)
    else:
        sock.write(frame)
