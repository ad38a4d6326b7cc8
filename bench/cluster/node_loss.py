"""Recovery time of `ovshard up --api` when a PC leaves for good: from the loss to every live stream progressing again.

A three-node Ray cluster on this machine (ray.cluster_utils.Cluster: the head and two nodes, each a raylet of its
own with its own cache folder, one thread a stage) serves stories260K compiled fp32 with one bundle stage per
layer, placed by measurement on 3 stages (`--stages 3 --exact`). Each round starts `--streams` greedy API streams
(the official openai client, long completions), waits until every one has text, then removes a node that runs
a stage, in one of two ways:

- ``kill``: SIGKILL of the node's raylet and workers (a laptop carried off): Ray notices late, so up's own
  watch finds the stage silent and gives the node up after ``--grace-s``;
- ``shutdown``: the node's processes stopped cleanly (`ray stop`): Ray reports the node dead at once.

It times, from the removal, when each stream's longest wait after it ended (its text flowing again), the first
and the last stream's (every stream progressing again), and reads the re-plan's own duration from `ovshard
status`. Every stream's text is checked against an
uninterrupted run. A round adds a node back for the next one.

Run: .venv/bin/python bench/cluster/node_loss.py [--rounds 2] [--grace-s 5] [--streams 4]
     [--out bench/results/node-loss.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import machine  # noqa: E402  (bench/ is not a package: the machine every result names)

from ovshard.compile import CompileConfig, compile_bundle  # noqa: E402
from ovshard.passes import WeightFormat  # noqa: E402
from ovshard.runtime.cluster.actors import THREADS_ENV  # noqa: E402

CLI = [sys.executable, "-m", "ovshard.cli", "-q"]
STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K"
PROMPTS = ["Once upon a time", "The little dog", "One day, a girl named", "Tom and his mom", "The sun was"]
TOKENS = 400


def bundle(root: Path) -> Path:
    out = root / "stories5"
    if not (out / "manifest.json").exists():
        compile_bundle(CompileConfig(STORIES, out, stages=5, weights=WeightFormat("fp32")))
    return out


def stream(client: Any, model: str, prompt: str, times: list[float], text: list[str], ready: threading.Event) -> None:
    """One streamed completion; the arrival time of every chunk with text."""
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True):
        piece = chunk.choices[0].text if chunk.choices else ""
        if piece:
            times.append(time.perf_counter())
            text.append(piece)
            ready.set()


def longest_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def resumed_after(times: list[float], lost: float) -> float | None:
    """Seconds from the loss to the text that ended the stream's longest wait after it (the tokens already on
    their way when the node went are not progress: the stall is)."""
    after = [t for t in times if t > lost]
    if not after:
        return None
    gaps = [(b - a, b) for a, b in zip([lost, *after], after, strict=False)]
    return max(gaps)[1] - lost


def status(address: str) -> tuple[dict[str, str], dict]:
    out = subprocess.run([*CLI, "status", "--ray", address], capture_output=True, text=True, timeout=120, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    return ({r["node"]: r["state"] for r in rows if "state" in r and "stage" not in r},
            next(r for r in rows if "serving" in r))


def round_once(nodes: Any, address: str, api: str, how: str, streams: int, expected: dict[str, str]) -> dict:
    client = openai.OpenAI(base_url=f"http://{api}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    prompts = PROMPTS[:streams]
    times: dict[str, list[float]] = {p: [] for p in prompts}
    texts: dict[str, list[str]] = {p: [] for p in prompts}
    ready = {p: threading.Event() for p in prompts}
    threads = [threading.Thread(target=stream, args=(client, model, p, times[p], texts[p], ready[p])) for p in prompts]
    for t in threads:
        t.start()
    for p in prompts:
        ready[p].wait(300)
    states, _ = status(address)
    victim = next(n for n in nodes.worker_nodes if states.get(n.node_id[:12]) == "serving")
    lost = time.perf_counter()
    nodes.remove_node(victim, allow_graceful=how == "shutdown")
    for t in threads:
        t.join(600)
    resumed = [resumed_after(times[p], lost) for p in prompts]
    finished = [p for p in prompts if "".join(texts[p]) == expected[p]]
    _, replan = status(address)
    known = [r for r in resumed if r is not None]
    return {"how": how, "streams": streams, "first_resumed_s": round(min(known), 2) if known else None,
            "all_resumed_s": round(max(known), 2) if len(known) == len(prompts) else None,
            "longest_gap_before_loss_s": round(max(longest_gap([t for t in times[p] if t < lost]) for p in prompts), 3),
            "replan_s": replan["last_replan"]["seconds"] if replan["last_replan"] else None,
            "cause": replan["last_replan"]["cause"] if replan["last_replan"] else None,
            "uninterrupted_text": len(finished) == len(prompts)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each kind of loss (default 2)")
    parser.add_argument("--grace-s", type=float, default=5.0, help="up's --grace-s (default 5)")
    parser.add_argument("--streams", type=int, default=4, choices=range(1, len(PROMPTS) + 1))
    parser.add_argument("--out", type=Path, default=Path("bench/results/node-loss.json"))
    args = parser.parse_args()
    from ray._private.services import write_node_ip_address
    from ray.cluster_utils import Cluster

    root = Path(tempfile.mkdtemp(prefix="ovshard-node-loss-"))
    fine = bundle(root)
    added = 0

    def add_node() -> None:
        """A node on an address of its own (127.0.0.k); drivers started here keep joining at the head's node,
        so `up`'s own node (whose processes die with it) is never the one removed."""
        nonlocal added
        added += 1
        nodes.add_node(num_cpus=1, node_ip_address=f"127.0.0.{1 + added}",
                       env_vars={THREADS_ENV: "1", "OVSHARD_CACHE_DIR": str(root / f"cache{added}")})
        write_node_ip_address(nodes.head_node.get_session_dir_path(), nodes.head_node.node_ip_address)

    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "env_vars": {THREADS_ENV: "1", "OVSHARD_CACHE_DIR": str(root / "cache0")}})
    for _ in range(2):
        add_node()
    log = open(root / "up.log", "w")
    up = subprocess.Popen([*CLI, "up", str(fine), "--ray", nodes.address, "--exact", "--stages", "3",
                           "--port-base", "17600", "--api", "127.0.0.1:0", "--grace-s", str(args.grace_s),
                           "--rebalance-at", "0", "--streams", str(args.streams), "--max-tokens", str(TOKENS)],
                          stdout=subprocess.PIPE, stderr=log, text=True)
    results = []
    try:
        assert up.stdout is not None
        while not (line := up.stdout.readline()).startswith('{"event": "listening"'):
            assert line, (root / "up.log").read_text()
        api = json.loads(line)["api"]
        client = openai.OpenAI(base_url=f"http://{api}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        expected = {p: client.completions.create(model=model, prompt=p, max_tokens=TOKENS, temperature=0)
                    .choices[0].text for p in PROMPTS[:args.streams]}
        for r in range(args.rounds):
            for how in ("kill", "shutdown"):
                result = round_once(nodes, nodes.address, api, how, args.streams, expected)
                print(json.dumps({"round": r, **result}), flush=True)
                results.append(result)
                add_node()
                out = subprocess.run([*CLI, "rebalance", "--ray", nodes.address], capture_output=True, text=True,
                                     timeout=600)
                print(f"rebalance onto the added node: exit {out.returncode}", file=sys.stderr, flush=True)
    finally:
        up.terminate()
        up.wait(60)
        nodes.shutdown()
    for how in ("kill", "shutdown"):
        figures = [r["all_resumed_s"] for r in results if r["how"] == how and r["all_resumed_s"] is not None]
        if figures:
            print(json.dumps({"how": how, "median_all_resumed_s": statistics.median(figures),
                              "rounds": len(figures)}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"grace_s": args.grace_s, "machine": machine(), "rounds": results}, indent=1))
    return 0 if all(r["uninterrupted_text"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
