"""The bench suites: which script each runs, with what arguments in a full run and in a quick one.

``bench/suite.py --suite NAME[,NAME]`` runs them (``--list`` prints this table); ``make bench`` and
``make bench-peers`` run the suites. A step's ``full`` arguments are those of the full run (None: by hand
only, it needs an input or runs long); ``quick`` those of a smoke run on stories260K (None: no quick
mode, skipped with ``--quick``). In arguments, ``{bundle}`` is stories260K compiled fp32 in 2 stages,
``{bundle1}`` in one stage, ``{stories}`` its checkpoint and ``{cache}`` the suite's cache folder.

A step's script is ``bench/<script>.py``: the tools at the top of bench/, a suite's one-purpose scripts
in a folder of its own (compile/, batching/, cpu_kernels/, cluster/, api/, against_llama_cpp/).
The runtime suite is the scenarios of bench/scenarios_*.py, run in-process by bench/suite.py itself.
Scripts outside every suite: bench/compile_memory.py, compile_memory_sweep.py, int4_frontier.py,
int4_fit_cost.py, compile/nncf_*.py and bench/device/ (their own Makefile lines), and the helper modules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    script: str  # bench/<script>.py: a top-level tool or <suite folder>/<name>
    measures: str
    full: tuple[str, ...] | None
    quick: tuple[str, ...] | None


@dataclass(frozen=True)
class Suite:
    name: str
    measures: str
    steps: tuple[Step, ...]


RUNTIME = "runtime"  # run in-process: the scenarios registered by bench/scenarios_*.py

SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite(RUNTIME, "decode speed, wire cost, streams, batching and speculation of compiled bundles (scenarios)", ()),
    Suite("compile", "what compiling costs beyond the weights", (
        Step("compile/compile_overhead",
             "the compiler's fixed cost per piece: stories260K in 2 stages, default and fp32",
             ("--rounds", "3"), ("--rounds", "1")),
        Step("compile/resplit",
             "re-split time as a share of a cold compile (2 stages cold, then 3 from the layer cache)",
             None, None),
        Step("compile/int8_choice_cost",
             "the cost of the whole-model INT8 choice alone, on a checkpoint", None,
             ("{stories}",)),
        Step("compile/prefill_logits_memory",
             "peak memory of a long prefill on a 128K vocabulary, logits of every row or "
             "only those needed", None, ("--tokens", "32", "--rounds", "1")),
        Step("compile/layer_clock",
             "where one compile's time goes, part by part, on the compile's thread and the fit-ahead thread",
             None, ("{stories}",)),
        Step("compile/calib_alone",
             "a calibrated layer's own parts alone at each thread count: its float32 run and its scale fit",
             None, ("{stories}", "--rounds", "1")),
        Step("int4_sim",
             "the default INT4 compile simulated in torch on SmolLM2's float weights: variants of its format and "
             "INT8 choice, perplexity on four texts", None, None),
        Step("compile/under_load",
             "the default compile of a real model again and again, every core held by numpy: each must end",
             None, ("{stories}", "--runs", "1", "--load", "1")),
        Step("compile/fork_beside_blas",
             "a fork beside a threaded numpy matmul (what telemetry forks did): hung trials, and with one BLAS "
             "thread", ("--trials", "3"), ("--trials", "1", "--seconds", "4")),
    )),
    Suite("batching", "paged stages: many sequences in one inference, and what batching changes", (
        Step("batching/paged_batch",
             "S sequences in one paged inference a stage against S one-row inferences and S "
             "stateful streams", (), ("--rounds", "6", "--sequences", "2")),
        Step("one_stream",
             "one stream alone through workers: paged with and without the static decode copy, and stateful",
             ("--models", "stories260K", "--rounds", "15"), ("{bundle1}", "--rounds", "1", "--tokens", "8")),
        Step("batching/tick_cost",
             "a paged tick's compute against its sequences, and the ceilings that puts on streams",
             (), ("--bundle", "{bundle}", "--rounds", "2")),
        Step("batching/batch_drift",
             "batched rows against the same rows alone: logit difference, greedy agreement", None,
             ("{bundle}", "--sequences", "2", "--steps", "2", "--prompt", "8")),
        Step("batching/batch_rows",
             "whether a multi-token step scores each row as one-token steps do, per hint set", None,
             ("--bundle", "{bundle1}")),
        Step("batching/chunked_prefill",
             "time to the first token of a long prompt: one step against chunked prefill", None,
             ("--tokens", "64", "--chunks", "0,32", "--rounds", "1")),
        Step("batching/rewind_diff",
             "how far mask-rewind logits are from physical-trim logits", None, ("--sequences", "3")),
    )),
    Suite("kernels", "one step's compute: weight formats, kernels, ops, the parts around the kernels", (
        Step("moe_step", "a Qwen3-30B-A3B-shaped stage cut to 4 layers against a dense stage of its active "
             "parameters", ("--out", "/tmp/ovshard-bench/moe-step"),
             ("--out", "{cache}/moe-step-small", "--small", "--layers", "1", "--rounds", "1", "--steps", "2")),
        Step("moe_step", "a GLM-4.5-Air-shaped stage of 4 sparse layers (32 of its 128 experts kept) against a dense "
             "stage of its active parameters", ("--preset", "glm-4.5-air", "--experts", "32", "--rounds", "6",
                                                "--steps", "24", "--out", "/tmp/ovshard-bench/moe-step-glm"),
             ("--preset", "glm-4.5-air", "--out", "{cache}/moe-step-glm-small", "--small", "--layers", "1",
              "--experts", "8", "--rounds", "1", "--steps", "2")),
        Step("mla_step", "a DeepSeek-V3-shaped stage's decode step against context, cached expanded, beside the "
             "compressed form's attention core", None, None),
        Step("cpu_kernels/int4_kernels",
             "decode speed of weight formats on the 1B shape (INT4 sym/asym, groups, INT8 share)",
             (), None),
        Step("cpu_kernels/moe_kernels",
             "the routed experts' GatherMatmul against dense FullyConnected nodes of the same bytes, 3 or 2 a block",
             None, ("--experts", "8", "--layers", "1", "--hidden", "256", "--expert-size", "64", "--threads", "1",
                    "--rounds", "1", "--steps", "2")),
        Step("cpu_kernels/fc_kernels",
             "the CPU plugin's fully connected kernels alone: formats x settings x threads", None,
             ("--shapes", "64x128", "--threads", "1", "--formats", "i4:32", "--settings", "bf16", "--mb", "1",
              "--repeats", "2")),
        Step("cpu_kernels/zero_points",
             "INT4 weights with f16 zero points (Q4_1 blocks) as stored against split into codes and group sums",
             (), ("--shapes", "64x128", "--blocks", "2", "--threads", "1", "--rounds", "1")),
        Step("op_profile",
             "one step of a one-stage bundle from OpenVINO's performance counters: per op type and "
             "layer", None, ("{bundle1}", "--threads", "1", "--steps", "2")),
        Step("step_parts",
             "a decode step's parts outside the kernels: detokenizer, sampler, inputs, infer call",
             None, ("{bundle1}", "--repeats", "20", "--threads", "1")),
        Step("static_decode", "a one-stage decode step on the dynamic paged model against its static copy, "
             "interleaved", None, ("{bundle1}", "--threads", "1", "--steps", "4", "--rounds", "1", "--context", "8")),
        Step("local_loop", "run --local in process: the engine loop over the stages against a decode loop of its "
             "own, interleaved", None, ("{bundle1}", "--threads", "1", "--tokens", "8", "--rounds", "1")),
    )),
    Suite("cluster", "ovshard up and the wire: placement, a node lost, TLS", (
        Step("cluster/placement", "measured placement against an equal split on an emulated unequal pair",
             ("--rounds", "3"), None),
        Step("cluster/node_loss",
             "a node lost for good mid-stream -> every stream progressing again", ("--rounds", "2"),
             None),
        Step("cluster/tls_cost", "bytes and ms per decode step, plain TCP against mutual TLS", None,
             ("--rounds", "2", "--tokens", "8")),
    )),
    Suite("api", "ovshard api under load", (
        Step("api_load", "ovshard api at 1-8 clients against the bare Session",
             ("--models", "stories260K,llama-3.2-1b", "--requests", "2"), ("--quick",)),
        Step("api/api_crowd", "64 streamed openai clients at once, every 4th going away", None, None),
        Step("api/placement", "a one-stage bundle's api (and chat) in the command's process against a worker",
             ("{bundle1}", "--rounds", "3"), ("{bundle1}", "--rounds", "1", "--tokens", "8")),
        Step("api/api_ttft_probe",
             "time to the first text: a raw socket client against the openai client", None,
             None),
    )),
    Suite("peers", "ovshard against llama.cpp (built once into ~/.cache/ovshard/peers; needs cmake, g++)", (
        Step("peers", "one node against the fastest llama.cpp that runs here",
             ("--models", "smollm2-135m,llama-3.2-1b,gemma3-270m,stories260K", "--threads", "2"), None),
        Step("against_llama_cpp/spec_copy",
             "prompt lookup on copy-style tasks, the real Gemma's INT4 bundle", (), None),
        Step("against_llama_cpp/decode_overhead",
             "the decode-step profile and CPU plugin settings (Gemma 3 270M)", ("--rounds", "4"),
             ("{bundle1}", "--rounds", "1", "--tokens", "8")),
        Step("against_llama_cpp/ttft",
             "time to the first token, cold and warm, against llama-completion", (), None),
        Step("against_llama_cpp/server_peers",
             "8 chat clients: ovshard api against llama-server -np 8", ("--tokens", "128"), None),
        Step("api_load", "8 openai clients at once against one, the Gemma bundle server_peers compiled",
             ("--bundle", "/tmp/ovshard-bench/bundles/gemma-3-270m-q4_k_m-2st-default", "--clients", "1,8",
              "--requests", "2", "--tokens", "64", "--rounds", "3"), None),
    )),
)}

# bench/ modules no suite runs as a step: helpers other scripts import, and scripts with their own Makefile lines.
HELPERS = ("harness", "report", "suite", "suites", "scenarios_base", "memprobe", "llama_build")
OWN_LINES = ("compile_memory", "compile_memory_sweep", "int4_frontier", "int4_fit_cost", "compile/nncf_formats",
             "compile/nncf_options")


def steps(names: list[str]) -> list[tuple[str, Step]]:
    """(suite, step) for the named suites, in order; SystemExit naming the suites where one is unknown."""
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"--suite: unknown {unknown}; expected names from {list(SUITES)}")
    return [(n, step) for n in names for step in SUITES[n].steps]


def inventory() -> str:
    """Every suite and step as markdown: the table of bench/README.md."""
    lines = ["| suite | script | measures | full run | quick |", "| --- | --- | --- | --- | --- |"]
    for suite in SUITES.values():
        if not suite.steps:
            lines.append(f"| {suite.name} | `suite.py` (scenarios) | {suite.measures} | yes | `--quick` |")
        for step in suite.steps:
            full = "by hand" if step.full is None else f"`{' '.join(step.full)}`".replace("``", "yes")
            quick = "-" if step.quick is None else f"`{' '.join(step.quick)}`"
            lines.append(f"| {suite.name} | `{step.script}.py` | {step.measures} | {full} | {quick} |")
    return "\n".join(lines)
