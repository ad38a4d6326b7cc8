"""``ovshard generate`` (through stage workers) and ``ovshard run --local`` (in this process, or workers of its own).

Either way every token comes from the engine loop (scheduling/engine.py): over a chain of workers (Head), or over
the stages in this process (LocalHead, client/local_head.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from ovshard.bundle.manifest import read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.local_head import LocalHead
from ovshard.runtime.client.scheduler import Scheduler
from ovshard.runtime.client.text import Text, TextStream, encode_prompts
from ovshard.runtime.commands.options import (
    EXACT_HELP,
    add_placement,
    add_sampling,
    add_security,
    pipeline_head,
    sampling_config,
    speculation_config,
    stages_head,
)
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.scheduling.requests import Request

log = logging.getLogger(__name__)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text through stage workers",
                       description="Connect to every stage (one host:port per stage, in order), stream the "
                       "generated text to stdout and timings to stderr.")
    p.add_argument("bundle", type=Path, help="the same bundle the workers serve (manifest and tokenizer)")
    p.add_argument("--stages", required=True, help="host0:7000,host1:7001,...")
    add_security(p)
    add_sampling(p)
    p.set_defaults(func=generate)


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate on this machine: in this process, or a local worker process per stage",
                       description="Everything on this machine. A one-stage bundle runs in this process (paged "
                       "attention, no worker); otherwise one `ovshard serve` process per stage on loopback. Either "
                       "way the same engine loop schedules every prompt, as `ovshard generate` would.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--local", action="store_true", required=True, help="everything on this machine")
    p.add_argument("--exact", action="store_true", help=EXACT_HELP)
    p.add_argument("--threads", type=int, help="CPU threads per stage (default: all)")
    add_placement(p)
    p.add_argument("--kv", choices=("auto", "stateful"), default="auto",
                   help="KV cache of every stage: auto (paged where a stage converts, else stateful) or stateful "
                        "(one ReadValue/Assign cache a stream, as `serve --kv stateful`)")
    add_sampling(p)
    p.set_defaults(func=run)


def _text_and_prompt(args: argparse.Namespace, pieces: bool = False) -> tuple[Text, list[int] | None]:
    """The bundle's tokenizer and the encoded --prompt (None with --prompts-file). A tokenizer's first call
    takes most of a second (the real Gemma 3: 0.8 s), so `run` does this while its stages load, and builds the
    detokenizer's ``pieces`` then too: a plain token's text is looked up instead of decoded twice, 0.5 ms a
    token on 2 cores (SmolLM2-135M; the pieces of its 49,152 tokens take 0.26 s)."""
    text = Text(args.bundle, read_manifest(args.bundle), chat=args.chat)
    prompt = None if args.prompts_file else text.encode(args.prompt, args.prompt_ids)
    if pieces:
        text.pieces()
    return text, prompt


def _generate(args: argparse.Namespace, open_head: Callable[[], AbstractContextManager[Head | LocalHead]],
              ready: Future[tuple[Text, list[int] | None]] | None = None) -> int:
    """Generate through the head ``open_head`` gives (opened once the prompts are read and checked); ``ready``:
    the tokenizer and prompt, prepared while the stages loaded."""
    m = read_manifest(args.bundle)
    text, prompt = ready.result() if ready is not None else _text_and_prompt(args)
    config = sampling_config(args, text.stops)
    speculation = speculation_config(args, m)
    if args.prompts_file:
        prompts = _read_prompts(args.prompts_file)
        encoded = encode_prompts(text, prompts, args.prompts_file)
        with open_head() as head:
            return _generate_many(args, head, text, prompts, encoded, config, speculation)
    assert prompt is not None
    with open_head() as head:
        return _generate_one(args, head, text, prompt, config, speculation)


def _generate_one(args: argparse.Namespace, head: Head | LocalHead, text: Text, prompt: list[int],
                  config: SamplingConfig, speculation: Speculation | None) -> int:
    """One prompt's completion streamed to stdout as it is sampled; the stats on stderr."""
    stats = Stats()
    echo = text.tok is not None and args.prompt_ids is None and text.chat is None  # a chat prints the answer only
    if echo:
        sys.stdout.write(args.prompt)
    shown = TextStream(text, prompt if echo else [])  # what is printed continues the printed prompt
    try:
        for token in head.generate(prompt, config, stats, speculation):
            sys.stdout.write(shown.push(token))
            sys.stdout.flush()
        sys.stdout.write(shown.finish() + "\n")
    except OvshardError as e:
        sys.stdout.write(shown.finish() + "\n")
        sys.stdout.flush()
        _print_stats(args, {**stats.to_dict(), "finish_reason": "error"})
        raise OvshardError(f"generation failed after {stats.new_tokens} tokens (printed above): {e}") from e
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


def _generate_many(args: argparse.Namespace, head: Head | LocalHead, text: Text, prompts: list[str], encoded: list[list[int]],
                   config: SamplingConfig, speculation: Speculation | None) -> int:
    """Every prompt over --streams concurrent streams; each completion printed as soon as it finishes."""
    start = time.perf_counter()
    finished: queue.Queue[int] = queue.Queue()  # indices of the requests, in the order they finish
    session = Scheduler(head, args.streams, speculation)
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
    return _generate(args, lambda: pipeline_head(args))


def run(args: argparse.Namespace) -> int:
    with ThreadPoolExecutor(1) as pool:
        ready = pool.submit(_text_and_prompt, args, True)  # while the stages load (OpenVINO releases the GIL)
        try:  # in this process: caches for as many full-length sequences as run at once
            with stages_head(args, paged=args.kv == "auto", slots=args.streams if args.prompts_file else 1,
                             background=bool(args.prompts_file)) as head:
                return _generate(args, lambda: nullcontext(head), ready)
        finally:
            ready.cancel()
