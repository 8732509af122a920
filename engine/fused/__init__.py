"""Fused small ops of the decode step: RMSNorm (plain and zero-centred), the
residual add fused into the next norm, GDN's gated norm, the MLP's SiLU * up,
and attention's per-head q/k norm + partial rotary and its sigmoid output gate.

Each op has a pure-PyTorch reference (engine/fused/reference.py: exactly what
the model computed before these kernels existed, and still what it computes
on the CPU) and a Triton kernel (engine/fused/kernels.py) that reproduces the
reference's rounding steps in one launch. Inside a CUDA graph each launch
still costs microseconds, and the eager ops cost several launches each, so at
batch 1 these dominate the step outside the weight GEMVs.

This package decides nothing about the model: model.py asks `use_fused(x)`
and calls the kernels or the references. It must not know about pages,
batches or the CUDA graphs.

Dispatch: CUDA tensors take the kernels unless TANDEM_FUSED_NORMS=0 (the old
eager path, kept for A/B on the GPU) or autograd is recording. CPU tensors always take the references
(CI compares them with transformers); tests force the kernels on CPU tensors
(Triton's interpreter) through `_FORCE_ON_CPU`.
"""
from __future__ import annotations

import os

import torch

from engine.switches import on_off

ENV_SWITCH = "TANDEM_FUSED_NORMS"
_FORCE_ON_CPU = False  # tests only: run the kernels on CPU tensors (TRITON_INTERPRET=1)
PAIR_ENV = "TANDEM_NORM_ROPE_PAIR"


def norm_rope_paired() -> bool:
    """Whether attention's q and k norm + rotary share one launch
    (kernels.norm_rope_pair; TANDEM_NORM_ROPE_PAIR, on by default; read at
    the call, in a CUDA graph at capture): the same bits as two launches."""
    return on_off(PAIR_ENV, True, on="q and k in one launch", off="a launch each")


def use_fused(x: torch.Tensor) -> bool:
    """Whether ops on `x` take the Triton kernels (read on every call, so a
    process's environment decides; inside a CUDA graph it was decided at capture).
    The kernels have no backward: with autograd on (training the MTP head on a
    GPU) the references run. The model's forwards run under inference_mode."""
    if not (x.is_cuda or _FORCE_ON_CPU) or torch.is_grad_enabled():
        return False
    return os.environ.get(ENV_SWITCH, "1") != "0"


def load_kernels():
    """The Triton module, imported on first use: triton is a GPU/test
    dependency, not one the CPU install needs."""
    from engine.fused import kernels as k
    return k
