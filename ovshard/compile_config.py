"""What ``ovshard compile`` is asked to do: the compile's config, and the checks that refuse a bad ask before
any work is done (counts, calibration settings, passes to skip), each naming the option to change.

compile.py drives the compile from a :class:`CompileConfig`; the command line (commands/compile.py), the
demo and the tests build one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ovshard.bundle.weights import WeightFormat
from ovshard.errors import ConfigError
from ovshard.ir.pass_manager import GraphPass
from ovshard.passes import pipeline

if TYPE_CHECKING:
    from ovshard.frontend.checkpoint import Checkpoint

log = logging.getLogger(__name__)

__all__ = ["CompileConfig", "DumpOptions", "check_calibration", "default_calibration"]


MLA_CACHES = ("latent", "expanded")


@dataclass(frozen=True)
class DumpOptions:
    """Which graphs to dump where. ``after``/``before`` are "all" or a set of pass names."""

    dump_dir: Path | None = None
    after: Collection[str] | str | None = None
    before: Collection[str] | str | None = None
    with_ir: bool = True
    print_after_change: Callable[[str], None] | None = None


@dataclass(frozen=True)
class CompileConfig:
    """One compile: the checkpoint and the bundle folder, how to cut the layers, the weight format, dumps,
    the layer cache and the memory and parallelism it may use. Checked when built (ConfigError, ValueError)."""

    checkpoint: Path
    output: Path
    stages: int | None = None  # balanced split into this many stages
    layers: tuple[tuple[int, int], ...] | None = None  # explicit half-open ranges
    budgets: tuple[int, ...] | None = None  # per-node memory budgets in bytes
    context_tokens: int = 4096  # KV cache length the budgets must hold
    weights: WeightFormat = field(default_factory=WeightFormat)
    max_positions: int | None = None  # rotary table length; default: max_position_embeddings up to 131,072
    frontend: str = "torchscript"  # "torchscript" or "onnx": how the stage module reaches OpenVINO
    dumps: DumpOptions = field(default_factory=DumpOptions)
    skip_passes: tuple[str, ...] = ()  # pipeline passes not to run (A/B experiments, e.g. the beam_idx Gather)
    streaming: bool = True  # one piece (layer, row chunk) at a time; False: trace and compress whole stages
    only_stage: int | None = None  # compile this stage only: a part bundle for `ovshard bundle merge`
    cache_dir: Path | None = None  # layer cache (compiled pieces by content); None: no cache
    jobs: int = 1  # pieces compiled in parallel processes
    max_memory: int | None = None  # bytes the compile may use in all; None: no cap
    piece_bytes: int = 16 << 20  # streamed: consecutive small layers share a piece up to this many f32 weight bytes
    balance: str = "reads"  # split by bytes read per decode step ("reads") or by memory held ("memory")
    # data-aware INT4: "default" (the shipped text where the compile can use it, else none: default_calibration), "text",
    # "auto" (the model's own text), a text file's path or "none"
    calibration: str = "default"
    calibration_samples: int = 4
    calibration_tokens: int = 128  # tokens per calibration sample
    # multi-head latent attention's cache: "latent" (the latent and rotary key, kv_b absorbed) or "expanded" (every
    # head's key and value: 38x the bytes at DeepSeek-V3's width, a faster step on CPU; frontend/mla.py)
    mla_cache: str = "latent"
    weights_from_source: bool = False  # the format left to the default: a rule of the checkpoint's (source_weights)

    def __post_init__(self) -> None:
        _check_counts(self)
        check_calibration(self)
        if self.mla_cache not in MLA_CACHES:
            raise ValueError(f"mla_cache={self.mla_cache!r}; expected one of {MLA_CACHES}")
        if self.mla_cache == "expanded" and self.jobs > 1:
            raise ValueError("mla_cache='expanded' is built in this process only; compile it with jobs=1")
        if not self.skip_passes:
            return
        known = [p.name for p in pipeline(self.weights)]
        unknown = [name for name in self.skip_passes if name not in known]
        if unknown:
            raise ValueError(f"skip_passes names {unknown}, which the pipeline does not have; "
                             f"expected names from {known}")

    def passes(self) -> list[GraphPass]:
        """The pipeline this config runs: ``pipeline(weights)`` without ``skip_passes``."""
        return [p for p in pipeline(self.weights) if p.name not in self.skip_passes]

    @property
    def streamed(self) -> bool:
        """Streaming traces pieces with TorchScript; the ONNX front end traces whole stages."""
        return self.streaming and self.frontend == "torchscript"

    @property
    def dumping(self) -> bool:
        """Whether graphs are dumped: a dump folder and passes to dump after or before."""
        d = self.dumps
        return d.dump_dir is not None and bool(d.after or d.before)


def _at_least(option: str, value: int | None, low: int, what: str, fix: str) -> None:
    """ConfigError naming ``option`` when ``value`` is given and below ``low``."""
    if value is not None and value < low:
        raise ConfigError(f"{option} {value}: expected {what}, at least {low}; {fix}")


def _check_counts(config: CompileConfig) -> None:
    """Refuse counts that would be silently replaced (0 stages, 0 positions, 0 jobs) or make no sense."""
    _at_least("--stages", config.stages, 1, "a number of stages", "pass --stages 1 for one stage")
    _at_least("--max-positions", config.max_positions, 1, "the longest context served in tokens",
              "leave it out for the checkpoint's max_position_embeddings")
    _at_least("--context-tokens", config.context_tokens, 0, "the KV-cache length in tokens the budgets "
              "must hold", "pass e.g. --context-tokens 4096")
    _at_least("--jobs", config.jobs, 1, "a number of layers compiled in parallel",
              "pass --jobs 1 for one at a time")


def check_calibration(config: CompileConfig) -> None:
    """Refuse --calibration settings this compile cannot honour ("default" is resolved later: default_calibration)."""
    if config.calibration == "default":  # resolved where the checkpoint is known (default_calibration), never an error
        return
    if config.calibration == "none":
        if config.weights.methods:
            raise ConfigError(f"--calibration-methods {','.join(config.weights.methods)} need calibration text: "
                              "add --calibration text (ovshard's own), auto (the model's own text) or FILE")
        return
    if not config.weights.is_int4:
        raise ConfigError(f"--calibration calibrates INT4 weights; --weights {config.weights.mode} has none: use "
                          "--weights int4_sym or int4_asym, or leave --calibration out")
    if not config.streamed:
        raise ConfigError("--calibration runs layer by layer inside the streamed compile: leave out --whole-stage "
                          "and --frontend onnx")


# GGUF block types (groups of 32) that a format stores as they are, data-free: Q4_1 (``m + d k``, its minimum at
# code 0 and its maximum at 15) in int4_affine's min-max groups, Q4_0 (``d (k - 8)``, its largest magnitude at code
# 0) in int4_sym's signed min-max groups
SOURCE_GROUPS = {"Q4_1": "int4_affine", "Q4_0": "int4_sym"}


def source_weights(config: CompileConfig, ckpt: Checkpoint) -> CompileConfig:
    """The default format for this checkpoint: where every decoder matrix of a dense source is in one block type of
    :data:`SOURCE_GROUPS` (a GGUF file's own types, or a float checkpoint's values on that grid: a GGUF file
    dequantized and saved as safetensors, ``ovshard.frontend.grids``), its format in groups of 32, every decoder
    weight (``--budget 1.0``), data-free: those groups hold the source's blocks as they are, so the bundle loses next
    to nothing against the source at its size (SmolLM2-135M's Q4_1 file: +0.0% to +0.4% perplexity at 5.65 bits a
    parameter, against the calibrated int4_sym default's +1.4% to +9.2% at 6.09; docs/results/2026-12-int4-accuracy.md);
    else unchanged. Warns where such blocks are compressed again in another form."""
    from ovshard.frontend.grids import on_grid

    quantized = ckpt.quantization is not None
    blocks = _source_blocks(ckpt) if quantized else on_grid(ckpt) if config.weights.is_int4 else None
    where = ("the source's decoder matrices are" if quantized
             else "every decoder matrix of this float checkpoint lies on the grid of")
    if config.weights_from_source:
        if blocks is None:
            config = large_table(config, ckpt)
        else:
            log.info("weights: %s %s: %s in groups of 32, data-free, holds them as they are (--weights, --group-size "
                     "or --budget choose otherwise)", where, blocks, SOURCE_GROUPS[blocks])
            calibration = "none" if config.calibration == "default" else config.calibration
            config = replace(config, weights=replace(config.weights, mode=SOURCE_GROUPS[blocks], group_size=32,
                                                     budget=1.0), calibration=calibration)
    kept = blocks is not None and (config.weights.mode, config.weights.group_size) == (SOURCE_GROUPS[blocks], 32)
    again = config.weights.mode not in ("fp32", "fp16") and not kept  # rounded a second time
    if quantized and again:
        log.warning("%s is quantized (%s); ovshard dequantizes it and compresses it again (--weights %s), which "
                    "compounds the two quantization errors. Compile with --weights fp16 or fp32, or start from the "
                    "original safetensors checkpoint.", ckpt.path.name, ckpt.quantization, config.weights.mode)
    elif blocks is not None and again:
        log.warning("every decoder matrix of %s lies on llama.cpp's %s grid (a quantized model saved as floats); "
                    "--weights %s rounds each weight again, which compounds the two quantization errors: leave "
                    "--weights, --group-size and --budget out to keep its blocks as they are (%s, groups of 32)",
                    ckpt.path.name, blocks, config.weights.mode, SOURCE_GROUPS[blocks])
    return config


def _source_blocks(ckpt: Checkpoint) -> str | None:
    """The block type of :data:`SOURCE_GROUPS` every decoder matrix of a dense quantized source is in, else None."""
    from ovshard.frontend.tensors import layer_tensors

    shapes = {name: shape for i in range(ckpt.dims.num_layers)
              for name, shape in layer_tensors(ckpt.spec, ckpt.dims, i).items() if len(shape) >= 2}
    types = {ckpt.tensor_info(name)[0] for name in shapes}
    stacked = any(len(shape) > 2 for shape in shapes.values())  # experts [experts, out, in]: NNCF's, not these groups
    return None if stacked or len(types) != 1 or next(iter(types)) not in SOURCE_GROUPS else next(iter(types))


LARGE_TABLE = 0.5  # a tied embedding over this share of the parameters gets its own INT4 format (large_table)
WIDE_TABLE = 256  # ... and at least this many rows a hidden unit: a model few layers deep by construction, not a
# larger model cut to a few layers (``ovshard synth --layers``), whose table the cut alone makes most of it
TABLE_GROUP = 16


def large_table(config: CompileConfig, ckpt: Checkpoint) -> CompileConfig:
    """The default format where a tied embedding is over half the model (Gemma 3 270M: 63%): the table in
    asymmetric INT4 groups of 16, fitted to the lm_head's inputs in a calibrated compile, and every decoder weight
    INT8 (``--budget 4.0``). Its INT8 copy alone would be over 4 bits a parameter; this costs 6.30 on Gemma 3 270M
    and loses +2.2% to +3.8% perplexity on prose, code and dialogue, against llama.cpp Q4_K_M's 7.36 bits
    (docs/results/2026-12-int4-accuracy.md); else unchanged. The table must also have at least ``WIDE_TABLE`` rows
    a hidden unit (Gemma 3 270M: 410; Gemma 3 1B 228, Llama 3.2 1B 63), so that cutting a larger model to a few
    layers never changes its default."""
    from ovshard.plan.costs import parameter_count

    d, spec = ckpt.dims, ckpt.spec
    if (not d.tie_word_embeddings or d.vocab_size < WIDE_TABLE * d.hidden_size
            or d.vocab_size * d.hidden_size <= LARGE_TABLE * parameter_count(spec, d)):
        return config
    log.info("weights: the tied embedding is %.0f%% of the parameters: INT4 asymmetric groups of %d for it, INT8 for "
             "every decoder weight (--weights, --group-size or --budget choose otherwise)",
             100 * d.vocab_size * d.hidden_size / parameter_count(spec, d), TABLE_GROUP)
    return replace(config, weights=replace(config.weights, embedding="int4_asym", embedding_group=TABLE_GROUP,
                                           budget=4.0))


def default_calibration(config: CompileConfig, ckpt: Checkpoint) -> str:
    """The default: INT4 weights calibrated on the shipped text, where this compile can; else data-free, said why."""
    if not config.weights.is_int4 or config.weights.methods or config.weights.mode == "int4_affine":
        return "text" if config.weights.methods else "none"  # int4_affine: data-free min-max
    if not config.streamed:
        why = "the streamed compile calibrates layer by layer (--whole-stage and --frontend onnx trace whole stages)"
    elif config.jobs > 1:
        why = f"--jobs {config.jobs} compiles layers side by side (calibration reads each layer's input from the one before)"
    elif not ckpt.has_tokenizer:
        why = f"{ckpt.path} has no tokenizer to read the calibration text with"
    else:
        return "text"
    log.info("INT4 weights data-free: %s; --calibration auto or FILE calibrates anyway where it can", why)
    return "none"
