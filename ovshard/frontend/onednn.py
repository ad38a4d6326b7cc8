"""The calibration's float32 matmuls (its layer-by-layer forward, the scale fit's) through oneDNN where torch has it.

torch's ``F.linear`` and ``torch.bmm`` in float32 call MKL's sgemm, which on AMD CPUs runs its AVX2 code: on 2
AVX-512 Zen cores, [1024, 2048] x [2048, 8192] took 170 ms through MKL and 78 ms through oneDNN (torch's own
``mkldnn`` ops, the ones its inductor emits), and the fit's [1024, 128] x [128, 128] 310 us against 146 us. Both
compute in float32 (no bf16 or tf32 rounding); they may add a long row in another order, so the two differ by
float32 noise (6e-6 at 2,048 inputs; none at 64 or 128 inputs). One kernel is chosen once a process, so every
run of a layer in it rounds alike. Without torch's oneDNN (a build without it), plain ``F.linear``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _probe() -> bool:
    """Whether this torch runs a float32 linear through oneDNN (``torch.ops.mkldnn._linear_pointwise``)."""
    try:
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        return bool(torch.backends.mkldnn.is_available()
                    and torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w)))
    except (AttributeError, RuntimeError):
        return False


AVAILABLE = _probe()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x`` [..., in] times ``weight`` [out, in] transposed, through oneDNN for
    float32 tensors that need no gradient (oneDNN's op has none)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if (AVAILABLE and weight.dim() == 2 and all(t.dtype == torch.float32 and not t.requires_grad for t in tensors)):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class OneDnnLinear(TorchFunctionMode):
    """Inside it, every ``F.linear`` runs as :func:`linear` (the calibration's float32 run of a layer)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            return linear(x, weight, args[2] if len(args) > 2 else kwargs.get("bias"))
        return func(*args, **kwargs)
