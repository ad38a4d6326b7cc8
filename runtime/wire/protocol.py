"""The wire messages between ovshard nodes (protocol v4): one tagged union of frozen msgspec Structs.

How a message becomes bytes (the 16-byte prefix, the JSON header, the body) is framing.py's part; this
module declares what may travel. msgspec checks every field on receipt: types, integer ranges, string
lengths, and unknown fields are refused. Activations travel as f16 by default (``ACTIVATION_WIRE_DTYPE``;
f32 on request), token ids as i64. Counts and ranges travel, never lists that grow with the prompt.

    kind  message   fields                                         meaning
    1     Hello     role ("head"|"upstream"), protocol,            first frame on a connection: who calls,
                    bundle_fingerprint, stage, session,            which bundle, stage and session; from the
                    next_hop (str|null), kv_blocks (int|null)      head, next_hop is the next stage's
                                                                   host:port (the stage links to it for
                                                                   this session only); kv_blocks: the
                                                                   paged KV blocks the head asks for (0:
                                                                   half the pool; null: none)
    2     HelloOk   stage, bundle_fingerprint, num_stages,         the handshake is accepted; a paged stage
                    block_size, kv_blocks                          names its block size (0: stateful) and
                                                                   the blocks granted to the session
    3     Open      stream                                         start a stream of the session (empty KV
                                                                   cache); answered by OpenOk or an Error
    4     Reset     stream                                         empty a stream's KV cache
    5     Close     stream                                         forget a stream of the session
    6     Step      stream, step, position, want, tensor,          run T new tokens (all visible): tensor is
                    timings, rewind, compact                       input_ids i64 [1,T] or hidden_states
                                                                   [1,T,H]; position = first new position
                                                                   id, which must equal the stage's visible
                                                                   count after the rewind; want = what the
                                                                   last stage returns: "argmax" (every
                                                                   row) | "topk:K" | "logits" (the last
                                                                   row), "@R" appended = the last R rows;
                                                                   before running, every stage hides its
                                                                   newest `rewind` visible positions (mask
                                                                   zeroing) and, if `compact`, drops hidden
                                                                   positions from its cache
    8     Result    stream, reply_to, tensor, timings, indices     the last stage's answer to Step `step`
                                                                   (reply_to = its step) or to a Batch's
                                                                   row (reply_to = the Batch's tick):
                                                                   argmax ids i64 [1,T]; top-k values
                                                                   [1,T,K] with their ids in `indices`; or
                                                                   logits [1,T,V]. timings: name -> seconds
    9     Error     code, message, stream, reply_to (int|null)     a refusal or failure (ERROR_CODES); after
                                                                   a protocol error the sender closes;
                                                                   reply_to: the Step's step or the
                                                                   Batch's tick it refuses, if any
    10    Ping      nonce                                          liveness check
    11    Pong      nonce                                          answer to Ping with the same nonce
    12    OpenOk    stream                                         the stream is open at this stage
    13    Batch     tick, rows [BatchRow], tensor, tables,         one inference of a paged stage over many
                    copies, timings, refused [Refusal]             sequences (below)
    14    BatchDone tick, timings, refused [Refusal]               the last stage ran Batch `tick`; its
                                                                   Results (one per row that wants scores,
                                                                   tagged with the row's stream) came first

A Batch (paged stages only) carries the rows of many sequences of one session, one after another: tensor is
input_ids i64 [N] (stage 0) or hidden_states [N, H]; BatchRow i is (stream, position, count, want, blocks):
its count rows run at positions [position, position + count), and its block table is the next ``blocks``
entries of ``tables`` (i32, block ids of the session's grant, ceil((position + count) / block_size) of
them); want is "" for a prefill chunk that wants no scores, else as Step's. The head owns the block tables
(it runs the scheduler, scheduling/tick_planner.py) and every stage applies ``copies`` (i32 [C, 2]: src, dst) before the
inference. A row a stage cannot run is refused alone (a Refusal travels on with the batch, and the last
stage reports it in BatchDone); the rest of the batch runs.

Kind 7 was v1's Rewind (retired: rewinds ride on Step so they stay ordered along the chain). A stream id
is the session's own (the head numbers its streams); streams are keyed by (session, stream), so one
session can neither see nor touch another's. A session id is 128 random bits in hex, chosen by the head.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

import msgspec
import numpy as np
import numpy.typing as npt

from ovshard.errors import OvshardError

PROTOCOL_VERSION = 5  # 5: Step.step, Batch.tick and BatchDone.tick, Result and Error reply_to (4: seq)
MAX_NDIM = 8
ACTIVATION_WIRE_DTYPE = "f16"
DTYPES: dict[str, np.dtype[Any]] = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4"), "i64": np.dtype("<i8"),
                                    "i32": np.dtype("<i4")}
ROLES = ("head", "upstream")
PROTOCOL_ERROR_CODES = ("bad_magic", "bad_version", "unknown_kind", "oversized", "bad_header", "bad_tensor",
                        "truncated", "timeout")
# Errors about a request or a connection (the frame itself was well formed)
REQUEST_ERROR_CODES = ("refused", "unauthorized", "failed", "busy", "no_stream", "unavailable", "position",
                       "draining", "internal")
ERROR_CODES = PROTOCOL_ERROR_CODES + REQUEST_ERROR_CODES
# Codes after which the head may reconnect and replay a stream (a stage restarted or went away)
RECOVERABLE_CODES = ("no_stream", "unavailable", "draining")
SESSION_PATTERN = r"^[0-9a-f]{32}\Z"  # \Z: "$" would let a trailing newline through
_WANT = re.compile(r"(argmax|logits|topk:([1-9][0-9]{0,8}))(?:@([1-9][0-9]{0,8}))?")

UInt = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
ShortText = Annotated[str, msgspec.Meta(max_length=4096)]
SessionId = Annotated[str, msgspec.Meta(pattern=SESSION_PATTERN)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
Timings = Annotated[dict[Name, Seconds], msgspec.Meta(max_length=64)]


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


class Tensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One tensor: dtype name, shape, and its bytes (C order, little-endian).

    In a frame's header a tensor is ``{"dtype", "shape"}`` only; its bytes are in the body (framing.py
    fills ``data`` from there). Build one with :meth:`from_array`; :meth:`check` verifies the bytes.
    """

    dtype: Literal["f16", "f32", "i64", "i32"]
    shape: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_NDIM)]
    data: bytes = b""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def check(self) -> Tensor:
        if len(self.data) != self.nbytes:
            raise ProtocolError("bad_tensor", f"{self.dtype}{list(self.shape)} needs {self.nbytes} bytes, "
                                              f"found {len(self.data)}")
        return self

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
        if array.ndim > MAX_NDIM:
            raise ProtocolError("bad_tensor", f"expected at most {MAX_NDIM} dimensions, found {array.ndim}")
        target = DTYPES[wire_dtype]
        if not _castable(array, target):
            raise ProtocolError("bad_tensor", f"cannot send {array.dtype} values as {wire_dtype}")
        with np.errstate(over="ignore"):  # overflow is detected just below
            out = array.astype(target, copy=False)
        if target.kind == "f" and np.count_nonzero(~np.isfinite(out)) != np.count_nonzero(~np.isfinite(array)):
            raise ProtocolError("bad_tensor", f"values overflow {wire_dtype} (max {np.finfo(target).max}); "
                                              "send them as f32")
        return cls(wire_dtype, tuple(int(d) for d in out.shape), out.tobytes())  # type: ignore[arg-type]

    @classmethod
    def activations(cls, array: np.ndarray, wire_dtype: str = ACTIVATION_WIRE_DTYPE) -> Tensor:
        """Activations as ``wire_dtype``, or as f32 when their values overflow it (Gemma's hidden states can
        pass f16's 65504): the next stage reads either."""
        try:
            return cls.from_array(array, wire_dtype)
        except ProtocolError:
            if wire_dtype == "f32":
                raise
            return cls.from_array(array, "f32")

    def to_array(self, dtype: npt.DTypeLike | None = None) -> np.ndarray:
        """The tensor as an array: a read-only view of the data, or a copy cast to ``dtype``."""
        array = np.frombuffer(self.check().data, dtype=DTYPES[self.dtype]).reshape(self.shape)
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


class MessageBase(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """Base of every wire message; the tag (``kind`` in the header) is the message's wire kind."""

    @classmethod
    def kind(cls) -> int:
        return int(cls.__struct_config__.tag)  # type: ignore[arg-type]


class Hello(MessageBase, frozen=True, tag=1):
    role: Literal["head", "upstream"]
    protocol: UInt
    bundle_fingerprint: Name
    stage: UInt  # the stage the caller expects this node to serve
    session: SessionId  # the head's session; an upstream link serves exactly this session
    next_hop: Name | None = None  # from the head: "host:port" of the next stage (None for the last)
    kv_blocks: UInt | None = None  # paged KV blocks asked for this session: 0 half the pool, None none


class HelloOk(MessageBase, frozen=True, tag=2):
    stage: UInt
    bundle_fingerprint: Name
    num_stages: UInt
    block_size: UInt = 0  # positions a paged KV block holds; 0: this stage keeps stateful streams
    kv_blocks: UInt = 0  # the paged blocks granted to the session (block ids 0..kv_blocks-1)

    def __post_init__(self) -> None:
        if not self.stage < self.num_stages:
            raise ValueError(f"HelloOk.stage {self.stage} must be less than num_stages={self.num_stages}")


class Open(MessageBase, frozen=True, tag=3):
    stream: UInt


class Reset(MessageBase, frozen=True, tag=4):
    stream: UInt


class Close(MessageBase, frozen=True, tag=5):
    stream: UInt


class Step(MessageBase, frozen=True, tag=6):
    stream: UInt
    step: UInt  # the head's number for this Step; its Result or Error replies to it
    position: UInt  # first position id of the new tokens (= the stage's visible count after the rewind)
    want: Annotated[str, msgspec.Meta(max_length=32)]  # "argmax" | "topk:K" | "logits", optionally "@R"
    tensor: Tensor  # input_ids i64 [1,T] or hidden_states [1,T,H]
    timings: Timings = {}  # seconds each earlier stage spent on it
    rewind: UInt = 0  # newest visible cached positions to hide before running (rejected drafts)
    compact: bool = False  # drop hidden positions from the cache before running

    def __post_init__(self) -> None:
        parse_want(self.want)
        shape = self.tensor.shape
        if len(shape) not in (2, 3) or shape[0] != 1 or shape[1] < 1:
            raise ValueError(f"Step.tensor: expected ids [1, T] or activations [1, T, H] with T >= 1 "
                             f"(batch 1), found shape {list(shape)}")


class Result(MessageBase, frozen=True, tag=8):
    stream: UInt
    reply_to: UInt  # the Step's step, or the tick of the Batch whose row this answers
    tensor: Tensor  # argmax ids i64 [1,T] | top-k values [1,T,K] | logits [1,T,V]
    timings: Timings
    indices: Tensor | None = None  # the top-k ids (i64 or i32), same shape as tensor; else None

    def __post_init__(self) -> None:
        if self.indices is not None and (self.indices.dtype not in ("i64", "i32")
                                         or self.indices.shape != self.tensor.shape):
            raise ValueError(f"Result.indices: expected integer ids of shape {list(self.tensor.shape)}, "
                             f"found {self.indices.dtype}{list(self.indices.shape)}")


class Error(MessageBase, frozen=True, tag=9):
    code: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    message: ShortText
    stream: UInt | None = None
    reply_to: UInt | None = None  # the Step's step or the Batch's tick it refuses


class Ping(MessageBase, frozen=True, tag=10):
    nonce: UInt


class Pong(MessageBase, frozen=True, tag=11):
    nonce: UInt


class OpenOk(MessageBase, frozen=True, tag=12):
    stream: UInt


Want = Annotated[str, msgspec.Meta(max_length=32)]
MAX_BATCH_ROWS = 1024


class BatchRow(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One sequence's part of a Batch (see the module docstring)."""

    stream: UInt
    position: UInt
    count: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    want: Want  # "" (no scores: a prefill chunk before the last) or a Step's want
    blocks: Dim  # entries of Batch.tables that form this row's block table

    def __post_init__(self) -> None:
        if self.want:
            parse_want(self.want)


class Refusal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A row a stage refused: the batch ran without it."""

    stream: UInt
    stage: UInt
    code: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    message: ShortText


Refusals = Annotated[list[Refusal], msgspec.Meta(max_length=MAX_BATCH_ROWS)]


class Batch(MessageBase, frozen=True, tag=13):
    tick: UInt  # the head's tick number
    rows: Annotated[list[BatchRow], msgspec.Meta(max_length=MAX_BATCH_ROWS)]
    tensor: Tensor  # input_ids i64 [N] or hidden_states [N, H], N = sum of the rows' counts
    tables: Tensor  # i32 [B]: the rows' block tables, one after another
    copies: Tensor | None = None  # i32 [C, 2]: (src, dst) blocks to copy before the inference
    timings: Timings = {}
    refused: Refusals = []

    def __post_init__(self) -> None:
        rows, shape = sum(r.count for r in self.rows), self.tensor.shape
        if len(shape) not in (1, 2) or shape[0] != rows:
            raise ValueError(f"Batch.tensor: expected ids [N] or activations [N, H] with N = {rows} (the rows' "
                             f"counts), found shape {list(shape)}")
        blocks = sum(r.blocks for r in self.rows)
        if self.tables.dtype != "i32" or self.tables.shape != (blocks,):
            raise ValueError(f"Batch.tables: expected i32 [{blocks}] (the rows' blocks), found "
                             f"{self.tables.dtype}{list(self.tables.shape)}")
        if self.copies is not None and (self.copies.dtype != "i32" or len(self.copies.shape) != 2
                                        or self.copies.shape[1] != 2):
            raise ValueError(f"Batch.copies: expected i32 [C, 2], found {self.copies.dtype}{list(self.copies.shape)}")


class BatchDone(MessageBase, frozen=True, tag=14):
    tick: UInt
    timings: Timings
    refused: Refusals = []


Message = Union[Hello, HelloOk, Open, Reset, Close, Step, Result, Error, Ping, Pong, OpenOk,  # noqa: UP007
                Batch, BatchDone]
KINDS: Mapping[int, type[MessageBase]] = {cls.kind(): cls for cls in Message.__args__}  # type: ignore[attr-defined]
TENSOR_FIELDS: Mapping[type[MessageBase], tuple[str, ...]] = {
    cls: tuple(f for f, t in zip(cls.__struct_fields__, msgspec.structs.fields(cls), strict=True)
               if "Tensor" in repr(t.type))
    for cls in KINDS.values()
}


def error(code: str, message: str, stream: int | None = None, reply_to: int | None = None) -> Error:
    """An Error frame; the message is cut to what the wire allows."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    return Error(code, message if len(message) <= 4096 else message[:4093] + "...", stream, reply_to)


def parse_want(want: str) -> tuple[str, int | None, int | None]:
    """(mode, K, rows) from a Step's ``want``: mode "argmax" | "logits" | "topk" (K its k, else None);
    rows = the last R rows asked for, None for the default (every row for argmax, the last for others)."""
    match = _WANT.fullmatch(want)
    if match is None:
        raise ProtocolError("bad_header", f'Step.want: expected "argmax", "logits" or "topk:K" with K >= 1, '
                                          f'optionally "@R" with R >= 1, found {show(want)}')
    mode, k, rows = match.groups()
    return ("topk" if k else mode), (int(k) if k else None), (int(rows) if rows else None)


def rows_read(want: str, fed: int) -> int:
    """How many of ``fed`` rows a Step's ``want`` reads: every row for a bare argmax, else the last R (1)."""
    mode, _, rows = parse_want(want)
    if rows is None:
        return fed if mode == "argmax" else 1
    return min(rows, fed)
