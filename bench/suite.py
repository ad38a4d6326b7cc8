#!/usr/bin/env python
"""The ovshard benchmark suites' one entry point: the runtime scenarios in-process, the other suites' scripts
(bench/suites.py) one after another.

    CI=true .venv/bin/python bench/suite.py --list                     # every suite and script, what it measures
    CI=true .venv/bin/python bench/suite.py --suite batching --quick   # a suite's smoke run on stories260K
    CI=true .venv/bin/python bench/suite.py --suite compile,kernels    # full runs (make bench runs them)

Runtime scenarios (``--only a,c`` selects; each writes bench/results/<key>.{json,md,png}, then summary.md):

  a  2- and 4-stage pipelines vs one stage, in-process (LocalPipeline) and over loopback TCP
  b  with vs without the beam_idx Gather (InjectBeamIdxGatherPass), and whether the CPU fused SDPA
  c  ovshard one stage vs openvino_genai.LLMPipeline (SDPA and PA backends) on the same bundle
  f  bytes on the wire per decode step, per hop
  g  achieved decode rate vs a memory-bandwidth bound

Models: a random-weight Llama-3.2-1B-shaped checkpoint (INT4 bundles) and the trained stories260K.
Variants of a scenario run interleaved in one process (round after round, every variant once) and
ratios are medians of per-round ratios: timings here drift +-50% between processes. Checkpoints and
bundles are cached under ``--cache``, keyed by their config and the compiler's source.

Reproduce the runtime suite (the default ``--suite runtime``; from the repository root)::

    CI=true .venv/bin/python bench/suite.py              # everything (~10-15 min once compiled)
    CI=true .venv/bin/python bench/suite.py --quick      # stories260K only, fewer rounds and tokens
    CI=true .venv/bin/python bench/suite.py --only a,c --models llama-3.2-1b

To add a scenario: a function ``(Bench) -> dict`` decorated with ``@scenario("key", "title")`` in a
``bench/scenarios_*.py`` module (see scenarios_base.py for the dict it returns); every such module is
imported at start, so nothing here needs to change.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("CI", "true")  # before openvino/nncf load: no telemetry forks, also in worker processes

import report  # noqa: E402
import suites  # noqa: E402
from scenarios_base import DEFAULT_CACHE, MODELS, ROOT, SCENARIOS, Bench, Settings, machine, progress  # noqa: E402

for _module in sorted(Path(__file__).parent.glob("scenarios_*.py")):
    if _module.stem != "scenarios_base":
        importlib.import_module(_module.stem)  # each registers its scenarios (decode: a b c g; wire: f)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default=suites.RUNTIME,
                        help=f"comma-separated suites, from {','.join(suites.SUITES)} (default {suites.RUNTIME})")
    parser.add_argument("--list", action="store_true", help="print every suite's scripts and arguments, then exit")
    parser.add_argument("--only", default=",".join(sorted(SCENARIOS)),
                        help=f"comma-separated scenario keys (default all: {','.join(sorted(SCENARIOS))})")
    parser.add_argument("--models", default=None, help=f"comma-separated, from {','.join(MODELS)} (default all; "
                        "--quick: stories260K)")
    parser.add_argument("--quick", action="store_true", help="smoke run: stories260K only, 2 rounds, 1/4 of the tokens "
                        "(other suites: each script's quick arguments)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per scenario (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed generations per variant first (default 1)")
    parser.add_argument("--token-scale", type=float, default=None,
                        help="new tokens per generation, as a multiple of each model's default (default 1; --quick "
                             "0.25): more weighs decode over prefill")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"checkpoints and compiled bundles (default {DEFAULT_CACHE})")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--rebuild", action="store_true", help="recompile bundles even when cached")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    models = args.models or ("stories260K" if args.quick else ",".join(MODELS))
    chosen = tuple(m.strip() for m in models.split(",") if m.strip())
    unknown = [m for m in chosen if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; expected names from {list(MODELS)}")
    return Settings(models=chosen, rounds=args.rounds or (2 if args.quick else 3), warmup=args.warmup,
                    cache=args.cache.resolve(), results=args.results.resolve(), rebuild=args.rebuild,
                    token_scale=args.token_scale or (0.25 if args.quick else 1.0))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print(suites.inventory())
        return 0
    names = [n.strip() for n in args.suite.split(",") if n.strip()]
    suites.steps(names)  # unknown names fail here, before anything runs
    failed = [f for n in names for f in (scenarios(args, argv) if n == suites.RUNTIME else run_steps(args, n))]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def scenarios(args: argparse.Namespace, argv: list[str] | None) -> list[str]:
    """The runtime suite: each chosen scenario in this process, then summary.md."""
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--only: unknown scenario(s) {unknown}; expected keys from {list(SCENARIOS)}")
    bench = Bench(settings_from(args))
    command = "CI=true .venv/bin/python bench/suite.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    facts = machine()
    for key in keys:
        s = SCENARIOS[key]
        progress(f"scenario {key}: {s.title} (models: {', '.join(bench.settings.models)})")
        start = time.perf_counter()
        result = s.run(bench)
        md = report.write_scenario(bench.settings.results, key, s.title, result, facts, command.strip())
        progress(f"scenario {key} done in {time.perf_counter() - start:.0f} s -> {md}")
        print(md.read_text())
    summary = report.write_summary(bench.settings.results)
    print(summary.read_text())
    print(f"results: {bench.settings.results}")
    return []


def run_steps(args: argparse.Namespace, name: str) -> list[str]:
    """A suite's scripts, each in its own process (full or quick arguments); the names of those that failed."""
    bench, stories = Bench(settings_from(args)), MODELS["stories260K"]
    fill = {"{bundle}": lambda: str(bench.bundle(stories, 2, "fp32")),
            "{bundle1}": lambda: str(bench.bundle(stories, 1, "fp32")),
            "{stories}": lambda: str(stories.path), "{cache}": lambda: str(bench.settings.cache)}
    failed = []
    for _, step in suites.steps([name]):
        chosen = step.quick if args.quick else step.full
        if chosen is None:
            progress(f"{name}: {step.script} skipped ({'no quick mode' if args.quick else 'run by hand'})")
            continue
        command = [sys.executable, str(ROOT / "bench" / f"{step.script}.py"), *(filled(a, fill) for a in chosen)]
        progress(f"{name}: {shlex.join(command[1:])}")
        if subprocess.run(command, cwd=ROOT, check=False).returncode != 0:
            failed.append(f"{name}/{step.script}")
    return failed


def filled(arg: str, fill: dict[str, Callable[[], str]]) -> str:
    """``arg`` with each placeholder in it (``{bundle}``, ...) made and put in."""
    for key, make in fill.items():
        if key in arg:
            arg = arg.replace(key, make())
    return arg


if __name__ == "__main__":
    sys.exit(main())
