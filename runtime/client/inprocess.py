"""All stages of a bundle in this process, run one after another: the reference runtime for tests, and
``ovshard run --local --in-process`` (no worker processes, no sockets, no frames: a decode step is the
stages' compute plus the sampler).

The networked runtime sends the same per-step inputs over TCP; this one calls the stages directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openvino as ov

from ovshard.bundle.checked import CheckedFiles
from ovshard.bundle.manifest import read_manifest, verify_files
from ovshard.runtime.decoding import decode
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.decoding.speculative import Speculation
from ovshard.runtime.engine.plugin import describe_plugin_config
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.engine.scores import Scores
from ovshard.runtime.engine.stage import Stage
from ovshard.runtime.wire.protocol import rows_read

log = logging.getLogger(__name__)


class LocalPipeline:
    """Stage-by-stage execution of one stream through every stage of a bundle."""

    def __init__(self, bundle: str | Path, device: str = "CPU", config: dict[str, str] | None = None,
                 verify: bool = True, slice_logits: bool = False, cache_dir: Path | None = None) -> None:
        """``slice_logits``: the last stage computes logits only for the rows ``step``'s want reads (as a
        worker does; ``forward`` then returns every row still). ``cache_dir``: OpenVINO's compiled-model cache."""
        self.bundle = Path(bundle)
        self.manifest = read_manifest(self.bundle)
        if verify:
            verify_files(self.bundle, self.manifest,
                         checked=CheckedFiles.in_cache(cache_dir))
        core = ov.Core()
        if cache_dir is not None:
            core.set_property({"CACHE_DIR": str(cache_dir)})
        log.info("every stage: %s", describe_plugin_config(self.manifest, device, config))
        self.stages = [Stage(self.bundle, self.manifest, i, core, device, config, slice_logits)
                       for i in range(self.manifest.num_stages)]
        self.position = 0
        self.max_positions = self.stages[0].max_positions
        self.vocab_size = self.manifest.architecture.vocab_size

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
        """Nothing to close (the head's interface): the stages go with this object."""

    def generate(self, prompt: list[int], config: SamplingConfig, stats: Stats | None = None,
                 speculation: Speculation | None = None) -> Iterator[int]:
        """decode.generate on this pipeline, from an empty cache."""
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
