"""All stages of a bundle in this process, run one after another, one sequence at a time: the stage loader of
``ovshard run --local`` without workers (client/local_head.py, whose stages the engine drives), and
:class:`LocalPipeline`, the reference that ``ovshard verify`` and the tests compare against (its forward pass,
greedy loop and decoding/decode.py's loop, none of which any command generates with).

A stage is
stateful (engine/stage.py: its own ReadValue/Assign cache and attention mask) or, with ``paged=True``, paged
(engine/paged.py: one sequence whose block table covers the bundle's ``max_positions``), the form a worker
loads by default. A paged stage attends to positions [0, position + T) of its caches, so a rewind needs no
work (the rejected drafts' rows are overwritten by the next step) and compaction has nothing to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.bundle.checked import CheckedFiles
from ovshard.bundle.manifest import Manifest, read_manifest, verify_files
from ovshard.errors import BundleError, PagedUnsupportedError
from ovshard.runtime.decoding import decode
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.paged import BLOCK_SIZE, PagedRows, PagedStage, blocks_for, compile_paged
from ovshard.runtime.engine.plugin import describe_plugin_config
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.engine.stage import Stage
from ovshard.runtime.wire.protocol import rows_read

log = logging.getLogger(__name__)


class OneSequence:
    """A paged stage serving one sequence, with Stage's step: ids [1, T] or hidden [1, T, H] in, [1, T, H]
    (or logits [1, T|rows, V]) out. The sequence owns every block, table 0..n-1 (n covers max_positions)."""

    def __init__(self, paged: PagedStage) -> None:
        if paged.num_blocks * paged.block_size < paged.max_positions:
            raise BundleError(f"a paged stage of {paged.num_blocks} blocks of {paged.block_size} positions cannot "
                              f"hold the bundle's {paged.max_positions} positions; expected blocks of "
                              f"{BLOCK_SIZE} (the CPU plugin's)")
        self.paged, self.sliced = paged, paged.sliced
        self.table = range(paged.num_blocks)

    def reset(self) -> None:
        """Nothing to clear: a step at position p attends to [0, p + T) only, and a new sequence starts at 0."""

    def step(self, x: np.ndarray, position: int, rewind: int = 0, compact: bool = False,
             rows: int | None = None) -> np.ndarray:
        """``position``: the visible length, where the new rows go (rows past it, rejected drafts, are
        overwritten), so ``rewind`` and ``compact`` need no work; ``rows`` as Stage.step's."""
        want = (rows or x.shape[1]) if self.sliced else None
        (out,) = self.paged.run([PagedRows(x[0], position, self.table, want)])  # x[0]: ids [T] or rows [T, H]
        return out[np.newaxis]  # [T, H|V] -> [1, T, H|V]


def load_stages(bundle: Path, device: str, config: dict[str, str] | None, verify: bool, slice_logits: bool,
                cache_dir: Path | None, paged: bool, static_decode: bool = True,
                slots: int = 1) -> tuple[Manifest, list[PagedStage | Stage]]:
    """The bundle's manifest and every stage compiled in this process: paged (caches for ``slots`` sequences of
    the bundle's ``max_positions``) when ``paged`` and the stage converts, else stateful (logged);
    ``static_decode``: a paged stage's one-token steps run a copy compiled with static shapes
    (engine/static_step.py; a second compile and the plugin's packed weights again). ``cache_dir``: OpenVINO's
    compiled-model cache."""
    manifest = read_manifest(bundle)
    if verify:
        verify_files(bundle, manifest, checked=CheckedFiles.in_cache(cache_dir))
    core = ov.Core()
    if cache_dir is not None:
        core.set_property({"CACHE_DIR": str(cache_dir)})
    log.info("every stage: %s", describe_plugin_config(manifest, device, config))
    blocks = slots * blocks_for(manifest.runtime_hints.max_positions, BLOCK_SIZE)
    stages: list[PagedStage | Stage] = []
    for index in range(manifest.num_stages):
        if paged:
            try:
                stages.append(compile_paged(core, bundle, manifest, index, device, config, blocks, slice_logits,
                                            static_decode))
                continue
            except PagedUnsupportedError as e:
                log.info("stage %d: stateful KV cache (its paged form is refused): %s", index, e)
        stages.append(Stage(bundle, manifest, index, core, device, config, slice_logits))
    return manifest, stages


class LocalPipeline:
    """Stage-by-stage execution of one stream through every stage of a bundle: the reference (module docstring)."""

    def __init__(self, bundle: str | Path, device: str = "CPU", config: dict[str, str] | None = None,
                 verify: bool = True, slice_logits: bool = False, cache_dir: Path | None = None,
                 paged: bool = False, static_decode: bool = True) -> None:
        """``slice_logits``: the last stage computes logits only for the rows ``step``'s want reads (as a
        worker does; ``forward`` then returns every row still). ``cache_dir``: OpenVINO's compiled-model cache.
        ``paged``: each stage in paged form (a stage that cannot be converted stays stateful, logged), its
        one-token steps on a copy compiled with static shapes unless ``static_decode`` is False (that copy
        costs a second compile and the plugin's packed weights again: engine/static_step.py)."""
        self.bundle = Path(bundle)
        self.manifest, stages = load_stages(self.bundle, device, config, verify, slice_logits, cache_dir, paged,
                                            static_decode)
        self.stages = [OneSequence(s) if isinstance(s, PagedStage) else s for s in stages]
        self.position = 0
        self.max_positions = self.manifest.runtime_hints.max_positions
        self.vocab_size = self.manifest.architecture.vocab_size
        self.hops = 1  # for Stats: no network, so a step's time beyond compute is one "hop" in this process

    def reset(self) -> None:
        for stage in self.stages:
            stage.reset()
        self.position = 0

    def _traverse(self, tokens: list[int], position: int, rewind: int = 0, compact: bool = False,
                  rows: int | None = None) -> tuple[list[np.ndarray], dict[str, float]]:
        """Every stage in turn; returns each stage's output and the seconds each took."""
        x = np.array([tokens], dtype=np.int64)  # [1, T]
        outputs, timings = [], {}
        for i, stage in enumerate(self.stages):
            start = time.perf_counter()
            x = stage.step(x, position, rewind=rewind, compact=compact, rows=rows)
            timings[f"stage{i}"] = time.perf_counter() - start
            outputs.append(x)
        self.position = position + len(tokens)
        return outputs, timings

    def forward(self, token_ids: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Feed new tokens; return logits [T, vocab] and each stage boundary's hidden states."""
        outputs, _ = self._traverse(token_ids, self.position)
        return outputs[-1][0], outputs[:-1]

    def step(self, tokens: list[int], position: int, want: str, rewind: int = 0, compact: bool = False) -> Scores:
        """One traversal as the networked runtime does it (decode.Target): rewind, compact, run, score."""
        outputs, timings = self._traverse(tokens, position, rewind, compact, rows_read(want, len(tokens)))
        return Scores.from_logits(outputs[-1][0], want, timings)

    def close(self) -> None:
        """Nothing to close: the stages go with this object."""

    def generate(self, prompt: list[int], config: SamplingConfig, stats: Stats | None = None,
                 speculation: Speculation | None = None) -> Iterator[int]:
        """decode.generate on this pipeline, from an empty cache: the reference decode loop of the tests
        (speculation, rewinds and compaction on stateful caches included)."""
        self.reset()
        return decode.generate(self, prompt, config, stats, speculation)

    def generate_greedy(self, prompt: list[int], max_new_tokens: int,
                        eos_ids: tuple[int, ...] = ()) -> tuple[list[int], list[np.ndarray]]:
        """Greedy decode; returns the new tokens and the logits row that chose each."""
        self.reset()
        logits, _ = self.forward(prompt)
        tokens, rows = [], []
        for _ in range(max_new_tokens):
            row = logits[-1]
            token = int(np.argmax(row))
            tokens.append(token)
            rows.append(row)
            if token in eos_ids:
                break
            logits, _ = self.forward([token])
        return tokens, rows
