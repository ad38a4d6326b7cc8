"""What TLS costs per hop: bytes and milliseconds per decode step, plain TCP vs mutual TLS, interleaved.

Two chains of two stage workers on loopback (stories260K by default, fp32, --exact): one plain, one with
`ovshard keygen` credentials. Rounds alternate the order; each round decodes --tokens greedy tokens on each
chain and records the mean head-measured step time (the decode phase, without the prefill). Bytes: each
chain is measured once more behind zero-latency counting relays (ovshard.runtime.wire.wanproxy.DelayProxy) in
front of both stages, so every byte of the three hops (head -> stage 0 -> stage 1 -> head) is counted.

    .venv/bin/python bench/tls_cost.py [--checkpoint PATH] [--rounds 7] [--tokens 64]

Writes bench/results/tls_cost.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from ovshard.compile import CompileConfig, compile_bundle  # noqa: E402
from ovshard.passes import WeightFormat  # noqa: E402
from ovshard.runtime.client.head import Head  # noqa: E402
from ovshard.runtime.client.launch import WorkerProcess, serve_command  # noqa: E402
from ovshard.runtime.decoding.decode import Stats  # noqa: E402
from ovshard.runtime.engine.sampler import SamplingConfig  # noqa: E402
from ovshard.runtime.wire.address import parse_address  # noqa: E402
from ovshard.runtime.wire.keygen import keygen  # noqa: E402
from ovshard.runtime.wire.tls import client_context, load_credentials  # noqa: E402
from ovshard.runtime.wire.wanproxy import DelayProxy  # noqa: E402

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
    parser.add_argument("--checkpoint", type=Path, default=ROOT.parent / "shared/models/stories260K")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/tls_cost.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ovshard-tls-") as tmp, ExitStack() as stack:
        bundle = Path(tmp) / "bundle"
        print("compiling", args.checkpoint.name, "into 2 stages", file=sys.stderr)
        compile_bundle(CompileConfig(args.checkpoint, bundle, weights=WeightFormat("fp32"), stages=2))
        keygen(Path(tmp) / "keys", stages=["s0", "s1"], heads=["head"])
        tls = client_context(load_credentials(Path(tmp) / "keys/head"))
        chains = {"plain": (start_chain(stack, bundle, None), None),
                  "tls": (start_chain(stack, bundle, Path(tmp) / "keys"), tls)}
        step_ms: dict[str, list[float]] = {"plain": [], "tls": []}
        for r in range(args.rounds):
            for mode in (("plain", "tls") if r % 2 == 0 else ("tls", "plain")):
                addresses, context = chains[mode]
                stats = decode(bundle, addresses, context, args.tokens)
                step_ms[mode].append(1000 * statistics.mean(stats.step_s[1:]))
            print(f"round {r + 1}/{args.rounds}: plain {step_ms['plain'][-1]:.3f} ms, tls {step_ms['tls'][-1]:.3f} ms",
                  file=sys.stderr)
        sizes = {mode: bytes_per_step(bundle, *chains[mode], args.tokens) for mode in chains}
    ratios = [t / p for t, p in zip(step_ms["tls"], step_ms["plain"], strict=True)]
    report = {
        "model": args.checkpoint.name, "stages": 2, "tokens": args.tokens, "rounds": args.rounds,
        "step_ms_median": {m: round(statistics.median(v), 3) for m, v in step_ms.items()},
        "tls_over_plain_step_ratio_median": round(statistics.median(ratios), 3),
        "tls_ms_per_hop": round((statistics.median(step_ms["tls"]) - statistics.median(step_ms["plain"])) / 3, 4),
        "bytes_per_decode_step": {m: {k: round(v, 1) for k, v in s.items()} for m, s in sizes.items()},
        "tls_bytes_per_hop": {k: round(sizes["tls"][k] - sizes["plain"][k], 1) for k in sizes["plain"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'':22}{'plain':>10}{'tls':>10}")
    print(f"{'step ms (median)':22}{report['step_ms_median']['plain']:>10}{report['step_ms_median']['tls']:>10}")
    for hop in sizes["plain"]:
        print(f"{hop + ' bytes':22}{sizes['plain'][hop]:>10.1f}{sizes['tls'][hop]:>10.1f}")
    print(f"TLS / plain step time: {report['tls_over_plain_step_ratio_median']}x; "
          f"{report['tls_ms_per_hop']} ms per hop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
