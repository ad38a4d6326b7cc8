"""What every benchmark scenario shares: the registry, the models and their cached bundles, decoders
that time greedy decode one way each, and the interleaved A/B measurement.

A scenario is a function ``(Bench) -> dict`` registered with ``@scenario("a", "title")``. The dict it
returns is the scenario's result: ``target`` (what it reports against; never asserted), ``settings``,
``rows`` (a list of flat dicts: the markdown table), ``summary`` (rows for bench/results/summary.md),
optionally ``samples`` (raw data), ``notes`` (lines under the table) and ``plot`` (see report.py).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import harness
import numpy as np
from harness import ROOT, STORIES, machine, median, progress  # noqa: F401  (re-exported: scripts import them here)

DEFAULT_CACHE = Path("/tmp/ovshard-bench")  # shared with bench/compile_memory.py: the 1B checkpoint is written once

# ------------------------------------------------------------------------------------------- registry

ScenarioFn = Callable[["Bench"], dict[str, Any]]


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    run: ScenarioFn


SCENARIOS: dict[str, Scenario] = {}


def scenario(key: str, title: str) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register ``fn`` as scenario ``key`` (selected with ``--only key``)."""

    def register(fn: ScenarioFn) -> ScenarioFn:
        if key in SCENARIOS:
            raise ValueError(f"scenario {key!r} is registered twice ({SCENARIOS[key].run.__name__}, {fn.__name__})")
        SCENARIOS[key] = Scenario(key, title, fn)
        return fn

    return register


# ------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """A model the suite measures, and how much decoding a measurement does on it."""

    name: str
    hidden_size: int
    prompt: tuple[int, ...]  # the same prompt ids for every variant
    new_tokens: int  # generated per measurement: 1 from the prefill + (new_tokens - 1) decode steps
    max_positions: int  # rotary table of the compiled bundles (short contexts only)
    synth_shape: str | None = None  # ovshard.tools.synth preset to write, or None for a checkpoint on disk
    path: Path | None = None


MODELS = {
    "llama-3.2-1b": ModelSpec("llama-3.2-1b", 2048, (128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679,
                                                     13, 578, 4062, 374, 1618, 311),
                              new_tokens=33, max_positions=1024, synth_shape="llama-3.2-1b"),
    "stories260K": ModelSpec("stories260K", 64, (1, 403, 407, 261, 378), new_tokens=129, max_positions=512,
                             path=STORIES),
}


# ------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...]
    rounds: int
    warmup: int
    cache: Path
    results: Path
    rebuild: bool = False
    token_scale: float = 1.0  # --quick: fewer tokens per measurement

    def tokens(self, model: ModelSpec) -> int:
        return max(3, round(model.new_tokens * self.token_scale))


class Bench:
    """The run's settings plus the shared, cached inputs: checkpoints and compiled bundles."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.settings.cache.mkdir(parents=True, exist_ok=True)

    @property
    def models(self) -> list[ModelSpec]:
        return [MODELS[m] for m in self.settings.models]

    def checkpoint(self, model: ModelSpec) -> Path:
        if model.path is not None:
            return model.path
        sys.path.insert(0, str(ROOT / "bench"))
        from compile_memory import ensure_checkpoint  # the same writer and folder as the compile benchmark

        path = self.settings.cache / f"ckpt-{model.synth_shape}-bfloat16"
        ensure_checkpoint(path, model.synth_shape, "bfloat16")
        return path

    def bundle(self, model: ModelSpec, stages: int, weights: str = "int4_sym", skip: tuple[str, ...] = (),
               layers: str | None = None) -> Path:
        """A compiled bundle for this config, from the cache or compiled now (in a subprocess).
        ``layers`` (e.g. "0:12,12:16") replaces the planner's split."""
        config = {"checkpoint": str(self.checkpoint(model)), "stages": stages, "weights": weights,
                  "skip_passes": list(skip), "max_positions": model.max_positions}
        if layers:  # only then, so the cache keys of planner-split bundles stay as they were
            config.update(stages=None, layers=layers)
        key = hashlib.sha256(json.dumps({**config, "code": _compiler_code_hash()}, sort_keys=True).encode())
        name = f"{model.name}-{stages}st-{weights}" + "".join(f"-no{s.removesuffix('Pass')}" for s in skip)
        name += f"-layers{layers.replace(':', '_').replace(',', '-')}" if layers else ""
        out = self.settings.cache / "bundles" / f"{name}-{key.hexdigest()[:10]}"
        if (out / "manifest.json").is_file() and not self.settings.rebuild:
            return out
        progress(f"compiling {name} -> {out}")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", _COMPILE, json.dumps({**config, "output": str(out)})],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        progress(f"  compiled in {time.perf_counter() - start:.0f} s")
        return out


# Compiles in a fresh process so the measuring process never imports torch or NNCF.
_COMPILE = """
import json, logging, sys
from pathlib import Path
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.passes import WeightFormat
logging.basicConfig(level=logging.ERROR)
c = json.loads(sys.argv[1])
layers = tuple(tuple(int(x) for x in r.split(":")) for r in c["layers"].split(",")) if c.get("layers") else None
compile_bundle(CompileConfig(checkpoint=Path(c["checkpoint"]), output=Path(c["output"]), stages=c["stages"],
                             layers=layers, weights=WeightFormat(c["weights"]), max_positions=c["max_positions"],
                             skip_passes=tuple(c["skip_passes"])))
"""


def _compiler_code_hash() -> str:
    """A cached bundle is stale once the code that writes it changes."""
    files = sorted((ROOT / "passes").glob("*.py")) + [ROOT / "ovshard" / f for f in
                                                      ("compile.py", "trace.py", "stage_module.py", "rope.py")]
    digest = hashlib.sha256()
    for f in files:
        if f.is_file():
            digest.update(f.read_bytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------- decoders


@dataclass
class Sample:
    """One greedy generation: ``tokens`` new ids; the decode phase is every step after the prefill."""

    tokens: list[int]
    decode_steps: int
    decode_s: float
    prefill_s: float
    wall_s: float  # the whole generation as the caller saw it, prefill included

    @property
    def tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s


class Decoder(Protocol):
    def greedy(self, prompt: list[int], new_tokens: int) -> Sample: ...


def timed_greedy(forward: Callable[[list[int]], np.ndarray], reset: Callable[[], None], prompt: list[int],
                 new_tokens: int) -> Sample:
    """Greedy decode with ``forward(ids) -> logits [T, V]``; each decode step timed on its own
    (forward of one token + argmax of its logits row)."""
    reset()
    start = time.perf_counter()
    token = int(np.argmax(forward(prompt)[-1]))
    prefill = time.perf_counter() - start
    tokens, steps = [token], []
    for _ in range(new_tokens - 1):
        t0 = time.perf_counter()
        token = int(np.argmax(forward([token])[-1]))
        steps.append(time.perf_counter() - t0)
        tokens.append(token)
    return Sample(tokens, len(steps), sum(steps), prefill, time.perf_counter() - start)


class LocalDecoder:
    """ovshard's in-process runtime: every stage of a bundle in this process (LocalPipeline)."""

    def __init__(self, bundle: Path) -> None:
        from ovshard.runtime.client.inprocess import LocalPipeline

        self.pipeline = LocalPipeline(bundle)

    def greedy(self, prompt: list[int], new_tokens: int) -> Sample:
        return timed_greedy(lambda ids: self.pipeline.forward(ids)[0], self.pipeline.reset, prompt, new_tokens)


class TcpDecoder:
    """ovshard over TCP: a Head in this process, one worker process per stage (addresses given)."""

    def __init__(self, bundle: Path, addresses: list[str]) -> None:
        from ovshard.runtime.client.head import Head

        self.head = Head(bundle, addresses)

    def greedy(self, prompt: list[int], new_tokens: int) -> Sample:
        from ovshard.runtime.client.head import Stats
        from ovshard.runtime.engine.sampler import SamplingConfig

        stats = Stats()
        start = time.perf_counter()
        tokens = list(self.head.generate(prompt, SamplingConfig(max_tokens=new_tokens), stats))
        wall = time.perf_counter() - start
        decode = stats.step_s[1:]  # head-measured round trips; step 0 is the prefill
        return Sample(tokens, len(decode), sum(decode), stats.step_s[0], wall)

    def close(self) -> None:
        self.head.close()


# ------------------------------------------------------------------------------------------- measuring


@dataclass
class Measured:
    """Interleaved samples of several variants: ``samples[variant][round]``."""

    variants: list[str]
    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def tokens_per_s(self, variant: str) -> list[float]:
        return [s.tokens_per_s for s in self.samples[variant]]

    def median_tps(self, variant: str) -> float:
        return median(self.tokens_per_s(variant))

    def ratio(self, variant: str, baseline: str) -> float:
        """Median over rounds of (variant / baseline) in the same round: pairs cancel slow drift."""
        pairs = zip(self.tokens_per_s(variant), self.tokens_per_s(baseline), strict=True)
        return median([a / b for a, b in pairs])

    def raw(self) -> dict[str, Any]:
        return {v: [{**asdict(s), "tokens_per_s": s.tokens_per_s} for s in self.samples[v]] for v in self.variants}


def interleaved(decoders: dict[str, Decoder], prompt: list[int], new_tokens: int, rounds: int, warmup: int,
                label: str = "") -> Measured:
    """for each round: every variant once (the starting variant rotates each round), after warm-up runs."""
    got = harness.interleaved({name: partial(d.greedy, prompt, new_tokens) for name, d in decoders.items()},
                              rounds, warmup, label, timed=False, show=lambda s: f"{s.tokens_per_s:.2f} tok/s")
    return Measured(got.cases, got.samples)
