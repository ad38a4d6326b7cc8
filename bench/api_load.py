#!/usr/bin/env python
"""Load on `ovshard api`: requests/s, tokens/s, time to first token and inter-token latency at 1, 2, 4, 8
concurrent clients, and the API's cost per token against the bare Scheduler over the same workers.

Per model it starts real processes: one ``ovshard serve`` per stage on loopback (``--threads 1`` each, as
scenario d: one core per stage stands in for one machine per stage) and one ``ovshard api --stages ...``
in front of them (``--streams`` and ``--queue`` = the most clients). This process holds a second head
over the same workers. Two sides, same prompt ids, greedy (temperature 0), same max_tokens, no
speculation (``ovshard api`` runs none), same number of concurrent streams:

  api      N asyncio clients (``openai.AsyncOpenAI``), each a closed loop of ``--requests`` streamed
           ``/v1/completions`` requests (token-id prompts, ``stream_options.include_usage``)
  session  N threads, each a closed loop of ``Scheduler.submit(...).result()`` on an in-process ``Head``

Each round runs every client count on both sides, the side that goes first alternating; the per-token
time (round wall / tokens generated) of api over session, per round, gives the overhead as a median of
per-round ratios (timings drift +-50% between processes here). Both sides must produce the same tokens:
every prompt's completion token count and text are compared across sides and rounds.

Models (``--models``): ``stories260K`` (the default: the trained tiny checkpoint in ../shared/models,
compiled to 2 stages with fp32 weights; a step is a few ms of framework overhead, so the API's cost shows
at its largest) and ``llama-3.2-1b`` (a random-weight Llama-3.2-1B shape from ``ovshard synth``, 2 stages,
INT4: a step of a real model's size, 0.1-0.3 s here with one thread a stage). Bundles are cached in /tmp/ovshard-bench with the suite's (compiled
in a subprocess on first use: ~15 s and ~2 min). ``--bundle PATH`` measures a bundle of yours instead.

    .venv/bin/python bench/api_load.py --quick          # smoke run: stories260K, 1 and 2 clients (~30 s)
    .venv/bin/python bench/api_load.py                  # stories260K: 1, 2, 4, 8 clients x 4 requests, 3 rounds
    .venv/bin/python bench/api_load.py --models stories260K,llama-3.2-1b --requests 2   # what `make bench` runs
    .venv/bin/python bench/api_load.py --bundle out/ --clients 1,4 --tokens 64

Besides the rates and latencies it records CPU time per generated token: of the `ovshard api` process and
of this one during api rounds (the load generator), of this one during session rounds (head + Scheduler),
and of the incremental detokenizer alone (with the plain pieces the server builds at start); on a 2-core
machine every ms of it is taken from the workers.

Writes bench/results/api_load.json (every figure, each round's samples, machine, versions, bundles and
arguments) and bench/results/api_load.png; prints the table on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

os.environ.setdefault("CI", "true")  # before openvino loads: no telemetry forks, also in the child processes

import numpy as np  # noqa: E402
import report  # noqa: E402
from scenarios_base import DEFAULT_CACHE, MODELS, ROOT, Bench, ModelSpec, Settings, machine, median, progress  # noqa: E402
from scenarios_streams import PROMPTS  # noqa: E402

from ovshard.bundle.manifest import read_manifest  # noqa: E402
from ovshard.runtime.client.head import Head  # noqa: E402
from ovshard.runtime.client.launch import local_workers  # noqa: E402
from ovshard.runtime.client.scheduler import Scheduler  # noqa: E402
from ovshard.runtime.client.text import Text, TextStream  # noqa: E402
from ovshard.runtime.engine.sampler import SamplingConfig  # noqa: E402

TARGET_OVERHEAD = 0.05  # API per-token time <= 1.05x the bare Scheduler's (reported, never asserted)
SIDES = ("api", "session")
WEIGHTS = {"stories260K": "fp32", "llama-3.2-1b": "int4_asym"}
API_START_S = 180.0


@dataclass(frozen=True)
class Plan:
    """One run's settings (the command line, checked)."""

    models: tuple[str, ...]  # ignored when ``bundle`` is given
    bundle: Path | None  # --bundle: measure this compiled bundle instead
    clients: tuple[int, ...]
    requests: int  # per client, per round
    tokens: int | None  # max_tokens per request; None: 128 for stories260K, 32 for llama-3.2-1b, 64 for --bundle
    rounds: int
    threads: int
    exact: bool
    cache: Path
    results: Path
    rebuild: bool

    def max_tokens(self, model: ModelSpec | None) -> int:
        return self.tokens or (model.new_tokens - 1 if model is not None else 64)


@dataclass
class Reply:
    """One request as its client saw it."""

    prompt: int  # index into the model's prompts
    tokens: int  # completion tokens (api: usage.completion_tokens; session: tokens sampled)
    text: str
    finish: str
    ttft_s: float  # request sent -> first text (api) or first token (session)
    gaps_s: list[float]  # between consecutive text chunks (api) or tokens (session)


@dataclass
class Round:
    """One side at one client count: every client's closed loop, start to the last reply."""

    wall_s: float
    replies: list[Reply]
    cpu_s: dict[str, float]  # CPU seconds (all threads) during the round: "server" (the process holding the
    # head: `ovshard api`, or this one for session) and, for api, "client" (this process: the load generator)
    detok_s: float = 0.0  # session: the time api_text took for every reply, after the round (not in wall_s)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.replies)

    def summary(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall_s, 4), "requests": len(self.replies), "tokens": self.tokens,
                "requests_per_s": round(len(self.replies) / self.wall_s, 3),
                "tokens_per_s": round(self.tokens / self.wall_s, 2),
                "ms_per_token": round(1000 * self.wall_s / self.tokens, 4),
                **{f"{k}_cpu_ms_per_token": round(1000 * v / self.tokens, 4) for k, v in self.cpu_s.items()},
                "ttft_ms": [round(1000 * r.ttft_s, 3) for r in self.replies]}


STORY_OPENINGS = ("Once upon a time", "The little dog", "One day, a girl named Lily", "Tom had a red ball",
                  "The sun was hot and", "In the big forest", "Mom said to Ben", "A bird sat on the tree")


def prompts_for(model: ModelSpec | None, text: Text, vocab: int) -> list[list[int]]:
    """Eight distinct prompts: client i's request j takes prompt (i + j) mod 8. The suite's ids for its models;
    for another bundle (--bundle), story openings through its tokenizer, or fixed ids without one."""
    if model is not None:
        if model.name in PROMPTS:
            return PROMPTS[model.name]
        return [list(model.prompt[:len(model.prompt) - i]) for i in range(8)]  # prefixes of the suite's prompt
    if text.tok is not None:
        return [text.encode(opening, None) for opening in STORY_OPENINGS]
    return [[(1 + 7919 * (8 * i + k)) % vocab for k in range(4 + i % 4)] for i in range(8)]


# ------------------------------------------------------------------------------------------- the two sides


class ApiServer:
    """An ``ovshard api`` process over running stage workers; ``url`` once it listens."""

    def __init__(self, bundle: Path, addresses: list[str], streams: int, model: str) -> None:
        self.command = [sys.executable, "-m", "ovshard.cli", "-q", "api", str(bundle), "--stages", ",".join(addresses),
                        "--listen", "127.0.0.1:0", "--streams", str(streams), "--queue", str(streams),
                        "--model", model]
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        try:
            self.url = f"http://{self._listening()}/v1"
        except BaseException:
            self.stop()
            raise

    def _listening(self) -> str:
        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], API_START_S)
        line = stdout.readline() if ready else ""
        if not line:
            raise SystemExit(f"`{shlex.join(self.command)}` did not report a listening address within "
                             f"{API_START_S:.0f} s (exit code {self.process.poll()}); its error is above")
        return str(json.loads(line)["api"])

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far (every thread; Linux /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def _api_client(client: Any, model: str, prompts: list[list[int]], first: int, requests: int,
                      tokens: int) -> list[Reply]:
    replies = []
    for j in range(requests):
        index = (first + j) % len(prompts)
        start = time.perf_counter()
        times, parts, count, finish = [], [], -1, ""
        stream = await client.completions.create(model=model, prompt=prompts[index], max_tokens=tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.text:
                    times.append(time.perf_counter())
                    parts.append(choice.text)
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
        times = times or [time.perf_counter()]  # no text at all (an eos first): the end stands for the first text
        replies.append(Reply(index, count, "".join(parts), finish, times[0] - start, list(np.diff(times))))
    return replies


def api_round(server: ApiServer, model: str, prompts: list[list[int]], clients: int, requests: int,
              tokens: int) -> Round:
    """``clients`` asyncio tasks, each ``requests`` streamed completions one after another."""
    import openai

    async def run() -> Round:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600) as client:
            cpu, server_cpu, start = time.process_time(), server.cpu_s(), time.perf_counter()
            per_client = await asyncio.gather(*(_api_client(client, model, prompts, i, requests, tokens)
                                                for i in range(clients)))
            wall = time.perf_counter() - start
            used = {"server": server.cpu_s() - server_cpu, "client": time.process_time() - cpu}
            return Round(wall, [r for replies in per_client for r in replies], used)

    return asyncio.run(run())


def session_round(head: Head, text: Text, prompts: list[list[int]], clients: int, requests: int,
                  config: SamplingConfig) -> Round:
    """``clients`` threads over a ``Scheduler(head, clients)``, each ``requests`` generations one after another."""
    session = Scheduler(head, clients)
    replies: list[list[tuple[int, float, list[float], Any]]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            for j in range(requests):
                index, times = (i + j) % len(prompts), list[float]()
                start = time.perf_counter()
                request = session.submit(prompts[index], config, _stamper(times))
                request.result()
                replies[i].append((index, start, times, request))
        except BaseException as e:  # noqa: BLE001 - raised in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,), name=f"client-{i}") for i in range(clients)]
    cpu, start = time.process_time(), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    session.close()
    if errors:
        raise errors[0]
    detok = time.perf_counter()
    done = [Reply(index, len(request.partial), api_text(text, prompts[index], request.partial, config.eos_token_ids),
                  request.finish_reason, times[0] - started, list(np.diff(times)))
            for per_client in replies for index, started, times, request in per_client]
    return Round(wall, done, {"server": cpu}, time.perf_counter() - detok)


def _stamper(times: list[float]) -> Callable[[int | None], None]:
    """A Scheduler listener that notes when each token arrives (it is called with None at the end)."""

    def on_token(token: int | None) -> None:
        if token is not None:
            times.append(time.perf_counter())

    return on_token


def api_text(text: Text, prompt: list[int], tokens: list[int], eos: tuple[int, ...]) -> str:
    """The text ``ovshard api`` streams for ``tokens`` (runtime/serve/api.py Run: the detokenizer primed with the
    prompt's last 8 ids, eos ids left out), to compare the two sides' outputs."""
    stream = TextStream(text, prompt, turn=False, stop_ids=eos)
    return "".join(stream.push(t) for t in tokens) + stream.finish()


# ------------------------------------------------------------------------------------------- measuring


def measure(name: str, bundle: Path, model: ModelSpec | None, plan: Plan) -> dict[str, Any]:
    """Every round of one bundle (of the suite's ``model``, or --bundle): samples[clients][side], one Round a round."""
    manifest = read_manifest(bundle)
    text = Text(bundle, manifest)
    text.pieces()  # as `ovshard api` does at start: the detokenizer's figure is the server's
    prompts, tokens = prompts_for(model, text, manifest.architecture.vocab_size), plan.max_tokens(model)
    config = SamplingConfig(max_tokens=tokens, eos_token_ids=tuple(manifest.generation.eos_token_ids))
    samples: dict[int, dict[str, list[Round]]] = {c: {s: [] for s in SIDES} for c in plan.clients}
    with ExitStack() as stack:
        addresses = stack.enter_context(local_workers(bundle, plan.exact, threads=plan.threads))
        server = ApiServer(bundle, addresses, max(plan.clients), name)
        stack.callback(server.stop)
        head = Head(bundle, addresses)
        stack.callback(head.close)
        sides = {"api": lambda c, n, cfg: api_round(server, name, prompts, c, n, cfg.max_tokens),
                 "session": lambda c, n, cfg: session_round(head, text, prompts, c, n, cfg)}
        warm = SamplingConfig(max_tokens=min(8, tokens), eos_token_ids=config.eos_token_ids)
        for side in SIDES:  # untimed: first connections, first infer requests on every slot
            sides[side](max(plan.clients), 1, warm)
        for r in range(plan.rounds):
            for k, clients in enumerate(plan.clients):
                for side in (SIDES if (r + k) % 2 == 0 else SIDES[::-1]):
                    samples[clients][side].append(sides[side](clients, plan.requests, config))
                progress(f"{name} round {r + 1}/{plan.rounds}, {clients} clients: " + ", ".join(
                    f"{s} {samples[clients][s][-1].tokens / samples[clients][s][-1].wall_s:.1f} tok/s" for s in SIDES))
    return {"bundle": str(bundle), "stages": manifest.num_stages, "max_tokens": tokens, "prompts": prompts,
            "api_command": shlex.join(server.command), "samples": samples}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def rows_for(model: str, samples: dict[int, dict[str, list[Round]]]) -> list[dict[str, Any]]:
    """One row per client count: medians over rounds, latency percentiles over every request of every round."""
    rows = []
    for clients, sides in samples.items():
        api, ses = sides["api"], sides["session"]
        ratios = [(a.wall_s / a.tokens) / (s.wall_s / s.tokens) for a, s in zip(api, ses, strict=True)]
        ratio = median(ratios)

        def pooled(rounds: list[Round], what: str) -> list[float]:
            return [v for rnd in rounds for r in rnd.replies for v in ([r.ttft_s] if what == "ttft" else r.gaps_s)]

        rows.append({
            "model": model, "clients": clients,
            "api_req_s": round(median([len(a.replies) / a.wall_s for a in api]), 3),
            "api_tok_s": round(median([a.tokens / a.wall_s for a in api]), 1),
            "api_ttft_p50_ms": round(1000 * percentile(pooled(api, "ttft"), 50), 2),
            "api_ttft_p95_ms": round(1000 * percentile(pooled(api, "ttft"), 95), 2),
            "api_itl_p50_ms": round(1000 * percentile(pooled(api, "gaps"), 50), 3),
            "session_req_s": round(median([len(s.replies) / s.wall_s for s in ses]), 3),
            "session_tok_s": round(median([s.tokens / s.wall_s for s in ses]), 1),
            "session_ttft_p50_ms": round(1000 * percentile(pooled(ses, "ttft"), 50), 2),
            "session_itl_p50_ms": round(1000 * percentile(pooled(ses, "gaps"), 50), 3),
            "api_server_cpu_ms_per_token": round(1000 * median([a.cpu_s["server"] / a.tokens for a in api]), 3),
            "api_client_cpu_ms_per_token": round(1000 * median([a.cpu_s["client"] / a.tokens for a in api]), 3),
            "session_cpu_ms_per_token": round(1000 * median([s.cpu_s["server"] / s.tokens for s in ses]), 3),
            "detok_ms_per_token": round(1000 * median([s.detok_s / s.tokens for s in ses]), 3),
            "per_token_api_over_session": round(ratio, 3),
            "overhead_pct": round(100 * (ratio - 1), 1),
            "rounds_ratio": [round(x, 3) for x in ratios],
        })
    return rows


def same_tokens(samples: dict[int, dict[str, list[Round]]]) -> dict[str, Any]:
    """Whether every prompt got one completion (token count, text, finish reason) on both sides, every round."""
    seen: dict[int, set[tuple[int, str, str]]] = {}
    for sides in samples.values():
        for rounds in sides.values():
            for rnd in rounds:
                for reply in rnd.replies:
                    seen.setdefault(reply.prompt, set()).add((reply.tokens, reply.text, reply.finish))
    differ = {str(p): sorted({(n, f) for n, _, f in outs}) for p, outs in seen.items() if len(outs) > 1}
    return {"equal": not differ, "requests": sum(len(rnd.replies) for sides in samples.values()
                                                 for rounds in sides.values() for rnd in rounds),
            "prompts": len(seen), "token_counts": {str(p): sorted({n for n, _, _ in o}) for p, o in seen.items()},
            "differing_prompts": differ}


# ------------------------------------------------------------------------------------------- output


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Per model: tokens/s, requests/s and the overhead % against clients; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    panels = [("generated tokens/s", [("api", "api_tok_s"), ("session", "session_tok_s")]),
              ("requests/s", [("api", "api_req_s"), ("session", "session_req_s")]),
              ("API per-token time over Scheduler, %", [("api / session - 1", "overhead_pct")])]
    fig, axes = plt.subplots(len(models), len(panels), figsize=(13, 3.6 * len(models)), squeeze=False)
    for row_axes, model in zip(axes, models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        x = [r["clients"] for r in mine]
        for ax, (label, series) in zip(row_axes, panels, strict=True):
            for name, key in series:
                ax.plot(x, [r[key] for r in mine], marker="o", label=name)
            if key == "overhead_pct":
                ax.axhline(100 * TARGET_OVERHEAD, color="grey", linewidth=0.8, linestyle="--",
                           label=f"target {100 * TARGET_OVERHEAD:.0f}%")
                ax.axhline(0, color="black", linewidth=0.5)
            else:
                ax.set_ylim(bottom=0)
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(c) for c in x])
            ax.set_xlabel("concurrent clients")
            ax.set_title(f"{model}: {label}", fontsize=10)
            ax.legend(fontsize=8)
    fig.suptitle("ovshard api under load vs the bare Scheduler (2 stages, loopback TCP)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


TABLE_COLUMNS = {"model": "model", "clients": "clients", "api_req_s": "req/s", "api_tok_s": "tok/s",
                 "api_ttft_p50_ms": "TTFT p50 ms", "api_ttft_p95_ms": "TTFT p95 ms", "api_itl_p50_ms": "ITL p50 ms",
                 "session_tok_s": "Scheduler tok/s", "session_ttft_p50_ms": "Scheduler TTFT p50 ms",
                 "session_itl_p50_ms": "Scheduler ITL p50 ms", "api_server_cpu_ms_per_token": "API CPU ms/tok",
                 "session_cpu_ms_per_token": "Scheduler CPU ms/tok",
                 "per_token_api_over_session": "API/Scheduler per token", "overhead_pct": "overhead %"}


def table(rows: list[dict[str, Any]]) -> str:
    return report.markdown_table([{name: row[key] for key, name in TABLE_COLUMNS.items()} for row in rows])


def notes(doc: dict[str, Any]) -> list[str]:
    """The lines under the table: the token check, what each figure is, the CPU split."""
    lines = [f"{name}: both sides generated the same tokens: {c['requests']} requests over {c['prompts']} prompts, "
             "one token count, text and finish reason each" if c["equal"] else
             f"{name}: the sides DIFFER on prompts {c['differing_prompts']}" for name, c in doc["same_tokens"].items()]
    lines.append("TTFT (request sent -> first text or token), ITL (between text chunks or tokens): p50/p95 over every "
                 "request of every round, api side unless named; tok/s, req/s: medians of rounds; API/Scheduler per "
                 "token: median of per-round ratios of wall time per generated token; overhead = that ratio - 1. "
                 f"Target: <= {100 * TARGET_OVERHEAD:.0f}% (reported, never asserted)")
    lines += [f"{r['model']}, {r['clients']} clients, CPU ms per generated token: `ovshard api` process "
              f"{r['api_server_cpu_ms_per_token']}, load generator {r['api_client_cpu_ms_per_token']}, bare Scheduler "
              f"(head + slots) {r['session_cpu_ms_per_token']}; the incremental detokenizer alone "
              f"{r['detok_ms_per_token']}" for r in doc["rows"] if r["clients"] == min(x["clients"] for x in doc["rows"])]
    return lines


def parse_args(argv: list[str] | None) -> Plan:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="stories260K", help=f"comma-separated, from {','.join(WEIGHTS)} "
                        "(default stories260K), compiled into 2 stages and cached")
    parser.add_argument("--bundle", type=Path, help="measure this compiled bundle instead of --models (prompts: "
                        "story openings through its tokenizer)")
    parser.add_argument("--clients", default=None, help="concurrent client counts (default 1,2,4,8; --quick 1,2)")
    parser.add_argument("--requests", type=int, default=None, help="requests per client per round (default 4; "
                        "--quick 2)")
    parser.add_argument("--tokens", type=int, default=None, help="max_tokens per request (default: 128 for "
                        "stories260K, 32 for llama-3.2-1b, 64 for --bundle; --quick 32)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 2)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per stage worker (default 1)")
    parser.add_argument("--exact", action="store_true", help="workers with f32 inference and KV cache")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 and 2 clients, 2 requests of 32 "
                        "tokens, 2 rounds (under a minute on stories260K)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"checkpoints and bundles (default "
                        f"{DEFAULT_CACHE}, shared with bench/suite.py)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--rebuild", action="store_true", help="recompile bundles even when cached")
    args = parser.parse_args(argv)
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models or any(m not in WEIGHTS for m in models):
        parser.error(f"--models {args.models}: expected names from {list(WEIGHTS)}")
    try:
        clients = tuple(int(c) for c in (args.clients or ("1,2" if args.quick else "1,2,4,8")).split(","))
    except ValueError:
        parser.error(f"--clients {args.clients}: expected comma-separated counts, e.g. 1,2,4,8")
    if any(c < 1 for c in clients) or len(set(clients)) != len(clients):
        parser.error(f"--clients {args.clients}: expected distinct counts >= 1")
    if args.bundle is not None and not (args.bundle / "manifest.json").is_file():
        parser.error(f"--bundle {args.bundle}: expected a compiled bundle (a folder with manifest.json)")
    plan = Plan(models=models, bundle=args.bundle.resolve() if args.bundle else None, clients=clients,
                requests=args.requests or (2 if args.quick else 4), tokens=args.tokens or (32 if args.quick else None), rounds=args.rounds or (2 if args.quick else 3),
                threads=args.threads, exact=args.exact, cache=args.cache.resolve(), results=args.results.resolve(),
                rebuild=args.rebuild)
    if min(plan.requests, plan.rounds, plan.threads, plan.tokens or 1) < 1:
        parser.error("--requests, --rounds, --threads and --tokens: expected at least 1")
    return plan


def bundles(plan: Plan) -> list[tuple[str, Path, ModelSpec | None]]:
    """(name, bundle, model) to measure: --bundle as it is, or each of --models compiled into 2 stages (cached)."""
    if plan.bundle is not None:
        return [(plan.bundle.name, plan.bundle, None)]
    bench = Bench(Settings(models=plan.models, rounds=plan.rounds, warmup=1, cache=plan.cache, results=plan.results,
                           rebuild=plan.rebuild))
    return [(name, bench.bundle(MODELS[name], 2, weights=WEIGHTS[name]), MODELS[name]) for name in plan.models]


def main(argv: list[str] | None = None) -> int:
    plan = parse_args(argv)
    command = ".venv/bin/python bench/api_load.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    facts = machine()
    facts["versions"].update({d: metadata.version(d) for d in ("openai", "starlette", "uvicorn", "msgspec")})
    rows, runs, checks = [], {}, {}
    for name, bundle, model in bundles(plan):
        progress(f"{name}: {plan.rounds} rounds of {','.join(map(str, plan.clients))} clients x {plan.requests} "
                 "requests, api and session interleaved")
        run = measure(name, bundle, model, plan)
        samples = run.pop("samples")
        rows += rows_for(name, samples)
        checks[name] = same_tokens(samples)
        runs[name] = {**run, "samples": {str(c): {s: [r.summary() for r in rounds] for s, rounds in sides.items()}
                                         for c, sides in samples.items()}}
    facts["loadavg_at_end"] = os.getloadavg()
    plan.results.mkdir(parents=True, exist_ok=True)
    png = plan.results / "api_load.png"
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(plan).items()}
    doc: dict[str, Any] = {
        "benchmark": "api_load", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command.strip(),
        "machine": facts, "target": f"API per-token time <= {1 + TARGET_OVERHEAD:.2f}x the bare Scheduler's "
        "(reported, never asserted)", "settings": settings, "rows": rows, "same_tokens": checks, "runs": runs,
        "plot_file": png.name if plot(rows, png) else None}
    doc["notes"] = notes(doc)
    out = plan.results / "api_load.json"
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"`{doc['command']}` on {facts['cpu_count']} CPUs ({facts['cpu']}), load average "
          f"{facts['loadavg_at_start'][0]:.2f} at start, {facts['loadavg_at_end'][0]:.2f} at the end\n")
    print(table(rows) + "\n")
    print("\n".join(f"- {line}" for line in doc["notes"]))
    print(f"\nresults: {out}" + (f", {png}" if doc["plot_file"] else " (no plot: matplotlib is missing)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
