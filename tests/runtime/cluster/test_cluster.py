"""`ovshard up` on a real local multi-node Ray cluster (ray.cluster_utils.Cluster: a head and a second node,
each a raylet of its own on a core of its own, with its own cache folder): the stage actors over mutual TLS, the
chain they form, Ray restarting a killed stage, placement by measured speed on an unequal pair, and stage
files pulled by nodes into their own caches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import at_once, compile_fp32, free_port_base, run_greedy
from families import moe_with_tokenizer

from ovshard.bundle import names
from ovshard.bundle.manifest import read_manifest
from ovshard.plan.placement import NodeProbe, plan_placement
from ovshard.runtime.client.head import Head
from ovshard.runtime.cluster.actors import THREADS_ENV
from ovshard.runtime.decoding.decode import Stats
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.wire.tls import client_context, load_credentials

pytestmark = pytest.mark.cluster


ray = pytest.importorskip("ray", reason="the cluster extra is not installed")
CLI = [sys.executable, "-m", "ovshard.cli"]
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"


FAST, SLOW = "fast", "slow"  # the pair: each node's processes on a core of their own, one thread a stage


@dataclass
class Pair:
    address: str
    node_ids: dict[str, str]  # FAST / SLOW -> the node's id
    slow_core: int


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("node-caches")
    return {FAST: root / "fast", SLOW: root / "slow"}


@pytest.fixture(scope="module")
def pair(caches: dict[str, Path]) -> Iterator[Pair]:
    """Two Ray nodes, each pinned to a core of its own (a raylet's workers inherit its CPU affinity)."""
    from ray.cluster_utils import Cluster

    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "the unequal pair needs two cores"

    def env(which: str) -> dict[str, str]:
        return {THREADS_ENV: "1", "OVSHARD_CACHE_DIR": str(caches[which])}

    try:
        os.sched_setaffinity(0, {cores[0]})
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                              "env_vars": env(FAST)})
        os.sched_setaffinity(0, {cores[-1]})
        slow = nodes.add_node(num_cpus=1, env_vars=env(SLOW))
    finally:
        os.sched_setaffinity(0, set(cores))
    try:
        yield Pair(nodes.address, {FAST: nodes.head_node.node_id, SLOW: slow.node_id}, cores[-1])
    finally:
        nodes.shutdown()


@pytest.fixture(scope="module")
def cluster(pair: Pair) -> str:
    return pair.address


@contextmanager
def busy(core: int) -> Iterator[Callable[[], None]]:
    """A busy loop on ``core`` at niceness 10, above Ray's workers' 15: it takes about three quarters of that
    core (CFS weights 110 : 36) while it runs; yields the function that stops it."""
    loop = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(10)\nwhile True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))

    def stop() -> None:
        if loop.poll() is None:
            loop.kill()
            loop.wait()

    try:
        yield stop
    finally:
        stop()


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("cluster")
    return {n: compile_fp32(stories, root / f"stories{n}", stages=n) for n in (2, 3)}


@contextmanager
def up(bundle: Path, address: str, port_base: int, *options: str) -> Iterator[dict]:
    """`ovshard up` as a user runs it; yields its JSON line (stages, pids) with the stage table as "table"."""
    process = subprocess.Popen([*CLI, "-q", "up", str(bundle), "--ray", address, "--exact",
                                "--port-base", str(port_base), *options], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        table = []
        while not (line := process.stdout.readline()).startswith("{"):
            assert line, process.stderr.read() if process.stderr else ""
            table.append(line)
        yield {**json.loads(line), "table": table, "process": process}
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(60)


def greedy(pipeline: dict, n: int, kill: int | None = None, after: int = 0) -> tuple[list[int], Stats]:
    """n greedy tokens through a head with up's credentials; with ``kill``, that pid is SIGKILLed after ``after``."""
    tls = client_context(load_credentials(Path(pipeline["credentials"])))
    head = Head(Path(pipeline["bundle"]), pipeline["stages"].split(","), retry_s=90, tls=tls)
    stats, tokens = Stats(), []
    try:
        for token in head.generate(PROMPT, SamplingConfig(max_tokens=n), stats):
            tokens.append(token)
            if kill is not None and len(tokens) == after:
                os.kill(kill, signal.SIGKILL)
    finally:
        head.close()
    return tokens, stats


def run_local(bundle: Path, n: int) -> str:
    out = subprocess.run([*CLI, "-q", "run", str(bundle), "--local", "--exact", "--prompt-ids",
                          ",".join(map(str, PROMPT)), "--max-tokens", str(n), "--speculative", "off"],
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout


def test_up_brings_three_stages_up_across_nodes_and_generates_run_locals_text(cluster: str,
                                                                             bundles: dict[int, Path]) -> None:
    """--placement bundle: each bundle stage is an actor, on the two nodes in turn, every link mutual TLS with
    up's own CA; `generate` with the printed --stages list and credentials prints what `run --local` prints,
    and a head without credentials is refused (2 stages: the next test)."""
    stages = 3
    with up(bundles[stages], cluster, free_port_base(stages), "--placement", "bundle") as pipeline:
        rows = [line.split() for line in pipeline["table"][1:]]
        assert [r[0] for r in rows] == [str(i) for i in range(stages)]
        assert len({r[1] for r in rows}) == 2, pipeline["table"]  # two nodes
        generate = [*CLI, "-q", "generate", pipeline["bundle"], "--stages", pipeline["stages"], "--prompt-ids",
                    ",".join(map(str, PROMPT)), "--max-tokens", "24", "--speculative", "off"]
        out = subprocess.run([*generate, "--credentials", pipeline["credentials"]], capture_output=True, text=True,
                             timeout=300, check=True)
        assert out.stdout == run_local(bundles[stages], 24)
        plain = subprocess.run([*generate, "--insecure", "--retry-s", "0"], capture_output=True, text=True,
                               timeout=300)
        assert plain.returncode != 0 and plain.stdout == "", plain.stderr


def test_a_killed_stage_actor_is_restarted_by_ray_and_the_stream_finishes_the_same(cluster: str,
                                                                                   bundles: dict[int, Path]) -> None:
    """SIGKILL of stage 1's actor process mid-stream: Ray restarts it on its port, the head replays, and the
    greedy tokens equal an uninterrupted run; `ovshard status` shows the restart, `ovshard down` stops the
    stages and the waiting `ovshard up` leaves by itself."""
    with up(bundles[2], cluster, free_port_base(2), "--placement", "bundle") as pipeline:
        addresses = pipeline["stages"].split(",")
        assert len({line.split()[1] for line in pipeline["table"][1:]}) == 2  # two nodes
        whole, _ = greedy(pipeline, 120)
        assert whole == run_greedy(bundles[2], PROMPT, 120)[0][:len(whole)]  # what `run --local --exact` runs
        cut, stats = greedy(pipeline, 120, kill=pipeline["pids"][1], after=20)
        assert cut == whole
        assert stats.replays >= 1, "the stream was never replayed: was the actor killed?"
        status = subprocess.run([*CLI, "-q", "status", "--ray", cluster], capture_output=True, text=True, timeout=120)
        rows = {row["stage"]: row for row in map(json.loads, status.stdout.splitlines()) if "stage" in row}
        assert status.returncode == 0, status.stderr
        assert (rows[0]["restarts"], rows[1]["restarts"]) == (0, 1) and rows[1]["state"] == "ALIVE", rows
        assert rows[1]["address"] == addresses[1] and rows[1]["pid"] != pipeline["pids"][1]
        assert rows[0]["steps"] > 120 and rows[0]["step_ms"] > 0, rows  # stage 0 served both runs
        subprocess.run([*CLI, "-q", "down", "--ray", cluster], timeout=120, check=True)
        assert pipeline["process"].wait(60) == 0


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "deepseek_v3", "llama4_text"])
def test_up_serves_an_moe_bundle_over_the_api_to_concurrent_clients(cluster: str, stories: Path, tmp_path: Path,
                                                                   model_type: str) -> None:
    """A 2-stage fp32 MoE bundle (stories260K's tokenizer; Qwen3-MoE, GLM-4.5's block, DeepSeek-V3's latent
    attention, Llama 4's chunked layers on stateful stages) under `ovshard up --api` on the two nodes: two clients
    at once each get the answer they get alone, and the first is what `run --local` prints."""
    import openai

    checkpoint = moe_with_tokenizer(stories, tmp_path / "ckpt", model_type)
    bundle = compile_fp32(checkpoint, tmp_path / "moe", stages=2)
    prompts = ["Once upon a time", "The cat"]
    with up(bundle, cluster, free_port_base(2), "--placement", "bundle", "--api", "127.0.0.1:0") as pipeline:
        process = pipeline["process"]
        while not (line := process.stdout.readline()).startswith('{"event": "listening"'):
            assert line, process.stderr.read()
        client = openai.OpenAI(base_url=f"http://{json.loads(line)['api']}/v1", api_key="none", max_retries=0,
                               timeout=300)

        def ask(prompt: str) -> str:
            return client.completions.create(model="moe", prompt=prompt, max_tokens=32, temperature=0).choices[0].text

        solo = [ask(p) for p in prompts]
        local = subprocess.run([*CLI, "-q", "run", str(bundle), "--local", "--exact", "--prompt", prompts[0],
                                "--max-tokens", "32", "--speculative", "off"], capture_output=True, text=True,
                               timeout=300, check=True)
        assert local.stdout.rstrip("\n") == prompts[0] + solo[0]
        assert at_once(ask, prompts) == solo


@pytest.fixture(scope="module")
def fine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama wide enough that a step takes the time of its weight bytes (hidden 512), one bundle
    stage per layer."""
    from ovshard.tools.synth import llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("fine")
    config = llama_config(hidden_size=512, intermediate_size=1536, num_hidden_layers=LAYERS, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=64, vocab_size=512, tie_word_embeddings=True,
                          max_position_embeddings=256)
    return compile_fp32(write_checkpoint(root / "ckpt", config), root / "fine", stages=LAYERS, max_positions=256)


LAYERS = 6


def test_placement_by_measurement_gives_the_faster_node_more_layers_and_nodes_pull_only_their_stages(
        pair: Pair, fine: Path, caches: dict[str, Path]) -> None:
    """On an unequal pair (a busy loop takes most of one node's core while the nodes are probed), the node that
    measured faster gets the longer run of layers of 2 stages; with --pull always each node pulls into its own
    cache only its stages' files, verified, joins them into one model, and the pipeline's greedy tokens equal
    the one-stage-per-layer bundle's run in-process, also when stage 1's actor is killed mid-stream and
    restarts from what its node's cache holds. (Which node measures faster depends on everything else the
    machine runs, so the test follows what up measured; the planner's choice from given speeds is unit-tested
    in test_placement.)"""
    with busy(pair.slow_core) as stop_busy, up(fine, pair.address, free_port_base(2), "--stages", "2", "--pull",
                                                "always") as pipeline:
        stop_busy()  # the probes ran under it; the stages need not
        assert len(pipeline["layers"]) == 2, pipeline["table"]
        where = {node: layers for node, layers in zip(pipeline["nodes"], pipeline["layers"], strict=True)}
        by_node = {which: where[node_id[:12]] for which, node_id in pair.node_ids.items()}
        counts = {which: end - start for which, (start, end) in by_node.items()}
        probes = pipeline["probes"]
        measured = [NodeProbe(**p) for p in probes["nodes"]]
        rtt = {(a, b): seconds for a, b, seconds in probes["rtt_s"]}
        plan = plan_placement(read_manifest(fine), measured, probes["head"], rtt, 2)
        assert [list(r) for r in plan.ranges] == pipeline["layers"], (probes, pipeline["table"])
        assert [n[:12] for n in plan.nodes] == pipeline["nodes"], (probes, pipeline["table"])
        which = {node: name for name, node in pair.node_ids.items()}
        faster, slower = sorted(measured, key=lambda p: p.seconds_per_byte)
        if faster.seconds_per_byte < 0.5 * slower.seconds_per_byte:  # e.g. the busy loop took the slow core
            assert counts[which[faster.node]] > counts[which[slower.node]], (counts, probes)
        expected = run_greedy(fine, PROMPT, 16)[0]
        assert greedy(pipeline, 16)[0] == expected
        cut, stats = greedy(pipeline, 16, kill=pipeline["pids"][1], after=4)  # restarted from its node's cache
        assert cut == expected and stats.replays >= 1
        manifest = read_manifest(fine)
        for which, (start, end) in by_node.items():
            held = sorted(p.name for p in next((caches[which] / "bundles").iterdir()).iterdir())
            mine = [e for e in manifest.stages if start <= e.stage.start < end]
            assert held == sorted([names.MANIFEST_FILE, *(n for e in mine for n in e.sha256)]), (which, held)
