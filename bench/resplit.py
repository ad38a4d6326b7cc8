"""Re-split time as a share of a cold compile: 2 stages cold (empty cache), then 3 stages from the cache.

Run: .venv/bin/python bench/resplit.py /tmp/resplit   (writes a random 130M-parameter Llama there once).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from ovshard.compile import CompileConfig, compile_bundle
from ovshard.tools.synth import llama_config, write_checkpoint

root = Path(sys.argv[1])
ckpt = root / "ckpt"
if not (ckpt / "config.json").exists():
    write_checkpoint(ckpt, llama_config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                        num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                                        tie_word_embeddings=False), dtype="bfloat16")
cache = root / "cache"
shutil.rmtree(cache, ignore_errors=True)
out = {}
for name, stages in (("cold 2 stages", 2), ("re-split 3 stages", 3), ("cold 3 stages (no cache)", 3)):
    t = time.perf_counter()
    compile_bundle(CompileConfig(ckpt, root / name.replace(" ", "_"), stages=stages,
                                 cache_dir=None if "no cache" in name else cache))
    out[name] = round(time.perf_counter() - t, 1)
out["re-split / cold"] = round(out["re-split 3 stages"] / out["cold 3 stages (no cache)"], 2)
print(json.dumps(out))
