"""PyTorch references of the fused ops: the model's CPU path, and the oracle of
the Triton kernels. Each rounds where the model always rounded (bf16 weights
times bf16 activations round the product; fp32 intermediates are kept where the
checkpoints' reference implementations keep them), so a kernel that matches
these to a few ulps matches the model."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """Over the last dim. Llama: weight * x̂ rounded to x's dtype first; Qwen3.5
    (zero-centred): x̂ * (1 + weight) in fp32, rounded once."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update and the next norm: (x + h, rms_norm(x + h)); the sum
    is rounded to the dtype before the norm reads it, as `x = x + h` does."""
    s = x + h
    return s, rms_norm(s, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """GDN output norm: per-head (last dim) Llama-style RMSNorm times SiLU(gate)
    in fp32, rounded to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return (out * F.silu(gate.float())).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation: SiLU(gate) (rounded to the dtype) times up."""
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotary on the leading `rotary_dim` dims of each head (rotate-half layout);
    x [T, heads, head_dim], cos/sin [T, rotary_dim]. Same as Rotary.apply."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
              rotary_dim: int, eps: float, zero_centered: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's per-head q (or k) path: the optional per-head RMSNorm, then
    rotary. Returns (rotated, normed before rotary): formats that store K
    before RoPE keep the second."""
    normed = x if weight is None else rms_norm(x, weight, eps, zero_centered)
    return rotate(normed, cos, sin, rotary_dim), normed


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention's output gate: out * sigmoid(gate), the sigmoid rounded to the dtype."""
    return out * torch.sigmoid(gate)
