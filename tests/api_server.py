"""`ovshard api` as a process for the API tests (over stage workers it starts itself, or with `--local`), and
its /metrics read back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from ovshard.runtime.client.launch import WorkerProcess, serve_command
from ovshard.runtime.tools.wanproxy import DelayProxy
from ovshard.runtime.wire.address import parse_address

CLI = [sys.executable, "-m", "ovshard.cli"]


class Api:
    """An `ovshard api` process: in front of two stage workers started here (`--exact`; ``delay_s``: each reached
    through a proxy that delays every byte that long each way), or (``local``) starting its own with `--local`."""

    def __init__(self, bundle: Path, *options: str, local: bool = False, delay_s: float = 0.0) -> None:
        self.workers: list[WorkerProcess] = []
        self.proxies: list[DelayProxy] = []
        if local:
            where = ["--local"]
        else:
            self.workers = [WorkerProcess(serve_command(bundle, i, "127.0.0.1:0", ["--exact"]), i) for i in range(2)]
            stages = [w.wait_listening(120) for w in self.workers]
            if delay_s:
                self.proxies = [DelayProxy(target=parse_address(a), latency_s=delay_s).start() for a in stages]
                stages = [proxy.address for proxy in self.proxies]
            where = ["--stages", ",".join(stages)]
        self.process = subprocess.Popen([*CLI, "-q", "api", str(bundle), *where, "--listen", "127.0.0.1:0", *options],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, self.process.stderr.read() if self.process.stderr else ""
        self.address = json.loads(line)["api"]
        self.url = f"http://{self.address}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        for w in self.workers:
            w.stop()
        for proxy in self.proxies:
            proxy.stop()


@contextmanager
def api(bundle: Path, *options: str, local: bool = False, delay_s: float = 0.0) -> Iterator[Api]:
    server = Api(bundle, *options, local=local, delay_s=delay_s)
    try:
        yield server
    finally:
        server.stop()


def metrics(url: str) -> dict[str, float]:
    """/metrics as {sample name with its labels: value}, e.g. ``ovshard_kv_blocks{state=used}``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return {s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def until(check: Callable[[dict[str, float]], bool], url: str, timeout: float = 15.0) -> dict[str, float]:
    """/metrics once ``check`` holds on it (polled); the last reading when it never did."""
    deadline = time.monotonic() + timeout
    while not check(seen := metrics(url)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def idle(seen: dict[str, float]) -> bool:
    """Nothing running, waiting or holding KV blocks, at the API and in the engine."""
    return (seen["ovshard_active_streams"], seen["ovshard_queue_depth"], seen["ovshard_kv_blocks{state=used}"],
            seen["ovshard_batch_sequences{state=running}"], seen["ovshard_batch_sequences{state=waiting}"]) == (0,) * 5
