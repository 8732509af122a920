"""Rotary position embedding: inverse frequencies (plain and Llama-3 scaled) and
its application to the leading `rotary_dim` dims of each head (rotate-half
layout, as in HF checkpoints)."""
from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's long-context rule: stretch low frequencies by `factor`, keep high
    ones, and blend smoothly between the two wavelength bounds."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class Rotary:
    """cos/sin tables for given positions; `apply` rotates q or k in place of a copy."""

    def __init__(self, config: ModelConfig) -> None:
        self.rotary_dim = config.rotary_dim
        self.inv_freq = inverse_frequencies(config)
        self._on_device: dict[torch.device, torch.Tensor] = {}  # not copied to the GPU every step

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """fp32 inverse frequencies on `device`, copied once (not inside a CUDA
        graph capture: the first forward, a warm-up, makes the copy)."""
        device = torch.device(device)
        inv_freq = self._on_device.get(device)
        if inv_freq is None:
            inv_freq = self._on_device[device] = self.inv_freq.to(device)
        return inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq_on(positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos/sin: [T, rotary_dim]."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
        return torch.cat((out, rest), dim=-1) if rest.numel() else out
