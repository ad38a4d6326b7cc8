"""A bundle stage converted to paged attention when a node loads it: the rows of many sequences in one inference.

The bundle keeps the stateful IR of the bundle contract (openvino-genai loads it; the fusion checks are
unchanged). ``compile_paged`` converts a stage as it loads it, as stage.py slices a last stage's logit rows:
OpenVINO's ``paged_attention_transformation`` replaces each layer's ReadValue/SDPA/Assign with one
``PagedAttentionExtension`` whose keys and values live in explicit inputs ``key_cache.N``/``value_cache.N``
that the CPU plugin types as [blocks, kv_heads, 32, head_dim] (block size 32; with a u8 or u4
``KV_CACHE_PRECISION`` the rows carry their scales and zero points too, e.g. key [blocks, kv_heads, 40, head_dim]
and value [blocks, kv_heads, 32, head_dim + 8] at u8). One step over S sequences, sequence s bringing T_s new
tokens at positions [p_s, p_s + T_s), N = sum of T_s rows::

    input_ids [N] i64 | inputs_embeds [N, H]   the new tokens of every sequence, one sequence after another
    position_ids [N] i64                       each row's position
    past_lens [S] i32                          p_s: positions already cached (the first new token's position)
    subsequence_begins [S+1] i32               sequence s owns rows [begins[s], begins[s+1])
    block_indices [B] i32                      the block tables, concatenated (ceil((p_s + T_s) / 32) blocks each)
    block_indices_begins [S+1] i32             sequence s's table is block_indices[begins[s]:begins[s+1]]
    max_context_len [] i32                     max over s of p_s + T_s
    -> hidden_states [N, 1, H] | logits [N, 1, V] (R rows: a sliced last stage computes the rows asked for)

Position p of sequence s is slot p % 32 of block table_s[p // 32]: the kernel writes the new rows' KV there and
attends over positions [0, p_s + T_s) of the sequence only, so the caches hold whatever the block manager
(scheduling/block_tables.py) decides and a rewind is a shorter ``past_lens``.

Facts of OpenVINO 2026.4.1 this module works around, each checked when it loads a stage:

* the transformation wants ``input_ids`` or ``inputs_embeds``: a later stage's ``hidden_states`` input is renamed;
* it treats ``inputs_embeds`` as flattened [N, H] (it unsqueezes axis 1) but leaves the input's shape [?, ?, H],
  so [N, 1, H] rows broadcast against the residual into [N, N, 1, H]: the input is reshaped to [?, H];
* it gives every PagedAttention ``sliding_window`` 0, whole-context attention: each sliding layer's window is read
  from its stateful mask (which counts visible positions: a CumSum of ``attention_mask``) and set;
* attention it cannot match (Gemma 2's soft-capped scores have no SDPA op) stays stateful: refused by count;
* PagedAttention has a sliding window but no chunks: a model with chunked attention (Llama 4) is refused by name;
* tensors bound with shared memory do not keep their numpy arrays alive (a freed cache crashed the process):
  the stage owns its cache arrays.

A refused stage raises :class:`PagedUnsupportedError`; the caller runs it on the stateful path (stage.py) and
logs why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from ovshard.bundle import names
from ovshard.bundle.manifest import Manifest
from ovshard.bundle.stage import StageSpec
from ovshard.errors import BundleError, PagedUnsupportedError
from ovshard.runtime.engine.logit_rows import lm_head
from ovshard.runtime.engine.plugin import plugin_config
from ovshard.runtime.engine.static_step import WIDEN_POSITIONS, DecodeStep, static_decode_model, why_no_copy

__all__ = ["CacheSpec", "PagedRows", "PagedStage", "blocks_for", "compile_paged", "gather_logit_rows",
           "paged_inputs", "to_paged"]

log = logging.getLogger(__name__)

CACHE_PREFIXES = ("key_cache.", "value_cache.")
PAGED_OP = "PagedAttentionExtension"
STATEFUL_OPS = ("ReadValue", "Assign", "ScaledDotProductAttention")
BLOCK_SIZE = 32  # positions a block of the CPU plugin's paged caches holds (it types the caches so)
_ROWS = 1  # of a cache's shape per block [kv_heads, rows, cols]: a value cache's rows are its positions
_MASK_INPUT = 3  # of ScaledDotProductAttention (q, k, v, mask, scale)
_SLIDING_WINDOW_INPUT = 10  # of PagedAttentionExtension (q, k, v, caches, past_lens, begins, blocks, ..., scale, window)


def blocks_for(length: int, block_size: int) -> int:
    """Blocks that hold ``length`` positions: ceil(length / block_size)."""
    return -(-length // block_size)


@dataclass(frozen=True)
class PagedRows:
    """One sequence's part of a paged step: ``x`` its new tokens, ids [T] (stage 0) or hidden rows [T, H];
    ``position`` the first new token's position (= positions already cached, ``past_lens``); ``blocks`` its
    block table, covering at least positions [0, position + T); ``want`` on a sliced last stage: the last rows
    to compute logits for (None: all T)."""

    x: np.ndarray
    position: int
    blocks: Sequence[int]
    want: int | None = None

    @property
    def count(self) -> int:
        return int(self.x.shape[0])

    @property
    def end(self) -> int:
        return self.position + self.count


@dataclass(frozen=True)
class CacheSpec:
    """One cache input as the plugin typed it: ``shape`` per block ([kv_heads, rows, cols])."""

    name: str
    element_type: ov.Type
    shape: tuple[int, ...]

    @property
    def bytes_per_block(self) -> int:
        return int(np.prod(self.shape)) * self.element_type.bitwidth // 8


def to_paged(model: ov.Model, spec: StageSpec) -> ov.Model:
    """``model`` (a stage's stateful IR) in paged form, in place: one PagedAttentionExtension per layer, caches
    and block tables as inputs. PagedUnsupportedError when the stage cannot be converted exactly."""
    where = f"stage {spec.index} (layers [{spec.start}, {spec.end}))"
    if not spec.first:
        _input(model, names.HIDDEN_STATES, where).get_tensor().set_names({names.INPUTS_EMBEDS})
    windows = _windows(model, where)
    try:
        paged_attention_transformation(model, False, False)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[-1]  # OpenVINO's check, after the source locations
        raise PagedUnsupportedError(f"{where}: OpenVINO's paged attention transformation refused it ({reason}); "
                                    "run this stage on the stateful path") from e
    _check_converted(model, len(spec.layers), where)
    _set_windows(model, windows)
    if not spec.first:
        embeds = _input(model, names.INPUTS_EMBEDS, where)
        hidden = embeds.get_partial_shape()[-1]
        embeds.get_node().set_partial_shape(ov.PartialShape([ov.Dimension(), hidden]))  # [N, H]
    model.validate_nodes_and_infer_types()
    return model


def _input(model: ov.Model, name: str, where: str) -> ov.Output:
    for port in model.inputs:
        if name in port.get_names():
            return port
    found = sorted(n for p in model.inputs for n in p.get_names())
    raise PagedUnsupportedError(f"{where} has no {name!r} input (found {found}); expected a stage of the bundle "
                                "contract: recompile the bundle")


def _windows(model: ov.Model, where: str) -> list[int | None]:
    """Each attention layer's sliding window, in layer order (None: full attention). A sliding layer's mask
    counts visible positions (a CumSum of ``attention_mask``) and keeps keys whose distance is below the
    window: ``Less(Subtract(seen_q, seen_k), window)`` in frontend/stage_module.py's ``causal_padding_mask``."""
    windows: list[int | None] = []
    for op in model.get_ordered_ops():
        if op.get_type_name() == "ScaledDotProductAttention":
            mask = op.input_value(_MASK_INPUT) if op.get_input_size() > _MASK_INPUT else None
            if mask is None or not _counts_mask(mask):
                windows.append(None)
                continue
            window = _window_of(mask)
            if window is None:
                raise PagedUnsupportedError(f"{where}: a sliding-window layer's mask has no constant window (expected "
                                            "Less(distance, window)); run this stage on the stateful path")
            windows.append(window)
    return windows


def _window_of(mask: ov.Output) -> int | None:
    for node in _above(mask):
        if node.get_type_name() == "Less" and node.input_value(0).get_node().get_type_name() == "Subtract":
            bound = node.input_value(1).get_node()
            if bound.get_type_name() == "Constant" and bound.get_output_size() == 1:
                values = bound.get_data().ravel()
                if values.size == 1:
                    return int(values[0])
    return None


def _above(output: ov.Output) -> list[ov.Node]:
    """The nodes ``output`` depends on, constants' consumers included, constants themselves not walked past."""
    seen, order, todo = set(), [], [output.get_node()]
    while todo:
        node = todo.pop()
        if node.get_name() in seen:
            continue
        seen.add(node.get_name())
        order.append(node)
        todo.extend(v.get_node() for v in node.input_values() if v.get_node().get_type_name() != "Constant")
    return order


def _set_windows(model: ov.Model, windows: list[int | None]) -> None:
    """Give each sliding layer's PagedAttentionExtension its window (the transformation leaves every layer's
    ``sliding_window`` input 0, whole-context attention). The CPU kernel then attends to the last ``window``
    positions up to and including the query's own, as the stateful mask does."""
    layers = [op for op in model.get_ordered_ops() if op.get_type_name() == PAGED_OP]
    for op, window in zip(layers, windows, strict=True):
        if window is not None:
            op.input(_SLIDING_WINDOW_INPUT).replace_source_output(ops.constant(np.array(window, np.int32)).output(0))


def _counts_mask(mask: ov.Output) -> bool:
    """Whether a CumSum over the attention_mask input (through Converts) lies above ``mask``."""
    seen, todo = set(), [mask.get_node()]
    while todo:
        node = todo.pop()
        if node.get_name() in seen:
            continue
        seen.add(node.get_name())
        if node.get_type_name() == "CumSum":
            source = node.input_value(0)
            while source.get_node().get_type_name() == "Convert":
                source = source.get_node().input_value(0)
            if names.ATTENTION_MASK in source.get_names():
                return True
        todo.extend(v.get_node() for v in node.input_values() if v.get_node().get_type_name() != "Constant")
    return False


def _check_converted(model: ov.Model, layers: int, where: str) -> None:
    kinds = [op.get_type_name() for op in model.get_ops()]
    paged, left = kinds.count(PAGED_OP), sorted({k for k in kinds if k in STATEFUL_OPS})
    if paged != layers or left:
        raise PagedUnsupportedError(
            f"{where}: expected one {PAGED_OP} per layer ({layers}) and no {'/'.join(STATEFUL_OPS)} after the "
            f"paged attention transformation; found {paged}, and {left or 'none'} left (attention in a form it "
            "does not match, e.g. soft-capped scores): run this stage on the stateful path")


def gather_logit_rows(model: ov.Model, vocab: int) -> ov.Model:
    """A paged last stage computing logits only for the rows in a new input ``names.SAMPLED_ROWS`` (i64 [R])."""
    head = lm_head(model, vocab)
    rows = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name=names.SAMPLED_ROWS)
    rows.output(0).get_tensor().set_names({names.SAMPLED_ROWS})
    picked = ops.gather(head.input_value(0), rows, ops.constant(np.array(0, np.int64)))  # [R, 1, H] of [N, 1, H]
    head.input(0).replace_source_output(picked.output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()
    return model


def compile_paged(core: ov.Core, bundle: Path, manifest: Manifest, index: int, device: str = "CPU",
                  config: dict[str, str] | None = None, num_blocks: int = 256,
                  slice_logits: bool = False, static_decode: bool = False) -> PagedStage:
    """Stage ``index`` read, converted to paged attention, compiled with ``plugin_config`` and given caches of
    ``num_blocks`` blocks; ``slice_logits``: a last stage computes only the rows each step wants;
    ``static_decode``: a step of one sequence and one row runs a copy compiled with static shapes
    (static_step.py; where that copy is refused, logged, every step runs the dynamic model).
    PagedUnsupportedError: run the stage with stage.Stage instead."""
    if not 0 <= index < manifest.num_stages:
        raise BundleError(f"stage {index} does not exist: the bundle has stages 0..{manifest.num_stages - 1}")
    entry = manifest.stages[index]
    if device.upper() != "CPU":
        raise PagedUnsupportedError(f"stage {index}: paged stages run on CPU only (asked for {device}); "
                                    "run this stage on the stateful path")
    if manifest.architecture.attention_chunk:
        raise PagedUnsupportedError(
            f"stage {index}: chunked attention (attention_chunk_size={manifest.architecture.attention_chunk}, Llama 4) "
            "has no PagedAttention form: the op takes a sliding window, not chunks, and would attend across chunk "
            "boundaries; run this stage on the stateful path")
    log.info("stage %d: converting %s to paged attention", index, entry.model_xml)
    model = to_paged(core.read_model(str(Path(bundle) / entry.model_xml)), entry.stage)
    sliced = slice_logits and entry.stage.last
    if sliced:
        gather_logit_rows(model, manifest.architecture.vocab_size)
    properties = plugin_config(manifest, device, config)
    try:
        compiled = core.compile_model(model, device, properties)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[-1]
        raise PagedUnsupportedError(f"stage {index}: the paged form does not compile on {device} ({reason}); "
                                    "run this stage on the stateful path") from e
    primary = names.INPUT_IDS if entry.stage.first else names.INPUTS_EMBEDS
    decode = None
    if static_decode:
        weights = (Path(bundle) / entry.model_xml).with_suffix(".bin").stat().st_size
        refusal = why_no_copy(weights)
        if refusal is None:
            decode = _compile_decode(core, model, primary, num_blocks, device, properties, index)
        else:
            log.info("stage %d: decode steps run the dynamic paged model (%s)", index, refusal)
    stage = PagedStage(compiled, primary, num_blocks, manifest.runtime_hints.max_positions, sliced, decode)
    stage.warm()
    return stage


def _compile_decode(core: ov.Core, model: ov.Model, primary: str, num_blocks: int, device: str,
                    properties: dict[str, str], index: int) -> ov.CompiledModel | None:
    """The static one-row copy of paged ``model`` compiled, or None (logged) where it is refused."""
    hidden = None if primary == names.INPUT_IDS else model.input(primary).get_partial_shape()[-1].get_length()
    try:
        return core.compile_model(static_decode_model(model, primary, hidden, num_blocks), device, properties)
    except (PagedUnsupportedError, RuntimeError) as e:
        log.info("stage %d: decode steps run the dynamic paged model (%s)", index, str(e).strip().splitlines()[-1])
        return None


def paged_inputs(primary: str, seqs: Sequence[PagedRows], block_size: int, sliced: bool) -> dict[str, np.ndarray]:
    """The inputs of one paged step over ``seqs`` (the table in this module's docstring)."""
    counts = [s.count for s in seqs]
    tables = [np.asarray(s.blocks[:-(-s.end // block_size)], dtype=np.int32) for s in seqs]
    inputs = {
        primary: np.concatenate([s.x for s in seqs]),  # [N] ids or [N, H] rows
        names.POSITION_IDS: np.concatenate([np.arange(s.position, s.end, dtype=np.int64) for s in seqs]),
        names.PAST_LENS: np.array([s.position for s in seqs], dtype=np.int32),
        names.SUBSEQUENCE_BEGINS: np.cumsum([0, *counts], dtype=np.int32),
        names.BLOCK_INDICES: np.concatenate(tables),
        names.BLOCK_INDICES_BEGINS: np.cumsum([0, *(len(t) for t in tables)], dtype=np.int32),
        names.MAX_CONTEXT_LEN: np.array(max(s.end for s in seqs), dtype=np.int32),
    }
    if sliced:
        ends = np.cumsum(counts)  # each sequence's rows end here; it wants the last `want` of them
        inputs[names.SAMPLED_ROWS] = np.concatenate([np.arange(end - (s.want or s.count), end, dtype=np.int64)
                                               for s, end in zip(seqs, ends, strict=True)])
    return inputs


class PagedStage:
    """A compiled paged stage and its KV caches: ``num_blocks`` blocks a layer, bound once with set_tensor.

    Each cache is a uint8 array [num_blocks, bytes_per_block] that this object owns (the bound tensors share
    its memory and the plugin's type and shape); ``cache(name)`` views it typed. With ``decode`` (the paged model
    compiled again with a one-row step's static shapes, static_step.py) a step of one sequence and one row runs
    that copy on the same caches."""

    def __init__(self, compiled: ov.CompiledModel, primary: str, num_blocks: int, max_positions: int,
                 sliced: bool = False, decode: ov.CompiledModel | None = None) -> None:
        self.compiled, self.primary, self.max_positions, self.sliced = compiled, primary, max_positions, sliced
        self.request = compiled.create_infer_request()
        self.specs = _cache_specs(compiled)
        self.block_size = _block_size(self.specs)
        self.num_blocks = num_blocks
        self._caches: dict[str, np.ndarray] = {}
        self._tensors: dict[str, ov.Tensor] = {}
        for spec in self.specs:
            self._caches[spec.name] = np.zeros((num_blocks, spec.bytes_per_block), dtype=np.uint8)
            tensor = ov.Tensor(self._caches[spec.name], [num_blocks, *spec.shape], spec.element_type)
            self._tensors[spec.name] = tensor
            self.request.set_tensor(spec.name, tensor)
        self.hidden = None  # the width of a later stage's rows
        if primary == names.INPUTS_EMBEDS:
            self.hidden = compiled.input(names.INPUTS_EMBEDS).get_partial_shape()[-1].get_length()
        self.decode = None if decode is None else DecodeStep(decode, primary, self.hidden, num_blocks, self._tensors)
        log.info("paged stage: %d caches of %d blocks x %d positions, %d bytes a token", len(self.specs),
                 num_blocks, self.block_size, self.bytes_per_token)

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block over every layer's key and value caches."""
        return sum(spec.bytes_per_block for spec in self.specs)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one position of one sequence takes in this stage (scales and zero points included)."""
        return self.bytes_per_block // self.block_size

    def warm(self) -> None:
        """A 2-token step, then a 1-token step, on block 0: the CPU plugin prepares its prompt kernels (packs their
        weights, generates their code) at the first step of several tokens, so a node pays that at load, not on
        its first request (the Llama-3.2-1B shape on 2 cores: a first 512-token prompt 4.2-4.5 s cold, 2.1 s
        after this 2.0-2.4 s warm-up, later prompts 2.0-2.2 s either way; docs/results/2026-12-one-node.md); and
        the static copy's attention told of WIDEN_POSITIONS at once (DecodeStep.widen).
        Block 0 holds garbage after: every sequence writes the positions of its blocks before it reads them."""
        x = np.zeros((2,) if self.hidden is None else (2, self.hidden), np.int64 if self.hidden is None else np.float32)
        self.run([PagedRows(x, 0, [0], 1 if self.sliced else None)])  # ids [2] or rows [2, H]
        self.run([PagedRows(x[:1], 2, [0], 1 if self.sliced else None)])
        if self.decode is not None:
            self.decode.widen(min(self.num_blocks * self.block_size, self.max_positions, WIDEN_POSITIONS))

    def cache(self, name: str) -> np.ndarray:
        """Cache ``name`` as its plugin type and shape [num_blocks, ...] (a view; u4 stays packed bytes)."""
        return self._tensors[name].data

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        """Copy block src to dst in every cache (copy-on-write of a shared block; blocks.Granted.copies)."""
        for src, dst in copies:
            for cache in self._caches.values():
                cache[dst] = cache[src]

    def run(self, seqs: Sequence[PagedRows]) -> list[np.ndarray]:
        """One inference over every sequence's new rows; returns each sequence's output rows:
        hidden [T, H] (or logits [T, V]; [want, V] on a sliced last stage)."""
        self._check(seqs)
        if self.decode is not None and len(seqs) == 1 and seqs[0].count == 1 and seqs[0].want != 0:  # decode
            rows = seqs[0]
            return [self.decode.run(rows.x, rows.position, rows.blocks[:-(-rows.end // self.block_size)])]
        self.request.infer(paged_inputs(self.primary, seqs, self.block_size, self.sliced))
        out = self.request.get_output_tensor(0).data
        out = out.reshape(out.shape[0], -1)  # [N or R, 1, H|V] -> [N or R, H|V]
        counts = [(s.want or s.count) if self.sliced else s.count for s in seqs]
        return [rows.copy() for rows in np.split(out, np.cumsum(counts)[:-1])]

    def _check(self, seqs: Sequence[PagedRows]) -> None:
        """Refuse rows the kernel would mis-read: it reads and writes block ids without bounds checks."""
        if not seqs:
            raise BundleError("a paged step needs at least one sequence, got none")
        writing: set[int] = set()
        for i, rows in enumerate(seqs):
            written = self._check_one(i, rows)
            if written & writing:
                raise BundleError(f"sequence {i} of the step writes into block(s) {sorted(written & writing)} "
                                  "that another sequence of the step writes too: a shared block must be copied "
                                  "first (blocks.Granted.copies)")
            writing |= written

    def _check_one(self, i: int, rows: PagedRows) -> set[int]:
        """Sequence ``i``'s rows are well formed; returns the blocks its new positions are written into."""
        needed = -(-rows.end // self.block_size)
        shape: tuple[int, ...] = (rows.count,) if self.hidden is None else (rows.count, self.hidden)
        form = "ids [T]" if self.hidden is None else "rows [T, H]"
        if rows.count < 1 or tuple(rows.x.shape) != shape or rows.position < 0 or rows.end > self.max_positions:
            raise BundleError(f"sequence {i} of the step: expected {form} with T >= 1 at positions within "
                              f"[0, {self.max_positions}), found x {rows.x.shape} at position {rows.position}; "
                              "recompile with a larger --max-positions for longer sequences")
        table = list(rows.blocks[:needed])
        if len(table) < needed or not all(0 <= b < self.num_blocks for b in table):
            raise BundleError(f"sequence {i} of the step: expected {needed} block ids in [0, {self.num_blocks}) "
                              f"for positions [0, {rows.end}), found {table}")
        if self.sliced and not 1 <= (rows.want or rows.count) <= rows.count:
            raise BundleError(f"sequence {i} of the step wants {rows.want} logit rows; expected 1..{rows.count}")
        return set(table[rows.position // self.block_size:])


def _cache_specs(compiled: ov.CompiledModel) -> list[CacheSpec]:
    specs = []
    for port in compiled.inputs:
        name = port.get_any_name()
        if name.startswith(CACHE_PREFIXES):
            shape = port.get_partial_shape()
            if shape.rank.get_length() != 4 or not all(d.is_static for d in list(shape)[1:]):
                raise PagedUnsupportedError(f"cache {name} has shape {shape}; expected [blocks, kv_heads, rows, "
                                            "cols] with all but the first static (the CPU plugin's paged layout)")
            per_block = tuple(d.get_length() for d in list(shape)[1:])
            specs.append(CacheSpec(name, port.get_element_type(), per_block))
    if not specs:
        raise PagedUnsupportedError("the compiled paged stage has no key_cache/value_cache inputs")
    return specs


def _block_size(specs: list[CacheSpec]) -> int:
    """Positions a block holds: the value caches' row count (a u8/u4 key cache adds rows of scales)."""
    sizes = {spec.shape[_ROWS] for spec in specs if spec.name.startswith("value_cache.")}
    if len(sizes) != 1:
        raise PagedUnsupportedError(f"value caches disagree on the block size: {sorted(sizes)}; expected one")
    return sizes.pop()
