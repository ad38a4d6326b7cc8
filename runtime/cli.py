"""``ovshard serve | generate | run``: the runtime's commands (no torch, transformers or nncf)."""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.bundle.manifest import Manifest, read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.chat import ChatTemplate, compile_plain_tokenizer, stop_ids
from ovshard.runtime.decode import Stats
from ovshard.runtime.head import PREFILL_CHUNK, Head
from ovshard.runtime.kv import CompactionPolicy
from ovshard.runtime.launch import exit_with_parent, listening_line, local_workers
from ovshard.runtime.local import LocalPipeline
from ovshard.runtime.sampler import IncrementalDetokenizer, SamplingConfig
from ovshard.runtime.security import (
    Credentials,
    check_listen_posture,
    client_context,
    is_loopback,
    load_credentials,
    server_context,
)
from ovshard.runtime.session import Request, Session
from ovshard.runtime.speculative import Speculation, make_speculation
from ovshard.runtime.stage import EXACT_HINTS
from ovshard.runtime.transport import parse_address
from ovshard.runtime.worker import Limits, StageWorker, model_cache

log = logging.getLogger(__name__)


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


def _credentials(args: argparse.Namespace) -> Credentials | None:
    folder = getattr(args, "credentials", None)
    return load_credentials(folder) if folder is not None else None


def worker_limits(args: argparse.Namespace) -> Limits:
    return Limits(max_connections=args.max_connections, max_sessions=args.max_sessions,
                  max_streams=args.max_streams, max_streams_per_session=args.max_streams_per_session,
                  frame_timeout_s=args.frame_timeout)


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas. glibc gives threads that allocate arenas of their own (up to 8 per core)
    and keeps what is freed in each, so a worker with a thread per connection grows its RSS with every
    new thread on a many-core machine; a few shared arenas keep it flat. No-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def serve(args: argparse.Namespace) -> int:
    limit_malloc_arenas()
    host, port = parse_address(args.listen)
    creds = _credentials(args)
    check_listen_posture(host, creds, args.insecure)
    if creds is None and not is_loopback(host):
        log.warning("serving %s WITHOUT authentication or encryption (--insecure): anyone who reaches this port "
                    "can use this stage and read what flows through it", args.listen)
    worker = StageWorker(args.bundle, args.stage, args.device, stage_config(args.exact, args.threads),
                         cache_dir=args.cache_dir, wire_dtype="f32" if args.wire_f32 else "f16",
                         limits=worker_limits(args),
                         server_tls=server_context(creds) if creds else None,
                         client_tls=client_context(creds) if creds else None)
    address = worker.listen(host, port)
    print(listening_line(args.stage, address), flush=True)  # how a launcher learns a port 0 address
    if getattr(args, "exit_with_parent", False):
        exit_with_parent(worker.stop)
    terminated = threading.Event()

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.set()
        worker.stop()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        worker.serve_forever()
    except KeyboardInterrupt:
        worker.stop()
    left = worker.drain()
    if terminated.is_set():
        log.info("stage %d: SIGTERM: stopped accepting, %s; exiting", args.stage,
                 f"{left} steps still running after {worker.limits.drain_s:.0f} s" if left else "in-flight steps finished")
    return 0


class Text:
    """Tokenizer and detokenizer from the bundle, or plain ids when it has none; with ``chat``, the chat
    template too: prompts become one user message, and answers stop at the end of the turn."""

    def __init__(self, bundle: Path, m: Manifest, chat: bool = False) -> None:
        self.tok = self.detok = self.plain_tok = None
        self.chat: ChatTemplate | None = None
        self.vocab_size = m.architecture.vocab_size  # token ids given as numbers must be below it
        self.stops = m.generation.eos_token_ids  # what generation stops at
        if m.tokenizer:
            import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)

            core = ov.Core()
            self.tok = core.compile_model(str(bundle / m.tokenizer.tokenizer), "CPU")
            self.detok = core.compile_model(str(bundle / m.tokenizer.detokenizer), "CPU")
            if chat:  # the rendered template holds every special token: the tokenizer adds none (no double BOS)
                self.chat = ChatTemplate.from_manifest(bundle, m)
                self.plain_tok = compile_plain_tokenizer(core, bundle / m.tokenizer.tokenizer)
                self.stops = stop_ids(m)
        elif chat:
            raise OvshardError(f"--chat needs the bundle's tokenizer, and {bundle} has none (its checkpoint had no "
                               "tokenizer the compile could convert): leave out --chat and pass --prompt-ids")

    def encode(self, prompt: str, prompt_ids: str | None, where: str = "--prompt-ids") -> list[int]:
        """``prompt_ids`` parsed and checked against the vocabulary (errors name ``where``), else ``prompt``
        tokenized (with --chat: rendered by the chat template as one user message first)."""
        if prompt_ids is not None:
            if self.chat is not None:
                raise OvshardError(f"{where} with --chat: the chat template takes text; pass --prompt TEXT, or "
                                   "leave out --chat to feed token ids as they are")
            return parse_token_ids(prompt_ids, self.vocab_size, where)
        if self.tok is None:
            raise OvshardError("this bundle has no tokenizer: pass --prompt-ids 1,5,17")
        if self.chat is not None and self.plain_tok is not None:
            return self.encode_conversation([{"role": "user", "content": prompt}])
        return [int(t) for t in self.tok([prompt])["input_ids"][0]]

    def encode_conversation(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation's prompt ids: rendered by the chat template with the generation prompt and tokenized
        without added special tokens (the template wrote them); without a template, the contents one per
        line, tokenized as any prompt (`ovshard chat` and the API's chat endpoint)."""
        if self.chat is not None and self.plain_tok is not None:
            rendered = self.chat.render(messages, add_generation_prompt=True)
            return [int(t) for t in self.plain_tok([rendered])["input_ids"][0]]
        return self.encode("\n".join(m["content"] for m in messages), None)

    def decode(self, ids: list[int]) -> str:
        if self.detok is None:
            return " ".join(map(str, ids)) + " "
        return str(self.detok(np.array([ids], dtype=np.int64))["string_output"][0])

    def answer(self, ids: list[int]) -> str:
        """A chat answer's text: the stop ids left out, and no special token in it."""
        return self.shown(self.decode([t for t in ids if t not in self.stops]))

    def push(self, detok: IncrementalDetokenizer, token: int) -> str:
        """The text ``token`` adds to a streamed completion (an end-of-turn token adds none)."""
        return "" if self.chat is not None and token in self.stops else self.shown(detok.push(token))

    def shown(self, text: str) -> str:
        """``text`` as printed: with --chat, without special tokens (the detokenizer skips those it knows)."""
        return self.chat.clean(text) if self.chat is not None else text


TOKEN_ID = re.compile(r"-?[0-9]+")  # a sign is let through so that a negative id gets the range message


def parse_token_ids(text: str, vocab_size: int, where: str = "--prompt-ids") -> list[int]:
    """The comma-separated token ids in ``text``, each in ``[0, vocab_size)``; OvshardError naming ``where``."""
    parts = [part.strip() for part in text.split(",")]
    shown = text if len(text) <= 60 else text[:57] + "..."
    if not all(TOKEN_ID.fullmatch(part) for part in parts):
        raise OvshardError(f"{where} {shown!r}: expected comma-separated token ids, e.g. 1,403,407")
    ids = [int(part) for part in parts]
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise OvshardError(f"{where} {shown!r}: token id {outside[0]} is outside this bundle's vocabulary; "
                           f"expected ids in [0, {vocab_size}), i.e. 0 to {vocab_size - 1}")
    return ids


def encode_prompts(text: Text, prompts: list[str], path: Path) -> list[list[int]]:
    """The token ids of each prompt of ``--prompts-file path``: tokenized, or without a tokenizer read as ids
    (errors name the file and the prompt, counting non-empty lines from 1)."""
    if text.tok is not None:
        return [text.encode(prompt, None) for prompt in prompts]
    return [text.encode("", line, f"--prompts-file {path}, prompt {n}") for n, line in enumerate(prompts, 1)]


def sampling_config(args: argparse.Namespace, stops: tuple[int, ...]) -> SamplingConfig:
    """--temperature, --top-k, --top-p, --seed and --max-tokens, stopping at ``stops``."""
    try:
        return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              max_tokens=args.max_tokens, eos_token_ids=stops)
    except ValueError as e:
        raise OvshardError(str(e)) from e


def speculation_config(args: argparse.Namespace, m: Manifest) -> Speculation | None:
    """--speculative, --draft-k and --compact-share; None for plain decoding."""
    try:
        policy = CompactionPolicy(hole_share=args.compact_share, limit=m.runtime_hints.max_positions)
    except ValueError as e:
        raise OvshardError(f"--compact-share: {e}") from e
    return make_speculation(args.speculative, args.draft_k, m, config=EXACT_HINTS if getattr(args, "exact", False) else None,
                            policy=policy, target_path=args.bundle)


def make_head(args: argparse.Namespace, addresses: list[str]) -> Head:
    """A head with --credentials, --insecure and --retry-s applied (generate, run and the API server)."""
    creds = _credentials(args)
    remote = [a for a in addresses if not is_loopback(parse_address(a)[0])]
    if creds is None and remote and not args.insecure:
        raise OvshardError(f"--stages {remote[0]}: expected --credentials DIR (made by `ovshard keygen`) to talk "
                           "to a stage beyond this machine, found none; pass --credentials, or --insecure on a "
                           "trusted network")
    return Head(args.bundle, addresses, retry_s=args.retry_s, tls=client_context(creds) if creds else None,
                prefill_chunk=getattr(args, "prefill_chunk", PREFILL_CHUNK))


def _text_and_prompt(args: argparse.Namespace) -> tuple[Text, list[int] | None]:
    """The bundle's tokenizer and the encoded --prompt (None with --prompts-file). A tokenizer's first call
    takes most of a second (the real Gemma 3: 0.8 s), so `run` does this while its stages load."""
    text = Text(args.bundle, read_manifest(args.bundle), chat=args.chat)
    return text, None if args.prompts_file else text.encode(args.prompt, args.prompt_ids)


def _generate(args: argparse.Namespace, addresses: list[str] | None,
              ready: Future[tuple[Text, list[int] | None]] | None = None) -> int:
    """Generate through the stages at ``addresses``, or (None) through every stage in this process;
    ``ready``: the tokenizer and prompt, prepared while the stages loaded."""
    m = read_manifest(args.bundle)
    text, prompt = ready.result() if ready is not None else _text_and_prompt(args)
    config = sampling_config(args, text.stops)
    speculation = speculation_config(args, m)
    if args.prompts_file:
        assert addresses is not None  # run refuses --in-process with --prompts-file
        prompts = _read_prompts(args.prompts_file)
        encoded = encode_prompts(text, prompts, args.prompts_file)
        many = make_head(args, addresses)
        try:
            return _generate_many(args, many, text, prompts, encoded, config, speculation)
        finally:
            many.close()
    assert prompt is not None
    head: Head | LocalPipeline
    if addresses is None:
        head = LocalPipeline(args.bundle, config=stage_config(args.exact, args.threads), slice_logits=True,
                             cache_dir=model_cache(None))
    else:
        head = make_head(args, addresses)
    stats = Stats()
    detok = IncrementalDetokenizer(text.decode)
    if text.tok is not None and args.prompt_ids is None and text.chat is None:  # a chat prints the answer only
        sys.stdout.write(args.prompt)
        for token in prompt:  # the first word's leading space depends on what precedes it
            detok.push(token)
    try:
        for token in head.generate(prompt, config, stats, speculation):
            sys.stdout.write(text.push(detok, token))
            sys.stdout.flush()
        sys.stdout.write(text.shown(detok.flush()) + "\n")
    except OvshardError as e:
        sys.stdout.write(text.shown(detok.flush()) + "\n")
        sys.stdout.flush()
        _print_stats(args, {**stats.to_dict(), "finish_reason": "error"})
        raise OvshardError(f"generation failed after {stats.new_tokens} tokens (printed above): {e}") from e
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
        data = Path(path).read_bytes()
    except OSError as e:
        raise OvshardError(f"--prompts-file {path}: {e.strerror or e}") from e
    try:
        lines = data.decode("utf-8-sig").splitlines()  # a byte-order mark is not part of the first prompt
    except UnicodeDecodeError as e:
        raise OvshardError(f"--prompts-file {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                           f"{e.start}); save it as UTF-8") from e
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise OvshardError(f"--prompts-file {path} has no prompts: write one prompt per line")
    return prompts


def _generate_many(args: argparse.Namespace, head: Head, text: Text, prompts: list[str], encoded: list[list[int]],
                   config: SamplingConfig, speculation: Speculation | None) -> int:
    """Every prompt over --streams concurrent streams; each completion printed as soon as it finishes."""
    start = time.perf_counter()
    finished: queue.Queue[int] = queue.Queue()  # indices of the requests, in the order they finish
    session = Session(head, args.streams, speculation)
    requests: list[Request] = []
    try:
        for i, ids in enumerate(encoded):
            requests.append(session.submit(ids, config, _when_finished(finished, i)))
        for _ in requests:
            _print_completion(text, prompts, encoded, requests[finished.get()])
    except BaseException:  # Ctrl-C or a closed stdout: stop what still runs instead of finishing it
        for request in requests:
            request.cancel()
        raise
    finally:
        session.close()
    wall = time.perf_counter() - start
    total = sum(r.stats.new_tokens for r in requests)
    failed = sum(r.error is not None for r in requests)
    summary = {"prompts": len(requests), "streams": args.streams, "new_tokens": total, "wall_s": round(wall, 3),
               "tokens_per_s": round(total / wall, 2), "failed": failed}
    _print_stats(args, summary)
    return 1 if failed else 0


def _when_finished(finished: queue.Queue[int], index: int) -> Callable[[int | None], None]:
    """A Request listener that puts ``index`` on ``finished`` at the end (the listener's None)."""

    def listener(token: int | None) -> None:
        if token is None:
            finished.put(index)

    return listener


def _print_completion(text: Text, prompts: list[str], encoded: list[list[int]], request: Request) -> None:
    """One finished request's block: ``=== [index] prompt``, its text, and its error line if it failed."""
    print(f"=== [{request.index}] " + (prompts[request.index] if text.tok else ""))
    tokens = request.partial  # all of them, or those generated before a failure
    if text.chat is not None:
        print(text.answer(tokens))
    else:
        print(text.decode(encoded[request.index] + tokens) if text.tok else text.decode(tokens))
    if request.error is not None:
        print(f"error after {len(tokens)} tokens: {request.error}")
    sys.stdout.flush()


def generate(args: argparse.Namespace) -> int:
    return _generate(args, stage_addresses(args.stages))


def run(args: argparse.Namespace) -> int:
    if args.in_process and args.prompts_file:
        raise OvshardError("--in-process runs one prompt at a time: give --prompt, or drop --in-process to "
                           "serve --prompts-file over --streams")
    with ThreadPoolExecutor(1) as pool:
        ready = pool.submit(_text_and_prompt, args)  # while the stages compile (OpenVINO releases the GIL)
        try:
            if args.in_process:
                return _generate(args, None, ready)
            with local_workers(args.bundle, args.exact, threads=args.threads) as addresses:
                args.credentials, args.insecure = None, False  # loopback workers of this process
                return _generate(args, addresses, ready)
        finally:
            ready.cancel()


def stage_addresses(text: str) -> list[str]:
    """The host:port list of --stages."""
    return [a.strip() for a in text.split(",") if a.strip()]
