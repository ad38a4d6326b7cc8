"""``ovshard compile``: checkpoint -> plan -> per stage (trace, passes, save) -> bundle, atomically.

Stages are compiled one after another and each stage's tensors, torch module and graph are freed
before the next starts, so peak memory follows the largest stage, not the model. What a compile is
asked to do, and the checks on it, are compile_config.py's (re-exported here).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path

import openvino as ov

from ovshard import watchdog
from ovshard.bundle import names, schema, staging
from ovshard.bundle.dims import ModelDims
from ovshard.bundle.manifest import (
    CPU_PLUGIN_BY_ISA_MEASURED,
    CPU_PLUGIN_HINTS,
    CPU_PLUGIN_HINTS_BY_ISA,
    CPU_PLUGIN_MEASURED,
    DQ_WITHIN_GROUPS_MEASURED,
    Chat,
    Generation,
    Manifest,
    PassRecord,
    RuntimeHints,
    Source,
    StageEntry,
    TensorSpec,
    TokenizerFiles,
    sha256_file,
    within_weight_groups,
)
from ovshard.bundle.plan import PartitionPlan
from ovshard.bundle.stage import StageSpec
from ovshard.bundle.weights import DEFAULT_DATA_AWARE, DEFAULT_DATA_AWARE_ASYM, OWN_FIT, WeightFormat
from ovshard.cache import PieceCache, tokenizer_key
from ovshard.compile_config import (
    CompileConfig,
    DumpOptions,
    check_calibration,
    default_calibration,
    source_weights,
)
from ovshard.errors import BundleError, ConfigError, PlanError
from ovshard.frontend.calibration import Activations, calibration_text
from ovshard.frontend.checkpoint import Checkpoint
from ovshard.frontend.fit_ahead import FitAhead
from ovshard.frontend.source import open_source
from ovshard.frontend.trace import trace_stage
from ovshard.ir.instruments import (
    DumpInstrument,
    PrintAfterChangeInstrument,
    ProgressInstrument,
    ValidateInstrument,
)
from ovshard.ir.naming import stable_names
from ovshard.ir.pass_manager import GraphPass, Instrument, PassContext, PassManager
from ovshard.layerwise import StageBuild, build_stage, piece_bytes_within, plan_jobs, prebuild
from ovshard.memory import PeakSampler, libraries_spared_from_gc, return_freed_blocks
from ovshard.passes import pipeline
from ovshard.plan.costs import model_costs, rotary_table_bytes
from ovshard.plan.partition import plan_balanced, plan_budgets, plan_layers
from ovshard.plan.precision import choose_int8, int4_groups
from ovshard.report import LayerProgress, StageFigures, format_report, stage_done
from ovshard.verify.predict import PredictFusionInstrument

log = logging.getLogger(__name__)

__all__ = ["PREDICTED_DEVICES", "CompileConfig", "DumpOptions", "compile_bundle", "compile_stage", "make_plan"]

PREDICTED_DEVICES = ("CPU", "GPU")  # the static fusion predictor runs for these after every stage
# the longest context compiled when --max-positions is left out and the checkpoint declares more (Llama 4 Scout:
# 10,485,760, whose f32 rotary tables would take 10.7 GB in every stage): Llama 3.1's 128K
DEFAULT_POSITIONS_CAP = 131_072
CHAT_RECORD = ".chat.json"  # the chat template's record beside a converted tokenizer, in the cache; never in a bundle


def _calibrate(config: CompileConfig, ckpt: Checkpoint, workdir: Path,
               max_positions: int) -> tuple[CompileConfig, Activations | FitAhead | None]:
    """With --calibration: the text, recorded in the weight format, and the activations the layers read."""
    if config.calibration == "default":
        config = replace(config, calibration=default_calibration(config, ckpt))
        check_calibration(config)
    if config.calibration == "none":
        return config, None
    text = calibration_text(ckpt, config.calibration, config.calibration_samples, config.calibration_tokens,
                            workdir / ".pieces" / "calibration")
    log.info("calibration: %d samples (%s), %d tokens in all, sha256 %s", len(text.samples), text.source,
             sum(map(len, text.samples)), text.digest)
    default = DEFAULT_DATA_AWARE if config.weights.mode == "int4_sym" else DEFAULT_DATA_AWARE_ASYM
    weights = replace(config.weights, methods=config.weights.methods or default, calibration=text.source,
                      calibration_digest=text.digest)
    if config.jobs > 1:
        log.warning("--jobs %d: a calibrated compile builds its layers one after another (each reads the "
                    "activations of the layers before it); using 1", config.jobs)
    activations = Activations(ckpt, text, max_positions)
    # the scale fit's work runs beside the layer's conversion (ovshard.frontend.fit_ahead)
    return replace(config, weights=weights, jobs=1), (FitAhead(activations, weights) if OWN_FIT in weights.methods
                                                      else activations)


def served_positions(config: CompileConfig, ckpt: Checkpoint) -> int:
    """The rotary tables' length, the longest context the bundle serves: ``--max-positions``, else the checkpoint's
    ``max_position_embeddings`` up to DEFAULT_POSITIONS_CAP (said when it cuts)."""
    declared = ckpt.dims.max_position_embeddings
    if config.max_positions or declared <= DEFAULT_POSITIONS_CAP:
        return config.max_positions or declared
    model = ckpt.description
    tables = rotary_table_bytes(len(model.rope), model.block.rotary_dim, declared)
    log.warning("the checkpoint declares %s positions, whose rotary tables would take %.1f GB in every stage; "
                "compiling for %s (--max-positions N serves a longer context)", f"{declared:,}", tables / 1e9,
                f"{DEFAULT_POSITIONS_CAP:,}")
    return DEFAULT_POSITIONS_CAP


def make_plan(config: CompileConfig, ckpt: Checkpoint) -> PartitionPlan:
    model = ckpt.description
    positions = config.max_positions or model.dims.max_position_embeddings
    rotary = rotary_table_bytes(len(model.rope), model.block.rotary_dim, positions)
    reach = [model.block.window(kind) or model.block.chunk(kind) for kind in model.block.layer_types]
    costs = model_costs(model.arch, model.dims, config.weights, stage_bytes=rotary, reach=reach)
    read_context = min(config.context_tokens, positions)  # a step's KV reads: no sequence outgrows the positions
    if config.layers is not None:
        return plan_layers(costs, config.layers, config.context_tokens)
    if config.budgets is not None:
        return plan_budgets(costs, config.budgets, config.context_tokens, config.balance, read_context)
    return plan_balanced(costs, config.stages or 1, config.context_tokens, config.balance, read_context)


def _instruments(config: CompileConfig) -> list[Instrument]:
    found: list[Instrument] = [ValidateInstrument(), ProgressInstrument(), PredictFusionInstrument(PREDICTED_DEVICES)]
    d = config.dumps
    if config.dumping and d.dump_dir is not None:
        found.append(DumpInstrument(d.dump_dir, after=d.after, before=d.before, with_ir=d.with_ir))
    if d.print_after_change is not None:
        found.append(PrintAfterChangeInstrument(d.print_after_change))
    return found


def compile_stage(ckpt: Checkpoint, stage: StageSpec, config: CompileConfig, max_positions: int,
                  workdir: Path, calibration: Activations | FitAhead | None = None,
                  progress: LayerProgress | None = None) -> tuple[StageEntry, list[PassRecord]]:
    """Build one stage (streamed or whole), save it; free everything before returning."""
    start = time.perf_counter()
    log.info("stage %d (%d of %d): layers [%d, %d), %s", stage.index, stage.index + 1, stage.num_stages,
             stage.start, stage.end, "streamed" if config.streamed else "traced whole")
    scratch = workdir / ".pieces" / f"stage{stage.index}"
    if config.streamed:
        build = StageBuild(ckpt, stage, config.passes(), _instruments(config), max_positions, scratch,
                           keep_raw=config.dumping, cache=_piece_cache(config, workdir),
                           piece_bytes=_piece_bytes(config), calibration=calibration, progress=progress)
        model, records = build_stage(build)
    else:
        build = None
        model = trace_stage(ckpt, stage, config.frontend, max_positions)
        ctx = PassContext(stage, ckpt.dims, max_positions)
        model, records = PassManager(config.passes(), _instruments(config)).run(model, ctx)
    xml = names.stage_xml(stage.index, stage.num_stages)
    stable_names(model)  # counter-based default names differ between processes; the saved XML must not
    staging.save_model(model, workdir / xml)
    state_variables = tuple(sorted(v.get_info().variable_id for v in model.get_variables()))
    del model, build  # the build holds the buffers the graph's chunked weights live in: free them after
    gc.collect()
    shutil.rmtree(scratch, ignore_errors=True)
    binary = xml.replace(".xml", ".bin")
    saved = ov.Core().read_model(workdir / xml)  # names as every reader will see them (weights mapped, not copied)
    entry = StageEntry(
        stage=stage,
        model_xml=xml,
        model_bin=binary,
        sha256={xml: sha256_file(workdir / xml), binary: sha256_file(workdir / binary)},
        inputs=TensorSpec.of_ports(list(saved.inputs)),
        outputs=TensorSpec.of_ports(list(saved.outputs)),
        state_variables=state_variables,
    )
    del saved
    log.info("stage %d: compiled in %.1f s", stage.index, time.perf_counter() - start)
    return entry, records


def _piece_cache(config: CompileConfig, workdir: Path) -> PieceCache | None:
    """The layer cache; parallel jobs need one, so without --cache-dir they share one inside the bundle's temp folder."""
    if config.cache_dir is not None:
        return PieceCache(config.cache_dir)
    return PieceCache(workdir / ".pieces" / "cache") if config.jobs > 1 else None


def _pipeline_without(weights: WeightFormat, skip: tuple[str, ...]) -> list[GraphPass]:
    return [p for p in pipeline(weights) if p.name not in skip]


def _prebuild(config: CompileConfig, ckpt: Checkpoint, stages: tuple[StageSpec, ...], max_positions: int,
              workdir: Path) -> None:
    """Check --max-memory against one layer; with --jobs > 1 compile the pieces in parallel processes first."""
    jobs = plan_jobs(ckpt, stages, config.jobs, config.max_memory)
    cache = _piece_cache(config, workdir)
    if jobs > 1 and cache is not None and not config.dumping:
        prebuild(ckpt.path, stages, functools.partial(_pipeline_without, config.weights, config.skip_passes),
                 max_positions, cache.root, workdir / ".pieces" / "jobs", jobs, _piece_bytes(config))


def _piece_bytes(config: CompileConfig) -> int:
    """Layers per piece by bytes; calibrated, one layer a piece. A calibrated piece's later layers would read inputs
    NNCF computes inside the piece, its first layer the float inputs ``Activations`` computes, so the INT4 codes of a
    layer (rounding on float noise) would depend on where the stage cuts put the piece boundaries."""
    return 0 if config.weights.methods else piece_bytes_within(config.max_memory, config.piece_bytes)


def _generation(ckpt: Checkpoint) -> Generation:
    """bos and eos ids, each checked to lie inside the vocabulary.

    An id outside it is a broken config, and a harmful one: openvino_genai writes -inf at ``logits[eos]``
    while ``min_new_tokens`` holds the eos back, so an eos past the vocabulary corrupts its heap (found as a
    1-in-150 crash of LLMPipeline on a random Phi-3 config, whose default eos is 32000 of 300 tokens).
    """
    gen = ckpt.generation_config or {}
    eos = gen.get("eos_token_id", ckpt.description.eos_token_id)
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    bos = gen.get("bos_token_id", ckpt.description.bos_token_id)
    vocab = ckpt.dims.vocab_size
    for key, ids in (("bos_token_id", () if bos is None else (bos,)), ("eos_token_id", eos_ids)):
        outside = [i for i in ids if not 0 <= i < vocab]
        if outside:
            raise ConfigError(f"{key} {outside} lies outside the vocabulary of {vocab} tokens (ids 0..{vocab - 1}): "
                              f"fix {key} in the checkpoint's config.json / generation_config.json")
    return Generation(bos_token_id=bos, eos_token_ids=eos_ids)


def _runtime_hints(max_positions: int, dims: ModelDims, weights: WeightFormat) -> RuntimeHints:
    """What every new bundle tells its nodes: the context length, and the measured CPU plugin properties
    (for every CPU, and per instruction-set class), each with the measurement that chose it; dynamic
    quantization's group within the bundle's smallest INT4 weight group."""
    group = min(int4_groups(dims, weights), default=None)
    base = within_weight_groups(CPU_PLUGIN_HINTS, group)
    by_isa = {isa: within_weight_groups(hints, group) for isa, hints in CPU_PLUGIN_HINTS_BY_ISA.items()}
    measured = {isa: _measured(CPU_PLUGIN_BY_ISA_MEASURED[isa], hints, by_isa[isa])
                for isa, hints in CPU_PLUGIN_HINTS_BY_ISA.items()}
    return RuntimeHints(max_positions, base, _measured(CPU_PLUGIN_MEASURED, CPU_PLUGIN_HINTS, base),
                        cpu_plugin_by_isa=by_isa, cpu_plugin_by_isa_measured=measured)


def _measured(text: str, hints: dict[str, str], written: dict[str, str]) -> str:
    """The measurement behind ``written``: ``text``, and the one behind the group change where there is one."""
    return text + (f"; {DQ_WITHIN_GROUPS_MEASURED}" if written != hints else "")


def _copy_configs(ckpt: Checkpoint, workdir: Path) -> dict[str, str]:
    """config.json and generation_config.json, which openvino-genai reads beside the model.

    Copied byte for byte from a checkpoint folder; a single-file checkpoint (GGUF) has none, so they are
    written from the config the reader built.
    """
    copied = {}
    contents = {"config.json": ckpt.config, "generation_config.json": ckpt.generation_config}
    for name, content in contents.items():
        source = ckpt.path / name
        if source.is_file():
            staging.copy_file(source, workdir / name)
        elif content is not None and not ckpt.path.is_dir():
            staging.write_text(workdir / name, json.dumps(content, indent=2, sort_keys=True) + "\n")
        else:
            continue
        copied[name] = sha256_file(workdir / name)
    return copied


def _tokenizer(ckpt: Checkpoint, workdir: Path, cache: PieceCache | None) -> tuple[TokenizerFiles | None, Chat | None]:
    """Convert the tokenizer (or take it from the cache) into ``workdir``: its files and chat template record.

    The chat record travels through the cache as one more file, ``CHAT_RECORD``, read back and removed here.
    """
    from ovshard.frontend.tokenizer import convert_tokenizer

    if not ckpt.has_tokenizer:
        log.warning("%s has no tokenizer; the bundle will take and return token ids only", ckpt.path)
        return None, None

    def convert(into: Path) -> list[str]:
        log.info("converting the tokenizer with openvino-tokenizers")
        scratch = workdir / ".pieces" / "tokenizer"
        written, chat = convert_tokenizer(ckpt.tokenizer_folder(scratch), into)
        shutil.rmtree(scratch, ignore_errors=True)
        if not written:
            return written
        staging.write_text(into / CHAT_RECORD, json.dumps(schema.encode(chat)))
        return [*written, CHAT_RECORD]

    files = convert(workdir) if cache is None else cache.files(tokenizer_key(ckpt.tokenizer_digest()), workdir, convert)
    if not files:
        return None, None
    record = workdir / CHAT_RECORD
    chat = schema.decode(Chat | None, json.loads(record.read_text()), CHAT_RECORD)
    record.unlink()
    files = [f for f in files if f != CHAT_RECORD and not (chat and f in chat.sha256)]
    return TokenizerFiles(tokenizer=names.TOKENIZER_XML, detokenizer=names.DETOKENIZER_XML,
                          sha256={f: sha256_file(workdir / f) for f in files}), chat


def _workdir(output: Path, needed: int = 0) -> Path:
    """A fresh temp folder beside ``output`` (same file system, so the final rename is atomic), locked while
    this compile runs; dead compiles' temp folders there are removed first. ``needed``: bytes, for a warning."""
    output = output.resolve()
    try:
        return staging.create(output, needed)
    except OSError as e:
        raise BundleError(f"cannot write the bundle to {output}: {e.strerror}; choose a writable -o") from e


def _publish(workdir: Path, output: Path) -> None:
    """Move the finished bundle into place; an existing bundle there is replaced."""
    shutil.rmtree(workdir / ".pieces", ignore_errors=True)  # each stage removed its own; the folder stays
    staging.publish(workdir, output)


def _chosen_stages(plan: PartitionPlan, only_stage: int | None) -> tuple[StageSpec, ...]:
    """The stages this compile builds: the whole plan, or ``only_stage`` alone for a part bundle."""
    if only_stage is None:
        return plan.specs
    if not 0 <= only_stage < len(plan.specs):
        raise PlanError(f"--only-stage {only_stage} is not a stage of this plan, which has stages 0.."
                        f"{len(plan.specs) - 1}; choose K from 0 to {len(plan.specs) - 1}")
    log.info("compiling stage %d of %d only: a part bundle; merge the parts with `ovshard bundle merge`",
             only_stage, len(plan.specs))
    return (plan.specs[only_stage],)


def compile_bundle(config: CompileConfig, progress: LayerProgress | None = None) -> Manifest:
    """Compile ``config.checkpoint`` into a stage bundle at ``config.output``; return its manifest. ``progress``,
    if given, counts the layers built and their seconds (a streamed compile)."""
    libraries = ("torch", "transformers", *(("nncf",) if config.weights.mode not in ("fp32", "fp16") else ()))
    # the compile's collections walk the compile's own objects; numpy's BLAS on one thread, a heartbeat watched
    with libraries_spared_from_gc(*libraries), watchdog.guarded():
        return _compile_bundle(config, progress or LayerProgress())


def _compile_bundle(config: CompileConfig, progress: LayerProgress) -> Manifest:
    started = time.perf_counter()
    return_freed_blocks()  # layer-sized buffers go back to the kernel when freed: memory follows one layer
    ckpt = open_source(config.checkpoint)
    if config.mla_cache == "expanded" and ckpt.dims.latent_cache:
        ckpt.description = replace(ckpt.description, dims=replace(ckpt.dims, latent_cache=False))
    ckpt.validate_tensors()
    config = replace(source_weights(config, ckpt), max_positions=served_positions(config, ckpt))
    generation = _generation(ckpt)
    if config.weights.is_int4 and not config.weights.int8_weights:  # one choice for the whole model
        config = replace(config, weights=replace(config.weights, int8_weights=choose_int8(ckpt, config.weights)))
    plan = make_plan(config, ckpt)
    log.info("partition plan (%s):\n%s", plan.strategy, plan.format_table())
    chosen = _chosen_stages(plan, config.only_stage)
    progress.total = sum(len(s.layers) for s in chosen)
    max_positions = served_positions(config, ckpt)
    needed = staging.space_needed(plan, ckpt.dims.head_dim, max_positions)
    workdir, figures = _workdir(config.output, needed), []
    try:
        config, activations = _calibrate(config, ckpt, workdir, max_positions)
        if config.streamed:
            _prebuild(config, ckpt, chosen, max_positions, workdir)
        entries, log_records = [], []
        for stage in chosen:
            with PeakSampler() as memory:
                entry, records = compile_stage(ckpt, stage, config, max_positions, workdir, activations, progress)
            figures.append(StageFigures(stage, memory.seconds, memory.peak))
            log.info("%s", stage_done(figures, chosen))
            watchdog.beat(f"stage {stage.index} compiled")
            entries.append(entry)
            log_records += records
        if isinstance(activations, FitAhead):
            activations.close()  # what it prepared for a piece the cache held goes now, and its thread
        tokenizer, chat = _tokenizer(ckpt, workdir, _piece_cache(config, workdir) if config.cache_dir else None)
        manifest = Manifest(
            source=Source(path=str(ckpt.path), fingerprint=ckpt.fingerprint(), model_type=ckpt.dims.model_type,
                          frontend=config.frontend, quantization=ckpt.quantization),
            architecture=ckpt.dims,
            weights=config.weights,
            plan=plan,
            stages=tuple(entries),
            pass_log=tuple(log_records),
            tokenizer=tokenizer,
            generation=generation,
            runtime_hints=_runtime_hints(max_positions, ckpt.dims, config.weights),
            extra_files=_copy_configs(ckpt, workdir),
            dumps=str(config.dumps.dump_dir.resolve()) if config.dumps.dump_dir and config.dumping else None,
            chat=chat,
        )
        staging.write_text(workdir / names.MANIFEST_FILE, manifest.to_json())
        _publish(workdir, config.output)
    except BaseException as e:
        full = staging.disk_full(e, workdir, config.output, needed)  # judged before the removal frees space
        staging.discard(workdir)
        if full is not None:
            raise full from e
        raise
    log.info("compile report:\n%s", format_report(figures, time.perf_counter() - started))
    return manifest
