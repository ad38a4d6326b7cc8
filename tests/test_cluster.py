"""`ovshard up` on a real local multi-node Ray cluster (ray.cluster_utils.Cluster: a head and a second node,
each a raylet of its own): the stage actors, the chain they form, and Ray restarting a killed stage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import compile_fp32, run_greedy

from ovshard.runtime.decode import Stats
from ovshard.runtime.head import Head
from ovshard.runtime.sampler import SamplingConfig

ray = pytest.importorskip("ray", reason="the cluster extra is not installed")
CLI = [sys.executable, "-m", "ovshard.cli"]
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    try:
        yield nodes.address
    finally:
        nodes.shutdown()


@pytest.fixture(scope="module")
def bundles(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("cluster")
    return {n: compile_fp32(stories, root / f"stories{n}", stages=n) for n in (2, 3)}


@contextmanager
def up(bundle: Path, address: str, port_base: int) -> Iterator[dict]:
    """`ovshard up` as a user runs it; yields its JSON line (stages, pids) with the stage table as "table"."""
    process = subprocess.Popen([*CLI, "-q", "up", str(bundle), "--ray", address, "--insecure", "--exact",
                                "--port-base", str(port_base)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
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


def greedy(bundle: Path, addresses: list[str], n: int, kill: int | None = None, after: int = 0) -> tuple[list[int], Stats]:
    """n greedy tokens through a head; with ``kill``, that pid is SIGKILLed after ``after`` tokens."""
    head, stats, tokens = Head(bundle, addresses, retry_s=90), Stats(), []
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
    """Each stage is an actor, on the two nodes in turn; `generate` over the printed --stages list prints what
    `run --local` prints (2 stages: the next test)."""
    stages = 3
    with up(bundles[stages], cluster, 17100 + 10 * stages) as pipeline:
        rows = [line.split() for line in pipeline["table"][1:]]
        assert [r[0] for r in rows] == [str(i) for i in range(stages)]
        assert len({r[1] for r in rows}) == 2, pipeline["table"]  # two nodes
        out = subprocess.run([*CLI, "-q", "generate", str(bundles[stages]), "--stages", pipeline["stages"],
                              "--insecure", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "24",
                              "--speculative", "off"], capture_output=True, text=True, timeout=300, check=True)
        assert out.stdout == run_local(bundles[stages], 24)


def test_a_killed_stage_actor_is_restarted_by_ray_and_the_stream_finishes_the_same(cluster: str,
                                                                                   bundles: dict[int, Path]) -> None:
    """SIGKILL of stage 1's actor process mid-stream: Ray restarts it on its port, the head replays, and the
    greedy tokens equal an uninterrupted run; `ovshard status` shows the restart, `ovshard down` stops the
    stages and the waiting `ovshard up` leaves by itself."""
    with up(bundles[2], cluster, 17200) as pipeline:
        addresses = pipeline["stages"].split(",")
        assert len({line.split()[1] for line in pipeline["table"][1:]}) == 2  # two nodes
        whole, _ = greedy(bundles[2], addresses, 120)
        assert whole == run_greedy(bundles[2], PROMPT, 120)[0][:len(whole)]  # what `run --local --exact` runs
        cut, stats = greedy(bundles[2], addresses, 120, kill=pipeline["pids"][1], after=20)
        assert cut == whole
        assert stats.replays >= 1, "the stream was never replayed: was the actor killed?"
        status = subprocess.run([*CLI, "-q", "status", "--ray", cluster], capture_output=True, text=True, timeout=120)
        rows = {row["stage"]: row for row in map(json.loads, status.stdout.splitlines())}
        assert status.returncode == 0, status.stderr
        assert (rows[0]["restarts"], rows[1]["restarts"]) == (0, 1) and rows[1]["state"] == "ALIVE", rows
        assert rows[1]["address"] == addresses[1] and rows[1]["pid"] != pipeline["pids"][1]
        subprocess.run([*CLI, "-q", "down", "--ray", cluster], timeout=120, check=True)
        assert pipeline["process"].wait(60) == 0
