"""Calibration for data-aware INT4 (ovshard's own scale fit; NNCF's AWQ, scale estimation, GPTQ, LoRA correction), layer by layer.

The text: ``--calibration text``, the calibration text that ships with ovshard (``calibration.txt`` beside
this module, written for it and Apache-2.0 like the rest: everyday prose of several kinds, technical prose
and Python code, about 2,300 tokens), ``--calibration FILE`` (either tokenized by the checkpoint's tokenizer
and cut into samples that start with BOS, taken evenly over the whole text), or ``auto``, the model's own
sampled continuations of a few neutral prompts, so any model calibrates offline with no data set. Generation runs the checkpoint in float32 with torch, one decoder
layer in memory at a time (each step reads every layer again, and the lm_head in row chunks): a step
costs one pass over the weights, so ``auto`` on a multi-billion-parameter model takes minutes; a
``FILE`` is read in a moment.

The activations: :class:`Activations` holds each sample's hidden state at one layer boundary and moves it
forward through the float32 layers as the compile asks for later layers, so a layer piece gets the
inputs the *uncompressed* layers before it produce. That makes each layer's calibration a function of
the checkpoint and the text alone: the same for every stage count and for a stage compiled alone with
``--only-stage`` (which first runs the layers before it). Memory: one layer's weights plus
``samples x tokens x hidden`` floats.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ovshard import watchdog
from ovshard.bundle import names
from ovshard.bundle.stage import StageSpec
from ovshard.errors import ConfigError, PassError
from ovshard.frontend import int4_fit
from ovshard.frontend.onednn import OneDnnLinear
from ovshard.frontend.pieces import context_ports, matrix_rows
from ovshard.frontend.rope import rotary_tables
from ovshard.frontend.stage_module import Context, Weights, rms_norm, softcap_logits
from ovshard.frontend.trace import load_layer
from ovshard.ir.pass_manager import Piece

if TYPE_CHECKING:
    from ovshard.frontend.checkpoint import Checkpoint

log = logging.getLogger(__name__)

# Neutral openings for ``auto``: plain prose, code, a list, a dialogue; the model writes the rest.
PROMPTS = ("The", "Once upon a time,", "In this article we explain", "def main():", "1. First,",
           "Q: What is the capital of", "The history of", "Dear team,")
SHIPPED_TEXT = Path(__file__).with_name("calibration.txt")  # ``--calibration text``
SEED = 0
TEMPERATURE, TOP_K = 0.8, 40  # sampled, not greedy: greedy text of a small model repeats itself
MIN_TOKENS = 16


@dataclass(frozen=True)
class CalibrationText:
    """Token ids of the calibration samples and how they were made (recorded in the weight format)."""

    samples: tuple[tuple[int, ...], ...]
    source: str  # "auto" or "file NAME"

    @property
    def digest(self) -> str:
        """sha256 of the token ids: part of every calibrated piece's cache key and of the manifest."""
        return hashlib.sha256(repr(self.samples).encode()).hexdigest()[:16]


def calibration_text(ckpt: Checkpoint, source: str, samples: int, tokens: int, scratch: Path) -> CalibrationText:
    """``samples`` sequences of up to ``tokens`` token ids from ``source``: "auto", "text" (ovshard's own
    calibration text) or a text file's path."""
    if samples < 1 or tokens < MIN_TOKENS:
        raise ConfigError(f"--calibration-samples {samples} of {tokens} tokens: expected at least 1 sample of at "
                          f"least {MIN_TOKENS} tokens, e.g. --calibration-samples 4")
    tokenizer = _tokenizer(ckpt, scratch)
    bos = (ckpt.generation_config or {}).get("bos_token_id", ckpt.description.bos_token_id)
    if source == "auto":
        prompts = _prompts(tokenizer, bos, samples, ckpt.dims.vocab_size)
        return CalibrationText(_generate(ckpt, prompts, tokens, scratch), "auto")
    path = SHIPPED_TEXT if source == "text" else Path(source)
    if not path.is_file():
        raise ConfigError(f"--calibration {source}: no such file; give a UTF-8 text file, text (ovshard's own), "
                          "auto (the model's own text) or none")
    if tokenizer is None:
        raise ConfigError(f"--calibration {source}: {ckpt.path} has no tokenizer to read a text with; use "
                          "--calibration auto")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--calibration {source}: cannot read it as UTF-8 text ({e})") from e
    # verbose=False: the whole text is longer than the tokenizer's model_max_length by design (it is cut into samples
    # below), and transformers would warn that running it through the model as one sequence fails
    ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    if max(ids, default=0) >= ckpt.dims.vocab_size:
        raise ConfigError(f"--calibration {source}: the tokenizer beside {ckpt.path} gives token ids up to {max(ids)}, "
                          f"past the model's {ckpt.dims.vocab_size} embedding rows: it is not this model's tokenizer; "
                          "put the model's own beside it, or compile with --calibration none (data-free INT4)")
    step = tokens - (bos is not None)
    cut = [([bos] if bos is not None else []) + ids[k:k + step] for k in range(0, len(ids), step)]
    cut = [c for c in cut if len(c) >= MIN_TOKENS]
    if len(cut) > samples:  # taken evenly over the text, so each of its kinds is in the samples
        cut = [cut[i * len(cut) // samples] for i in range(samples)]
    if not cut:
        raise ConfigError(f"--calibration {source}: {len(ids)} tokens, fewer than one sample of {MIN_TOKENS}; "
                          "give a longer text")
    if len(cut) < samples:
        log.warning("--calibration %s: %d tokens make %d samples of %d tokens, not %d", source, len(ids), len(cut),
                    tokens, samples)
    return CalibrationText(tuple(tuple(c) for c in cut), "text" if source == "text" else f"file {path.name}")


def _tokenizer(ckpt: Checkpoint, scratch: Path):  # -> transformers tokenizer | None
    if not ckpt.has_tokenizer:
        return None
    from transformers import AutoTokenizer

    folder = ckpt.tokenizer_folder(scratch)
    return AutoTokenizer.from_pretrained(folder)


def _prompts(tokenizer, bos: int | None, samples: int, vocab: int) -> list[list[int]]:
    """Token ids of ``samples`` prompts: the neutral openings in turn, or (no tokenizer) BOS and one token."""
    rng = np.random.default_rng(SEED)
    out = []
    for k in range(samples):
        if tokenizer is not None:
            ids = list(tokenizer(PROMPTS[k % len(PROMPTS)], add_special_tokens=False)["input_ids"])
        else:
            ids = [int(rng.integers(0, min(256, vocab)))]
        out.append(([bos] if bos is not None else []) + ids)
    return out


def _all_layers(ckpt: Checkpoint) -> StageSpec:
    return StageSpec(0, 1, 0, ckpt.dims.num_layers)


class _Rows:
    """A 2-D checkpoint tensor as a float32 file in ``scratch``, written once in row chunks and read mapped:
    generation reads the lm_head at every step, and a file-backed map costs no anonymous memory (the bound
    of one layer), where dequantizing a GGUF table each step would cost seconds."""

    def __init__(self, ckpt: Checkpoint, scratch: Path) -> None:
        self.ckpt, self.scratch = ckpt, scratch
        self.files: dict[str, np.ndarray] = {}

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.files:
            rows, cols = self.ckpt.tensor_info(name)[1]
            self.scratch.mkdir(parents=True, exist_ok=True)
            path = self.scratch / f"{name}.f32"
            table = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, cols))
            for start, block in matrix_rows(self.ckpt, name, CHUNK_ROWS):
                table[start:start + block.shape[0]] = block
            table.flush()
            del table
            self.files[name] = np.load(path, mmap_mode="r")
        return self.files[name]


CHUNK_ROWS = 4096


def _embed(ckpt: Checkpoint, ids: np.ndarray, table: np.ndarray | None = None) -> torch.Tensor:
    """Embedding rows of ``ids`` [batch, seq] (times the family's scale): from ``table`` (a mapped copy of the
    embedding) or, without one, read from the checkpoint: only the rows used, a run of consecutive ids at once."""
    d, flat = ckpt.dims, ids.reshape(-1)
    if table is not None:
        out = np.asarray(table[flat], dtype=np.float32)
    else:
        used = np.unique(flat)  # sorted
        runs = np.split(used, np.flatnonzero(np.diff(used) != 1) + 1)
        rows = np.concatenate([ckpt.load_rows(ckpt.spec.embed, int(r[0]), int(r[-1]) + 1).numpy() for r in runs])
        out = rows[np.searchsorted(used, flat)]  # [tokens, hidden]
    h = torch.from_numpy(out.reshape(*ids.shape, d.hidden_size))
    return h if ckpt.block.embed_scale is None else h * torch.tensor(ckpt.block.embed_scale, dtype=h.dtype)


def _logits(ckpt: Checkpoint, h: torch.Tensor, head: np.ndarray) -> torch.Tensor:
    """The lm_head (``head``, mapped) on ``h`` [batch, hidden], a chunk of rows at a time."""
    normed = rms_norm(h, ckpt.load(ckpt.spec.final_norm), ckpt.dims.rms_norm_eps, ckpt.block.norm_offset)
    parts = [F.linear(normed, torch.from_numpy(np.array(head[a:a + CHUNK_ROWS], dtype=np.float32)))  # a copy
             for a in range(0, head.shape[0], CHUNK_ROWS)]
    return softcap_logits(torch.cat(parts, dim=-1), ckpt.block)


def _generate(ckpt: Checkpoint, prompts: list[list[int]], tokens: int,
              scratch: Path) -> tuple[tuple[int, ...], ...]:
    """Sample each prompt's continuation to ``tokens`` ids in all, as one left-padded batch, layer by layer."""
    d, blk = ckpt.dims, ckpt.block
    rows = _Rows(ckpt, scratch / "rows")
    embed = rows(ckpt.spec.embed)
    head = embed if ckpt.dims.tie_word_embeddings else rows(ckpt.spec.lm_head)
    stage, rng = _all_layers(ckpt), np.random.default_rng(SEED)
    context = Context(blk, stage.layers)
    tables = rotary_tables(ckpt.description, stage.layers, None)
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    past: list[torch.Tensor] = [torch.zeros(len(prompts), d.cache_heads, 0, dim) for _ in range(d.num_layers)
                                for dim in d.cache_dims]
    new, started = ids, time.perf_counter()
    log.info("calibration: the model writes %d samples of %d tokens (each token reads every layer once)",
             len(prompts), tokens)
    with torch.no_grad():
        for step in range(tokens - min(map(len, prompts))):  # until the shortest prompt has ``tokens``
            attention = torch.from_numpy(mask)
            positions = torch.clamp(attention.cumsum(-1) - 1, min=0)[:, -new.shape[1]:]
            values = context.build(tables, attention, positions)
            h = _embed(ckpt, new, embed)
            for i in stage.layers:
                one = Context(blk, range(i, i + 1))
                h, (past[2 * i], past[2 * i + 1]) = _layer(ckpt, i, h, _pick(context, one, values),
                                                           (past[2 * i], past[2 * i + 1]))
            logits = _logits(ckpt, h[:, -1], head).double() / TEMPERATURE
            top = torch.topk(logits, min(TOP_K, logits.shape[-1]), dim=-1)
            probs = torch.softmax(top.values, dim=-1).numpy()
            chosen = [int(top.indices[r, rng.choice(probs.shape[1], p=probs[r] / probs[r].sum())])
                      for r in range(len(prompts))]
            new = np.asarray(chosen, np.int64)[:, None]
            ids, mask = np.concatenate([ids, new], 1), np.concatenate([mask, np.ones_like(new)], 1)
            if (step + 1) % 16 == 0:
                log.info("calibration: token %d of %d (%.1f s)", step + 1 + min(map(len, prompts)), tokens,
                         time.perf_counter() - started)
                watchdog.beat(f"calibration: token {step + 1} of {tokens}")
    del embed, head, rows  # the mapped tables; their files go with the compile's scratch folder
    return tuple(tuple(int(t) for t, m in zip(row, keep, strict=True) if m)[:tokens]
                 for row, keep in zip(ids, mask, strict=True))


def _layer(ckpt: Checkpoint, i: int, h: torch.Tensor, values: list[torch.Tensor],
           past: tuple[torch.Tensor, torch.Tensor], weights: Weights | None = None,
           ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Decoder layer ``i`` in float32 on ``h`` (its ``weights``, or loaded for this call only): (h, its keys and
    values)."""
    weights = weights if weights is not None else load_layer(ckpt, i, _all_layers(ckpt))
    h, (k, v) = Context(ckpt.block, range(i, i + 1)).run_layers(ckpt.dims, [weights], h, values, past)
    return h, (k, v)


def _pick(whole: Context, one: Context, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """From the values ``whole`` built, those ``one`` (a sub-range of its layers) reads, in its order."""
    ropes, masks, scale = whole.split(values)
    picked = [t for key in one.ropes for t in ropes[key]]
    return picked + [masks[kind] for kind in one.masks] + ([scale] if one.tuned and scale is not None else [])


class Activations:
    """Each sample's hidden state at a layer boundary, moved forward through the float32 layers on demand.

    Called with a piece, returns NNCF's dataset for it: one dict of the piece's inputs per sample (its
    hidden state, the rotary and mask values its layers read, empty past keys and values); None for the
    embedding and the lm_head, which stay INT8 or are compressed data-free.

    :meth:`fit_int4` fits a decoder weight's INT4 scales to the inputs its matmul gets (``int4_fit``): those
    are caught while the float32 layer runs to move the samples on (``_Inputs``), once a layer, so the layer
    trace that feeds the next layer also gives this one's calibration.
    """

    def __init__(self, ckpt: Checkpoint, text: CalibrationText, max_positions: int | None = None) -> None:
        self.ckpt, self.text = ckpt, text
        self.at = 0
        self.hidden: list[torch.Tensor] = []
        self.tables = rotary_tables(ckpt.description, range(ckpt.dims.num_layers), max_positions)
        self.caught_layer: int | None = None  # the layer whose matmul inputs ``caught`` holds
        self.caught: dict[str, torch.Tensor] = {}  # projection ("q", "down") -> its inputs [tokens, in]
        self.moments: dict[tuple[int, int], torch.Tensor] = {}  # (id of the inputs, group) -> second moments
        self.lent: dict[int, Weights] = {}  # layer -> its float32 weights, loaded by the piece's trace (lend)
        self.table_moments: dict[int, torch.Tensor] = {}  # group -> second moments of the lm_head's inputs

    def weights(self, layer: int) -> Weights | None:
        return None  # never loaded ahead: the trace loads each layer and lends it (``lend``)

    def lend(self, first: int, weights: Sequence[Weights]) -> None:
        """Layers ``first`` ...'s float32 weights, loaded for their trace: :meth:`catch` reads them, not the file."""
        self.lent = {first + k: w for k, w in enumerate(weights)}

    def fit_int4(self, key: str, weight: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
        """INT4 codes and f16 scales of decoder weight ``key`` (``"3.down"``), fitted to its calibration inputs;
        experts stacked [experts, out, in] each to the inputs of the tokens routed to it (an expert no token chose:
        the data-free min-max scale)."""
        layer, projection = key.split(".")
        if self.caught_layer != int(layer):
            self.catch(int(layer))
        if weight.ndim == 3:
            fitted = [self._fit(f"{projection}[{e}]", weight[e], group) for e in range(weight.shape[0])]
            return np.stack([c for c, _ in fitted]), np.stack([s for _, s in fitted])
        if projection not in self.caught:
            raise PassError(f"the scale fit of layer {layer}'s {projection} weight needs the inputs of its matmul, and "
                            f"the float32 run of layer {layer} read no such weight through F.linear (it caught the "
                            f"inputs of {', '.join(sorted(self.caught)) or 'none'}): compile with --calibration none "
                            "(data-free INT4) and report the model, whose layer reads that weight another way")
        return self._fit(projection, weight, group)

    def fit_table(self, weight: np.ndarray, group: int, asym: bool = False) -> tuple[np.ndarray, ...]:
        """INT4 codes and f16 scales (asymmetric: codes, zero points, scales) of rows of the lm_head (or the
        embedding tied to it), fitted to the lm_head's inputs: every sample run through every float32 layer (once;
        for the first stage's embedding, before its layers, which then start again from the embedding) and the
        final norm."""
        if group not in self.table_moments:
            d, blk = self.ckpt.dims, self.ckpt.block
            self._move_to(d.num_layers)
            norm = self.ckpt.load(self.ckpt.spec.final_norm)
            with torch.no_grad():
                inputs = torch.cat([rms_norm(h, norm, d.rms_norm_eps, blk.norm_offset).reshape(-1, d.hidden_size)
                                    for h in self.hidden])
            self.table_moments[group] = int4_fit.second_moments(inputs, group)
            watchdog.beat("calibration: the lm_head's inputs kept")
        rows = torch.from_numpy(np.array(weight, np.float32))
        fitted = (int4_fit.fit_asym if asym else int4_fit.fit)(rows, self.table_moments[group])
        return tuple(t.numpy() for t in fitted)

    def _fit(self, projection: str, weight: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
        inputs = self.caught.get(projection)
        if inputs is None:  # an expert no calibration token was routed to
            codes, scales = int4_fit.minmax(int4_fit.read_only(weight), group)
            return codes.numpy(), scales.numpy()
        return int4_fit.fit_inputs(inputs, weight, group, self.moments)

    def catch(self, layer: int, each: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """Run ``layer`` on every sample, keeping its matmuls' inputs, and move the samples past it. Where the samples
        make one batch, ``each`` gets each weight's projection and inputs [tokens, in] as its matmul runs."""
        self._move_to(layer)
        self.caught, self.moments, self.caught_layer = {}, {}, None
        weights = self._weights(layer)
        catch = _Inputs(weights, each if len({h.shape[1] for h in self.hidden}) == 1 else None)
        with torch.no_grad():
            self._forward(layer, weights, catch)
        self.caught, self.caught_layer, self.at = catch.inputs(), layer, layer + 1
        watchdog.beat(f"calibration: layer {layer} run in float32, its matmul inputs kept")

    def _weights(self, layer: int) -> Weights:
        """Layer ``layer``'s float32 weights: those lent by its piece's trace, else read from the checkpoint."""
        lent = self.lent.pop(layer, None)
        return lent if lent is not None else load_layer(self.ckpt, layer, _all_layers(self.ckpt))

    def __call__(self, piece: Piece) -> list[dict[str, np.ndarray]] | None:
        if piece.kind != "layers" or piece.start is None or piece.end is None:
            return None
        self._move_to(piece.start)
        layers = range(piece.start, piece.end)
        d = self.ckpt.dims
        items = []
        ports = [name for name, _, _ in context_ports(self.ckpt, layers)]
        for h in self.hidden:
            item = {names.piece_hidden(piece.start): h.numpy()}
            item.update(zip(ports, (v.numpy() for v in self._context(layers, h.shape[1])), strict=True))
            item.update({past: np.zeros((1, d.cache_heads, 0, d.cache_dims[n % 2]), np.float32)
                         for n, (past, _) in enumerate(names.kv_pairs(layers))})
            items.append(item)
        return items

    def _forward(self, i: int, weights: Weights, catch: _Inputs | None = None) -> None:
        """Every sample through layer ``i`` (its ``weights``), the samples of one length as one batch: one matmul of
        a thousand rows runs ~3x faster than eight of 128 on 2 cores. Its matmuls run through oneDNN (``onednn``),
        every run of a layer alike; ``catch``, inside that, sees each ``F.linear`` first."""
        d = self.ckpt.dims
        out: list[torch.Tensor] = list(self.hidden)
        by_length: dict[int, list[int]] = {}
        for n, h in enumerate(self.hidden):
            by_length.setdefault(h.shape[1], []).append(n)
        for length, rows in by_length.items():
            batch = torch.cat([self.hidden[n] for n in rows])  # [samples, seq, hidden]
            key_dim, value_dim = d.cache_dims
            empty = torch.zeros(len(rows), d.cache_heads, 0, key_dim), torch.zeros(len(rows), d.cache_heads, 0, value_dim)
            with OneDnnLinear(), catch if catch is not None else contextlib.nullcontext():
                h = _layer(self.ckpt, i, batch, self._context(range(i, i + 1), length), empty, weights)[0]
            for k, n in enumerate(rows):
                out[n] = h[k:k + 1]
        self.hidden = out

    def _context(self, layers: range, length: int) -> list[torch.Tensor]:
        mask = torch.ones(1, length, dtype=torch.int64)
        positions = torch.arange(length, dtype=torch.int64)[None]
        tables = {key: self.tables[key] for key in Context(self.ckpt.block, layers).ropes}
        return Context(self.ckpt.block, layers).build(tables, mask, positions)

    def _move_to(self, layer: int) -> None:
        if layer < self.at or not self.hidden:  # from the start: the embedding of every sample
            flat = _embed(self.ckpt, np.concatenate([np.asarray(s, np.int64) for s in self.text.samples])[None])
            bounds = np.cumsum([0, *map(len, self.text.samples)])
            self.hidden = [flat[:, a:z].clone() for a, z in itertools.pairwise(bounds)]  # one pass for all
            self.at = 0
        if layer > self.at:
            log.info("calibration: running layers [%d, %d) in float32 for the inputs of layer %d", self.at, layer,
                     layer)
        with torch.no_grad():
            while self.at < layer:
                i = self.at
                weights = self._weights(i)  # once for every sample
                self._forward(i, weights)
                del weights
                self.at += 1
                watchdog.beat(f"calibration: layer {i} run in float32")


class _Inputs(TorchFunctionMode):
    """Inside it, every ``F.linear`` whose weight is one of a layer's keeps its input, by projection."""

    def __init__(self, weights: Weights, each: Callable[[str, torch.Tensor], None] | None = None) -> None:
        super().__init__()
        self.each = each
        self.flat: dict[int, torch.Tensor] = {}  # id of an input -> it as [tokens, in], one for all that read it
        self.names = {id(t): name.removesuffix("_weight") for name, t in weights.named_buffers()
                      if name.endswith("_weight") and t.dim() == 2}
        self.experts = {t[e].data_ptr(): f"{name.removesuffix('_weight')}[{e}]" for name, t in weights.named_buffers()
                        if name.endswith("_weight") and t.dim() == 3 for e in range(t.shape[0])}  # an expert's slice
        self.seen: dict[str, list[torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            name = self.names.get(id(weight)) or self.experts.get(weight.data_ptr())  # "down", "experts_down[3]"
            if name is not None:
                self.seen.setdefault(name, []).append(args[0])  # held: projections reading it are told by identity
                if self.each is not None:
                    self.each(name, self.flat.setdefault(id(args[0]), args[0].reshape(-1, args[0].shape[-1])))
        return func(*args, **kwargs)

    def inputs(self) -> dict[str, torch.Tensor]:
        """Projection -> its inputs over every sample [tokens, in]; projections that read the same input (q, k
        and v; gate and up) share one tensor."""
        joined: dict[int, torch.Tensor] = {}
        out = {}
        for name, parts in self.seen.items():
            if id(parts[0]) not in joined:
                joined[id(parts[0])] = torch.cat([x.reshape(-1, x.shape[-1]) for x in parts])
            out[name] = joined[id(parts[0])]
        return out
