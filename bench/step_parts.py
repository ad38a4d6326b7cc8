#!/usr/bin/env python
"""What a one-node decode step costs beyond its kernels, part by part (a one-stage bundle in the CLI's process).

Each part is timed alone, many times, with the inputs a decode step gives it: the detokenizer turning one more
token into text (``TextStream.push``, what `run` prints), the sampler over the vocabulary (``Scores.from_logits``
and the accept rule on one logits row, greedy and top-k/top-p), the paged step's input arrays
(``paged_inputs``), OpenVINO's infer call on a model of one op with as many inputs (its fixed cost: binding
tensors, the plugin's dispatch), and the copy of the output. Then a whole step through ``LocalPipeline`` against
the stage's own ``run``: what the decode loop adds around it. Framing, loopback and the engine are not on this
path (they are the worker path's: ``bench/against_llama_cpp/decode_overhead.py``).

    CI=true .venv/bin/python bench/step_parts.py BUNDLE [--repeats 2000] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import write_results  # noqa: E402  (bench/ is not a package)


def per_call_us(call: Callable[[], object], repeats: int) -> float:
    for _ in range(min(50, repeats)):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return 1e6 * (time.perf_counter() - start) / repeats


def infer_call_us(inputs: dict[str, np.ndarray], repeats: int, threads: int) -> float:
    """An infer of a model that adds its first input to itself, fed every array of a paged step."""
    params = [ops.parameter(ov.PartialShape([-1] * a.ndim), ov.Type(a.dtype), name=n) for n, a in inputs.items()]
    for p, name in zip(params, inputs, strict=True):
        p.output(0).get_tensor().set_names({name})
    model = ov.Model([ops.add(params[0], params[0])], params)
    request = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": str(threads)}).create_infer_request()
    return per_call_us(lambda: request.infer(inputs), repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.client.inprocess import LocalPipeline
    from ovshard.runtime.client.text import Text, TextStream
    from ovshard.runtime.decoding.speculative import accept
    from ovshard.runtime.engine.paged import PagedRows, paged_inputs
    from ovshard.runtime.engine.sampler import SamplingConfig, make_rng
    from ovshard.runtime.engine.scores import Scores

    m = read_manifest(args.bundle)
    vocab = m.architecture.vocab_size
    text = Text(args.bundle, m)
    stream = TextStream(text, [1, 2, 3])
    rng = np.random.default_rng(0)
    row = rng.standard_normal(vocab).astype(np.float32)
    greedy, sampled = SamplingConfig(), SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, seed=1)
    draw = make_rng(sampled)
    ids = iter(rng.integers(100, min(vocab, 20000), 10 * args.repeats).tolist())
    rows = [PagedRows(np.array([7], np.int64), 100, list(range(8)), 1)]
    step_inputs = paged_inputs("input_ids", rows, 32, True)
    parts = {
        "detokenizer, one token": per_call_us(lambda: stream.push(next(ids)), args.repeats),
        "sampler, greedy (argmax of the row)": per_call_us(
            lambda: accept([], None, Scores.from_logits(row[None], "argmax"), greedy, draw, vocab), args.repeats),
        "sampler, top-k 40 / top-p 0.95 over the row": per_call_us(
            lambda: accept([], None, Scores.from_logits(row[None], "logits"), sampled, draw, vocab), args.repeats),
        "paged step inputs": per_call_us(lambda: paged_inputs("input_ids", rows, 32, True), args.repeats),
        "OpenVINO infer call, 9 inputs, one op": infer_call_us(step_inputs, args.repeats, args.threads),
        "output row copy": per_call_us(lambda: row.copy(), args.repeats),
    }
    pipeline = LocalPipeline(args.bundle, config={"INFERENCE_NUM_THREADS": str(args.threads)}, slice_logits=True,
                             paged=True)
    stage = pipeline.stages[0]
    pipeline.step(list(range(1, 17)), 0, "argmax")
    whole, alone = [], []
    for i in range(64):
        start = time.perf_counter()
        pipeline.step([7], 16 + i, "argmax")
        whole.append(time.perf_counter() - start)
        start = time.perf_counter()
        stage.step(np.array([[7]], np.int64), 16 + i, rows=1)
        alone.append(time.perf_counter() - start)
    parts["decode loop target around the stage (LocalPipeline.step - stage.step)"] = 1e6 * (
        statistics.median(whole) - statistics.median(alone))
    step_ms = round(1e3 * statistics.median(alone), 3)
    rows = [{"part": name, "us a step": round(value, 1)} for name, value in parts.items()]
    print(f"stage step (the kernels and the infer call): {step_ms} ms")
    print(write_results("step_parts", rows, {"bundle": str(args.bundle), "stage step ms": step_ms}, out=args.out,
                        title="a decode step's parts outside the kernels"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
