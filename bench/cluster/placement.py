"""Placement by measurement against today's equal split, on an emulated unequal pair, and `up` to first token.

A two-node Ray cluster on this machine (ray.cluster_utils.Cluster), made unequal one of two ways:
``--emulate share`` (default): each node's processes on a core of their own (the raylet's CPU affinity, which
its workers inherit), one thread a stage, and a busy process sharing the second node's core, so that node
runs at about half speed while the two stages never compete for a core; ``--emulate threads``: the head node's
stages on 2 threads, the other's on 1 ($OVSHARD_THREADS; on 2 cores the stages then compete when both work,
as with 2 streams). A random-weight Llama (hidden 1024, 8 layers) compiled fp32 with
one bundle stage per layer is brought up with `ovshard up --placement even` and `--placement measured` in
alternating rounds; each round times greedy decoding with 1 stream and with 2 streams (Scheduler), and the
whole `ovshard up` command from its start to the first token of a request. Reports the median ratio of
measured / even decode throughput per round.

Run: .venv/bin/python bench/cluster/placement.py [--emulate share|threads] [--rounds 3] [--tokens 48]
     [--out bench/results/placement-<emulate>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import machine  # noqa: E402  (bench/ is not a package: the machine every result names)

from ovshard.compile import CompileConfig, compile_bundle  # noqa: E402
from ovshard.passes import WeightFormat  # noqa: E402
from ovshard.runtime.client.head import Head  # noqa: E402
from ovshard.runtime.client.scheduler import Scheduler  # noqa: E402
from ovshard.runtime.engine.sampler import SamplingConfig  # noqa: E402
from ovshard.tools.synth import llama_config, write_checkpoint  # noqa: E402

CLI = [sys.executable, "-m", "ovshard.cli", "-q"]
PROMPT = [1, 17, 42, 99, 7, 300, 12, 5]


def bundle(root: Path) -> Path:
    out = root / "fine8"
    if not (out / "manifest.json").exists():
        config = llama_config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                              num_key_value_heads=4, head_dim=64, vocab_size=2048, tie_word_embeddings=True,
                              max_position_embeddings=512)
        ckpt = write_checkpoint(root / "ckpt", config)
        compile_bundle(CompileConfig(ckpt, out, stages=8, weights=WeightFormat("fp32"), max_positions=512))
    return out


def up(fine: Path, address: str, placement: str) -> tuple[subprocess.Popen, dict, float]:
    """Start `ovshard up`; returns the process, its JSON line and seconds from start to that line."""
    start = time.perf_counter()
    process = subprocess.Popen([*CLI, "up", str(fine), "--ray", address, "--insecure", "--placement", placement,
                                "--port-base", "17800" if placement == "even" else "17900"],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    while not (line := process.stdout.readline()).startswith("{"):
        if not line:
            raise SystemExit(f"ovshard up --placement {placement} failed")
    return process, json.loads(line), start


def decode(pipeline: dict, streams: int, tokens: int) -> float:
    """Decode tokens per second over ``streams`` concurrent greedy requests (prefill excluded)."""
    head = Head(Path(pipeline["bundle"]), pipeline["stages"].split(","))
    session = Scheduler(head, streams=streams)
    try:
        config = SamplingConfig(max_tokens=tokens)
        start = time.perf_counter()
        requests = session.run_all([PROMPT] * streams, config)
        wall = time.perf_counter() - start
        return sum(len(r.result()) for r in requests) / wall
    finally:
        session.close()
        head.close()


def first_token_s(pipeline: dict, start: float) -> float:
    head = Head(Path(pipeline["bundle"]), pipeline["stages"].split(","))
    try:
        next(iter(head.generate(PROMPT, SamplingConfig(max_tokens=1))))
        return time.perf_counter() - start
    finally:
        head.close()


def unequal_pair(emulate: str) -> tuple[object, subprocess.Popen | None]:
    """The two-node cluster, the second node slower; the busy process that slows it (share), if any."""
    from ray.cluster_utils import Cluster

    if emulate == "threads":
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                              "env_vars": {"OVSHARD_THREADS": "2"}})
        nodes.add_node(num_cpus=1, env_vars={"OVSHARD_THREADS": "1"})
        return nodes, None
    cores = sorted(os.sched_getaffinity(0))
    one = {"OVSHARD_THREADS": "1"}
    os.sched_setaffinity(0, {cores[0]})  # the raylet started now, and its workers, inherit this mask
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, "env_vars": one})
    os.sched_setaffinity(0, {cores[1]})
    nodes.add_node(num_cpus=1, env_vars=one)
    # a busy loop at the niceness Ray gives its workers (15), on the slow node's core: it takes half of it
    busy = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(15)\nwhile True: pass"])
    os.sched_setaffinity(0, set(cores))
    return nodes, busy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "ovshard-bench-placement")
    parser.add_argument("--emulate", choices=("share", "threads"), default="share")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = args.out or Path(f"bench/results/placement-{args.emulate}.json")
    fine = bundle(args.root)
    nodes, busy = unequal_pair(args.emulate)
    rows: list[dict] = []
    try:
        for r in range(args.rounds):
            for placement in ("even", "measured"):
                process, pipeline, start = up(fine, nodes.address, placement)
                try:
                    row = {"round": r, "placement": placement, "layers": pipeline["layers"],
                           "threads": pipeline["threads"], "up_s": pipeline["up_s"],
                           "up_to_first_token_s": round(first_token_s(pipeline, start), 2)}
                    for streams in (1, 2):
                        row[f"tokens_per_s_{streams}"] = round(decode(pipeline, streams, args.tokens), 2)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                finally:
                    process.send_signal(signal.SIGTERM)
                    process.wait(120)
    finally:
        nodes.shutdown()
        if busy is not None:
            busy.kill()
    result = {"emulate": args.emulate, "machine": machine(), "rows": rows}
    for streams in (1, 2):
        ratios = [m[f"tokens_per_s_{streams}"] / e[f"tokens_per_s_{streams}"]
                  for e, m in zip(rows[0::2], rows[1::2], strict=True)]
        result[f"measured_over_even_{streams}_stream"] = round(statistics.median(ratios), 3)
    result["up_to_first_token_s"] = statistics.median(r["up_to_first_token_s"] for r in rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'placement':10} {'layers':22} {'threads':8} {'1 stream tok/s':>15} {'2 streams tok/s':>16} "
          f"{'up->1st token s':>16}")
    for row in rows:
        print(f"{row['placement']:10} {str(row['layers']):22} {str(row['threads']):8} {row['tokens_per_s_1']:>15} "
              f"{row['tokens_per_s_2']:>16} {row['up_to_first_token_s']:>16}")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
