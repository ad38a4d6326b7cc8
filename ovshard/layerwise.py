"""Streamed stage build: peak memory of one layer, not of a stage.

Each piece of a stage (the embedding in row chunks, the prologue, one decoder layer at a time, the final
norm, the lm_head in row chunks) is traced on its own and run through the pipeline's layer-scoped passes
(weight compression); a finished piece is written to disk and read back memory-mapped, so its weights are
file-backed and the next layer starts from an empty heap. The pieces are then joined into one stage graph
(``ovshard.ir.splice``), which the stage-scoped passes rewrite as in a whole-stage compile. The result
computes exactly what the whole-stage trace computes, with the same per-weight formats.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import openvino as ov

from ovshard import watchdog
from ovshard.bundle import names, schema, staging
from ovshard.bundle.manifest import PassRecord
from ovshard.bundle.stage import StageSpec
from ovshard.cache import PieceCache, piece_key
from ovshard.errors import PassError
from ovshard.frontend import pieces
from ovshard.frontend.checkpoint import Checkpoint
from ovshard.frontend.tensors import layer_tensors
from ovshard.frontend.trace import load_layer
from ovshard.ir.pass_manager import Calibration, GraphPass, Instrument, PassContext, PassManager, Piece
from ovshard.ir.splice import Assembler, RowSplicer
from ovshard.report import LayerProgress

log = logging.getLogger(__name__)


@dataclass
class _Totals:
    """The layer-scoped passes' records summed over the pieces of a stage."""

    seconds: dict[str, float] = field(default_factory=dict)
    modified: dict[str, bool] = field(default_factory=dict)

    def add(self, records: list[PassRecord]) -> None:
        for r in records:
            self.seconds[r.name] = self.seconds.get(r.name, 0.0) + r.seconds
            self.modified[r.name] = self.modified.get(r.name, False) or r.modified


@dataclass
class StageBuild:
    """Everything one streamed stage build needs."""

    ckpt: Checkpoint
    stage: StageSpec
    passes: list[GraphPass]
    instruments: list[Instrument]
    max_positions: int
    scratch: Path  # pieces and chunk buffers; the caller deletes it after saving the stage
    keep_raw: bool = False  # also join the uncompressed pieces, for the 00_input dump
    cache: PieceCache | None = None  # compiled pieces by content; None: build every piece
    piece_bytes: int = 16 << 20  # layers are grouped into one piece up to this many bytes of f32 weights
    totals: _Totals = field(default_factory=_Totals)
    buffers: list = field(default_factory=list)  # chunk splicers' file-backed buffers: the graph's weights
    last_records: list[PassRecord] = field(default_factory=list)  # of the piece built last
    calibration: Calibration | None = None  # a piece's calibration inputs (PassContext)
    progress: LayerProgress | None = None  # the whole compile's layers: one line a layer piece
    core: ov.Core = field(default_factory=ov.Core)

    @property
    def layer_passes(self) -> list[GraphPass]:
        found = [p for p in self.passes if p.scope == "layer"]
        if self.passes[:len(found)] != found:
            raise PassError(f"layer-scoped passes {[p.name for p in found]} must come first in the pipeline "
                            f"{[p.name for p in self.passes]}: a streamed compile runs them before joining")
        return found


def build_stage(b: StageBuild) -> tuple[ov.Model, list[PassRecord]]:
    """The stage graph after the whole pipeline, and its pass log; peak memory is about one layer's."""
    stage, dims = b.stage, b.ckpt.dims
    joined, raw = Assembler(), Assembler() if b.keep_raw else None
    if stage.first:
        weight = _matrix(b, b.ckpt.spec.embed, pieces.embedding_chunk, Piece("embedding"), joined, raw)
        if b.ckpt.block.embed_scale is not None:
            for asm in filter(None, (joined, raw)):
                asm.add(pieces.embed_scale_piece(b.ckpt))
    else:
        for asm in filter(None, (joined, raw)):
            _stage_input(asm, names.piece_hidden(stage.start), dims.hidden_size)
    for asm in filter(None, (joined, raw)):
        asm.add(pieces.prologue_piece(b.ckpt, stage, b.max_positions))
    progress = b.progress or LayerProgress(len(stage.layers))  # the rate of the layers alone, not the embedding's
    for a, z in layer_groups(b.ckpt, stage, b.piece_bytes):
        began = time.perf_counter()
        piece = Piece("layers", a, z)
        _add_piece(b, functools.partial(_trace_layers, b, a, z), piece, joined, raw, f"layers_{a}_{z}")
        log.info("stage %d: %s done in %.1f s; %s", stage.index, piece, time.perf_counter() - began,
                 progress.add(z - a, time.perf_counter() - began))
        watchdog.beat(f"stage {stage.index}: {piece} compiled")
    if stage.last:
        for asm in filter(None, (joined, raw)):
            asm.add(pieces.final_norm_piece(b.ckpt))
        if dims.tie_word_embeddings and stage.first:  # one constant feeds the embedding and the lm_head
            _tied_head(b, joined, weight[0])
            if raw is not None:
                _tied_head(b, raw, weight[1])
        else:
            _matrix(b, head_tensor(b.ckpt), pieces.head_chunk, HEAD, joined, raw)
        if b.ckpt.block.final_softcap is not None:
            for asm in filter(None, (joined, raw)):
                asm.add(pieces.softcap_piece(b.ckpt))
    return _finish(b, joined, raw)


HEAD = Piece("head")


def layer_groups(ckpt: Checkpoint, stage: StageSpec, piece_bytes: int) -> list[tuple[int, int]]:
    """The stage's layers in consecutive groups of at most ``piece_bytes`` of f32 weights (at least one layer
    each): small layers share a trace and a compression call, large ones go one at a time."""
    groups, start, held = [], stage.start, 0
    for i in stage.layers:
        size = 4 * sum(math.prod(s) for s in layer_tensors(ckpt.spec, ckpt.dims, i).values())
        if i > start and held + size > piece_bytes:
            groups.append((start, i))
            start, held = i, 0
        held += size
    groups.append((start, stage.end))
    return groups


def head_tensor(ckpt: Checkpoint) -> str:
    return ckpt.spec.embed if ckpt.dims.tie_word_embeddings else ckpt.spec.lm_head


def _stage_input(asm: Assembler, alias: str, hidden: int) -> None:
    param = ov.opset13.parameter(ov.PartialShape([-1, -1, hidden]), ov.Type.f32, name=names.HIDDEN_STATES)
    param.output(0).get_tensor().set_names({names.HIDDEN_STATES})
    asm.parameters[names.HIDDEN_STATES] = param
    asm.provide(alias, param.output(0))


def embedding_output(ckpt: Checkpoint) -> str:
    """What the embedding's row chunks produce: the first layer's input, or the rows before Gemma's scale."""
    return names.piece_hidden(0) if ckpt.block.embed_scale is None else names.PIECE_EMBEDDED


def head_output(ckpt: Checkpoint) -> str:
    """What the lm_head produces: the logits, or the logits before Gemma 2's soft-capping."""
    return names.LOGITS if ckpt.block.final_softcap is None else names.PIECE_HEAD


def _tied_head(b: StageBuild, asm: Assembler, weight: ov.Output) -> None:
    logits = ov.opset13.matmul(asm.produced[names.PIECE_NORMED], weight, transpose_a=False, transpose_b=True)
    name = head_output(b.ckpt)
    logits.output(0).get_tensor().set_names({name})
    asm.provide(name, logits.output(0))


def _trace_layers(b: StageBuild, a: int, z: int) -> ov.Model:
    """Layers [a, z) traced. A calibrated compile lends their float32 weights, which the traced graph's constants
    share, to its float32 runs of the layers (``Calibration.lend``): read once, held once."""
    weights = []
    for i in range(a, z):
        held = b.calibration.weights(i) if b.calibration is not None else None  # loaded ahead by the calibration
        weights.append(held if held is not None else load_layer(b.ckpt, i, b.stage))
    if b.calibration is not None:
        b.calibration.lend(a, weights)
    return pieces.layers_piece(b.ckpt, a, z, b.stage, weights)


def _run_layer_passes(b: StageBuild, model: ov.Model, piece: Piece) -> ov.Model:
    ctx = PassContext(b.stage, b.ckpt.dims, b.max_positions, piece=piece, calibration=b.calibration)
    try:
        model, records = PassManager(b.layer_passes).run(model, ctx)
    finally:
        if b.calibration is not None:
            b.calibration.lend(0, [])  # the piece is done with: its weights go with its graph
    b.totals.add(records)
    b.last_records = records
    return model


def _persist(b: StageBuild, model: ov.Model, name: str) -> ov.Model:
    """Write a finished piece and read it back: its weights become file-backed (mapped), the heap is freed."""
    path = b.scratch / f"{name}.xml"
    b.scratch.mkdir(parents=True, exist_ok=True)
    staging.save_model(model, path)
    del model
    gc.collect()
    return b.core.read_model(path)


def _piece_facts(b: StageBuild, piece: Piece, tensors: list[str]) -> dict:
    """Everything that decides a piece's bytes, for its cache key (code and library versions are added)."""
    return {"piece": schema.encode(piece), "tensors": {n: b.ckpt.tensor_digest(n) for n in tensors},
            "dims": schema.encode(b.ckpt.dims), "block": schema.encode(b.ckpt.block), "passes": [(p.name, repr(vars(p))) for p in b.layer_passes]}


def _cached(b: StageBuild, piece: Piece, tensors: list[str], build: Callable[[], ov.Model]) -> ov.Model:
    """``build()`` (a piece through the layer passes), or the same piece from the cache."""
    if b.cache is None:
        return build()
    built = False

    def compile_piece() -> tuple[ov.Model, list[dict]]:
        nonlocal built
        built, model = True, build()
        return model, [{"name": r.name, "modified": r.modified, "seconds": r.seconds} for r in b.last_records]

    found = b.cache.get_or_build(piece_key(_piece_facts(b, piece, tensors)), compile_piece, str(piece))
    if not built:  # from the cache: its passes ran in no time here
        b.totals.add([PassRecord(b.stage.index, r["name"], r["modified"], 0.0) for r in found.records])
    return found.model


def _add_piece(b: StageBuild, trace: Callable[[], ov.Model], piece: Piece, joined: Assembler,
               raw: Assembler | None, name: str) -> None:
    if raw is not None:  # dumping: no cache, keep the traced piece too
        model = trace()
        raw.add(_persist(b, model.clone(), f"{name}.raw"))
        joined.add(_persist(b, _run_layer_passes(b, model, piece), name))
        return
    tensors = [n for i in range(piece.start or 0, piece.end or 0) for n in layer_tensors(b.ckpt.spec, b.ckpt.dims, i)]
    joined.add(_cached(b, piece, tensors, lambda: _persist(b, _run_layer_passes(b, trace(), piece), name)))


def _matrix(b: StageBuild, tensor: str, chunk_model: Callable, piece: Piece, joined: Assembler,
            raw: Assembler | None) -> tuple[ov.Output, ov.Output | None]:
    """The embedding or lm_head piece, compressed in row chunks; returns its weight (and the raw one)."""
    if raw is not None:
        models = _matrix_models(b, tensor, chunk_model, piece, with_raw=True)
        joined.add(models[""])
        raw.add(models["raw"])
        return _weight_of(models[""], piece), _weight_of(models["raw"], piece)
    model = _cached(b, piece, [tensor], lambda: _matrix_models(b, tensor, chunk_model, piece, with_raw=False)[""])
    joined.add(model)
    return _weight_of(model, piece), None


def _weight_of(model: ov.Model, piece: Piece) -> ov.Output:
    consumer = model.get_results()[0].input_value(0).get_node()  # the Gather or the MatMul
    return consumer.input_value(0 if piece.kind == "embedding" else 1)


def _matrix_models(b: StageBuild, tensor: str, chunk_model: Callable, piece: Piece,
                   with_raw: bool) -> dict[str, ov.Model]:
    rows, cols = b.ckpt.tensor_info(tensor)[1]
    chunk = pieces.chunk_rows(rows, cols)
    splicers = {"": RowSplicer(rows, b.scratch, f"{piece.kind}")}
    if with_raw:
        splicers["raw"] = RowSplicer(rows, b.scratch, f"{piece.kind}.raw")
    first: dict[str, ov.Model] = {}
    log.info("stage %d: %s from %s in chunks of %d rows", b.stage.index, piece, tensor, chunk)
    for start, block in pieces.matrix_rows(b.ckpt, tensor, chunk):
        for key, splicer in splicers.items():
            model, _ = chunk_model(block)
            if key == "":
                model = _run_layer_passes(b, model, piece)
            splicer.add(start, _weight_of(model, piece))
            first.setdefault(key, model)
            watchdog.beat(f"stage {b.stage.index}: {piece}, rows from {start} compiled")
        del block
    for key, splicer in splicers.items():
        splicer.finish()
        b.buffers.append(splicer.buffers)  # the joined weight's constants share these buffers' memory
        model = first[key]
        model.validate_nodes_and_infer_types()
        model.outputs[0].get_tensor().set_names(
            {embedding_output(b.ckpt) if piece.kind == "embedding" else head_output(b.ckpt)})
    return first


def _finish(b: StageBuild, joined: Assembler, raw: Assembler | None) -> tuple[ov.Model, list[PassRecord]]:
    stage = b.stage
    inputs = [names.INPUT_IDS if stage.first else names.HIDDEN_STATES, names.ATTENTION_MASK, names.POSITION_IDS]
    inputs += [p for p, _ in names.kv_pairs(stage.layers)]
    final = (names.LOGITS, names.LOGITS) if stage.last else (names.piece_hidden(stage.end), names.HIDDEN_STATES)
    outputs = [final] + [(present, present) for _, present in names.kv_pairs(stage.layers)]
    title = f"stage_{stage.index}"
    model = joined.model(inputs, outputs, title)
    start_model = raw.model(inputs, outputs, title) if raw is not None else model
    done = {name: (model, PassRecord(stage.index, name, b.totals.modified.get(name, False),
                                     round(seconds, 4)))
            for name, seconds in b.totals.seconds.items()}
    for p in b.layer_passes:  # a layer pass no piece needed (e.g. nothing to compress) still has a record
        done.setdefault(p.name, (model, PassRecord(stage.index, p.name, False, 0.0)))
    ctx = PassContext(stage, b.ckpt.dims, b.max_positions)
    return PassManager(b.passes, b.instruments).run(start_model, ctx, done=done)


# ----- parallel piece builds ---------------------------------------------------------------------------

PROCESS_BYTES = 1 << 30  # a compile process before it holds any weights: Python, torch, OpenVINO, NNCF
WORK_FACTOR = 4.0  # a layer's f32 weights, times this: torch's copy, OpenVINO's, NNCF's temporaries


@dataclass(frozen=True)
class Job:
    """One piece for a worker process to compile into the cache."""

    stage: StageSpec
    piece: Piece
    tensor: str | None = None  # the matrix of an embedding or head piece


def layer_work_bytes(ckpt: Checkpoint, i: int) -> int:
    """About what compiling decoder layer ``i`` holds at its peak, beyond the process itself."""
    shapes = layer_tensors(ckpt.spec, ckpt.dims, i).values()
    return int(WORK_FACTOR * 4 * sum(math.prod(s) for s in shapes))


def plan_jobs(ckpt: Checkpoint, stages: tuple[StageSpec, ...], jobs: int, max_memory: int | None) -> int:
    """How many pieces to compile at once within ``max_memory``; PlanError if one layer alone does not fit.

    With a cap, a job holds one layer (``piece_bytes_within``); without one, jobs as asked."""
    from ovshard.bundle.plan import format_bytes
    from ovshard.errors import PlanError

    layer = max(layer_work_bytes(ckpt, i) for s in stages for i in s.layers)
    if max_memory is None:
        return max(1, jobs)
    if PROCESS_BYTES + layer > max_memory:
        raise PlanError(f"--max-memory {format_bytes(max_memory)} cannot hold one layer of this model: compiling "
                        f"a layer needs about {format_bytes(PROCESS_BYTES + layer)} ({format_bytes(layer)} for its "
                        f"weights and the compressor's work, {format_bytes(PROCESS_BYTES)} for the process); raise "
                        "--max-memory or compile on a larger machine")
    fit = int((max_memory - PROCESS_BYTES) // (PROCESS_BYTES + layer))  # the main process joins the stages
    chosen = max(1, min(jobs, fit))
    if chosen < jobs:
        log.warning("--jobs %d: %s fits %d at a time (about %s a layer job); using %d", jobs,
                    format_bytes(max_memory), chosen, format_bytes(PROCESS_BYTES + layer), chosen)
    return chosen


def piece_bytes_within(max_memory: int | None, default: int) -> int:
    """The layer group size that keeps one job within ``max_memory`` (one layer a piece at the least)."""
    if max_memory is None:
        return default
    return max(1, min(default, int((max_memory - PROCESS_BYTES) / WORK_FACTOR)))


def prebuild(checkpoint: Path, stages: tuple[StageSpec, ...], passes_of: Callable[[], list[GraphPass]],
             max_positions: int, cache_root: Path, scratch: Path, jobs: int, piece_bytes: int) -> None:
    """Compile every piece of ``stages`` into the cache with ``jobs`` worker processes (largest first)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ovshard.frontend.source import open_source

    ckpt = open_source(checkpoint)
    work: list[Job] = []
    for s in stages:
        if s.first:
            work.append(Job(s, Piece("embedding"), ckpt.spec.embed))
        work += [Job(s, Piece("layers", a, z)) for a, z in layer_groups(ckpt, s, piece_bytes)]
        if s.last and not (ckpt.dims.tie_word_embeddings and s.first):
            work.append(Job(s, HEAD, head_tensor(ckpt)))
    log.info("compiling %d pieces in %d worker processes", len(work), jobs)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_job, checkpoint, job, passes_of, max_positions, cache_root, scratch / f"job{n}",
                               piece_bytes) for n, job in enumerate(work)]
        for done, future in enumerate(futures, start=1):
            future.result()
            log.info("pieces compiled: %d of %d", done, len(work))
            watchdog.beat(f"{done} of {len(work)} pieces compiled in worker processes")


def _job(checkpoint: Path, job: Job, passes_of: Callable[[], list[GraphPass]], max_positions: int,
         cache_root: Path, scratch: Path, piece_bytes: int) -> None:
    from ovshard.frontend.source import open_source
    from ovshard.memory import return_freed_blocks

    return_freed_blocks()  # as in the main process (ovshard.compile.compile_bundle)
    with watchdog.no_telemetry(), watchdog.one_blas_thread():  # as in the main process: no fork, no BLAS threads
        _job_piece(open_source(checkpoint), job, passes_of, max_positions, cache_root, scratch, piece_bytes)


def _job_piece(ckpt: Checkpoint, job: Job, passes_of: Callable[[], list[GraphPass]], max_positions: int,
               cache_root: Path, scratch: Path, piece_bytes: int) -> None:
    b = StageBuild(ckpt, job.stage, passes_of(), [], max_positions, scratch, cache=PieceCache(cache_root),
                   piece_bytes=piece_bytes)
    joined = Assembler()
    if job.piece.kind == "layers" and job.piece.start is not None and job.piece.end is not None:
        a, z = job.piece.start, job.piece.end
        _add_piece(b, lambda: pieces.layers_piece(ckpt, a, z, job.stage), job.piece, joined, None, f"layers_{a}_{z}")
    elif job.tensor is not None:
        chunk = pieces.embedding_chunk if job.piece.kind == "embedding" else pieces.head_chunk
        _matrix(b, job.tensor, chunk, job.piece, joined, None)
