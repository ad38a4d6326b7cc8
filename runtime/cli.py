"""``ovshard serve | generate | run``: the runtime's commands (no torch, transformers or nncf)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.bundle.manifest import Manifest, read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.decode import Stats
from ovshard.runtime.head import Head
from ovshard.runtime.kv import CompactionPolicy
from ovshard.runtime.launch import listening_line, local_workers
from ovshard.runtime.sampler import IncrementalDetokenizer, SamplingConfig
from ovshard.runtime.session import Session
from ovshard.runtime.speculative import Speculation, make_speculation
from ovshard.runtime.stage import EXACT_HINTS
from ovshard.runtime.transport import parse_address
from ovshard.runtime.worker import StageWorker


def stage_config(exact: bool, threads: int | None) -> dict[str, str] | None:
    """OpenVINO properties of a stage: f32 hints for --exact, a thread count for --threads."""
    config = dict(EXACT_HINTS) if exact else {}
    if threads is not None:
        if threads < 1:
            raise OvshardError(f"--threads {threads}: expected at least 1 CPU thread per stage")
        config["INFERENCE_NUM_THREADS"] = str(threads)
        # the CPU plugin pins its threads to cores; stages that share a machine would all pin to the
        # same first cores and take turns instead of running side by side
        config["ENABLE_CPU_PINNING"] = "NO"
    return config or None


def serve(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen)
    worker = StageWorker(args.bundle, args.stage, args.device, stage_config(args.exact, args.threads),
                         wire_dtype="f32" if args.wire_f32 else "f16")
    address = worker.listen(host, port)
    print(listening_line(args.stage, address), flush=True)  # how a launcher learns a port 0 address
    try:
        worker.serve_forever()
    except KeyboardInterrupt:
        worker.stop()
    return 0


class Text:
    """Tokenizer and detokenizer from the bundle, or plain ids when it has none."""

    def __init__(self, bundle: Path, m: Manifest) -> None:
        self.tok = self.detok = None
        if m.tokenizer:
            import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)

            core = ov.Core()
            self.tok = core.compile_model(str(bundle / m.tokenizer.tokenizer), "CPU")
            self.detok = core.compile_model(str(bundle / m.tokenizer.detokenizer), "CPU")

    def encode(self, prompt: str, prompt_ids: str | None) -> list[int]:
        if prompt_ids:
            return [int(t) for t in prompt_ids.split(",")]
        if self.tok is None:
            raise OvshardError("this bundle has no tokenizer: pass --prompt-ids 1,5,17")
        return [int(t) for t in self.tok([prompt])["input_ids"][0]]

    def decode(self, ids: list[int]) -> str:
        if self.detok is None:
            return " ".join(map(str, ids)) + " "
        return str(self.detok(np.array([ids], dtype=np.int64))["string_output"][0])


def _sampling(args: argparse.Namespace, m: Manifest) -> SamplingConfig:
    try:
        return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              max_tokens=args.max_tokens,
                              eos_token_ids=m.generation.eos_token_ids)
    except ValueError as e:
        raise OvshardError(str(e)) from e


def _speculation(args: argparse.Namespace, m: Manifest) -> Speculation | None:
    try:
        policy = CompactionPolicy(hole_share=args.compact_share, limit=m.runtime_hints.max_positions)
    except ValueError as e:
        raise OvshardError(f"--compact-share: {e}") from e
    return make_speculation(args.speculative, args.draft_k, m, config=EXACT_HINTS if getattr(args, "exact", False) else None,
                            policy=policy)


def _generate(args: argparse.Namespace, addresses: list[str]) -> int:
    m = read_manifest(args.bundle)
    text = Text(args.bundle, m)
    config = _sampling(args, m)
    speculation = _speculation(args, m)
    if args.prompts_file:
        prompts = _read_prompts(args.prompts_file)
        encoded = [text.encode(p, None) for p in prompts] if text.tok else [text.encode("", p) for p in prompts]
        head = Head(args.bundle, addresses)
        try:
            return _generate_many(args, head, text, prompts, encoded, config, speculation)
        finally:
            head.close()
    prompt = text.encode(args.prompt, args.prompt_ids)
    head = Head(args.bundle, addresses)
    stats = Stats()
    detok = IncrementalDetokenizer(text.decode)
    if text.tok is not None and not args.prompt_ids:
        sys.stdout.write(args.prompt)
        for token in prompt:  # the first word's leading space depends on what precedes it
            detok.push(token)
    try:
        for token in head.generate(prompt, config, stats, speculation):
            sys.stdout.write(detok.push(token))
            sys.stdout.flush()
        sys.stdout.write(detok.flush() + "\n")
    finally:
        head.close()
    _print_stats(args, stats.to_dict())
    return 0


def _print_stats(args: argparse.Namespace, report: dict) -> None:
    if args.stats == "json":
        print(json.dumps(report), file=sys.stderr)
    else:
        print(", ".join(f"{k}={v}" for k, v in report.items()), file=sys.stderr)


def _read_prompts(path: Path) -> list[str]:
    """One prompt per non-empty line (without a tokenizer: comma-separated token ids per line)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise OvshardError(f"--prompts-file {path}: {e.strerror or e}") from e
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise OvshardError(f"--prompts-file {path} has no prompts: write one prompt per line")
    return prompts


def _generate_many(args: argparse.Namespace, head: Head, text: Text, prompts: list[str], encoded: list[list[int]],
                   config: SamplingConfig, speculation: Speculation | None) -> int:
    """Every prompt over --streams concurrent streams; completions printed in prompt order."""
    start = time.perf_counter()
    session = Session(head, args.streams, speculation)
    try:
        requests = session.run_all(encoded, config)
    finally:
        session.close()
    wall = time.perf_counter() - start
    failed = 0
    for prompt, request in zip(prompts, requests, strict=True):
        print(f"=== [{request.index}] " + (prompt if text.tok else ""))
        if request.error is not None:
            failed += 1
            print(f"error: {request.error}")
            continue
        print(text.decode(encoded[request.index] + request.result()) if text.tok else text.decode(request.result()))
    total = sum(r.stats.new_tokens for r in requests)
    summary = {"prompts": len(requests), "streams": args.streams, "new_tokens": total, "wall_s": round(wall, 3),
               "tokens_per_s": round(total / wall, 2), "failed": failed}
    _print_stats(args, summary)
    return 1 if failed else 0


def generate(args: argparse.Namespace) -> int:
    return _generate(args, [a.strip() for a in args.stages.split(",") if a.strip()])


def run(args: argparse.Namespace) -> int:
    with local_workers(args.bundle, args.exact, threads=args.threads) as addresses:
        return _generate(args, addresses)
