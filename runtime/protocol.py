"""The wire messages between ovshard nodes: one tagged union of frozen dataclasses, strictly checked.

How a message becomes bytes (the 16-byte prefix, the JSON header, the body) is framing.py's part;
this module declares what may travel. Integers are in [0, 2**63). Activations travel as f16 by
default (``ACTIVATION_WIRE_DTYPE``; f32 on request), token ids as i64.

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

A message checks every field's type (and the facts in its ``_check``) whenever it is built, sent or
received, so a wrong value is a ``ProtocolError`` whose ``code`` is one of ``PROTOCOL_ERROR_CODES``.
A peer that closes the connection raises ``ConnectionClosed`` (``clean`` is true when it closed
between frames).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from ovshard.errors import OvshardError

PROTOCOL_VERSION = 2
MAX_NDIM = 8
ACTIVATION_WIRE_DTYPE = "f16"
DTYPES: dict[str, np.dtype[Any]] = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4"), "i64": np.dtype("<i8"), "i32": np.dtype("<i4")}
ROLES = ("head", "upstream")
PROTOCOL_ERROR_CODES = ("bad_magic", "bad_version", "unknown_kind", "oversized", "bad_header", "bad_tensor",
                        "truncated")
_INT_LIMIT = 2**63
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


def show(value: Any) -> str:
    """A value for an error message: its repr, cut to 80 characters."""
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
            raise ProtocolError("bad_tensor", f"expected a dtype in {sorted(DTYPES)}, found {show(self.dtype)}")
        if (type(self.shape) is not tuple or len(self.shape) > MAX_NDIM
                or any(type(d) is not int or d < 0 for d in self.shape)):
            raise ProtocolError("bad_tensor", f"expected a shape of at most {MAX_NDIM} non-negative ints, "
                                              f"found {show(self.shape)}")
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
    return ProtocolError("bad_header", f"{where}: expected {expected}, found {show(value)}")


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
_KINDS: dict[int, type[MessageBase]] = {}
KINDS: Mapping[int, type[MessageBase]] = _KINDS  # wire kind -> message class, read-only


@dataclass(frozen=True)
class MessageBase:
    """Base of every wire message: checks each field's type when built (sent or received)."""

    KIND: ClassVar[int] = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            _CHECKS[str(f.type)](f"{type(self).__name__}.{f.name}", getattr(self, f.name))
        self._check()

    def _check(self) -> None:
        """Facts beyond field types; overridden where a message has some."""


_M = TypeVar("_M", bound=MessageBase)


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
class Hello(MessageBase):
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
class HelloOk(MessageBase):
    stage: int
    bundle_fingerprint: str
    num_stages: int

    def _check(self) -> None:
        if not self.stage < self.num_stages:
            raise _fail("HelloOk.stage", f"less than num_stages={self.num_stages}", self.stage)


@_message(3)
@dataclass(frozen=True)
class Open(MessageBase):
    stream: int


@_message(4)
@dataclass(frozen=True)
class Reset(MessageBase):
    stream: int


@_message(5)
@dataclass(frozen=True)
class Close(MessageBase):
    stream: int


@_message(6)
@dataclass(frozen=True)
class Step(MessageBase):
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
class Result(MessageBase):
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
class Error(MessageBase):
    code: str
    message: str
    stream: int | None = None

    def _check(self) -> None:
        if not self.code:
            raise _fail("Error.code", "a non-empty string", self.code)


@_message(10)
@dataclass(frozen=True)
class Ping(MessageBase):
    nonce: int


@_message(11)
@dataclass(frozen=True)
class Pong(MessageBase):
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
