"""One compiled stage and the per-stream state a node keeps for it.

A stage is driven step by step: the caller gives the new tokens' inputs (ids or hidden states) and
their positions; the stage keeps the attention mask of everything in its KV cache itself, so only
the new part ever needs to be sent to it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.bundle import names
from ovshard.bundle.manifest import Manifest, StageEntry
from ovshard.errors import BundleError
from ovshard.runtime.engine.kv import KVCache, StepInputs, step_inputs
from ovshard.runtime.engine.logit_rows import slice_logit_rows
from ovshard.runtime.engine.plugin import plugin_config

__all__ = ["EXACT_HINTS", "Stage", "compile_on_device", "plugin_config", "step_inputs"]

log = logging.getLogger(__name__)

# Hints that make a CPU stage compute like the Hugging Face reference (tests, verification): f32 compute and
# KV cache, and no dynamic quantization of activations for compressed weights, so a step of several tokens
# scores each row as a one-token step does (to ~4e-5 on the real Gemma 3 270M; 0.58 with the defaults).
EXACT_HINTS = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def compile_on_device(core: ov.Core, bundle: Path, manifest: Manifest, index: int, device: str,
                  config: dict[str, str] | None, slice_logits: bool) -> tuple[ov.CompiledModel, bool]:
    """Stage ``index`` compiled on ``device`` with ``plugin_config``; with ``slice_logits`` a last stage's
    lm_head gets only the rows each step asks for (logit_rows.py). Returns the model and whether it is sliced."""
    entry = manifest.stages[index]
    log.info("stage %d: compiling %s on %s", index, entry.model_xml, device)
    model = core.read_model(str(Path(bundle) / entry.model_xml))
    sliced = slice_logits and index == manifest.num_stages - 1
    if sliced:
        model = slice_logit_rows(model, manifest.architecture.vocab_size)
    return core.compile_model(model, device, plugin_config(manifest, device, config)), sliced


class Stage:
    """A compiled stage with one stateful InferRequest (one stream)."""

    def __init__(self, bundle: Path, manifest: Manifest, index: int, core: ov.Core | None = None,
                 device: str = "CPU", config: dict[str, str] | None = None, slice_logits: bool = False) -> None:
        if not 0 <= index < manifest.num_stages:
            raise BundleError(f"stage {index} does not exist: the bundle has stages 0..{manifest.num_stages - 1}")
        self.entry: StageEntry = manifest.stages[index]
        self.max_positions = manifest.runtime_hints.max_positions
        self.compiled, self.sliced = compile_on_device(core or ov.Core(), bundle, manifest, index, device, config,
                                                   slice_logits)
        self.cache = KVCache(self.compiled.create_infer_request())
        self.primary = names.INPUT_IDS if index == 0 else names.HIDDEN_STATES
        # The activation output is port 0. A middle stage's output tensor is named hidden_states like
        # its input; OpenVINO's IR reader makes tensor names unique, so it reads back as hidden_states_1.
        self.output = self.compiled.output(0)

    def reset(self) -> None:
        self.cache.reset()

    def step(self, x: np.ndarray, position: int, rewind: int = 0, compact: bool = False,
             rows: int | None = None) -> np.ndarray:
        """Run new tokens through the stage. x: ids [1, T] or hidden [1, T, H]; position: the first's id.

        ``rewind`` hides the newest cached positions first and ``compact`` drops hidden ones (see kv.py);
        ``rows``: on a sliced last stage, the last rows to compute logits for (default: every row).
        """
        rows = (rows or x.shape[1]) if self.sliced else None
        inputs = StepInputs(self.primary, x, position, (1,) * x.shape[1], self.max_positions, rows)
        return self.cache.step(inputs, self.output, rewind, compact).copy()
