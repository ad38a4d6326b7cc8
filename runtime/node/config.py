"""How a stage node is set up: its limits, OpenVINO properties, compiled-model cache and allocator."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

from ovshard.bundle.manifest import Manifest
from ovshard.bundle.places import cache_root
from ovshard.errors import OvshardError
from ovshard.runtime.engine.paged import BLOCK_SIZE
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.runtime.wire.framing import DEFAULT_MAX_FRAME
from ovshard.runtime.wire.transport import HANDSHAKE_TIMEOUT_S

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one worker grants: anything beyond is refused with an Error, never allocated."""

    max_connections: int = 256
    max_sessions: int = 64
    max_streams: int = 256  # over all sessions
    max_streams_per_session: int = 32
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S  # TLS handshake and Hello, from accept
    frame_timeout_s: float = 30.0  # a frame that has begun must be whole within this (+ 1 s per MiB)
    pre_auth_frame_bytes: int = 4096  # the Hello's frame
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    drain_s: float = 30.0  # how long SIGTERM waits for in-flight steps

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_sessions", "max_streams", "max_streams_per_session"):
            if getattr(self, name) < 1:
                raise OvshardError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected at least 1")
        if self.frame_timeout_s <= 0 or self.handshake_timeout_s <= 0:
            raise OvshardError("--frame-timeout and the handshake timeout must be positive seconds")


KV_POOL_SEQUENCES = 16  # full-length sequences a paged stage's pool holds by default
KV_POOL_MAX_TOKENS = 1 << 16  # ... but at most this many positions (memory, not a limit on any sequence)


def kv_pool_blocks(manifest: Manifest, block_size: int = BLOCK_SIZE) -> int:
    """The default paged KV pool of a stage: room for KV_POOL_SEQUENCES sequences of the bundle's
    max_positions, capped at KV_POOL_MAX_TOKENS positions but never below one full-length sequence. The
    caches are zeroed lazily by the OS, so blocks never written take no memory."""
    full = -(-manifest.runtime_hints.max_positions // block_size)
    return max(full, min(KV_POOL_SEQUENCES * full, KV_POOL_MAX_TOKENS // block_size))


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


def model_cache(cache_dir: Path | None) -> Path | None:
    """Where OpenVINO keeps this node's compiled models (so a restart skips compiling): ``cache_dir``, or
    ``ov_cache`` in the node's cache ($OVSHARD_CACHE_DIR or ~/.cache/ovshard), never inside the bundle, so a
    bundle may be read-only. None (compile every time, with a warning) when the folder cannot be made."""
    folder = cache_dir or cache_root() / "ov_cache"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("no compiled-model cache: cannot create %s (%s); each start compiles the stage again; pass "
                    "--cache-dir to a writable folder", folder, e.strerror or e)
        return None
    return folder


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas. glibc gives threads that allocate arenas of their own (up to 8 per core)
    and keeps what is freed in each, so a worker with a thread per connection grows its RSS with every
    new thread on a many-core machine; a few shared arenas keep it flat. No-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass
