"""The elementwise math of a decoder layer that both attention forms (q/k/v, and multi-head latent attention in
:mod:`ovshard.frontend.mla`) use: RMSNorm and the rotary embedding, written for tracing."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last axis, scaled by ``weight`` (Llama) or ``offset + weight`` (Gemma: 1 + w)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    scale = weight if offset == 0.0 else offset + weight
    return scale * (x * torch.rsqrt(variance + eps))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """A weightless RMSNorm over the last axis (Llama 4's q/k L2 norm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]: interleaved rotary pairs (DeepSeek's
    rope_interleave, Llama 4's complex rotary) as rotate_half's halves. q and k share the permutation, so their dot
    product, and every per-head norm after it, is unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` head dims of x [batch, heads, seq, head_dim]; the rest pass through."""
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
