#!/usr/bin/env python
"""The routed experts' kernel against a dense one of the same bytes: a mixture-of-experts block in the forms the
CPU plugin gathers, one token a step.

A GLM-4.5-Air-shaped block (hidden 4096, experts of 1408, 8 routed of ``--experts``; sigmoid routing), repeated
``--layers`` times with weights of its own, written in torch and converted as ovshard's stage module writes it:
``3gemm`` (gate, up and down, each one MatMul over every expert: the plugin's ConvertTiledMoeBlockTo3GatherMatmuls
makes them GatherMatmuls that read the routed experts only), ``fused`` (gate and up in one biased projection,
clamped: gpt-oss's form, which the plugin turns into 2 GatherMatmuls), and ``dense`` (one MLP of 8 x 1408 a layer:
the bytes the routed experts hold, in FullyConnected nodes). Every weight NNCF-compressed (``KIND@MODE:GROUP``,
e.g. ``3gemm@int4_sym:128``; group -1: one scale a row). Decode steps interleaved (bench/harness.py), medians;
each case's nodes by type from the runtime graph and its slowest op types from the performance counters of its
last step.

    CI=true .venv/bin/python bench/cpu_kernels/moe_kernels.py [--experts 32] [--layers 2] [--threads 8,4]
        [--cases 3gemm@int4_sym:128,fused@int4_sym:128,dense@int4_sym:128]

Writes bench/results/moe_kernels.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import openvino as ov
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from harness import interleaved, write_results  # noqa: E402  (bench/ is not a package)

TOPK = 8
KINDS = ("3gemm", "fused", "dense")


class Block(torch.nn.Module):
    """``layers`` MoE blocks (or dense MLPs of the routed experts' width) in a residual chain."""

    def __init__(self, kind: str, experts: int, layers: int, hidden: int, size: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def r(*shape: int) -> torch.nn.ParameterList:
            return torch.nn.ParameterList([torch.randn(*shape, generator=g) * 0.02 for _ in range(layers)])

        self.kind, self.experts = kind, experts
        self.router = r(experts, hidden)
        if kind == "dense":
            self.gate, self.up, self.down = r(TOPK * size, hidden), r(TOPK * size, hidden), r(hidden, TOPK * size)
        elif kind == "fused":
            self.gate_up, self.gate_up_bias = r(experts, 2 * size, hidden), r(experts, 2 * size)
            self.down, self.down_bias = r(experts, hidden, size), r(experts, hidden)
        else:
            self.gate, self.up, self.down = r(experts, size, hidden), r(experts, size, hidden), r(experts, hidden, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        for i in range(len(self.router)):
            flat = x.reshape(-1, h)
            if self.kind == "dense":
                x = x + F.linear(F.silu(F.linear(flat, self.gate[i])) * F.linear(flat, self.up[i]),
                                 self.down[i]).view(b, t, h)
                continue
            logits = F.linear(flat, self.router[i])
            top_w, top_i = torch.topk(torch.sigmoid(logits), TOPK, dim=-1)
            routing = torch.zeros_like(logits).scatter(1, top_i, top_w / top_w.sum(-1, keepdim=True))
            tiled = flat.repeat(self.experts, 1).view(self.experts, -1, h)
            if self.kind == "fused":
                gu = torch.matmul(tiled, self.gate_up[i].transpose(1, 2)) + self.gate_up_bias[i][:, None]
                gate, up = gu[..., ::2].clamp(max=7.0), gu[..., 1::2].clamp(min=-7.0, max=7.0)
                glu = gate * torch.sigmoid(gate * 1.702)  # its own product: the plugin's pattern wants a Swish
                out = torch.matmul((up + 1) * glu, self.down[i].transpose(1, 2))
                out = out + self.down_bias[i][:, None]
            else:
                gate = F.silu(torch.matmul(tiled, self.gate[i].transpose(1, 2)))
                out = torch.matmul(gate * torch.matmul(tiled, self.up[i].transpose(1, 2)), self.down[i].transpose(1, 2))
            weights = routing.transpose(0, 1).reshape(self.experts, b, t)[..., None]
            x = x + (out.view(self.experts, b, t, h) * weights).sum(dim=0)
        return x


def build(case: str, experts: int, layers: int, hidden: int, size: int) -> ov.Model:
    import nncf

    kind, fmt = case.split("@")
    mode, group = fmt.split(":")
    if kind not in KINDS:
        raise SystemExit(f"--cases {case}: expected KIND@MODE:GROUP with KIND one of {', '.join(KINDS)}")
    with torch.no_grad():
        model = ov.convert_model(Block(kind, experts, layers, hidden, size).eval(),
                                 example_input=torch.randn(1, 1, hidden), input=[ov.PartialShape([1, -1, hidden])])
    return nncf.compress_weights(model, mode=getattr(nncf.CompressWeightsMode, mode.upper()), group_size=int(group),
                                 ratio=1.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--expert-size", type=int, default=1408)
    p.add_argument("--threads", default="8,4")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cases", default="3gemm@int4_sym:128,fused@int4_sym:128,dense@int4_sym:128")
    a = p.parse_args()
    core = ov.Core()
    models = {case: build(case, a.experts, a.layers, a.hidden, a.expert_size) for case in a.cases.split(",")}
    x = np.random.default_rng(0).standard_normal((1, 1, a.hidden)).astype(np.float32)
    rows = []
    for threads in (int(t) for t in a.threads.split(",")):
        config = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "128",
                  "INFERENCE_NUM_THREADS": threads, "PERF_COUNT": True}
        requests, nodes = {}, {}
        for case, model in models.items():
            compiled = core.compile_model(model, "CPU", config)
            kinds = [op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops()]
            nodes[case] = {k: kinds.count(k) for k in ("GatherMatmul", "FullyConnected")}
            requests[case] = compiled.create_infer_request()

        def steps(request: ov.InferRequest) -> None:
            for _ in range(a.steps):
                request.infer([x])

        got = interleaved({case: lambda r=r: steps(r) for case, r in requests.items()}, a.rounds, warmup=1,
                          label=f"{threads} threads")
        dense = next((c for c in models if c.startswith("dense@")), None)
        for case, request in requests.items():
            ms = 1000 * statistics.median(got.samples[case]) / a.steps
            ops: dict[str, float] = {}
            for info in request.profiling_info:
                ops[info.node_type] = ops.get(info.node_type, 0.0) + info.real_time.total_seconds() * 1e3
            top = sorted(ops.items(), key=lambda kv: -kv[1])[:3]
            rows.append({"threads": threads, "case": case, "step_ms": round(ms, 3), **nodes[case],
                         "top ops (ms)": ", ".join(f"{k} {v:.2f}" for k, v in top)})
        if dense:
            base = next(r["step_ms"] for r in rows if r["threads"] == threads and r["case"] == dense)
            for r in rows:
                if r["threads"] == threads:
                    r["over dense"] = round(r["step_ms"] / base, 2)
    print(write_results("moe_kernels", rows, {"experts": a.experts, "layers": a.layers, "hidden": a.hidden,
                                              "expert_size": a.expert_size, "steps": a.steps, "rounds": a.rounds},
                        title="routed experts (GatherMatmul) against dense FullyConnected nodes of the same bytes"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
