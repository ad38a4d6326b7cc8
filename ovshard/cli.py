"""The ``ovshard`` command line: the parser built from the command modules (each a parser beside its
handler, in ovshard/commands/ and runtime/commands/), dispatched through ``set_defaults(func=...)``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from ovshard.commands import bundle, cache, demo, synth
from ovshard.commands import compile as compile_cmd
from ovshard.commands import inspect as inspect_cmd
from ovshard.commands import verify as verify_cmd
from ovshard.errors import DiskFullError, OvshardError
from ovshard.runtime.cluster.up import PlanChoice
from ovshard.runtime.commands import api, chat, generate, keygen, proxy, serve, up

log = logging.getLogger("ovshard")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ovshard", description="Compile a Hugging Face causal LM into pipeline stages of stateful "
        "OpenVINO IR, and inspect the result.", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  ovshard compile path/to/hf-checkpoint --stages 4 -o out/\n"
        "  ovshard compile CKPT --budgets 2GB,2GB,4GB --weights int4_sym --dump-after all\n"
        "  ovshard inspect out/\n"
        "  ovshard inspect out/ --stage 1 --pass InjectBeamIdxGatherPass --diff\n"
        "  ovshard demo")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (compile_cmd.add_parser, inspect_cmd.add_parser, verify_cmd.add_parser, serve.add_parser,
                generate.add_generate_parser, generate.add_run_parser, chat.add_parser):
        add(sub)
    up.add_up_parser(sub, _cluster_planner)
    up.add_status_down_parsers(sub)
    for add in (demo.add_parser, proxy.add_parser, synth.add_parser, bundle.add_parser, cache.add_parser,
                keygen.add_parser, api.add_parser):
        add(sub)
    return parser


def _cluster_planner(manifest: Any, probes: list[dict], head: str, rtt: dict, stages: int | None,
                     context_tokens: int, strategy: str) -> PlanChoice:
    """`ovshard up`'s planner: the probes its actors returned, planned by ovshard.plan.placement."""
    from ovshard.plan.placement import NodeProbe, plan_placement

    nodes = [NodeProbe(p["node"], p["host"], p["seconds_per_byte"], p["free_bytes"]) for p in probes]
    placement = plan_placement(manifest, nodes, head, rtt, stages, context_tokens, strategy)
    return PlanChoice(list(placement.nodes), [tuple(g) for g in placement.groups], placement.format_table(),
                      [message for _, message in placement.left_out], placement.slowest_step_s)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="ovshard: %(message)s", stream=sys.stderr)
    if not args.verbose:
        for noisy in ("nncf", "transformers", "torch"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that went away (`| head`) shows up here rather than at exit
        return code
    except DiskFullError as e:  # not a refusal of the request: the work failed, and may succeed with more space
        print(f"ovshard {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OvshardError as e:
        print(f"ovshard {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # whoever read stdout stopped early (`ovshard inspect ... | head`): no traceback, and point stdout
        # at /dev/null so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"ovshard {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
