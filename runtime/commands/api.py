"""``ovshard api``: an OpenAI-compatible HTTP server over a pipeline."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ovshard.bundle.manifest import read_manifest
from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.scheduler import Scheduler
from ovshard.runtime.client.text import Text
from ovshard.runtime.commands.options import (
    add_http,
    add_pipeline,
    add_placement,
    add_security,
    stages_head,
)
from ovshard.runtime.engine.paged import BLOCK_SIZE, blocks_for
from ovshard.runtime.node.config import kv_pool_blocks
from ovshard.runtime.serve.api import ApiService, serve_api
from ovshard.runtime.wire.address import parse_address
from ovshard.runtime.wire.tls import is_loopback

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API over stage workers",
                       description="One head behind an OpenAI-compatible HTTP server: /v1/models, "
                       "/v1/chat/completions, /v1/completions (stream with server-sent events), /health, /metrics. "
                       "As many requests run at once as the stages' KV memory holds (--streams), the rest wait in "
                       "order (--queue). Needs the api extra: pip install 'ovshard[api]'.")
    p.add_argument("bundle", type=Path)
    add_pipeline(p)
    p.add_argument("--listen", default="127.0.0.1:8000", help="host:port of the HTTP server (default 127.0.0.1:8000)")
    add_http(p)
    p.add_argument("--exact", action="store_true", help="with --local: f32 inference and KV cache")
    p.add_argument("--threads", type=int, help="with --local: CPU threads per stage")
    add_placement(p)
    add_security(p)
    p.set_defaults(func=run)


def run(args: Any, watch: Callable[[Head], Callable[[], None]] | None = None) -> int:
    """``ovshard api``: a head over ``--stages`` (or local workers) and the HTTP server in front of it;
    ``watch(head)`` (``up``: the supervisor that moves the head with the stages) starts once the head is
    there and returns what stops it."""
    host, port = parse_address(args.listen)
    api_key = args.api_key or os.environ.get("OVSHARD_API_KEY") or None
    if api_key is None and not is_loopback(host) and not args.insecure:
        raise OvshardError(f"--listen {args.listen}: expected --api-key KEY (or $OVSHARD_API_KEY) to serve the API "
                           "beyond this machine, found none; pass one, listen on 127.0.0.1, or pass --insecure")
    manifest = read_manifest(args.bundle)
    # in this process: the engine on its own thread, the KV pool a worker's default (the same requests at once)
    slots = max(1, kv_pool_blocks(manifest) // blocks_for(manifest.runtime_hints.max_positions, BLOCK_SIZE))
    with stages_head(args, slots=slots, background=True, prefill_chunk=args.prefill_chunk) as head, \
            ExitStack() as stack:
        if watch is not None:
            assert isinstance(head, Head), "up's supervisor moves a head over workers"
            stack.callback(watch(head))
        session = Scheduler(head, args.streams, max_queue=args.queue)
        stack.callback(session.close)
        text = Text(args.bundle, manifest, chat=manifest.chat is not None and manifest.tokenizer is not None)
        service = ApiService(args.bundle, manifest, head, session, text,
                        model=args.model or Path(args.bundle).resolve().name, default_max_tokens=args.max_tokens)

        def announce(address: str) -> None:
            print(json.dumps({"event": "listening", "api": address}), flush=True)
            log.info("OpenAI-compatible API on http://%s/v1 (model %r)", address, service.model)

        serve_api(service, host, port, announce, api_key)
    return 0
