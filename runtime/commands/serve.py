"""``ovshard serve``: one stage of a bundle over TCP, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from ovshard.runtime.client.launch import exit_with_parent, listening_line
from ovshard.runtime.commands.options import EXACT_HELP, add_security, credentials
from ovshard.runtime.node.config import Limits, limit_malloc_arenas, stage_config
from ovshard.runtime.node.worker import StageWorker
from ovshard.runtime.wire.address import parse_address
from ovshard.runtime.wire.tls import check_listen_posture, client_context, is_loopback, server_context

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--kv", choices=("auto", "paged", "stateful"), default="auto",
                   help="KV cache: paged (every head's streams batched into one inference a tick; "
                        "prefix reuse), stateful (one cache a stream), auto (default: paged where the stage's "
                        "attention converts, else stateful, logged)")
    p.add_argument("--kv-blocks", type=int, metavar="N",
                   help="paged KV blocks of 32 positions this stage holds for all its heads (default: 16 "
                        "sequences of the bundle's max positions, at most 65,536 positions)")
    p.add_argument("--no-static-decode", dest="static_decode", action="store_false",
                   help="run a paged stage's one-row decode steps on its dynamic model too (default: on a copy "
                        "compiled with static shapes, where the stage's weights are at most 1 GiB and the memory "
                        "available holds them twice; about the weights again in memory, faster a step)")
    p.add_argument("--cache-dir", type=Path, help="compiled-model cache (default: $OVSHARD_CACHE_DIR/ov_cache or "
                   "~/.cache/ovshard/ov_cache; the bundle may be read-only)")
    add_security(p)
    limits = p.add_argument_group("limits", "what one worker grants; anything beyond is refused with an Error")
    limits.add_argument("--max-connections", type=int, default=256, help="open connections (default 256)")
    limits.add_argument("--max-sessions", type=int, default=64, help="connected heads (default 64)")
    limits.add_argument("--max-streams", type=int, default=256, help="open streams over all heads (default 256)")
    limits.add_argument("--max-streams-per-session", type=int, default=32, help="open streams per head (default 32)")
    limits.add_argument("--frame-timeout", type=float, default=30.0,
                        help="seconds a frame that has begun may take to arrive, plus 1 s per MiB (default 30)")
    p.set_defaults(func=run)


def worker_limits(args: argparse.Namespace) -> Limits:
    return Limits(max_connections=args.max_connections, max_sessions=args.max_sessions,
                  max_streams=args.max_streams, max_streams_per_session=args.max_streams_per_session,
                  frame_timeout_s=args.frame_timeout)


def run(args: argparse.Namespace) -> int:
    limit_malloc_arenas()
    host, port = parse_address(args.listen)
    creds = credentials(args)
    check_listen_posture(host, creds, args.insecure)
    if creds is None and not is_loopback(host):
        log.warning("serving %s WITHOUT authentication or encryption (--insecure): anyone who reaches this port "
                    "can use this stage and read what flows through it", args.listen)
    worker = StageWorker(args.bundle, args.stage, args.device, stage_config(args.exact, args.threads),
                         cache_dir=args.cache_dir, wire_dtype="f32" if args.wire_f32 else "f16",
                         limits=worker_limits(args),
                         server_tls=server_context(creds) if creds else None,
                         client_tls=client_context(creds) if creds else None, kv=args.kv,
                         kv_blocks=args.kv_blocks, static_decode=args.static_decode)
    address = worker.listen(host, port)
    terminated = threading.Event()

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.set()
        worker.stop()

    signal.signal(signal.SIGTERM, on_sigterm)  # before the address goes out: a launcher's SIGTERM drains
    if getattr(args, "exit_with_parent", False):
        exit_with_parent(worker.stop)
    print(listening_line(args.stage, address), flush=True)  # how a launcher learns a port 0 address
    try:
        worker.serve_forever()
    except KeyboardInterrupt:
        worker.stop()
    left = worker.drain()
    log.info("stage %d: %s", args.stage, worker.summary())
    if terminated.is_set():
        log.info("stage %d: SIGTERM: stopped accepting, %s; exiting", args.stage,
                 f"{left} steps still running after {worker.limits.drain_s:.0f} s" if left else "in-flight steps finished")
    return 0
