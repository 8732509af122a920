"""Gated DeltaNet over a whole batch at once, for CUDA: state slots gathered
and scattered by a device index (no per-sequence Python loop, so a decode
step can be captured in a CUDA graph), and fla-core's Triton kernels when
they are installed (`pip install tandem-serve[gpu]`): the fused recurrent
form for decode steps, the chunked form with cu_seqlens for prefill.

Without fla-core the same batched layout runs engine/gdn.py's PyTorch
recurrence, so everything here also works (slowly) without it. The CPU path
of the model does not come here: it keeps the per-sequence reference loop.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

from engine.gdn import causal_conv1d, chunked_gated_delta_rule, recurrent_gated_delta_rule


@functools.lru_cache(maxsize=1)
def fla_available() -> bool:
    """fla-core is importable and not switched off (TANDEM_NO_FLA=1 compares paths)."""
    if os.environ.get("TANDEM_NO_FLA", "") not in ("", "0"):
        return False
    return importlib.util.find_spec("fla") is not None


def use_batched_path(x: torch.Tensor) -> bool:
    return x.is_cuda


def decode_conv(mixed: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor,
                fresh: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token per sequence through the depthwise causal conv + SiLU.

    mixed [B, C]; windows [slots, C, K-1] updated in place at `slots`;
    fresh [B] bool: sequences that start from a zero window."""
    window = windows.index_select(0, slots)
    window = torch.where(fresh[:, None, None], torch.zeros_like(window), window)
    seq = torch.cat((window.to(mixed.dtype), mixed[:, :, None]), dim=-1)  # [B, C, K]
    y = (seq.float() * weight.float()[None]).sum(-1)
    windows.index_copy_(0, slots, seq[:, :, 1:].to(windows.dtype))
    return F.silu(y).to(mixed.dtype)


def prefill_conv(mixed: torch.Tensor, windows: torch.Tensor, slots: list[int],
                 fresh: list[bool], offsets: list[int], weight: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(mixed)
    for i, slot in enumerate(slots):
        lo, hi = offsets[i], offsets[i + 1]
        window = torch.zeros_like(windows[slot]) if fresh[i] else windows[slot]
        out[lo:hi], windows[slot] = causal_conv1d(mixed[lo:hi], window, weight)
    return out


def _initial_states(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor):
    initial = states.index_select(0, slots)
    return torch.where(fresh[:, None, None, None], torch.zeros_like(initial), initial)


def gated_delta_rule_decode(q, k, v, g, beta, states, slots, fresh):
    """One token per sequence. q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv];
    states [slots, Hv, Dk, Dv] fp32 updated in place at `slots`. Returns o [B, Hv, Dv]."""
    initial = _initial_states(states, slots, fresh)
    if fla_available():
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        # By keyword: in fla-core 0.6.0 gk and gv come before beta, and a
        # positional call silently misreads the arguments.
        o, final = fused_recurrent_gated_delta_rule(
            q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None].float(),
            beta=beta[:, None], scale=q.shape[-1] ** -0.5, initial_state=initial,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
    else:
        o, final = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                              beta[:, None], initial)
    states.index_copy_(0, slots, final.float())
    return o[:, 0]


def gated_delta_rule_prefill(q, k, v, g, beta, states, slots, fresh, offsets: list[int]):
    """Ragged sequences packed along T. q, k [T, Hk, Dk]; v [T, Hv, Dv];
    g, beta [T, Hv]; offsets the host cu_seqlens. Returns o [T, Hv, Dv]."""
    initial = _initial_states(states, slots, fresh)
    if fla_available():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        cu_seqlens = torch.tensor(offsets, dtype=torch.long, device=q.device)
        o, final = chunk_gated_delta_rule(
            q=q[None], k=k[None], v=v[None], g=g[None].float(), beta=beta[None],
            scale=q.shape[-1] ** -0.5, initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        o = o[0]
    else:
        o = torch.empty_like(v)
        finals = []
        for i in range(len(offsets) - 1):
            lo, hi = offsets[i], offsets[i + 1]
            oi, fi = chunked_gated_delta_rule(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi],
                                              g[None, lo:hi], beta[None, lo:hi], initial[i:i + 1])
            o[lo:hi] = oi[0]
            finals.append(fi)
        final = torch.cat(finals)
    states.index_copy_(0, slots, final.float())
    return o
