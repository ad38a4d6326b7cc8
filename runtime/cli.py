"""``ovshard serve | generate | run``: the runtime's commands (no torch, transformers or nncf)."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.errors import OvshardError
from ovshard.manifest import Manifest, read_manifest
from ovshard.runtime.decode import Stats
from ovshard.runtime.head import Head
from ovshard.runtime.kv import CompactionPolicy
from ovshard.runtime.sampler import IncrementalDetokenizer, SamplingConfig
from ovshard.runtime.speculative import Speculation, make_speculation
from ovshard.runtime.stage import EXACT_HINTS
from ovshard.runtime.worker import StageWorker, parse_address


def serve(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen)
    worker = StageWorker(args.bundle, args.stage, args.device, EXACT_HINTS if args.exact else None,
                         wire_dtype="f32" if args.wire_f32 else "f16")
    try:
        worker.serve(host, port)
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
            self.tok = core.compile_model(str(bundle / m.tokenizer["tokenizer"]), "CPU")
            self.detok = core.compile_model(str(bundle / m.tokenizer["detokenizer"]), "CPU")

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
                              eos_token_ids=tuple(m.generation.get("eos_token_ids") or ()))
    except ValueError as e:
        raise OvshardError(str(e)) from e


def _speculation(args: argparse.Namespace, m: Manifest) -> Speculation | None:
    try:
        policy = CompactionPolicy(hole_share=args.compact_share, limit=int(m.runtime_hints["max_positions"]))
    except ValueError as e:
        raise OvshardError(f"--compact-share: {e}") from e
    return make_speculation(args.speculative, args.draft_k, m, config=EXACT_HINTS if getattr(args, "exact", False) else None,
                            policy=policy)


def _generate(args: argparse.Namespace, addresses: list[str]) -> int:
    m = read_manifest(args.bundle)
    text = Text(args.bundle, m)
    prompt = text.encode(args.prompt, args.prompt_ids)
    speculation = _speculation(args, m)
    head = Head(args.bundle, addresses)
    stats = Stats()
    detok = IncrementalDetokenizer(text.decode)
    if text.tok is not None and not args.prompt_ids:
        sys.stdout.write(args.prompt)
    try:
        for token in head.generate(prompt, _sampling(args, m), stats, speculation):
            sys.stdout.write(detok.push(token))
            sys.stdout.flush()
        sys.stdout.write(detok.flush() + "\n")
    finally:
        head.close()
    report = stats.to_dict()
    if args.stats == "json":
        print(json.dumps(report), file=sys.stderr)
    else:
        print(", ".join(f"{k}={v}" for k, v in report.items()), file=sys.stderr)
    return 0


def generate(args: argparse.Namespace) -> int:
    return _generate(args, [a.strip() for a in args.stages.split(",") if a.strip()])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_workers(bundle: Path, exact: bool = False, timeout: float = 120.0):
    """One ``ovshard serve`` process per stage on loopback; yields their addresses; stops them after."""
    m = read_manifest(bundle)
    addresses = [f"127.0.0.1:{free_port()}" for _ in m.stages]
    procs = []
    try:
        for i, address in enumerate(addresses):
            cmd = [sys.executable, "-m", "ovshard.cli", "-q", "serve", str(bundle), "--stage", str(i),
                   "--listen", address] + (["--exact"] if exact else [])
            procs.append(subprocess.Popen(cmd))
        for address, proc in zip(addresses, procs, strict=True):
            _wait_listening(address, proc, timeout)
        yield addresses
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def _wait_listening(address: str, proc: subprocess.Popen, timeout: float) -> None:
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise OvshardError(f"the worker for {address} exited with code {proc.returncode}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise OvshardError(f"the worker for {address} did not listen within {timeout:.0f} s")


def run(args: argparse.Namespace) -> int:
    with local_workers(args.bundle, args.exact) as addresses:
        return _generate(args, addresses)
