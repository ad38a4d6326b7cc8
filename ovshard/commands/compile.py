"""``ovshard compile``: a checkpoint into a stage bundle."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ovshard.errors import OvshardError

if TYPE_CHECKING:
    from ovshard.compile import CompileConfig
    from ovshard.report import LayerProgress

WEIGHT_HELP = """weight format: fp32 (exact; for parity tests), fp16, int8 (per channel),
int4_sym (default: with the sensitive weights in INT8 it measured ahead of int4_asym on the real models,
docs/results/2026-12-int4-accuracy.md), int4_asym, int4_affine (asymmetric with an f16 zero point per group,
llama.cpp's Q4_1 form at --group-size 32; data-free; the default where the decoder is Q4_1 blocks: a GGUF file's,
or a float checkpoint's values on that grid)"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compile a Hugging Face checkpoint into a stage bundle",
                       description="Trace, convert and optimise a Hugging Face causal LM into N pipeline "
                       "stages (one stateful OpenVINO IR each) plus manifest and tokenizer.")
    p.add_argument("checkpoint", type=Path, metavar="MODEL",
                   help="a Hugging Face folder (config.json + *.safetensors) or a .gguf file; a Hugging Face Hub id "
                   "owner/name[@revision] (or owner/name/FILE.gguf), fetched into the Hugging Face cache; or "
                   "ollama:name[:tag], a model Ollama has pulled (docs/compile.md: model names)")
    p.add_argument("-o", "--output", type=Path, default=Path("out"), help="bundle folder (default: out)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--stages", type=int, help="split into N stages, minimising the largest (default 1)")
    split.add_argument("--layers", help="explicit half-open layer ranges, e.g. 0:3,3:5,5:7")
    split.add_argument("--budgets", help="per-node memory budgets, e.g. 2GB,2GB,4GB (one stage each)")
    p.add_argument("--context-tokens", type=int, default=4096,
                   help="KV-cache length counted against --budgets, and the context whose KV cache a step reads "
                   "when --balance reads (up to --max-positions; default 4096)")
    p.add_argument("--balance", default="reads", choices=("reads", "memory"),
                   help="what --stages (and --budgets, among the splits that fit) even out: each stage's bytes "
                   "read per decode step, its step time (default; its weights, the lm_head's in the last stage, "
                   "the embedding's gathered rows hardly, and its layers' KV cache of one sequence at "
                   "--context-tokens), or its memory (weights + KV cache)")
    p.add_argument("--mla-cache", default="latent", choices=("latent", "expanded"),
                   help="multi-head latent attention (DeepSeek-V3): cache the latent and rotary key (default; 38x "
                   "fewer bytes at V3's width) or every head's key and value (a faster decode step on CPU)")
    p.add_argument("--weights",
                   choices=("fp32", "fp16", "int8", "int4_sym", "int4_asym", "int4_affine"), help=WEIGHT_HELP)
    p.add_argument("--group-size", type=int, help="INT4 group size (default 128)")
    p.add_argument("--budget", type=float,
                   help="INT4: keep the decoder weights INT4 hurts most in INT8, chosen for the whole model, while "
                   "the bundle stays within this multiple of its all-INT4 size (default 1.15; 1.0: none)")
    p.add_argument("--ratio", type=float, default=0.0,
                   help="INT4: the least share of decoder weights that stays INT4 whatever --budget allows "
                   "(default 0.0; 1.0: every decoder weight INT4)")
    p.add_argument("--all-layers", action="store_true",
                   help="INT4 also for the embedding and the lm_head (default: those stay INT8)")
    p.add_argument("--embedding", choices=("int8", "int4_sym", "int4_asym"),
                   help="INT4: the embedding and lm_head's format (default int8, per channel; a tied embedding over half "
                   "the parameters: int4_asym groups of 16); an INT4 table in a calibrated compile is fitted to the "
                   "lm_head's inputs (the final hidden states of the calibration text)")
    p.add_argument("--embedding-group-size", type=int, help="INT4 group size of an INT4 --embedding (default 32)")
    p.add_argument("--calibration", default="default", metavar="text|auto|none|FILE",
                   help="INT4: data-aware compression, layer by layer in the streamed compile (ovshard's own scale fit "
                   "for int4_sym, NNCF's scale estimation for int4_asym), on calibration text: text (the ~2,300 tokens "
                   "of prose and code that ship with ovshard), auto (the model's own sampled text from neutral "
                   "prompts), a UTF-8 text file, or none (data-free). Default: text where the checkpoint has a "
                   "tokenizer and the compile is streamed in one job, else none")
    p.add_argument("--calibration-samples", type=int, default=4, help="calibration samples (default 4)")
    p.add_argument("--calibration-tokens", type=int, default=128, help="tokens per calibration sample (default 128)")
    p.add_argument("--calibration-methods", metavar="M[,M]",
                   help="data-aware methods: scale_fit (ovshard's own, int4_sym, alone; the default there) or "
                   "NNCF's awq, scale_estimation (the default for int4_asym), gptq, lora_correction")
    p.add_argument("--frontend", default="torchscript", choices=("torchscript", "onnx"),
                   help="torchscript: torch.jit.trace + OpenVINO's PyTorch front end (default); onnx: "
                   "torch.onnx.export at opset 23 + OpenVINO's ONNX front end")
    p.add_argument("--max-positions", type=int,
                   help="rotary table length = longest context served (default: max_position_embeddings, at most 131072)")
    p.add_argument("--dump-after", metavar="all|PASS[,PASS]", help="dump the graph after these passes")
    p.add_argument("--dump-before", metavar="all|PASS[,PASS]", help="dump the graph before these passes")
    p.add_argument("--dump-dir", type=Path,
                   help="where dumps go (default: <output>.dumps); alone, it means --dump-after all")
    p.add_argument("--no-dump-ir", action="store_true", help="dump text and DOT only, no IR copies")
    p.add_argument("--whole-stage", action="store_true",
                   help="trace and compress each stage whole (memory of a stage) instead of streaming one "
                   "layer at a time (memory of a layer; the default with --frontend torchscript)")
    p.add_argument("--only-stage", type=int, metavar="K",
                   help="compile stage K only (on its own node, from its own copy of the checkpoint); join "
                   "the parts with `ovshard bundle merge`")
    p.add_argument("--cache-dir", type=Path,
                   help="layer cache: compiled pieces by content, reused across splits and after a crash "
                   "(default: $OVSHARD_CACHE_DIR or ~/.cache/ovshard)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the layer cache")
    p.add_argument("--jobs", type=int, default=1, help="compile up to N layers in parallel processes (default 1)")
    p.add_argument("--max-memory", metavar="SIZE",
                   help="cap on the compile's memory, e.g. 8GB: fewer parallel jobs, or a clear refusal when "
                   "one layer alone does not fit")
    p.add_argument("--json", action="store_true",
                   help="print a JSON summary on stdout instead of the bundle table: bundle, stages, layers, seconds, "
                   "seconds a layer, peak RSS, bits per parameter (progress still goes to stderr)")
    p.add_argument("--print-after-change", action="store_true",
                   help="print the graph text after every pass that changed it")
    p.set_defaults(func=run)


def _selection(text: str | None, option: str, known: Sequence[str]) -> frozenset[str] | str | None:
    """``all`` or a set of pass names; a name the pipeline lacks is an error, not a silent no-dump."""
    if text is None:
        return None
    if text == "all":
        return "all"
    chosen = frozenset(t.strip() for t in text.split(",") if t.strip())
    unknown = sorted(chosen - set(known))
    if unknown or not chosen:
        found = ", ".join(unknown) if unknown else repr(text)
        raise OvshardError(f"{option}: no pass named {found}; expected all or comma-separated names from "
                           f"the pipeline: {', '.join(known)}")
    return chosen


def compile_config(args: argparse.Namespace) -> CompileConfig:
    from ovshard.cache import default_cache_dir
    from ovshard.compile import CompileConfig, DumpOptions
    from ovshard.passes import WeightFormat, pipeline
    from ovshard.plan.partition import parse_budgets, parse_layers

    methods = tuple(m.strip() for m in args.calibration_methods.split(",") if m.strip()) if args.calibration_methods else ()
    weights = WeightFormat(args.weights or "int4_sym", 128 if args.group_size is None else args.group_size, args.ratio,
                           args.all_layers, 1.15 if args.budget is None else args.budget, methods=methods,
                           embedding=args.embedding or "int8",
                           embedding_group=32 if args.embedding_group_size is None else args.embedding_group_size)
    known = [p.name for p in pipeline(weights)]
    dump_dir = args.dump_dir or (args.output.parent / f"{args.output.name}.dumps")
    emit = (lambda text: print(text, flush=True)) if args.print_after_change else None
    dump_after = args.dump_after
    if args.dump_dir is not None and dump_after is None and args.dump_before is None:
        dump_after = "all"  # asking for a dump folder means asking for dumps
    return CompileConfig(
        checkpoint=args.checkpoint,
        output=args.output,
        stages=args.stages,
        layers=tuple(parse_layers(args.layers)) if args.layers else None,
        budgets=tuple(parse_budgets(args.budgets)) if args.budgets else None,
        context_tokens=args.context_tokens,
        balance=args.balance,
        weights=weights,
        max_positions=args.max_positions,
        frontend=args.frontend,
        dumps=DumpOptions(dump_dir, _selection(dump_after, "--dump-after", known),
                          _selection(args.dump_before, "--dump-before", known), not args.no_dump_ir, emit),
        streaming=not args.whole_stage,
        only_stage=args.only_stage,
        cache_dir=None if args.no_cache else (args.cache_dir or default_cache_dir()),
        jobs=args.jobs,
        max_memory=parse_budgets(args.max_memory)[0] if args.max_memory else None,
        calibration=args.calibration,
        calibration_samples=args.calibration_samples,
        calibration_tokens=args.calibration_tokens,
        mla_cache=args.mla_cache,
        weights_from_source=all(v is None for v in (args.weights, args.group_size, args.budget, args.embedding,
                                                    args.embedding_group_size)) and not args.all_layers,
    )


def run(args: argparse.Namespace) -> int:
    from ovshard.bundle.manifest import read_part_manifest
    from ovshard.compile import compile_bundle
    from ovshard.report import LayerProgress
    from ovshard.verify.inspect import summary

    progress, started = LayerProgress(), time.perf_counter()
    compile_bundle(compile_config(args), progress)
    if args.json:
        print(json.dumps(json_summary(args.output, progress, time.perf_counter() - started)))
    else:
        print(summary(args.output, read_part_manifest(args.output)))  # with --only-stage, a part bundle
    return 0


def json_summary(bundle: Path, progress: LayerProgress, seconds: float) -> dict:
    """What ``--json`` prints: the bundle, its size in layers, the compile's time and peak memory, and stored bits
    per parameter (every parameter once, as llama.cpp's files are measured; null for a part bundle)."""
    from ovshard.bundle.manifest import read_part_manifest
    from ovshard.frontend.arch import ARCHITECTURES
    from ovshard.memory import read_status
    from ovshard.plan.costs import bits_per_parameter
    from ovshard.verify.reference import weight_bytes

    part = read_part_manifest(bundle)
    bits = bits_per_parameter(weight_bytes(bundle, part), ARCHITECTURES[part.architecture.model_type],
                              part.architecture, part.weights, part.num_stages) if part.complete else None
    per_layer = progress.seconds_per_layer
    return {"bundle": str(bundle.resolve()), "stages": len(part.stages), "layers": progress.total or
            sum(e.layers[1] - e.layers[0] for e in part.stages), "seconds": round(seconds, 2),
            "seconds_per_layer": None if per_layer is None else round(per_layer, 3),
            "peak_rss_bytes": read_status().get("hwm"), "bits_per_parameter": None if bits is None else round(bits, 3),
            "weights": part.weights.describe()}
