"""Gated DeltaNet over a whole batch at once, for CUDA tensors: state slots
read and written through device indices, no per-sequence Python loop, so
decode and speculative verify steps can be captured in CUDA graphs.

What runs where (GatedDeltaNet.forward in engine/model.py picks):
- CUDA, every sequence with 1..8 new tokens (decode steps, speculative verify
  batches of k+1 tokens, short chunks and the part of a chunk after a
  snapshot inside it, engine/batch.py SnapshotSplit): the fused Triton steps of
  engine/gdn_kernels.py, one conv kernel and one recurrence kernel per layer,
  g/beta computed inside from the raw projections; the state after each token
  goes to its write slot (ForwardBatch.gdn). TANDEM_FUSED_GDN=0
  switches them off (A/B on the GPU) and the two items below run instead.
- CUDA decode steps without the fused steps: `decode_conv` and
  `gated_delta_rule_decode` below (the PyTorch recurrence of engine/gdn.py on
  gathered slots).
- CUDA prefill (longer chunks): `prefill_conv` and `gated_delta_rule_prefill`
  (fla-core's chunked kernel over cu_seqlens where fla is installed, the
  `gpu` extra; else, or with TANDEM_FLA=0, the chunked PyTorch form per
  sequence). Without the fused steps, verify batches
  (position slots) take the model's per-sequence loop.
- CPU: never here; the model keeps the per-sequence reference loop.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

from engine.gdn import chunked_gated_delta_rule, recurrent_gated_delta_rule


@functools.lru_cache(maxsize=1)
def fla_available() -> bool:
    """fla-core is importable and not switched off (TANDEM_FLA=0): its chunked
    rule runs the CUDA prefill. On the H200 (2026-12-01, fla-core 0.6.0) it
    agrees with our chunked form at the 27B's head layout
    (tests/test_gdn_fla.py) and took the 27B's prefill from 26% to 52% MFU at
    32K (BENCHMARKS.md). Decode and verify run our fused kernels
    (engine/gdn_kernels.py), and the unfused decode path stays PyTorch: fla's
    fused recurrent form has not passed our tests on the GPU.
    """
    if os.environ.get("TANDEM_FLA", "1") in ("", "0"):
        return False
    return importlib.util.find_spec("fla") is not None


def use_batched_path(x: torch.Tensor) -> bool:
    return x.is_cuda


def fused_enabled() -> bool:
    """The fused Triton steps are on unless TANDEM_FUSED_GDN=0 (read per call,
    so a process can A/B them; inside a captured graph nothing is read)."""
    return os.environ.get("TANDEM_FUSED_GDN", "1") not in ("0", "")


def use_fused_path(x: torch.Tensor, batch) -> bool:
    """CUDA tensors, the switch on, and every sequence of the ForwardBatch within
    the kernels' 1..8 new tokens."""
    if not x.is_cuda or not fused_enabled():
        return False
    from engine import gdn_kernels  # triton: imported only where it runs

    return gdn_kernels.fits(batch.attention.max_new_tokens)


def fused_conv(mixed, windows, weight, offsets, positions, state_slots, write_slots,
               max_new_tokens: int) -> torch.Tensor:
    """Conv + SiLU of each sequence's new tokens; see gdn_kernels.conv_step."""
    from engine import gdn_kernels

    return gdn_kernels.conv_step(mixed, windows, weight, offsets, positions, state_slots,
                                 write_slots, max_new_tokens)


def fused_recurrence(q, k, v, a, b, a_log, dt_bias, states, offsets, positions, state_slots,
                     write_slots, max_new_tokens: int) -> torch.Tensor:
    """The gated delta rule with g/beta from the raw a/b projections; see
    gdn_kernels.recurrence_step."""
    from engine import gdn_kernels

    return gdn_kernels.recurrence_step(q, k, v, a, b, a_log, dt_bias, states, offsets,
                                       positions, state_slots, write_slots, max_new_tokens)


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


def prefill_conv(mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
                 batch) -> torch.Tensor:
    """The prefill batch's conv + SiLU: one Triton launch (gdn_kernels.conv_chunk)
    over the ForwardBatch's device indices, or its per-sequence PyTorch
    reference with TANDEM_FUSED_GDN=0."""
    from engine import gdn_kernels  # triton: imported only where it runs

    slots = [seq.state_slot for seq in batch.seqs]
    fresh = [seq.start == 0 for seq in batch.seqs]
    if not fused_enabled():
        return gdn_kernels.conv_chunk_reference(mixed, windows, weight, batch.offsets, slots,
                                                fresh)
    return gdn_kernels.conv_chunk(mixed, windows, weight, batch.row_sequences,
                                  batch.attention.q_offsets, batch.positions,
                                  batch.state_slots, batch.offsets, slots, fresh)


def _initial_states(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor):
    initial = states.index_select(0, slots)
    return torch.where(fresh[:, None, None, None], torch.zeros_like(initial), initial)


def gated_delta_rule_decode(q, k, v, g, beta, states, slots, fresh):
    """One token per sequence. q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv];
    states [slots, Hv, Dk, Dv] fp32 updated in place at `slots`. Returns o [B, Hv, Dv]."""
    initial = _initial_states(states, slots, fresh)
    o, final = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                          beta[:, None], initial)
    states.index_copy_(0, slots, final.float())
    return o[:, 0]


def gated_delta_rule_prefill(q, k, v, g, beta, states, slots, fresh, offsets: list[int],
                             varlen=None):
    """Ragged sequences packed along T. q, k [T, Hk, Dk]; v [T, Hv, Dv];
    g, beta [T, Hv]; offsets the host cu_seqlens; varlen the forward's
    batch.VarlenIndex of them, shared by its layers so that fla builds no
    index and makes no device sync per layer (None: made here). Returns
    o [T, Hv, Dv]."""
    initial = _initial_states(states, slots, fresh)
    if fla_available():
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        from engine import gdn_kernels
        from engine.batch import VarlenIndex

        varlen = varlen or VarlenIndex.build(offsets, q.device)
        # our own q/k norm: fla's autotunes through spilling configs (gdn_kernels)
        q, k = gdn_kernels.l2_normalize_heads(q), gdn_kernels.l2_normalize_heads(k)
        o, final = chunk_gated_delta_rule(
            q=q[None], k=k[None], v=v[None], g=g[None].float(), beta=beta[None],
            scale=q.shape[-1] ** -0.5, initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=False, cu_seqlens=varlen.cu_seqlens,
            cu_seqlens_cpu=varlen.host_cu_seqlens, chunk_indices=varlen.chunk_indices)
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
