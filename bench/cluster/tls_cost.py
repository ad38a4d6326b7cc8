"""What TLS costs per hop: bytes and milliseconds per decode step, plain TCP vs mutual TLS, interleaved.

Two chains of two stage workers on loopback (stories260K by default, fp32, --exact): one plain, one with
`ovshard keygen` credentials. Rounds alternate the order; each round decodes --tokens greedy tokens on each
chain and records the mean head-measured step time (the decode phase, without the prefill). Bytes: each
chain is measured once more behind zero-latency counting relays (ovshard.runtime.tools.wanproxy.DelayProxy) in
front of both stages, so every byte of the three hops (head -> stage 0 -> stage 1 -> head) is counted.

    .venv/bin/python bench/cluster/tls_cost.py [--checkpoint PATH] [--rounds 7] [--tokens 64]

Writes bench/results/tls_cost.{json,md} (bench/harness.py) and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from harness import RESULTS, STORIES, interleaved, write_results  # noqa: E402  (bench/ is not a package)

from ovshard.compile import CompileConfig, compile_bundle  # noqa: E402
from ovshard.passes import WeightFormat  # noqa: E402
from ovshard.runtime.client.head import Head  # noqa: E402
from ovshard.runtime.client.launch import WorkerProcess, serve_command  # noqa: E402
from ovshard.runtime.decoding.decode import Stats  # noqa: E402
from ovshard.runtime.engine.sampler import SamplingConfig  # noqa: E402
from ovshard.runtime.tools.keygen import keygen  # noqa: E402
from ovshard.runtime.tools.wanproxy import DelayProxy  # noqa: E402
from ovshard.runtime.wire.address import parse_address  # noqa: E402
from ovshard.runtime.wire.tls import client_context, load_credentials  # noqa: E402

PROMPT = [1, 403, 407, 261, 378]


def start_chain(stack: ExitStack, bundle: Path, creds: Path | None) -> list[str]:
    addresses = []
    for stage in range(2):
        options = ["--exact", "--threads", "1"] + (["--credentials", str(creds / f"s{stage}")] if creds else [])
        worker = WorkerProcess(serve_command(bundle, stage, "127.0.0.1:0", options), stage)
        stack.callback(worker.stop)
        addresses.append(worker.wait_listening(120))
    return addresses


def decode(bundle: Path, addresses: list[str], tls: object, tokens: int) -> Stats:
    head = Head(bundle, addresses, tls=tls)  # type: ignore[arg-type]
    stats = Stats()
    try:
        list(head.generate(PROMPT, SamplingConfig(max_tokens=tokens), stats))
    finally:
        head.close()
    return stats


def bytes_per_step(bundle: Path, addresses: list[str], tls: object, tokens: int) -> dict[str, float]:
    """Bytes of each hop per decode step, counted by relays in front of both stages."""
    with ExitStack() as stack:
        relays = [stack.enter_context(DelayProxy(target=parse_address(a))) for a in addresses]
        before = decode(bundle, [r.address for r in relays], tls, 2)  # handshakes, Open, prefill: subtracted
        counts0 = [(r.bytes_up, r.bytes_down) for r in relays]
        stats = decode(bundle, [r.address for r in relays], tls, tokens + 2)
        counts1 = [(r.bytes_up, r.bytes_down) for r in relays]
    steps = len(stats.step_s) - len(before.step_s)
    up0 = counts1[0][0] - 2 * counts0[0][0]
    up1 = counts1[1][0] - 2 * counts0[1][0]
    down1 = counts1[1][1] - 2 * counts0[1][1]
    return {"head_to_stage0": up0 / steps, "stage0_to_stage1": up1 / steps, "stage1_to_head": down1 / steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=STORIES)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ovshard-tls-") as tmp, ExitStack() as stack:
        bundle = Path(tmp) / "bundle"
        print("compiling", args.checkpoint.name, "into 2 stages", file=sys.stderr)
        compile_bundle(CompileConfig(args.checkpoint, bundle, weights=WeightFormat("fp32"), stages=2))
        keygen(Path(tmp) / "keys", stages=["s0", "s1"], heads=["head"])
        tls = client_context(load_credentials(Path(tmp) / "keys/head"))
        chains = {"plain": (start_chain(stack, bundle, None), None),
                  "tls": (start_chain(stack, bundle, Path(tmp) / "keys"), tls)}

        def step_ms(mode: str) -> float:
            stats = decode(bundle, *chains[mode], args.tokens)
            return 1000 * statistics.mean(stats.step_s[1:])

        got = interleaved({mode: lambda mode=mode: step_ms(mode) for mode in chains}, args.rounds, label="ms a step",
                          timed=False)
        sizes = {mode: bytes_per_step(bundle, *chains[mode], args.tokens) for mode in chains}
    rows = [{"mode": mode, "step_ms": round(got.median(mode), 3), "x_plain": round(got.ratio(mode, "plain"), 3),
             **{f"{hop} bytes": round(n, 1) for hop, n in sizes[mode].items()},
             "samples_ms": [round(v, 3) for v in got.samples[mode]]} for mode in chains]
    meta = {"model": args.checkpoint.name, "stages": 2, "tokens": args.tokens, "rounds": args.rounds,
            "tls_ms_per_hop": round((got.median("tls") - got.median("plain")) / 3, 4),
            "tls_bytes_per_hop": {k: round(sizes["tls"][k] - sizes["plain"][k], 1) for k in sizes["plain"]}}
    print(write_results("tls_cost", rows, meta, out=args.out, title="TLS against plain TCP, per decode step"))
    print(f"TLS / plain step time: {rows[1]['x_plain']}x; {meta['tls_ms_per_hop']} ms per hop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
