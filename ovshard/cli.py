"""The ``ovshard`` command line. Each subcommand builds one config object and calls one function."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ovshard.errors import DiskFullError, OvshardError

log = logging.getLogger("ovshard")

WEIGHT_HELP = """weight format: fp32 (exact; for parity tests), fp16, int8 (per channel),
int4_sym (default: with the sensitive weights in INT8 it measured ahead of int4_asym on the real models,
README "INT4 accuracy"), int4_asym"""


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


def _add_compile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compile a Hugging Face checkpoint into a stage bundle",
                       description="Trace, convert and optimise a Hugging Face causal LM into N pipeline "
                       "stages (one stateful OpenVINO IR each) plus manifest and tokenizer.")
    p.add_argument("checkpoint", type=Path, help="a Hugging Face folder (config.json + *.safetensors) or a .gguf file")
    p.add_argument("-o", "--output", type=Path, default=Path("out"), help="bundle folder (default: out)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--stages", type=int, help="split into N stages, minimising the largest (default 1)")
    split.add_argument("--layers", help="explicit half-open layer ranges, e.g. 0:3,3:5,5:7")
    split.add_argument("--budgets", help="per-node memory budgets, e.g. 2GB,2GB,4GB (one stage each)")
    p.add_argument("--context-tokens", type=int, default=4096,
                   help="KV-cache length counted against --budgets (default 4096)")
    p.add_argument("--balance", default="reads", choices=("reads", "memory"),
                   help="what --stages (and --budgets, among the splits that fit) even out: each stage's weight "
                   "bytes read per decode step, its step time (default; the lm_head counts, the embedding's "
                   "gathered rows hardly), or its memory (weights + KV cache)")
    p.add_argument("--weights", default="int4_sym",
                   choices=("fp32", "fp16", "int8", "int4_sym", "int4_asym"), help=WEIGHT_HELP)
    p.add_argument("--group-size", type=int, default=128, help="INT4 group size (default 128)")
    p.add_argument("--budget", type=float, default=1.15,
                   help="INT4: keep the decoder weights INT4 hurts most in INT8, chosen for the whole model, while "
                   "the bundle stays within this multiple of its all-INT4 size (default 1.15; 1.0: none)")
    p.add_argument("--ratio", type=float, default=0.0,
                   help="INT4: the least share of decoder weights that stays INT4 whatever --budget allows "
                   "(default 0.0; 1.0: every decoder weight INT4)")
    p.add_argument("--all-layers", action="store_true",
                   help="INT4 also for the embedding and the lm_head (default: those stay INT8)")
    p.add_argument("--calibration", default="none", metavar="auto|none|FILE",
                   help="INT4: data-aware compression (NNCF, layer by layer in the streamed compile) on calibration "
                   "text: auto (the model's own sampled text from neutral prompts), a UTF-8 text file, or none "
                   "(default: data-free)")
    p.add_argument("--calibration-samples", type=int, default=8, help="calibration samples (default 8)")
    p.add_argument("--calibration-tokens", type=int, default=128, help="tokens per calibration sample (default 128)")
    p.add_argument("--calibration-methods", metavar="M[,M]",
                   help="NNCF's data-aware methods: awq, scale_estimation, gptq, lora_correction (default with "
                   "--calibration: awq,scale_estimation)")
    p.add_argument("--frontend", default="torchscript", choices=("torchscript", "onnx"),
                   help="torchscript: torch.jit.trace + OpenVINO's PyTorch front end (default); onnx: "
                   "torch.onnx.export at opset 23 + OpenVINO's ONNX front end")
    p.add_argument("--max-positions", type=int,
                   help="rotary table length = longest context served (default: max_position_embeddings)")
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
    p.add_argument("--print-after-change", action="store_true",
                   help="print the graph text after every pass that changed it")


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show a bundle's stages, pass log and graphs",
                       description="Without --stage: stage table, pass log with timings, I/O of each "
                       "stage. With --stage: that stage's graph; with --pass: the dump after that pass.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--stage", type=int, help="stage index")
    p.add_argument("--pass", dest="pass_name", metavar="PASS", help="e.g. InjectBeamIdxGatherPass")
    p.add_argument("--format", default="text", choices=("text", "dot", "svg", "xml"),
                   help="text and dot print the graph; svg and xml print the file's path")
    p.add_argument("--diff", action="store_true", help="unified diff of the graph before/after --pass")
    p.add_argument("--dump-dir", type=Path, help="dump folder if not the one the manifest records")


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="prove the KV-cache fusions fired and the numbers match",
                       description="Check file checksums; compile each stage on --device and read the "
                       "runtime graph (one KV-fused SDPA per layer, no attention MatMul/Softmax, weights in "
                       "the manifest's precision); with --predict, check the fusion preconditions statically "
                       "(no device needed); with --reference, compare against the Hugging Face model. "
                       "Exit 0 only if every check passes.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--device", help="OpenVINO device for the runtime-graph check (default CPU, or none "
                   "when only --predict is given)")
    p.add_argument("--predict", metavar="GPU,CPU", help="static fusion prediction for these devices")
    p.add_argument("--reference", type=Path, metavar="HF_CHECKPOINT", help="compare against this checkpoint")
    p.add_argument("--prompt", default="Once upon a time", help="prompt for --reference")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens compared with --reference")
    p.add_argument("--perplexity", type=Path, metavar="TEXT", help="with --reference: score this UTF-8 text "
                   "as llama.cpp's llama-perplexity does (chunks of --perplexity-context tokens, the second half "
                   "of each scored) with the bundle and the reference; report both perplexities and the top-1 "
                   "agreement along it, judged by the weight format's thresholds")
    p.add_argument("--perplexity-context", type=int, metavar="N",
                   help="chunk length for --perplexity (default 512, or the bundle's positions when fewer)")
    p.add_argument("--json", action="store_true", help="machine-readable report")


EXACT_HELP = ("f32 inference and KV cache, no dynamic quantization (parity with HF; a step of several tokens "
              "scores each row as one-token steps do)")

def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve one stage of a bundle over TCP",
                       description="Load one stage (checking its sha256 against the manifest), compile it on "
                       "--device with a model cache so restarts are fast, and serve it until Ctrl-C.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--listen", default="127.0.0.1:7000",
                   help="host:port (default 127.0.0.1:7000); port 0 binds a free port. Once listening, the "
                   'worker prints {"event": "listening", "stage": S, "address": "HOST:PORT"} on stdout')
    p.add_argument("--device", default="CPU", help="OpenVINO device: CPU, GPU, NPU, AUTO (default CPU)")
    p.add_argument("--exact", action="store_true", help=EXACT_HELP)
    p.add_argument("--wire-f32", action="store_true", help="send activations as f32 (default f16)")
    p.add_argument("--threads", type=int, help="CPU threads for this stage (default: all); give stages "
                   "that share a machine a share each")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when stdin closes: used by `ovshard run --local` so its workers die with it")
    p.add_argument("--cache-dir", type=Path, help="compiled-model cache (default: $OVSHARD_CACHE_DIR/ov_cache or "
                   "~/.cache/ovshard/ov_cache; the bundle may be read-only)")
    _add_security(p)
    limits = p.add_argument_group("limits", "what one worker grants; anything beyond is refused with an Error")
    limits.add_argument("--max-connections", type=int, default=256, help="open connections (default 256)")
    limits.add_argument("--max-sessions", type=int, default=64, help="connected heads (default 64)")
    limits.add_argument("--max-streams", type=int, default=256, help="open streams over all heads (default 256)")
    limits.add_argument("--max-streams-per-session", type=int, default=32, help="open streams per head (default 32)")
    limits.add_argument("--frame-timeout", type=float, default=30.0,
                        help="seconds a frame that has begun may take to arrive, plus 1 s per MiB (default 30)")


def _add_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--credentials", type=Path, metavar="DIR",
                   help="this node's folder from `ovshard keygen` (ca.pem, cert.pem, key.pem): mutual TLS on "
                   "every link; required beyond loopback unless --insecure")
    p.add_argument("--insecure", action="store_true",
                   help="allow plain TCP beyond loopback without credentials (a trusted network only)")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text through stage workers",
                       description="Connect to every stage (one host:port per stage, in order), stream the "
                       "generated text to stdout and timings to stderr.")
    p.add_argument("bundle", type=Path, help="the same bundle the workers serve (manifest and tokenizer)")
    p.add_argument("--stages", required=True, help="host0:7000,host1:7001,...")
    _add_security(p)
    _add_sampling(p)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--chat", action="store_true",
                   help="apply the bundle's chat template: --prompt (or each line of --prompts-file) is one user "
                   "message; stop at the end of the turn; print the answer only")
    p.add_argument("--prompt-ids", help="comma-separated token ids (for bundles without a tokenizer)")
    p.add_argument("--prompts-file", type=Path,
                   help="one prompt per line (token ids per line without a tokenizer); all are generated over "
                   "--streams concurrent streams, and each is printed as soon as it finishes")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams for --prompts-file (default 4)")
    p.add_argument("--stats", choices=("text", "json"), default="text", help="timings on stderr")
    _add_decoding(p)


def _add_decoding(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"new tokens per answer at most (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--speculative", default="prompt-lookup", metavar="prompt-lookup|draft:PATH|off",
                   help="drafter: n-gram lookup in the prompt and generated text (default), a one-stage draft "
                   "bundle with the same tokenizer run on this node, or off (plain decoding)")
    p.add_argument("--draft-k", default="auto", metavar="N|auto",
                   help="drafts verified per pipeline traversal; auto picks K from the acceptance rate and "
                   "a modelled step cost, never from timings, so output does not depend on load (default auto)")
    p.add_argument("--compact-share", type=float, default=0.5,
                   help="compact a stream's KV caches when rewound holes reach this share (default 0.5)")
    p.add_argument("--retry-s", type=float, default=30.0,
                   help="when a stage goes away mid-generation, reconnect and replay for up to this many "
                   "seconds before failing with the partial output (default 30)")
    _add_prefill(p)


def _add_prefill(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                   help="send a prompt through the stages in steps of N tokens, pipelined: stage k computes one "
                   "chunk while stage k+1 computes the one before (default 0: the whole prompt in one step, "
                   "4.4x quicker to the first token on OpenVINO's CPU plugin here; see the README)")


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="start a local worker process per stage and generate",
                       description="Everything on this machine: one `ovshard serve` process per stage on "
                       "loopback, then generate as `ovshard generate` would.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--local", action="store_true", required=True, help="workers on this machine")
    p.add_argument("--exact", action="store_true", help=EXACT_HELP)
    p.add_argument("--threads", type=int, help="CPU threads per worker process (default: all)")
    p.add_argument("--in-process", action="store_true",
                   help="run every stage in this process instead of one worker process per stage: no sockets or "
                        "frames per token (one prompt at a time; the README's decode-step profile)")
    _add_sampling(p)


def _add_api(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API over stage workers",
                       description="One head with --streams stream slots behind an OpenAI-compatible HTTP server: "
                       "/v1/models, /v1/chat/completions, /v1/completions (stream with server-sent events), "
                       "/health, /metrics. Needs the api extra: pip install 'ovshard[api]'.")
    p.add_argument("bundle", type=Path)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--stages", help="host0:7000,host1:7001,... (workers started with `ovshard serve`)")
    where.add_argument("--local", action="store_true", help="start one worker process per stage on loopback")
    p.add_argument("--listen", default="127.0.0.1:8000", help="host:port of the HTTP server (default 127.0.0.1:8000)")
    _add_http(p)
    p.add_argument("--exact", action="store_true", help="with --local: f32 inference and KV cache")
    p.add_argument("--threads", type=int, help="with --local: CPU threads per worker process")
    _add_security(p)


def _add_http(p: argparse.ArgumentParser) -> None:
    """The API server's options (`api`, and `up --api`)."""
    p.add_argument("--streams", type=int, default=4, help="concurrent stream slots (default 4)")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot; beyond it 429 (default 16)")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens when a request names none (default 256)")
    p.add_argument("--model", help="the model id clients send (default: the bundle folder's name)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default $OVSHARD_API_KEY); needed to "
                   "listen beyond loopback unless --insecure")
    p.add_argument("--retry-s", type=float, default=30.0,
                   help="reconnect and replay for this long when a stage goes away, then answer 503 (default 30)")
    _add_prefill(p)


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="bring a pipeline up on a Ray cluster: placed by measurement, supervised",
                       description="Probe each node (speed, free memory, round trips), place runs of the bundle's "
                       "stages on them, pull stage files to nodes that lack them, and run one Ray actor per placed "
                       "stage, binding a port on its node, mutual TLS off --ray local; Ray restarts an actor that "
                       "dies and the head replays its streams. Prints the stage table and a JSON line with the "
                       "--stages list, then serves the API (--api) or waits until Ctrl-C / SIGTERM, which stops "
                       "every stage. Needs the cluster extra: pip install 'ovshard[cluster]'.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--ray", required=True, metavar="local|auto|ADDRESS",
                   help="local: a private Ray instance on this machine, owned by this command; auto or host:port: "
                   "a cluster started with `ray start --head` (and `ray start --address=...` on the others)")
    p.add_argument("--api", metavar="HOST:PORT", help="serve the OpenAI-compatible API there (default: print the "
                   "--stages list for `ovshard generate` and wait)")
    p.add_argument("--port-base", type=int, default=7000,
                   help="stage k listens on this port + k on its node (default 7000; --ray local picks free "
                   "loopback ports)")
    p.add_argument("--placement", choices=("measured", "even", "bundle"), default="measured",
                   help="measured (default): probe each node's speed and memory and give faster nodes more layers; "
                   "even: equal runs of the bundle's stages; bundle: one actor per bundle stage, nodes in turn")
    p.add_argument("--stages", type=int, metavar="N", help="placed stages (default: as many nodes as help); the "
                   "bundle's stages are the units, so compile with more stages than nodes (e.g. one per layer)")
    p.add_argument("--context-tokens", type=int, default=4096,
                   help="the context each stage's KV cache must fit in its node's memory (default 4096)")
    p.add_argument("--pull", choices=("missing", "always"), default="missing",
                   help="missing (default): a node without the bundle's folder pulls its stages' files; always: "
                   "every node pulls into its cache ($OVSHARD_CACHE_DIR or ~/.cache/ovshard)")
    p.add_argument("--exact", action="store_true", help="f32 inference and KV cache")
    p.add_argument("--threads", type=int, help="CPU threads per stage worker ($OVSHARD_THREADS on a node wins)")
    _add_http(p)
    _add_security(p)


def _add_status_down(sub: argparse._SubParsersAction) -> None:
    for name, what in (("status", "each stage actor's state, restarts, node, address, layers and memory"),
                       ("down", "stop every ovshard stage actor on the cluster (a waiting `ovshard up` then leaves)")):
        p = sub.add_parser(name, help=what, description=f"On a Ray cluster: {what}.")
        p.add_argument("--ray", default="auto", metavar="auto|ADDRESS",
                       help="the cluster (default auto); for `up --ray local`, the \"ray\" address it printed")


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal through stage workers (or --local), with history",
                       description="An interactive chat: each line read is a user message; the conversation so "
                       "far is rendered by the bundle's chat template (without one: plain text, one message per "
                       "line) and the answer streams to stdout. /reset forgets the conversation, /stats prints "
                       "the last answer's figures (tokens/s, speculative acceptance, per-stage compute ms, "
                       "per-hop network ms), /quit or end-of-file (Ctrl-D) leaves. Ctrl-C stops an answer (the "
                       "part shown stays in the conversation); at the prompt it leaves.")
    p.add_argument("bundle", type=Path)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--stages", help="host0:7000,host1:7001,... (workers started with `ovshard serve`)")
    where.add_argument("--local", action="store_true", help="start one worker process per stage on loopback")
    p.add_argument("--system", help="a system prompt: the first message of every conversation (kept by /reset)")
    p.add_argument("--exact", action="store_true", help="with --local: f32 inference and KV cache")
    p.add_argument("--threads", type=int, help="with --local: CPU threads per worker process")
    _add_decoding(p, max_tokens=256)
    _add_security(p)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="compile the built-in default model and print a report",
                       description="Compile ../shared/models/stories260K (or a small random Llama when it "
                       "is absent) into stages, check the KV-cache fusion, and generate a sample.")
    p.add_argument("-o", "--output", type=Path, default=Path("out/demo"))
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--checkpoint", type=Path, help="compile this checkpoint instead of the default")


def _add_proxy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="relay TCP with added latency and a bandwidth cap (WAN emulation)",
                       description="Accept connections on --listen and relay each to --target, delaying every "
                       "chunk by the one-way latency of its direction and, with --bandwidth-mbit, by its "
                       "serialisation time. Runs until Ctrl-C.")
    p.add_argument("--listen", default="127.0.0.1:7100", help="host:port (default 127.0.0.1:7100)")
    p.add_argument("--target", required=True, help="host:port to relay to, e.g. a stage worker")
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency client -> target (default 0)")
    p.add_argument("--latency-back-ms", type=float,
                   help="one-way latency target -> client (default: --latency-ms)")
    p.add_argument("--bandwidth-mbit", type=float, help="cap each direction at this many Mbit/s (default: none)")


def _add_synth(sub: argparse._SubParsersAction) -> None:
    from ovshard.tools.shapes import SHAPES  # plain data: no numpy, torch or openvino

    p = sub.add_parser("synth", help="write a random-weight checkpoint of a named shape or config.json",
                       description="Write a Hugging Face checkpoint (config.json, generation_config.json, "
                       "safetensors) of any supported family with seeded random weights, streamed tensor by "
                       "tensor in bounded memory and renamed into place when complete.")
    p.add_argument("shape", help=f"{', '.join(SHAPES)}, or the path of a config.json of a supported family "
                   "(or of the folder holding it)")
    p.add_argument("-o", "--output", type=Path, required=True, help="checkpoint folder (new or empty)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="storage dtype (default: the config's dtype; float32 for the named shapes)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--layers", type=int, help="override num_hidden_layers, e.g. 1 for a small test")
    p.add_argument("--max-shard-size", default="2GB", help="split into shards of at most this size (default 2GB)")
    p.add_argument("--dry-run", action="store_true", help="report the files, parameters and bytes; write nothing")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ovshard", description="Compile a Hugging Face causal LM into pipeline stages of stateful "
        "OpenVINO IR, and inspect the result.", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  ovshard compile path/to/hf-checkpoint --stages 4 -o out/\n"
        "  ovshard compile CKPT --budgets 2GB,2GB,4GB --weights int4_sym --dump-after all\n"
        "  ovshard inspect out/\n"
        "  ovshard inspect out/ --stage 1 --pass InjectBeamIdxGatherPass --diff\n"
        "  ovshard demo")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_compile(sub)
    _add_inspect(sub)
    _add_verify(sub)
    _add_serve(sub)
    _add_generate(sub)
    _add_run(sub)
    _add_chat(sub)
    _add_up(sub)
    _add_status_down(sub)
    _add_demo(sub)
    _add_proxy(sub)
    _add_synth(sub)
    _add_bundle(sub)
    _add_cache(sub)
    _add_keygen(sub)
    _add_api(sub)
    return parser


def _add_bundle(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bundle", help="work on bundles: merge stage parts compiled on separate nodes")
    verbs = p.add_subparsers(dest="bundle_command", required=True)
    merge = verbs.add_parser("merge", help="join part bundles (compile --only-stage K) into one bundle",
                             description="Check that the parts come from one checkpoint and one plan, that every "
                             "stage is there exactly once and every file matches its sha256, then write one "
                             "bundle.")
    merge.add_argument("parts", type=Path, nargs="+", help="part bundle folders")
    merge.add_argument("-o", "--output", type=Path, required=True, help="the merged bundle folder")


def _add_cache(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="the layer cache of compiled pieces: size report or clear")
    p.add_argument("cache_command", choices=("info", "clear"))
    p.add_argument("--cache-dir", type=Path, help="default: $OVSHARD_CACHE_DIR or ~/.cache/ovshard")


def _add_keygen(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="make a cluster CA and a certificate per node (mutual TLS)",
                       description="Write a cluster CA (ca.pem, ca.key: keep it offline) and one folder per "
                       "node (ca.pem, cert.pem, key.pem) to pass to that node as --credentials. Needs the "
                       "cryptography package (ovshard[secure]); serving nodes do not.")
    p.add_argument("-o", "--output", type=Path, required=True, help="a new or empty folder")
    p.add_argument("--stages", required=True, metavar="NAME[,NAME...]", help="stage node names, e.g. s0,s1")
    p.add_argument("--heads", default="head", metavar="NAME[,NAME...]", help="head node names (default head)")
    p.add_argument("--days", type=int, default=825, help="certificate validity in days (default 825)")
    p.add_argument("--force", action="store_true", help="replace an earlier keygen folder (its CA too)")


def _compile_config(args: argparse.Namespace):
    from ovshard.cache import default_cache_dir
    from ovshard.compile import CompileConfig, DumpOptions
    from ovshard.passes import WeightFormat, pipeline
    from ovshard.plan.partition import parse_budgets, parse_layers

    methods = tuple(m.strip() for m in args.calibration_methods.split(",") if m.strip()) if args.calibration_methods else ()
    weights = WeightFormat(args.weights, args.group_size, args.ratio, args.all_layers, args.budget, methods=methods)
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
    )


def _verify(args: argparse.Namespace) -> int:
    from ovshard.verify.checks import VerifyConfig, format_report, report_json, verify_bundle

    predict = tuple(d.strip().upper() for d in args.predict.split(",") if d.strip()) if args.predict else ()
    device = args.device or (None if predict else "CPU")
    if device and device.lower() == "none":
        device = None
    rows = verify_bundle(VerifyConfig(args.bundle, device, predict, args.reference, args.prompt, args.tokens,
                                      args.perplexity, args.perplexity_context))
    print(report_json(rows) if args.json else format_report(rows))
    return 0 if all(r.verdict != "FAIL" for r in rows) else 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "compile":
        from ovshard.bundle.manifest import read_part_manifest
        from ovshard.compile import compile_bundle
        from ovshard.verify.inspect import summary

        compile_bundle(_compile_config(args))
        print(summary(args.output, read_part_manifest(args.output)))  # with --only-stage, a part bundle
        return 0
    if args.command == "inspect":
        from ovshard.verify.inspect import InspectConfig, inspect_bundle

        print(inspect_bundle(InspectConfig(args.bundle, args.stage, args.pass_name, args.format, args.diff,
                                           args.dump_dir)))
        return 0
    if args.command == "verify":
        return _verify(args)
    if args.command in ("serve", "generate", "run"):
        from ovshard.runtime import cli as runtime_cli

        return getattr(runtime_cli, args.command)(args)
    if args.command == "proxy":
        from ovshard.runtime.wanproxy import main_proxy

        return main_proxy(args)
    if args.command in ("up", "status", "down"):
        from ovshard.runtime import cluster

        if args.command == "up":
            return cluster.main_up(args, _cluster_planner)
        return {"status": cluster.main_status, "down": cluster.main_down}[args.command](args)
    if args.command == "chat":
        from ovshard.runtime.chat_repl import main_chat

        return main_chat(args)
    if args.command == "api":
        from ovshard.runtime.api import main_api

        return main_api(args)
    if args.command == "keygen":
        from ovshard.runtime.keygen import main_keygen

        return main_keygen(args)
    if args.command == "synth":
        from ovshard.tools.synth import main_synth

        return main_synth(args)
    if args.command == "bundle":
        from ovshard.merge import merge_bundles
        from ovshard.verify.inspect import summary

        manifest = merge_bundles(args.parts, args.output)
        print(summary(args.output, manifest))
        return 0
    if args.command == "cache":
        from ovshard.cache import clear_cache, default_cache_dir, format_report

        root = args.cache_dir or default_cache_dir()
        print(format_report(root) if args.cache_command == "info" else clear_cache(root))
        return 0
    from ovshard.tools.demo import DemoConfig, run_demo

    return 0 if run_demo(DemoConfig(args.output, args.stages, args.checkpoint)) else 1


def _cluster_planner(manifest: Any, probes: list[dict], head: str, rtt: dict, stages: int | None,
                     context_tokens: int, strategy: str) -> tuple[list[str], list[tuple[int, ...]], str, list[str]]:
    """`ovshard up`'s planner: the probes its actors returned, planned by ovshard.plan.placement."""
    from ovshard.plan.placement import NodeProbe, plan_placement

    nodes = [NodeProbe(p["node"], p["host"], p["seconds_per_byte"], p["free_bytes"]) for p in probes]
    placement = plan_placement(manifest, nodes, head, rtt, stages, context_tokens, strategy)
    return (list(placement.nodes), [tuple(g) for g in placement.groups], placement.format_table(),
            [message for _, message in placement.left_out])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="ovshard: %(message)s", stream=sys.stderr)
    if not args.verbose:
        for noisy in ("nncf", "transformers", "torch"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        code = _run(args)
        sys.stdout.flush()  # a reader that went away (`| head`) shows up here rather than at exit
        return code
    except DiskFullError as e:  # not a refusal of the request: the work failed, and may succeed with more space
        print(f"ovshard {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OvshardError as e:
        print(f"ovshard {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # whoever read stdout stopped early (`ovshard inspect ... | head`): no traceback, and point stdout
        # at /dev/null so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"ovshard {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
