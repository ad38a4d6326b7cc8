"""Re-split time as a share of a cold compile: 2 stages cold (empty cache), then 3 stages from the cache.

Run: .venv/bin/python bench/compile/resplit.py /tmp/resplit   (writes a random 130M-parameter Llama there once).
Writes bench/results/resplit.{json,md} (bench/harness.py) and prints the table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import write_results  # noqa: E402  (bench/ is not a package)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a folder for the checkpoint (written once) and the bundles")
    root = parser.parse_args().root
    from ovshard.compile import CompileConfig, compile_bundle
    from ovshard.tools.synth import llama_config, write_checkpoint

    ckpt = root / "ckpt"
    if not (ckpt / "config.json").exists():
        write_checkpoint(ckpt, llama_config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                            num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                            vocab_size=32000, tie_word_embeddings=False), dtype="bfloat16")
    cache = root / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    out = {}
    for name, stages in (("cold 2 stages", 2), ("re-split 3 stages", 3), ("cold 3 stages (no cache)", 3)):
        t = time.perf_counter()
        compile_bundle(CompileConfig(ckpt, root / name.replace(" ", "_"), stages=stages,
                                     cache_dir=None if "no cache" in name else cache))
        out[name] = round(time.perf_counter() - t, 1)
    rows = [{"compile": name, "s": seconds} for name, seconds in out.items()]
    meta = {"re-split / cold": round(out["re-split 3 stages"] / out["cold 3 stages (no cache)"], 2)}
    print(write_results("resplit", rows, meta, title="re-split against a cold compile"))
    print(f"re-split / cold: {meta['re-split / cold']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
