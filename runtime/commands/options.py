"""Options that several runtime commands share, and the objects they build from them."""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from ovshard.bundle.manifest import Manifest, read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.client.admission import DEFAULT_QUEUE
from ovshard.runtime.client.head import BUDGET, Head
from ovshard.runtime.client.launch import local_workers
from ovshard.runtime.client.local_head import LocalHead
from ovshard.runtime.client.streams import STREAM_SLOTS
from ovshard.runtime.decoding.speculative import Speculation, make_speculation
from ovshard.runtime.engine.kv import CompactionPolicy
from ovshard.runtime.engine.plugin import describe_plugin_config
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.runtime.node.config import model_cache, stage_config
from ovshard.runtime.wire.address import parse_address
from ovshard.runtime.wire.tls import Credentials, client_context, is_loopback, load_credentials

log = logging.getLogger(__name__)

EXACT_HELP = ("f32 inference and KV cache, no dynamic quantization (parity with HF; a step of several tokens "
              "scores each row as one-token steps do)")


def add_pipeline(p: argparse.ArgumentParser) -> None:
    """Where the stages are: --stages host:port,... (workers started with `ovshard serve`) or --local."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--stages", help="host0:7000,host1:7001,... (workers started with `ovshard serve`)")
    where.add_argument("--local", action="store_true", help="start one worker process per stage on loopback")


def add_placement(p: argparse.ArgumentParser) -> None:
    """--in-process / --workers: where `--local` runs the stages (`run`, `chat` and `api`)."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--in-process", action="store_true",
                       help="with --local: every stage in this process, whatever their number: no sockets or "
                            "frames per token, one tick at a time (the default for a one-stage bundle)")
    where.add_argument("--workers", action="store_true",
                       help="with --local: one worker process per stage over loopback TCP even for a one-stage "
                            "bundle (to compare, or to measure the networked path)")


def local_in_process(args: argparse.Namespace) -> bool:
    """Whether `chat` or `api` runs the stages in this process: under ``--local`` as :func:`runs_in_process` says;
    ``--in-process`` or ``--workers`` without ``--local`` is a usage error (they place local stages only)."""
    if getattr(args, "local", False):
        return runs_in_process(args)
    if getattr(args, "in_process", False) or getattr(args, "workers", False):
        raise OvshardError("--in-process and --workers choose where --local runs the "
                           "stages; add --local, or leave them out to use the workers of --stages")
    return False


def runs_in_process(args: argparse.Namespace) -> bool:
    """Whether `--local` runs the stages in this process: --in-process, or a one-stage bundle (a worker process
    would only add a socket's round trip to every step) unless --workers. Says which."""
    stages = read_manifest(args.bundle).num_stages
    in_process = args.in_process or (stages == 1 and not args.workers)
    counted = "one stage" if stages == 1 else f"{stages} stages"
    if in_process:
        kv = "paged" if getattr(args, "kv", "auto") == "auto" else "stateful"
        log.info("%s: running in this process (%s), no worker%s", counted, kv, "" if stages == 1 else "s")
    else:
        log.info("%s: one worker process per stage over loopback TCP", counted)
    return in_process


def add_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--credentials", type=Path, metavar="DIR",
                   help="this node's folder from `ovshard keygen` (ca.pem, cert.pem, key.pem): mutual TLS on "
                   "every link; required beyond loopback unless --insecure")
    p.add_argument("--insecure", action="store_true",
                   help="allow plain TCP beyond loopback without credentials (a trusted network only)")


def add_sampling(p: argparse.ArgumentParser) -> None:
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
    add_decoding(p)


def add_decoding(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
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
    add_prefill(p)


def add_prefill(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="send a prompt through the stages in steps of N tokens, pipelined: stage k computes one "
                   "chunk while stage k+1 computes the one before; 0: the whole prompt in one step (default: "
                   "512 on paged stages, 1.39x quicker to the first token of 2,048 tokens here; one step on "
                   "stateful stages, whose chunks are slower; see docs/runtime.md)")


def add_http(p: argparse.ArgumentParser) -> None:
    """The API server's options (`api`, and `up --api`)."""
    p.add_argument("--streams", type=int, default=None, metavar="N",
                   help="requests generated at once (default: by memory, as many as the KV blocks the stages "
                   "granted this head hold, each reserving its prompt plus its max_tokens, at most "
                   f"{BUDGET.max_seqs}, the planner's sequences at once; {STREAM_SLOTS} over stateful "
                   "stages, a stream each); N: at most N, whatever their size")
    p.add_argument("--queue", type=int, default=DEFAULT_QUEUE, metavar="N",
                   help="requests that may wait, in arrival order, for a place; beyond it 429 with Retry-After "
                   f"(default {DEFAULT_QUEUE}: a waiting request holds only its connection and prompt, so a burst "
                   "is served in turn rather than refused)")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens when a request names none (default 256)")
    p.add_argument("--model", help="the model id clients send (default: the bundle folder's name)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default $OVSHARD_API_KEY); needed to "
                   "listen beyond loopback unless --insecure")
    p.add_argument("--retry-s", type=float, default=30.0,
                   help="reconnect and replay for this long when a stage goes away, then answer 503 (default 30)")
    add_prefill(p)


def credentials(args: argparse.Namespace) -> Credentials | None:
    folder = getattr(args, "credentials", None)
    return load_credentials(folder) if folder is not None else None


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


def stage_addresses(text: str) -> list[str]:
    """The host:port list of --stages."""
    return [a.strip() for a in text.split(",") if a.strip()]


def make_head(args: argparse.Namespace, addresses: list[str]) -> Head:
    """A head with --credentials, --insecure and --retry-s applied (generate, run and the API server)."""
    creds = credentials(args)
    remote = [a for a in addresses if not is_loopback(parse_address(a)[0])]
    if creds is None and remote and not args.insecure:
        raise OvshardError(f"--stages {remote[0]}: expected --credentials DIR (made by `ovshard keygen`) to talk "
                           "to a stage beyond this machine, found none; pass --credentials, or --insecure on a "
                           "trusted network")
    return Head(args.bundle, addresses, retry_s=args.retry_s, tls=client_context(creds) if creds else None,
                prefill_chunk=getattr(args, "prefill_chunk", None))


@contextmanager
def stages_head(args: argparse.Namespace, ignore_sigint: bool = False, **local: Any) -> Iterator[Head | LocalHead]:
    """The stages in this process where :func:`local_in_process` says so (a LocalHead with ``local``'s options and
    the node's --exact, --threads and model cache), else :func:`pipeline_head` (`run`, `chat` and `api`)."""
    if local_in_process(args):
        with LocalHead(args.bundle, config=stage_config(args.exact, args.threads), cache_dir=model_cache(None),
                       **local) as head:
            yield head
        return
    with pipeline_head(args, ignore_sigint) as head:
        yield head


@contextmanager
def pipeline_head(args: argparse.Namespace, ignore_sigint: bool = False) -> Iterator[Head]:
    """The head over ``--stages``, or (``--local``) over one worker process per stage on loopback, which
    stop when the head is done (`run`, `api` and `chat`). ``ignore_sigint``: the local workers ignore SIGINT
    (`chat`: Ctrl-C in a terminal reaches the whole process group, and must stop an answer, not the stages)."""
    with ExitStack() as stack:
        if getattr(args, "local", False):
            # the workers run -q (their exit lines would follow the stats): say here what each compiles with,
            # as they would, from the same bundle, settings and CPU (OVSHARD_CPU_ISA included)
            config = stage_config(args.exact, args.threads)
            log.info("local workers: %s", describe_plugin_config(read_manifest(args.bundle), "CPU", config))
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore_sigint else None
            try:  # an ignored signal stays ignored across exec
                addresses = stack.enter_context(local_workers(args.bundle, args.exact, threads=args.threads,
                                                                kv=getattr(args, "kv", "auto")))
            finally:
                if previous is not None:
                    signal.signal(signal.SIGINT, previous)
            args.credentials, args.insecure = None, False  # loopback workers of this process
        elif args.stages:
            addresses = stage_addresses(args.stages)
        else:
            raise OvshardError(f"ovshard {args.command}: expected --stages host:port,... or --local")
        head = make_head(args, addresses)
        stack.callback(head.close)
        yield head
