"""``ovshard proxy``: relay TCP with added latency and a bandwidth cap (WAN emulation)."""

from __future__ import annotations

import argparse
import logging
import socket
import time

from ovshard.errors import OvshardError
from ovshard.runtime.tools.wanproxy import DelayProxy
from ovshard.runtime.wire.address import parse_address

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``ovshard proxy``: relay until Ctrl-C, then report the bytes relayed (exit 0)."""
    listen, target = parse_address(args.listen, "--listen"), parse_address(args.target, "--target")
    try:
        socket.getaddrinfo(*target, type=socket.SOCK_STREAM)
    except OSError as e:
        raise OvshardError(f"--target {args.target!r}: cannot resolve {target[0]!r} ({e}); "
                           "give a reachable host name or IP address") from e
    latency_back_ms = args.latency_ms if args.latency_back_ms is None else args.latency_back_ms
    bandwidth = None if args.bandwidth_mbit is None else args.bandwidth_mbit * 1e6 / 8
    try:
        proxy = DelayProxy(listen, target, args.latency_ms / 1e3, latency_back_ms / 1e3, bandwidth)
        proxy.start()
    except ValueError as e:
        raise OvshardError(str(e)) from e
    except OSError as e:
        raise OvshardError(f"cannot listen on {args.listen}: {e.strerror or e}; choose another "
                           "--listen address or port") from e
    cap = f"{args.bandwidth_mbit:g} Mbit/s each way" if bandwidth else "no bandwidth cap"
    logger.info("relaying %s -> %s:%d: %g ms up, %g ms down, %s (Ctrl-C stops)", proxy.address, *target,
                args.latency_ms, latency_back_ms, cap)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    logger.info("stopped: %d bytes up, %d bytes down", proxy.bytes_up, proxy.bytes_down)
    return 0
