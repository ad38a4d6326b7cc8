"""``ovshard synth``: a random-weight checkpoint of a named shape or config.json."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ovshard.tools.shapes import SHAPES  # plain data: no numpy, torch or openvino

    p = sub.add_parser("synth", help="write a random-weight checkpoint of a named shape or config.json",
                       description="Write a Hugging Face checkpoint (config.json, generation_config.json, "
                       "safetensors) of any supported family with seeded random weights, streamed tensor by "
                       "tensor in bounded memory and renamed into place when complete.")
    p.add_argument("shape", help=f"{', '.join(SHAPES)}, or the path of a config.json of a supported family "
                   "(or of the folder holding it)")
    p.add_argument("-o", "--output", type=Path, required=True, help="checkpoint folder (new or empty)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="storage dtype (default: the dtype the named shape's model is published in, e.g. bfloat16 for "
                   "llama-3.2-1b, float32 for gemma-2-2b and tiny; for a config.json its dtype/torch_dtype; else float32)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--layers", type=int, help="override num_hidden_layers, e.g. 1 for a small test")
    p.add_argument("--max-shard-size", default="2GB", help="split into shards of at most this size (default 2GB)")
    p.add_argument("--dry-run", action="store_true", help="report the files, parameters and bytes; write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ovshard.tools.synth import main_synth

    return main_synth(args)
