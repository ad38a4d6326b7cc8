#!/usr/bin/env python
"""ovshard's API against llama.cpp's own server on the same real model, threads and clients: aggregate tok/s.

    .venv/bin/python bench/against_llama_cpp/server_peers.py [--clients 8] [--requests 2] [--tokens 64] [--rounds 3]
        [--gguf FILE] [--stages 2]

The real Gemma 3 270M (its Q4_K_M GGUF, tests/real_gemma.py), or ``--gguf``'s model. llama.cpp's ``llama-server`` serves the file with
``-np C --cont-batching -t 2`` (built as ``make bench-peers`` builds llama.cpp, bench/peers.py); ovshard serves a
bundle of ``--stages`` stages (default 2) compiled from the same file with the default settings, one worker a
stage, the threads split between them (2 stages: `ovshard serve --threads 1` each, the same 2 cores) behind ``ovshard api --streams C``. The same C clients
(``openai.AsyncOpenAI``) each send R chat requests one after another (different user messages, temperature 0,
max_tokens T, streamed) to one server, then to the other, the order alternating by round; a round's figure is
completion tokens / wall seconds, the ratio the median of per-round ratios (timings drift here).

Writes bench/results/server_peers.{json,md}; the table on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import peers  # noqa: E402  (bench/peers.py: builds llama.cpp once)
from harness import current_bundle  # noqa: E402
from llama_build import fastest  # noqa: E402
from report import write_rows  # noqa: E402

from ovshard.runtime.client.launch import local_workers  # noqa: E402

QUESTIONS = ("Tell me a short story about a fox.", "What is the capital of France, and why?",
             "Write three lines about the sea.", "Explain what a CPU cache does.", "Name five fruits.",
             "Describe a rainy morning.", "How do birds fly?", "Give me a recipe for pancakes.",
             "What is a prime number?", "Why is the sky blue?", "Write a haiku about snow.",
             "List the planets of the solar system.", "What does a compiler do?", "Tell a joke about cats.",
             "How does a bicycle stay upright?", "Describe your ideal weekend.")


def log(message: str) -> None:
    print(f"[server_peers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_bundle(gguf: Path, stages: int, cache: Path) -> Path:
    """The default compile of ``gguf`` in ``stages`` stages, compiled once into ``cache`` by the compiler at hand
    (an older compiler's default is compiled again)."""
    out = current_bundle(cache, f"{gguf.stem.lower()}-{stages}st-default")
    if not (out / "manifest.json").is_file():
        log(f"compiling {gguf.name} into {stages} stages -> {out}")
        subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(gguf), "--stages", str(stages),
                        "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


class Server:
    """A process serving the OpenAI API at ``url`` once it answers /v1/models."""

    def __init__(self, command: list[str], url: str, ready_line: bool = False) -> None:
        self.command, self.url = command, url
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE if ready_line else subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, text=True)
        if ready_line:  # `ovshard api` prints {"api": "host:port"} once it listens
            assert self.process.stdout is not None
            ready, _, _ = select.select([self.process.stdout], [], [], 300)
            line = self.process.stdout.readline() if ready else ""
            if not line:
                self.stop()
                raise SystemExit(f"{command[0]} did not start")
            self.url = f"http://{json.loads(line)['api']}/v1"
        self._wait()

    def _wait(self) -> None:
        import urllib.request

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/models", timeout=5).read()
                return
            except OSError:
                if self.process.poll() is not None:
                    raise SystemExit(f"`{' '.join(self.command)}` exited with {self.process.returncode}") from None
                time.sleep(0.5)
        raise SystemExit(f"{self.url} did not answer within 300 s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def one_client(client, model: str, first: int, requests: int, tokens: int) -> int:  # noqa: ANN001
    done = 0
    for j in range(requests):
        question = QUESTIONS[(first + j) % len(QUESTIONS)]
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                      max_tokens=tokens, temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                done += chunk.usage.completion_tokens
    return done


def one_round(url: str, model: str, clients: int, requests: int, tokens: int) -> float:
    import openai

    async def run() -> float:
        client = openai.AsyncOpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_client(client, model, i * requests, requests, tokens)
                                        for i in range(clients)))
        wall = time.perf_counter() - start
        await client.close()
        return sum(counts) / wall

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="chat requests per client per round")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all, each side (default 2)")
    parser.add_argument("--kv", choices=("auto", "stateful"), default="auto",
                        help="ovshard's workers: paged and batched (auto, the default) or one cache a stream")
    parser.add_argument("--gguf", type=Path, help="the model both sides serve (default: the real Gemma 3 270M's "
                        "Q4_K_M)")
    parser.add_argument("--stages", type=int, default=2, help="ovshard's stages, one worker each, the threads "
                        "split between them (default 2)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/ovshard-bench/bundles"))
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args()
    from real_gemma import gemma_gguf_path

    gguf = args.gguf or gemma_gguf_path()
    if not gguf.is_file():
        parser.error(f"--gguf {gguf}: no such file")
    if not 1 <= args.stages <= args.threads:
        parser.error(f"--stages {args.stages}: expected 1 to --threads ({args.threads}), one thread a stage at least")
    bundle = default_bundle(gguf, args.stages, args.cache)
    peer = fastest(peers.llama_cpp(), peers.TARGETS, gguf, log=log)  # AMX where it runs, else without
    log(f"llama.cpp: {peer.label}")
    port = free_port()
    llama = [str(peer.tool("llama-server")), "-m", str(gguf), "-np", str(args.clients),
             "--cont-batching", "-t", str(args.threads), "-c", str(args.clients * 1024), "--host", "127.0.0.1",
             "--port", str(port)]
    samples: dict[str, list[float]] = {"ovshard": [], "llama-server": []}
    threads = max(1, args.threads // args.stages)
    with local_workers(bundle, threads=threads, kv=args.kv) as addresses:
        ours = Server([sys.executable, "-m", "ovshard.cli", "-q", "api", str(bundle), "--stages", ",".join(addresses),
                       "--listen", "127.0.0.1:0", "--streams", str(args.clients), "--queue", str(args.clients),
                       "--model", gguf.stem], "", ready_line=True)
        theirs = Server(llama, f"http://127.0.0.1:{port}/v1")
        try:
            for url in (ours.url, theirs.url):
                one_round(url, gguf.stem, args.clients, 1, 8)  # warm-up
            for r in range(args.rounds):
                order = [("ovshard", ours.url), ("llama-server", theirs.url)]
                for side, url in (order if r % 2 == 0 else order[::-1]):
                    samples[side].append(one_round(url, gguf.stem, args.clients, args.requests, args.tokens))
                    log(f"round {r + 1}: {side} {samples[side][-1]:.1f} tok/s")
        finally:
            ours.stop()
            theirs.stop()
    ratio = statistics.median(a / b for a, b in zip(samples["ovshard"], samples["llama-server"], strict=True))
    rows = [{"clients": args.clients, "ovshard_kv": args.kv, "ovshard_tok_s": round(statistics.median(samples["ovshard"]), 1),
             "llama_server_tok_s": round(statistics.median(samples["llama-server"]), 1),
             "ovshard_vs_llama_server": round(ratio, 2), "target": ">= 1.3x", "llama.cpp build": peer.label}]
    command = " ".join([".venv/bin/python", "bench/against_llama_cpp/server_peers.py", *sys.argv[1:]])
    print(write_rows(args.results, "server_peers", command, [{**rows[0], "samples": samples}], list(rows[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
