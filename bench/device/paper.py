#!/usr/bin/env python
"""The paper's tables on one many-core machine: ovshard against llama.cpp, one node and a pipeline of pinned "nodes".

Made for a 16-core Intel Xeon reached as a bare machine (``bench/device/run.sh`` installs what it needs there),
and runs anywhere with enough cores, memory and disk (the 8B shape: ~16 GB checkpoint, ~5 GB per GGUF, ~5 GB
of ovshard bundle). Phases (``--only``; each appends to ``<work>/paper.json`` as it ends, so an interrupted run
keeps what it measured):

  kernels  bench/cpu_kernels/fc_kernels.py: the CPU plugin's fully connected kernels by weight format, plugin setting and
           thread count at the shapes' widths, beside the copy bandwidth at each thread count.
  setup    llama.cpp built from a source tree (cmake: llama-bench, llama-quantize, ggml-rpc-server), the fastest
           build that runs here (bench/llama_build.py: AMX checked with a one-token run); the random-weight
           Llama shapes written (bf16), converted with llama.cpp's converter (bf16 GGUF, a borrowed SentencePiece
           tokenizer: decode speed does not read the vocabulary's strings) and quantized to Q4_0 (its fastest
           4-bit format on these CPUs); ovshard's default compile of each shape with ``--calibration none`` (random weights:
           calibration changes no op or type, only values, and costs 9x the time), the largest in 4 stages,
           regrouped at the IR level into 2 stages and 1 (runtime/cluster/regroup.py).
  settings the candidate CPU plugin settings for this CPU's class A/B in one process on each one-stage bundle,
           interleaved; the fastest at the table's node threads is written into every bundle's hints for this
           class (manifest runtime_hints.cpu_plugin_by_isa), so the phases after run as a user would.
  profile  bench/op_profile.py on each one-stage bundle: a decode step per op type and per layer, and the
           largest shape's 512-token prompt.
  cost     compile cost per decoder layer at the last shape: data-free against the default (calibrated: the
           scale fit on the shipped text), wall seconds and peak RSS at 2 and 4 layers.
  one      one node: decode tokens/s of ``ovshard run --local --threads T`` against ``llama-bench -t T`` on the
           Q4_0 file, both pinned (taskset) to the same T cores, rounds interleaved; the time to the first token
           of a 512-token prompt (llama-bench -p 512 against ovshard's prefill). ``PAPER_VARIANTS`` adds
           one-stage compiles with other flags as more sides of the same rounds, e.g. ``"int4=--budget 1.0
           --all-layers"`` (``;`` between variants), each with its bytes a token beside its rate.
  table    the paper's table, 8B: a "node" is one ``ovshard serve`` pinned to its own 4 cores
           (``PAPER_NODE_CORES``: another count, e.g. 2, where nodes of 4 together reach the host's memory
           bandwidth, which separate PCs would not share) behind a relay
           with 0.3 ms one-way delay and a 1 Gbit/s cap per direction (ovshard's DelayProxy: containers here
           allow no network namespace), the head in this process on the cores left; 1 node/1 user, 2/1, 2/2,
           2/8 and 4/4 (users = concurrent streams, greedy, paged workers: continuous batching); aggregate
           tokens/s and the ratio to 1 node/1 user. llama.cpp RPC for the 2-node 1-user row: two
           ``ggml-rpc-server`` pinned likewise (``-t`` the node's cores) behind the same relays, ``llama-bench --rpc``.
  quarter  the 70B shape's quarter as one node's stage at 1K and 8K context, and the 4-node rates it implies
  wan      the 8B layout behind 100 ms links: naive pipeline decode against streams and prompt lookup
           (both in bench/device/far.py)

    python bench/device/paper.py --work /tmp/paper --llama-src DIR [--only setup,cost,one,table] [--shapes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(HERE))
os.environ.setdefault("CI", "true")  # no telemetry forks, also in worker processes
import far  # noqa: E402  (bench/device/far.py)
import tuning  # noqa: E402  (bench/device/tuning.py)
from llama_build import fastest  # noqa: E402

# stories260K's tokenizer files, lent to the random-weight shapes (the device gets no ../shared: run.sh carries them)
STORIES = Path(os.environ.get("PAPER_TOKENIZER_FROM", ROOT.parent / "shared" / "models" / "stories260K"))
PROMPT_1B = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13, 578, 4062, 374, 1618, 311]
NODE_CORES = int(os.environ.get("PAPER_NODE_CORES", 4))  # cores of one "node" in the table
# name=flags;...: more one-stage compiles of each shape (data-free, as the default's), sides of the one phase
VARIANTS = {name: tuple(flags.split()) for name, _, flags in
            (v.partition("=") for v in os.environ.get("PAPER_VARIANTS", "").split(";") if v.strip())}
# the largest shape's compile: 4 stages for the table (regrouped into 2 and 1), 1 where no table runs
LARGEST_STAGES = int(os.environ.get("PAPER_LARGEST_STAGES", 4))
# PAPER_LLAMA=0: setup builds no llama.cpp and writes no GGUF (minutes of a short lend), so the table runs without
# its llama.cpp RPC row and the one phase cannot run
WITH_LLAMA = os.environ.get("PAPER_LLAMA", "1") != "0"
DELAY_S = 0.0003  # one way, per hop: a home LAN
LINK_BYTES_PER_S = 125e6  # 1 Gbit/s
TABLE = ((1, 1), (2, 1), (2, 2), (2, 8), (4, 4))  # (nodes, users); --table replaces it
PAPER = {(1, 1): 24.56, (2, 1): None, (2, 2): 43.97}  # the paper's 8B figures (tok/s) where it gives them


def log(message: str) -> None:
    print(f"[paper {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(command: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], check=True, text=True, **kw)


def pinned(cores: str, command: list[Any]) -> list[str]:
    """``command`` pinned to ``cores`` (taskset), or as it is where taskset is missing."""
    prefix = ["taskset", "-c", cores] if shutil.which("taskset") else []
    return [*prefix, *[str(c) for c in command]]


class Results:
    """``<work>/paper.json``: one key per phase, written as each phase ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2))


# ----------------------------------------------------------------------------------------------- setup


LLAMA_TARGETS = ("llama-bench", "llama-quantize", "ggml-rpc-server")


def checkpoint(work: Path, shape: str, layers: int | None = None) -> Path:
    """A random-weight bf16 checkpoint of ``shape`` (``layers`` cuts it), with stories260K's tokenizer files
    beside it (the compile's tokenizer and calibration text; ids stay far below the shape's vocabulary)."""
    from ovshard.tools.shapes import preset
    from ovshard.tools.synth import write_checkpoint

    path = work / (f"ckpt-{shape}" + (f"-{layers}l" if layers else ""))
    if not (path / "config.json").is_file():
        log(f"writing {path.name}")
        config = preset(shape, **({"num_hidden_layers": layers} if layers else {}))
        write_checkpoint(path, config, dtype="bfloat16")
        for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (STORIES / f).is_file():
                shutil.copy(STORIES / f, path / f)
    return path


def gguf_files(work: Path, llama_src: Path, bins: Path, shape: str, ckpt: Path) -> dict[str, Path]:
    out = work / f"gguf-{shape}"
    out.mkdir(exist_ok=True)
    files = {kind: out / f"{kind}.gguf" for kind in ("Q4_0",)}  # llama.cpp's fastest 4-bit format on x86
    if all(f.is_file() for f in files.values()):
        return files
    full = out / "bf16.gguf"
    if not full.is_file():
        log(f"converting {shape} to GGUF")
        run([sys.executable, llama_src / "convert_hf_to_gguf.py", ckpt, "--outtype", "bf16", "--outfile",
             out / "bf16.partial"], stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(llama_src / "gguf-py")))
        (out / "bf16.partial").replace(full)
    for kind, path in files.items():
        if not path.is_file():
            log(f"quantizing {shape} to {kind}")
            run([bins / "llama-quantize", full, out / f"{kind}.partial", kind], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            (out / f"{kind}.partial").replace(path)
    full.unlink()
    return files


def compile_bundle(ckpt: Path, out: Path, stages: int, extra: tuple[str, ...] = (),
                   positions: int = 4096, package: str | None = None) -> dict[str, float]:
    """``ovshard compile`` in a child process: its wall seconds and peak RSS (GB), the peak as the compile reports
    it (``VmHWM``): a child's ``ru_maxrss`` starts from this process's resident set at the fork, which after the
    8B shape's checkpoint writing is larger than a compile's whole peak. ``package``: another ovshard (a folder laid
    out as run.sh lays out this one) first on the child's path, to time a change against the code before it."""
    start = time.perf_counter()
    env = None if package is None else dict(os.environ, PYTHONPATH=f"{package}:{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(ckpt), "-o", str(out),
                           "--stages", str(stages), "--max-positions", str(positions), "--no-cache", "--json", *extra],
                          stdout=subprocess.PIPE, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"compile of {ckpt} failed (status {done.returncode})")
    found = json.loads(done.stdout)
    peak = found["peak_rss_bytes"]
    return {"wall_s": round(time.perf_counter() - start, 1), "peak_rss_gb": round(peak / 2**30, 2) if peak else None,
            "layer_pieces_s_per_layer": found.get("seconds_per_layer")}


def regroup(fine: Path, groups: list[list[int]], out: Path) -> Path:
    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.cluster.regroup import write_group, write_group_bundle

    if (out / "manifest.json").is_file():
        return out
    manifest = read_manifest(fine)
    entries = [write_group(fine, manifest, groups, g, out) for g in range(len(groups))]
    write_group_bundle(fine, manifest, groups, entries, out)
    return out


def setup(work: Path, llama_src: Path, shapes: list[str], results: Results) -> dict[str, Any]:
    """Disk-frugal order (the 8B shape: 16 GB checkpoint, 16 GB bf16 GGUF, ~14 GB of bundles): the GGUFs first
    (the bf16 file deleted once quantized), then the bundles, then the checkpoint deleted."""
    built: dict[str, Any] = {}
    from llama_build import build

    builder = threading.Thread(target=lambda: built.update(bins=build(llama_src, LLAMA_TARGETS, log=log)))
    if WITH_LLAMA:
        builder.start()  # the build runs beside the checkpoints' writing
    facts: dict[str, Any] = {}
    ckpts = {shape: checkpoint(work, shape) for shape in shapes}
    if WITH_LLAMA:
        builder.join()
        if "bins" not in built:
            raise RuntimeError("the llama.cpp build failed (see above)")
    ggufs, bundles = {}, {}
    for shape in shapes:
        if WITH_LLAMA:
            ggufs[shape] = {k: str(v) for k, v in gguf_files(work, llama_src, built["bins"], shape,
                                                             ckpts[shape]).items()}
        stages = LARGEST_STAGES if shape == shapes[-1] else 1
        fine = work / f"bundle-{shape}-{stages}st"
        if not (fine / "manifest.json").is_file():
            log(f"compiling {shape} (default, data-free, {stages} stages)")
            facts[f"compile {shape}"] = compile_bundle(ckpts[shape], fine, stages, ("--calibration", "none"))
            log(f"compiled {shape}: {facts[f'compile {shape}']}")
        bundles[shape] = {"1": str(fine)}  # keys as JSON keeps them
        for name, flags in VARIANTS.items():
            out = work / f"bundle-{shape}-1st-{name}"
            if not (out / "manifest.json").is_file():
                log(f"compiling {shape} ({name}: {' '.join(flags)}, data-free, 1 stage)")
                facts[f"compile {shape} {name}"] = compile_bundle(ckpts[shape], out, 1, ("--calibration", "none", *flags))
            bundles[shape][f"1 {name}"] = str(out)
        if stages == 4:
            bundles[shape].update({"4": str(fine), "2": str(regroup(fine, [[0, 1], [2, 3]], work / f"bundle-{shape}-2st")),
                                   "1": str(regroup(fine, [[0, 1, 2, 3]], work / f"bundle-{shape}-1st"))})
        shutil.rmtree(ckpts[shape])
        log(f"{shape} ready; disk free {shutil.disk_usage(work).free / 2**30:.1f} GB")
    llama = fastest(llama_src, LLAMA_TARGETS, Path(ggufs[shapes[0]]["Q4_0"]), log=log) if WITH_LLAMA else None
    log(f"llama.cpp: {llama.label if llama else 'not built (PAPER_LLAMA=0)'}")
    state = {"bins": str(llama.bins) if llama else None, "llama.cpp": llama.label if llama else None,
             "bundles": bundles, "ggufs": ggufs, "facts": facts,
             "variants": {name: " ".join(flags) for name, flags in VARIANTS.items()}}
    results.put("setup", state)
    return state


# ----------------------------------------------------------------------------------------------- cost


def cost(work: Path, results: Results, shape: str) -> None:
    """Per-layer compile cost at ``shape``: (long - short) / (its layers - short's) for each variant, wall and peak
    RSS, at 2 and 4 layers (``PAPER_COST_LAYERS=2,8`` for another pair: the 8B shape's fixed part, its
    embedding and INT8 lm_head, hides a layer's cost at 2 and 4)."""
    short, long = (int(n) for n in os.environ.get("PAPER_COST_LAYERS", "2,4").split(","))
    variants: dict[str, tuple[tuple[str, ...], str | None]] = {
        "data-free": (("--calibration", "none"), None), "the default (scale fit on the shipped text)": ((), None)}
    if os.environ.get("PAPER_COST_BEFORE"):  # the default compile of an earlier ovshard, beside this one's
        variants["the default, the code before (PAPER_COST_BEFORE)"] = ((), os.environ["PAPER_COST_BEFORE"])
    rows = []
    for name, (extra, package) in variants.items():
        got = {}
        for layers in (short, long):
            ckpt = checkpoint(work, shape, layers)
            out = work / f"cost-{layers}l"
            shutil.rmtree(out, ignore_errors=True)
            got[layers] = compile_bundle(ckpt, out, 1, ("--budget", "1.0", *extra), package=package)
            shutil.rmtree(out, ignore_errors=True)
            log(f"cost: {name}, {layers} layers: {got[layers]}")
        rows.append({"variant": name, f"wall_{short}_layers_s": got[short]["wall_s"],
                     f"wall_{long}_layers_s": got[long]["wall_s"],
                     "s_per_layer": round((got[long]["wall_s"] - got[short]["wall_s"]) / (long - short), 2),
                     f"peak_rss_gb_{short}_layers": got[short]["peak_rss_gb"],
                     f"peak_rss_gb_{long}_layers": got[long]["peak_rss_gb"],
                     f"layer_pieces_s_per_layer_{long}_layers": got[long]["layer_pieces_s_per_layer"]})
        results.put("cost", {"shape": shape, "rows": rows})
    base = rows[0]["s_per_layer"]
    for row in rows:
        row["vs_data_free"] = round(row["s_per_layer"] / base, 2) if base > 0 else None
    results.put("cost", {"shape": shape, "rows": rows})


# ----------------------------------------------------------------------------------------------- one node


def prompt_for(bundle: str | Path) -> list[int]:
    """The 1B shape's prompt ids, folded into a smaller vocabulary's range."""
    from ovshard.bundle.manifest import read_manifest

    vocab = read_manifest(Path(bundle)).architecture.vocab_size
    return [t % vocab for t in PROMPT_1B]


def ovshard_run(bundle: str, cores: str, threads: int, prompt: list[int], tokens: int) -> dict[str, float]:
    done = run(pinned(cores, [sys.executable, "-m", "ovshard.cli", "-q", "run", bundle, "--local", "--threads",
                              threads, "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", tokens,
                              "--speculative", "off", "--stats", "json"]), capture_output=True)
    return json.loads(done.stderr.strip().splitlines()[-1])


def llama_bench(bins: str, cores: str, gguf: str, threads: int, prompt: int, tokens: int,
                rpc: str | None = None) -> float:
    command = [Path(bins) / "llama-bench", "-m", gguf, "-p", prompt, "-n", tokens, "-t", threads, "-r", "1",
               "-o", "json"]
    if rpc:
        command += ["--rpc", rpc, "-ngl", "99"]
    done = run(pinned(cores, command), capture_output=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def one_node(state: dict[str, Any], results: Results, shapes: list[str], rounds: int, tokens: int,
             thread_counts: list[int]) -> None:
    if not state["bins"]:
        raise RuntimeError("the one phase compares against llama.cpp: run setup without PAPER_LLAMA=0")
    rows = []
    for shape in shapes:
        bundle = state["bundles"][shape]["1"]
        ours = {"ovshard": bundle, **{f"ovshard {name}": state["bundles"][shape][f"1 {name}"]
                                      for name in state.get("variants", {}) if f"1 {name}" in state["bundles"][shape]}}
        for threads in thread_counts:
            if shape == shapes[-1] and threads < NODE_CORES:
                continue  # the largest shape from a node's cores up
            cores = f"0-{threads - 1}"
            samples: dict[str, list[float]] = {**{k: [] for k in ours}, **{k: [] for k in state["ggufs"][shape]}}
            for r in range(rounds):
                sides = list(samples) if r % 2 == 0 else list(samples)[::-1]
                for side in sides:
                    if side in ours:
                        value = ovshard_run(ours[side], cores, threads, prompt_for(bundle),
                                            tokens)["decode_tokens_per_s"]
                    else:
                        value = llama_bench(state["bins"], cores, state["ggufs"][shape][side], threads, 0, tokens)
                    samples[side].append(value)
                    log(f"one: {shape} {threads} threads round {r}: {side} {value:.2f} tok/s")
            ttft_ours = ovshard_run(bundle, cores, threads, (prompt_for(bundle) * 32)[:512], 2)["time_to_first_token_s"]
            ttft = {k: round(512 / llama_bench(state["bins"], cores, g, threads, 512, 0), 3)
                    for k, g in state["ggufs"][shape].items()}
            for kind in state["ggufs"][shape]:
                for side, path in ours.items():
                    ratios = [a / b for a, b in zip(samples[side], samples[kind], strict=True)]
                    rows.append({"shape": shape, "threads": threads, "ovshard": side, "llama.cpp file": kind,
                                 "llama.cpp build": state.get("llama.cpp", "native"),
                                 "ovshard MB": _weights_mb(path), "llama.cpp MB": round(Path(state["ggufs"][shape][kind]).stat().st_size / 1e6),
                                 "ovshard tok/s": round(statistics.median(samples[side]), 2),
                                 "llama.cpp tok/s": round(statistics.median(samples[kind]), 2),
                                 "ratio": round(statistics.median(ratios), 3),
                                 "ttft 512 ovshard s": round(ttft_ours, 3) if side == "ovshard" else "",
                                 "ttft 512 llama.cpp s": ttft[kind]})
            results.put("one", {"rows": rows, "tokens": tokens, "rounds": rounds, "prompt": "16 tokens"})


def _weights_mb(bundle: str) -> int:
    """A bundle's stage weights (every stage's .bin but the tokenizer's), MB."""
    return round(sum(p.stat().st_size for p in Path(bundle).glob("*.bin") if "tokenizer" not in p.name) / 1e6)


# ----------------------------------------------------------------------------------------------- table


def _workers(stack: ExitStack, bundle: str, threads: int, delay_s: float = DELAY_S) -> list[str]:
    """One pinned ``ovshard serve`` per stage (node i: cores 4i..4i+3) behind a relay delaying each way by
    ``delay_s``, capped at 1 Gbit/s."""
    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.client.launch import WorkerProcess, serve_command
    from ovshard.runtime.tools.wanproxy import DelayProxy

    stages = read_manifest(Path(bundle)).num_stages
    workers = []
    for i in range(stages):
        cores = f"{NODE_CORES * i}-{NODE_CORES * i + NODE_CORES - 1}"
        command = serve_command(Path(bundle), i, options=["--threads", str(threads)], exit_with_parent=True)
        worker = WorkerProcess(pinned(cores, command), i)
        stack.callback(worker.stop)
        workers.append(worker)
    addresses = []
    for worker in workers:
        host, port = worker.wait_listening(600).rsplit(":", 1)
        proxy = stack.enter_context(DelayProxy(target=(host, int(port)), latency_s=delay_s,
                                               bandwidth_bytes_per_s=LINK_BYTES_PER_S))
        addresses.append(proxy.address)
    return addresses


def table(state: dict[str, Any], results: Results, shape: str, rounds: int, tokens: int,
          layout: tuple[tuple[int, int], ...]) -> None:
    from scenarios_streams import _aggregate

    from ovshard.runtime.client.head import Head
    from ovshard.runtime.tools.wanproxy import DelayProxy

    bundles = state["bundles"][shape]
    # the head on the cores no node of the widest row takes (the 4-node row on a 16-core machine at 4 cores a
    # node leaves none: then the cores beyond two nodes, shared with the last two)
    cpus = os.cpu_count() or 2 * NODE_CORES
    first = max(n for n, _ in layout) * NODE_CORES
    head_cores = set(range(first if first < cpus else 2 * NODE_CORES, cpus)) or {0}
    os.sched_setaffinity(0, head_cores)
    samples: dict[tuple[int, int], list[float]] = {key: [] for key in layout}
    rpc: list[float] = []
    prompt = prompt_for(bundles["1"])
    with ExitStack() as stack:
        heads = {}
        for nodes in sorted({n for n, _ in layout}):
            bundle = bundles[str(nodes)]
            heads[nodes] = Head(Path(bundle), _workers(stack, bundle, NODE_CORES), timeout=600)
            stack.callback(heads[nodes].close)
            _aggregate(heads[nodes], [prompt], 4, 1, None)  # warm-up
        log("table: workers up")
        for r in range(rounds):
            order = layout if r % 2 == 0 else layout[::-1]
            for nodes, users in order:
                prompts = [prompt[: len(prompt) - i] for i in range(users)]
                got = _aggregate(heads[nodes], prompts, tokens, users, None)
                samples[(nodes, users)].append(got["tokens_per_s"])
                log(f"table: round {r} {nodes} nodes {users} users: {got['tokens_per_s']:.2f} tok/s")
            results.put("table", _table_rows(shape, samples, rpc, tokens))
        for _ in range(rounds if (2, 1) in layout and state["bins"] else 0):  # llama.cpp RPC, 2 nodes, 1 user, with the ovshard workers idle
            with ExitStack() as servers:
                ports = []
                for i in range(2):
                    port = _free_port()
                    proc = subprocess.Popen(pinned(f"{NODE_CORES * i}-{NODE_CORES * i + NODE_CORES - 1}",
                                                   [Path(state["bins"]) / "ggml-rpc-server", "-p", port, "-t",
                                                    NODE_CORES]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    servers.callback(lambda p=proc: (p.terminate(), p.wait(30)))
                    proxy = servers.enter_context(DelayProxy(target=("127.0.0.1", port), latency_s=DELAY_S,
                                                             bandwidth_bytes_per_s=LINK_BYTES_PER_S))
                    ports.append(proxy.address)
                time.sleep(2.0)
                cores = ",".join(map(str, sorted(head_cores)))
                rpc.append(llama_bench(state["bins"], cores, state["ggufs"][shape]["Q4_0"], NODE_CORES, 0, tokens,
                                       ",".join(ports)))
                log(f"table: llama.cpp RPC 2 nodes 1 user: {rpc[-1]:.2f} tok/s")
        results.put("table", _table_rows(shape, samples, rpc, tokens))


def _table_rows(shape: str, samples: dict[tuple[int, int], list[float]], rpc: list[float],
                tokens: int) -> dict[str, Any]:
    base = samples[(1, 1)]
    rows = []
    for (nodes, users), values in samples.items():
        if not values:
            continue
        ratios = [v / b for v, b in zip(values, base, strict=False)]
        rows.append({"nodes": nodes, "users": users, "tok/s": round(statistics.median(values), 2),
                     "vs 1 node 1 user": round(statistics.median(ratios), 2) if ratios else None,
                     "paper tok/s": PAPER.get((nodes, users))})
    out: dict[str, Any] = {"shape": shape, "rows": rows, "tokens_per_user": tokens, "node_cores": NODE_CORES,
                           "link": f"{DELAY_S * 1000} ms one way, {LINK_BYTES_PER_S * 8 / 1e9:.0f} Gbit/s per direction"}
    if rpc and samples.get((2, 1)):
        out["llama.cpp RPC 2 nodes 1 user tok/s"] = round(statistics.median(rpc), 2)
        out["ovshard / llama.cpp RPC, 2 nodes 1 user"] = round(statistics.median(samples[(2, 1)]) /
                                                                statistics.median(rpc), 2)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------------------------- settings, profile


def settings(state: dict[str, Any], results: Results, threads: list[int], rounds: int) -> None:
    """The candidates A/B on every one-stage bundle; the fastest at a node's threads into every bundle's hints."""
    rows: list[dict[str, Any]] = []
    largest = list(state["bundles"])[-1]
    for shape, bundles in state["bundles"].items():
        counts = [t for t in threads if t >= NODE_CORES] if shape == largest else threads
        rows += tuning.settings(Path(bundles["1"]), counts, max(rounds, 3), 8 if shape == largest else 16)
        results.put("settings", {"rows": rows})
    label, properties = tuning.choose(rows, NODE_CORES)
    every = [Path(b) for bundles in state["bundles"].values() for b in bundles.values()]
    isa = tuning.write_hints(every, properties, f"bench/device/paper.py settings ({label} fastest at {NODE_CORES} "
                             "threads over the one-stage bundles)")
    results.put("settings", {"rows": rows, "chosen": {"class": isa, "label": label, "properties": properties,
                                                      "threads": NODE_CORES}})
    log(f"settings: {label} written into every bundle's hints for {isa}")


def profiles(state: dict[str, Any], results: Results, work: Path, shapes: list[str]) -> None:
    found: dict[str, Any] = {}
    for shape in shapes:
        bundle = Path(state["bundles"][shape]["1"])
        for threads in ((2, NODE_CORES, 2 * NODE_CORES) if shape != shapes[-1] else (2 * NODE_CORES,)):
            found[f"{shape} decode t{threads}"] = tuning.profile(work, bundle, threads)
            results.put("profile", found)
    largest = Path(state["bundles"][shapes[-1]]["1"])
    found[f"{shapes[-1]} prefill 512 t{2 * NODE_CORES}"] = tuning.profile(work, largest, 2 * NODE_CORES, prefill=512)
    results.put("profile", found)


# ----------------------------------------------------------------------------------------------- report


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# ovshard on {data.get('machine', {}).get('cpu', 'this machine')}", ""]
    for key in ("cost", "one", "table", "wan", "quarter"):
        part = data.get(key)
        if not part or not part.get("rows" if key != "quarter" else "rates"):
            continue
        rows = part["rows" if key != "quarter" else "rates"]
        cols = list(rows[0])
        lines += [f"## {key}", "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
        lines += [""] + [f"- {k}: {v}" for k, v in part.items() if k not in ("rows", "rates")] + [""]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                cpu = line.split(":", 1)[1].strip()
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0]
        isa = [f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_int8", "amx_bf16", "amx_tile")
               if f" {f}" in flags]
    except (OSError, IndexError):
        isa = []
    import openvino

    return {"cpu": cpu, "cores": os.cpu_count(), "isa": isa, "openvino": openvino.get_version(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--llama-src", type=Path, required=True, help="a llama.cpp source tree (its CMakeLists.txt)")
    parser.add_argument("--only", default="kernels,setup,settings,profile,one,table", help="phases, in this order")
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b", help="one-node shapes; the last one is "
                        "the table's and, without --cost-shape, the compile cost's")
    parser.add_argument("--cost-shape", help="the shape whose compile cost per layer the cost phase measures")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", default="2,4,8", help="one node's thread counts (the largest shape from 4)")
    parser.add_argument("--table", default=",".join(f"{n}x{u}" for n, u in TABLE), help="nodes x users rows")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = Results(args.work / "paper.json")
    results.put("machine", machine())
    shapes = args.shapes.split(",")
    phases = args.only.split(",")  # run in this order
    layout = tuple(tuple(int(x) for x in row.split("x")) for row in args.table.split(","))
    state: dict[str, Any] = results.data.get("setup", {})
    threads = [int(t) for t in args.threads.split(",")]
    steps = {"setup": lambda: state.update(setup(args.work, args.llama_src, shapes, results)),
             "cost": lambda: cost(args.work, results, args.cost_shape or shapes[-1]),
             "one": lambda: one_node(state, results, shapes, args.rounds, args.tokens,
                                     [int(t) for t in args.threads.split(",")]),
             "table": lambda: table(state, results, shapes[-1], args.rounds, args.tokens, layout),
             "kernels": lambda: results.put("kernels", tuning.kernels(args.work, shapes, sorted({threads[0], threads[-1]}))),
             "settings": lambda: settings(state, results, threads, args.rounds),
             "profile": lambda: profiles(state, results, args.work, shapes),
             "quarter": lambda: far.quarter(sys.modules[__name__], args.work, results, 2 * NODE_CORES),
             "wan": lambda: far.wan(sys.modules[__name__], state, args.work, results, args.rounds, args.tokens)}
    for phase in phases:
        start = time.perf_counter()
        try:
            steps[phase]()
        except Exception as e:  # one phase's failure must not lose the others' figures
            log(f"{phase} failed: {type(e).__name__}: {e}")
            results.put(f"{phase}_error", f"{type(e).__name__}: {e}")
        log(f"{phase} done in {time.perf_counter() - start:.0f} s")
    (args.work / "paper.md").write_text(markdown(results.data))
    print(markdown(results.data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
