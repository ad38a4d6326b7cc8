"""The compute side of a stage node: one stage of a bundle loaded in OpenVINO, paged or stateful, and the
Steps and Batches run on it. No sockets: worker.py serves it over TCP.

A stage is loaded with ``slice_logits`` (the default) when it is the last: it computes logits for the rows
each Step's ``want`` reads only (runtime/engine/logit_rows.py); False keeps the bundle's all-rows graph (the
before side of bench/compile/prefill_logits_memory.py).

``kv``: "paged" converts the stage to paged attention (engine/paged.py) and serves Batches from a pool of
``kv_blocks`` KV blocks (None: node/config.kv_pool_blocks); "stateful" keeps one stateful cache a stream and
serves Steps; "auto" (the default) is paged where the stage converts, else stateful with a log line.

``static_decode`` (the default): a paged stage also compiles a copy with a one-row step's static shapes
(engine/static_step.py), and a Batch of one sequence and one row (a lone stream's decode step, every stage's
common case in a one-user pipeline) runs on it; where that copy is refused (weights too large, too little
memory) the refusal is logged at load and every Batch runs the dynamic model.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.bundle import names
from ovshard.bundle.checked import CheckedFiles
from ovshard.bundle.manifest import bundle_fingerprint, read_manifest, verify_files
from ovshard.errors import BundleError, OvshardError, PagedUnsupportedError
from ovshard.runtime.engine.kv import KVCache, StepInputs
from ovshard.runtime.engine.paged import PagedStage, compile_paged
from ovshard.runtime.engine.plugin import describe_plugin_config
from ovshard.runtime.engine.stage import compile_on_device
from ovshard.runtime.node.batches import BatchRun, KVPool, batch_input, run_batch
from ovshard.runtime.node.config import kv_pool_blocks, model_cache
from ovshard.runtime.node.heads import RequestError
from ovshard.runtime.node.steps import check_step, step_input
from ovshard.runtime.wire import protocol as p

log = logging.getLogger(__name__)

__all__ = ["StageBackend"]


class StageBackend:
    """Stage ``stage`` of ``bundle``, its files verified and compiled for ``device`` (the module docstring says
    how ``kv`` and ``slice_logits`` choose the graph); ``paged`` and ``pool`` are set for a paged stage,
    ``compiled`` for a stateful one."""

    def __init__(self, bundle: Path, stage: int, device: str = "CPU", config: dict | None = None,
                 cache_dir: Path | None = None, slice_logits: bool = True, kv: str = "auto",
                 kv_blocks: int | None = None, static_decode: bool = True) -> None:
        self.bundle = Path(bundle)
        self.manifest = read_manifest(self.bundle)
        if not 0 <= stage < self.manifest.num_stages:
            raise BundleError(f"--stage {stage}: the bundle has stages 0..{self.manifest.num_stages - 1}")
        cache = model_cache(cache_dir)
        # files checked before and unchanged since are not read again (a restart's sha256 of the weights)
        verify_files(self.bundle, self.manifest, stages=[stage], checked=CheckedFiles.in_cache(cache))
        self.stage, self.entry = stage, self.manifest.stages[stage]
        self.last = stage == self.manifest.num_stages - 1
        self.fingerprint = bundle_fingerprint(self.bundle)
        self.max_positions = self.manifest.runtime_hints.max_positions
        core = ov.Core()
        if cache is not None:
            core.set_property({"CACHE_DIR": str(cache)})
        log.info("stage %d: %s", stage, describe_plugin_config(self.manifest, device, config))
        self.paged: PagedStage | None = None
        self.pool: KVPool | None = None
        if kv not in ("auto", "paged", "stateful"):
            raise OvshardError(f"--kv {kv!r}: expected auto, paged or stateful")
        if kv != "stateful":
            self._load_paged(core, device, config, kv == "paged", kv_blocks, slice_logits, static_decode)
        if self.paged is None:
            self.compiled, self.sliced = compile_on_device(core, self.bundle, self.manifest, stage, device, config,
                                                           slice_logits)
        self.paged_lock = threading.Lock()  # one inference at a time on the paged caches

    def _load_paged(self, core: ov.Core, device: str, config: dict | None, required: bool,
                    kv_blocks: int | None, slice_logits: bool, static_decode: bool) -> None:
        """The stage with paged attention and its block pool; a stage that does not convert stays stateful
        unless ``required``."""
        try:
            blocks = kv_blocks or kv_pool_blocks(self.manifest)
            self.paged = compile_paged(core, self.bundle, self.manifest, self.stage, device, config, blocks,
                                       slice_logits, static_decode)
            if not static_decode:
                log.info("stage %d: decode steps run the dynamic paged model (--no-static-decode)", self.stage)
            sequence = -(-self.max_positions // self.paged.block_size)
            self.pool, self.sliced = KVPool(blocks, sequence), self.paged.sliced
        except PagedUnsupportedError as e:
            if required:
                raise
            log.info("stage %d: stateful KV cache, one stream at a time per request (no batching): %s",
                     self.stage, e)

    @property
    def static_steps(self) -> int | None:
        """Steps run on the paged stage's static decode copy; None where it has none."""
        return None if self.paged is None or self.paged.decode is None else self.paged.decode.steps

    @property
    def block_size(self) -> int:
        """Positions a KV block holds; 0 for a stateful stage."""
        return 0 if self.paged is None else self.paged.block_size

    def new_stream(self) -> KVCache:
        """A stream's own stateful cache (Open), on a stateful stage."""
        return KVCache(self.compiled.create_infer_request())

    def step_input(self, msg: p.Step, cache: KVCache) -> np.ndarray:
        """The Step's input rows, checked against the stream's cache before anything runs."""
        x = step_input(msg, self.stage, self.manifest.architecture)
        check_step(msg, x.shape[1], cache, self.stage, self.max_positions)
        return x

    def run_step(self, msg: p.Step, cache: KVCache, x: np.ndarray) -> tuple[np.ndarray, float]:
        """Run the Step on its stream's cache: its output (activations, or logits at the last stage) and the
        compute time in seconds."""
        start = time.perf_counter()
        primary = names.INPUT_IDS if self.stage == 0 else names.HIDDEN_STATES
        rows = p.rows_read(msg.want, x.shape[1]) if self.sliced else None
        inputs = StepInputs(primary, x, msg.position, (1,) * x.shape[1], self.max_positions, rows)
        out = cache.step(inputs, self.compiled.output(0), msg.rewind, msg.compact)
        return out, time.perf_counter() - start

    def batch_input(self, msg: p.Batch, grant: np.ndarray | None) -> np.ndarray:
        """The Batch's input rows, checked before anything runs: a paged stage, a session with blocks."""
        if self.paged is None or grant is None:
            raise RequestError("refused", f"stage {self.stage} holds no paged KV blocks for this session (a "
                                          "stateful stage, or a Hello without kv_blocks): send Steps")
        if len(msg.timings) > self.stage:
            raise RequestError("failed", f"Batch {msg.tick}: {len(msg.timings)} timings, but only {self.stage} "
                                         f"stages come before stage {self.stage}")
        return batch_input(msg, self.stage, self.manifest.architecture)

    def run_batch(self, msg: p.Batch, grant: np.ndarray, x: np.ndarray) -> BatchRun:
        """Run the Batch's rows in the session's granted blocks, one inference (rows it cannot run refused)."""
        assert self.paged is not None, "batch_input checks the stage is paged"
        return run_batch(self.paged, grant, msg, x, self.stage, self.paged_lock)
