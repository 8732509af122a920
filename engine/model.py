"""The model forward over the paged interface, for both families:

- "llama": dense decoder (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with
  per-head q/k RMSNorm);
- "qwen3_5": the hybrid of Gated DeltaNet layers and gated full-attention
  layers with zero-centred norms and partial rotary, plus the MTP head's
  weights (kept for speculative decoding).

Module and parameter names are Hugging Face's, except that the projections
reading the same input are merged into one matrix (as vLLM's
QKVParallelLinear / MergedColumnParallelLinear do), so a decode step
launches one weight GEMV where it launched two to four: MLP `gate_up_proj`
(gate_proj, up_proj), attention `qkv_proj` (q_proj, k_proj, v_proj, biases
too) and GDN `in_proj` (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). Each
module names its merged projections and their checkpoint parts in
`merged_parts`; the loader joins a checkpoint's tensors by it
(engine/weights/merge.py), and the outputs are split back into views here.

The forward takes a ForwardBatch of sequences of different lengths and
positions and reads/writes KV pages and GDN state slots in a PagedKVCache;
on the CPU everything is plain PyTorch.

On CUDA the small per-layer ops (norms, the residual adds, SiLU * up, q/k
norm + rotary, the output gate) run as fused Triton kernels (engine/fused;
TANDEM_FUSED_NORMS=0 keeps the eager ops). To fuse each residual add into the
norm after it, the layer loop carries the residual stream as (x, pending): the
stream's value is x + pending, added by the next norm.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch
from engine.cache import PagedKVCache
from engine import gdn_batched
from engine.config import LINEAR_ATTENTION, ModelConfig
from engine.fused import load_kernels as fused_kernels, norm_rope_paired, reference, use_fused
from engine.gdn import causal_conv1d, chunked_gated_delta_rule, recurrent_gated_delta_rule
from engine.rotary import Rotary


class RMSNorm(nn.Module):
    """Llama-style RMSNorm (w * x̂), or Qwen3.5's zero-centred one ((1 + w) * x̂,
    multiplied in fp32): the two round differently in bf16, so both are kept."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return fused_kernels().rms_norm(x, self.weight, self.eps, self.zero_centered)
        return reference.rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add_forward(self, x: torch.Tensor, h: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual update then this norm: (x + h, norm(x + h)); h None: (x, norm(x))."""
        if h is None:
            return x, self(x)
        if use_fused(x):
            return fused_kernels().add_rms_norm(x, h, self.weight, self.eps, self.zero_centered)
        return reference.add_rms_norm(x, h, self.weight, self.eps, self.zero_centered)


class GatedRMSNorm(nn.Module):
    """GDN output norm: RMSNorm per head, then times SiLU(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return fused_kernels().gated_rms_norm(x, gate, self.weight, self.eps)
        return reference.gated_rms_norm(x, gate, self.weight, self.eps)


MergedParts = dict[str, tuple[tuple[str, int], ...]]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.merged_parts: MergedParts = {"gate_up_proj": (("gate_proj", i), ("up_proj", i))}
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self._intermediate = i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.gate_up_proj(x))

    def project(self, norm: "RMSNorm", x: torch.Tensor, pending: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(x + pending, gate_up(norm(x + pending)), activated): the residual
        update, the norm and the first projection. activated: a one-row
        CUDA GEMV gave SiLU(gate) * up in its epilogue
        (gemv_cuda.SiluMulEpilogue), half as wide, and the activation's
        launch goes away."""
        epilogue = None
        if hasattr(self.gate_up_proj, "epilogue_applies"):   # it judges the row and the card
            from engine.quant.gemv_cuda import SiluMulEpilogue

            epilogue = SiluMulEpilogue()
        return norm_then_project_in_epilogue(norm, x, pending, self.gate_up_proj, epilogue)

    def finish(self, gate_up: torch.Tensor, activated: bool = False) -> torch.Tensor:
        """The MLP after its first projection (gate_up_proj's output, or
        with activated the activation project gave). A quantized down
        projection may do the activation itself (QuantLinear.forward_activated:
        in the CUDA GEMV's prologue)."""
        if activated:
            return self.down_proj(gate_up)
        if use_fused(gate_up) and hasattr(self.down_proj, "forward_activated"):
            out = self.down_proj.forward_activated(gate_up)
            if out is not None:
                return out
        gate, up = gate_up.split(self._intermediate, dim=-1)
        act = fused_kernels().silu_mul(gate, up) if use_fused(gate_up) \
            else reference.silu_mul(gate, up)
        return self.down_proj(act)


class Attention(nn.Module):
    """Full attention with GQA over paged KV; optional q/k norm and output gate."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.output_gate = config.attn_output_gate
        q_out = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        kv_out = self.num_kv_heads * self.head_dim
        self.merged_parts: MergedParts = {
            "qkv_proj": (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out))}
        self.qkv_proj = nn.Linear(config.hidden_size, q_out + 2 * kv_out,
                                  bias=config.attention_bias)
        self._qkv_split = (q_out, kv_out, kv_out)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.zero_centered_norm)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.zero_centered_norm)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: torch.Tensor):
        """(q [T, heads, D], gate [T, heads, D] or None, k, v [T, kv_heads, D]),
        before the q/k norms and RoPE."""
        return self.split_projection(self.qkv_proj(x))

    def split_projection(self, qkv: torch.Tensor):
        """project() from qkv_proj's output."""
        tokens = qkv.shape[0]
        # views of one [T, q + k + v] output: every row keeps unit stride
        q, k, v = qkv.split(self._qkv_split, dim=-1)
        q = q.view(tokens, self.num_heads, -1)
        gate = None
        if self.output_gate:  # per head: [query | gate]
            q, gate = q.split(self.head_dim, dim=-1)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        return q, gate, k, v

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache,
                rotary: Rotary, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.forward_projected(self.qkv_proj(x), batch, cache, rotary, cos_sin)

    def forward_projected(self, qkv: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache,
                          rotary: Rotary, cos_sin: tuple[torch.Tensor, torch.Tensor]
                          ) -> torch.Tensor:
        """The layer after its first projection (qkv_proj's output)."""
        tokens = qkv.shape[0]
        q, gate, k, v = self.split_projection(qkv)
        pre_rope = cache.layer_format(self.layer).k_pre_rope
        if use_fused(qkv):
            q, k, k_stored = self._norm_rope_fused(q, k, rotary, cos_sin, pre_rope)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            k_stored = k  # formats that store K before RoPE apply it after dequantizing
            q, k = rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin)
        cache.write_kv(self.layer, batch.kv_slots, k_stored if pre_rope else k, v)
        # the fused path gates inside attention (its split combine, or
        # engine/fused's kernel after it)
        fused_gate = gate if use_fused(qkv) else None
        out = cache.attend(self.layer, q, batch.attention, self.head_dim ** -0.5,
                           output_gate=fused_gate)
        out = out.reshape(tokens, -1)
        if gate is not None and fused_gate is None:
            out = out * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(out)

    def _norm_rope_fused(self, q, k, rotary, cos_sin, keep_k_normed: bool):
        """q/k norm (when the model has one) and rotary, both in one launch
        (norm_rope_paired) or one each; with keep_k_normed also K before
        rotary (for formats that store it so)."""
        kernels, dim = fused_kernels(), rotary.rotary_dim
        q_weight = None if self.q_norm is None else self.q_norm.weight
        k_weight = None if self.k_norm is None else self.k_norm.weight
        eps, zc = (0.0, False) if self.q_norm is None else (self.q_norm.eps,
                                                             self.q_norm.zero_centered)
        if norm_rope_paired():
            return kernels.norm_rope_pair(q, k, q_weight, k_weight, *cos_sin, dim, eps, zc,
                                          keep_k_normed=keep_k_normed)
        q, _ = kernels.norm_rope(q, q_weight, *cos_sin, dim, eps, zc)
        k, k_normed = kernels.norm_rope(k, k_weight, *cos_sin, dim, eps, zc,
                                        keep_normed=keep_k_normed)
        return q, k, k_normed


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer; its memory is one state slot per sequence."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_k_heads, self.num_v_heads = config.linear_num_k_heads, config.linear_num_v_heads
        self.k_dim, self.v_dim = config.linear_k_head_dim, config.linear_v_head_dim
        key_total = self.num_k_heads * self.k_dim
        value_total = self.num_v_heads * self.v_dim
        conv_dim = config.linear_conv_dim
        parts = (("in_proj_qkv", conv_dim), ("in_proj_z", value_total),
                 ("in_proj_b", self.num_v_heads), ("in_proj_a", self.num_v_heads))
        self.merged_parts: MergedParts = {"in_proj": parts}
        self.in_proj = nn.Linear(config.hidden_size, sum(rows for _, rows in parts), bias=False)
        self._in_split = tuple(rows for _, rows in parts)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel, groups=conv_dim,
                                bias=False, padding=config.linear_conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_total, config.hidden_size, bias=False)
        self._split = (key_total, key_total, value_total)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        return self.forward_projected(self.in_proj(x), batch, cache)

    def project(self, norm: "RMSNorm", x: torch.Tensor, pending: torch.Tensor | None,
                batch: ForwardBatch, cache: PagedKVCache
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(x + pending, in_proj(norm(x + pending)), convolved): the residual
        update, the norm and the first projection. convolved: a one-token
        decode step's conv + SiLU ran in in_proj's CUDA GEMV epilogue
        (gemv_cuda.ConvEpilogue), so the output's first conv_dim columns
        already hold it and its launch goes away."""
        epilogue = None
        if hasattr(self.in_proj, "epilogue_applies") and self._one_fused_token(x, batch):
            epilogue = self._conv_epilogue(batch, cache)
        return norm_then_project_in_epilogue(norm, x, pending, self.in_proj, epilogue)

    @staticmethod
    def _one_fused_token(x: torch.Tensor, batch: ForwardBatch) -> bool:
        """A batch of one token that the fused GDN steps run (CUDA): its
        conv may run in in_proj's one-row GEMV."""
        return (x.is_cuda and x.shape[0] == 1 and batch.attention.max_new_tokens == 1
                and gdn_batched.use_fused_path(x, batch) and batch.gdn.rows is None)

    def _conv_epilogue(self, batch: ForwardBatch, cache: PagedKVCache):
        from engine.quant.gemv_cuda import ConvEpilogue

        return ConvEpilogue(self.conv1d.weight[:, 0, :], cache.conv_window(self.layer),
                            batch.positions, batch.gdn.read, batch.gdn.write)

    def forward_projected(self, projected: torch.Tensor, batch: ForwardBatch,
                          cache: PagedKVCache, convolved: bool = False) -> torch.Tensor:
        """The layer after its first projection (in_proj's output; with
        convolved, its qkv columns already through the conv, see project)."""
        tokens = projected.shape[0]
        # views of one [T, qkv + z + b + a] output (row stride the whole width)
        mixed, z, b, a = projected.split(self._in_split, dim=-1)
        z = z.view(tokens, self.num_v_heads, self.v_dim)
        states, windows = cache.recurrent_state(self.layer), cache.conv_window(self.layer)
        weight = self.conv1d.weight[:, 0, :]
        # the fused steps write a snapshot like any other per-token state (batch.gdn)
        if batch.takes_snapshots and not gdn_batched.use_fused_path(projected, batch):
            out = self._mix_around_snapshots(mixed, a, b, batch.snapshot_split, states,
                                             windows, weight)
        else:
            out = self._mix(mixed, a, b, batch, states, windows, weight, convolved)
        return gated_norm_then_project(self.norm, out, z, self.out_proj)

    def _mix_around_snapshots(self, mixed, a, b, split, states, windows, weight):
        """The conv and recurrence up to each snapshot, the snapshot, then the
        rest: the same two passes a prefill cut at the snapshot makes, without
        a second forward of the whole model for the rows after it."""
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.v_dim, dtype=mixed.dtype,
                          device=mixed.device)
        rows = split.rows_before
        out[rows] = self._mix(mixed[rows], a[rows], b[rows], split.before, states, windows, weight)
        split.take_snapshots(states, windows)
        rows = split.rows_after
        out[rows] = self._mix(mixed[rows], a[rows], b[rows], split.after, states, windows, weight)
        return out

    def _mix(self, mixed, a, b, batch, states, windows, weight, convolved: bool = False):
        """Conv + SiLU (unless convolved: mixed is its output) and the gated
        delta rule of the batch's rows, reading and updating its state
        slots; [T, Hv, Dv]."""
        tokens = mixed.shape[0]
        if gdn_batched.use_fused_path(mixed, batch):
            return self._forward_fused(mixed, a, b, batch, states, windows, weight, convolved)
        if convolved:
            raise AssertionError("a convolved projection outside the fused GDN steps")
        beta = torch.sigmoid(b)
        # decay in log space; fp32 so that exp(A_log) cannot overflow in half precision
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        # speculative verify (position_slots) keeps every state: the per-sequence path
        keeps_every_state = any(seq.position_slots for seq in batch.seqs)
        if gdn_batched.use_batched_path(mixed) and not keeps_every_state:
            return self._forward_batched(mixed, g, beta, batch, states, windows, weight)
        out = torch.empty(tokens, self.num_v_heads, self.v_dim, dtype=mixed.dtype,
                          device=mixed.device)
        for i, seq in enumerate(batch.seqs):
            lo, hi = batch.offsets[i], batch.offsets[i + 1]
            slot = seq.state_slot
            fresh = seq.start == 0  # a new sequence starts from zeros, whatever the slot held
            window = torch.zeros_like(windows[slot]) if fresh else windows[slot]
            if seq.position_slots:  # the slot is rewritten below; keep the input window
                window = window.clone()
            conv_out, windows[slot] = causal_conv1d(mixed[lo:hi], window, weight)
            q, k, v = conv_out.split(self._split, dim=-1)
            q = q.view(1, hi - lo, self.num_k_heads, self.k_dim)
            k = k.view(1, hi - lo, self.num_k_heads, self.k_dim)
            v = v.view(1, hi - lo, self.num_v_heads, self.v_dim)
            initial = None if fresh else states[slot][None]
            if seq.position_slots:
                o = self._run_keeping_every_state(seq, q, k, v, g[None, lo:hi], beta[None, lo:hi],
                                                  initial, window, mixed[lo:hi], states, windows)
            else:
                rule = recurrent_gated_delta_rule if hi - lo == 1 else chunked_gated_delta_rule
                o, final = rule(q, k, v, g[None, lo:hi], beta[None, lo:hi], initial)
                states[slot] = final[0]
            out[lo:hi] = o[0]
        return out

    def _forward_fused(self, mixed, a, b, batch, states, windows, weight, convolved=False):
        """Decode and verify steps on CUDA: two Triton kernels (one when the
        conv ran in in_proj's epilogue: convolved), every index on the
        device (graph-safe); the state after each token goes to its write
        slot (batch.gdn). See engine/gdn_batched.py."""
        tokens = mixed.shape[0]
        meta, slots = batch.attention, batch.gdn
        where = (meta.q_offsets, batch.positions, slots.read, slots.write, meta.max_new_tokens)
        conv_out = mixed if convolved else gdn_batched.fused_conv(mixed, windows, weight, *where)
        q, k, v = conv_out.split(self._split, dim=-1)
        q = q.view(tokens, self.num_k_heads, self.k_dim)
        k = k.view(tokens, self.num_k_heads, self.k_dim)
        v = v.view(tokens, self.num_v_heads, self.v_dim)
        out = gdn_batched.fused_recurrence(q, k, v, a, b, self.A_log, self.dt_bias, states,
                                           *where)
        return out if slots.rows is None else out.index_select(0, slots.rows)

    def _forward_batched(self, mixed, g, beta, batch, states, windows, weight):
        """All sequences at once with device-indexed state slots (CUDA; graph-safe
        for decode steps); see engine/gdn_batched.py."""
        tokens = mixed.shape[0]
        slots = batch.state_slots
        if batch.is_decode:
            fresh = batch.positions == 0
            conv_out = gdn_batched.decode_conv(mixed, windows, slots, fresh, weight)
        else:
            fresh = batch.fresh
            conv_out = gdn_batched.prefill_conv(mixed, windows, weight, batch)
        q, k, v = conv_out.split(self._split, dim=-1)
        q = q.view(tokens, self.num_k_heads, self.k_dim)
        k = k.view(tokens, self.num_k_heads, self.k_dim)
        v = v.view(tokens, self.num_v_heads, self.v_dim)
        if batch.is_decode:
            return gdn_batched.gated_delta_rule_decode(q, k, v, g, beta, states, slots, fresh)
        return gdn_batched.gated_delta_rule_prefill(q, k, v, g, beta, states, slots, fresh,
                                                    batch.offsets, batch.varlen)

    @staticmethod
    def _run_keeping_every_state(seq, q, k, v, g, beta, initial, window, inputs, states, windows):
        """Speculative verify: the recurrent form, writing the state and conv
        window after each new token into that token's position slot. The input
        state and window were read before the first write, so position_slots[0]
        may be the sequence's own slot."""
        o, _, every = recurrent_gated_delta_rule(q, k, v, g, beta, initial, output_all_states=True)
        history = torch.cat((window.to(inputs.dtype), inputs.t()), dim=-1)  # [C, K-1+T]
        width = window.shape[-1]
        for j, slot in enumerate(seq.position_slots):
            states[slot] = every[0, j]
            windows[slot] = history[:, j + 1:j + 1 + width]
        return o


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer] == LINEAR_ATTENTION
        zc = config.zero_centered_norm
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zc)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, zc)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer)
        else:
            self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)

    def forward(self, x, batch, cache, rotary, cos_sin):
        x, pending = self.forward_deferred(x, None, batch, cache, rotary, cos_sin)
        return x + pending

    def forward_deferred(self, x, pending, batch, cache, rotary, cos_sin):
        """The layer on the residual stream x + pending (pending None: x alone);
        returns the stream after it as (x', pending'), the MLP's output left
        unadded so that the next norm adds it in the same kernel. Rounding is
        that of the plain `x = x + h` sequence."""
        if self.is_linear:
            mixer = self.linear_attn
            x, projected, convolved = mixer.project(self.input_layernorm, x, pending, batch,
                                                    cache)
            h = mixer.forward_projected(projected, batch, cache, convolved)
        else:
            mixer = self.self_attn
            x, projected = norm_then_project(self.input_layernorm, x, pending, mixer.qkv_proj)
            h = mixer.forward_projected(projected, batch, cache, rotary, cos_sin)
        x, projected, activated = self.mlp.project(self.post_attention_layernorm, x, h)
        return x, self.mlp.finish(projected, activated)


def norm_then_project(norm: RMSNorm, x: torch.Tensor, pending: torch.Tensor | None,
                      linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + pending, linear(norm(x + pending))): the residual update, the
    norm and the projection after it. A quantized projection may do the norm
    itself (QuantLinear.forward_normed: in the CUDA GEMV's prologue, with
    TANDEM_NORM_PROLOGUE=1), which saves the norm's launch."""
    if use_fused(x) and hasattr(linear, "forward_normed"):
        fused = linear.forward_normed(x, pending, norm.weight, norm.eps, norm.zero_centered)
        if fused is not None:
            return fused
    x, h = norm.add_forward(x, pending)
    return x, linear(h)


def norm_then_project_in_epilogue(norm: RMSNorm, x: torch.Tensor, pending: torch.Tensor | None,
                                  linear: nn.Module, epilogue
                                  ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(x + pending, projection, in_epilogue): norm_then_project, and where
    the projection's GEMV can end with `epilogue` (None: not asked; a
    gemv_cuda epilogue, asked only of a projection with
    QuantLinear.epilogue_applies) that op done in it, in_epilogue True. The
    norm then runs in the same GEMV's prologue where forward_normed can
    (TANDEM_NORM_PROLOGUE=1), else its own launch."""
    if epilogue is None or not linear.epilogue_applies(x, epilogue):
        return (*norm_then_project(norm, x, pending, linear), False)
    fused = linear.forward_normed(x, pending, norm.weight, norm.eps, norm.zero_centered,
                                  epilogue=epilogue) if use_fused(x) else None
    if fused is not None:
        return (*fused, True)
    x, h = norm.add_forward(x, pending)
    return x, linear.forward_in_epilogue(h, epilogue), True


def gated_norm_then_project(norm: GatedRMSNorm, x: torch.Tensor, gate: torch.Tensor,
                            linear: nn.Module) -> torch.Tensor:
    """linear(norm(x, gate)) of GDN's output [T, heads, head_dim]. A
    quantized projection may do the gated norm itself
    (QuantLinear.forward_gated_normed: in the CUDA GEMV's prologue, with
    TANDEM_GATED_PROLOGUE=1), which saves the norm's launch."""
    if use_fused(x) and hasattr(linear, "forward_gated_normed"):
        fused = linear.forward_gated_normed(x, gate, norm.weight, norm.eps)
        if fused is not None:
            return fused
    return linear(norm(x, gate).reshape(x.shape[0], -1))


def run_layers(layers, x, batch, cache, rotary, cos_sin, final_norm: RMSNorm,
               streams: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
    """x through `layers` then `final_norm`, each residual add fused into the
    norm after it. `streams`: layer indices whose residual stream (after that
    layer) to keep, filled in place; the add it costs is paid only there."""
    pending = None
    for i, layer in enumerate(layers):
        x, pending = layer.forward_deferred(x, pending, batch, cache, rotary, cos_sin)
        if streams is not None and i in streams:
            streams[i] = x + pending
    return final_norm.add_forward(x, pending)[1]


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norm)


class MTPHead(nn.Module):
    """Qwen3.5's multi-token-prediction layer: fc(concat(norm(embed(next)), norm(h)))
    then one full-attention decoder layer with its own KV and a final norm; the
    lm_head is shared. Run by the speculative decoder (engine/speculative).

    The pair at position p is (h_p, token p+1) and predicts token p + 2; its KV
    sits at position p of the MTP layer's page pool (same page table as the
    target). h is the target's final hidden state after its norm (what vLLM
    feeds its Qwen3-Next MTP proposer), and for the next draft the MTP's own
    normed output."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, zc, eps = config.hidden_size, config.zero_centered_norm, config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zc)
        mtp_config = _full_attention_view(config)  # MTP layers are full attention
        self.layers = nn.ModuleList(DecoderLayer(mtp_config, config.num_layers + i)
                                    for i in range(config.mtp_num_layers))
        self.norm = RMSNorm(h, eps, zc)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                cache: PagedKVCache, rotary: Rotary) -> torch.Tensor:
        """embedded: the next tokens' embeddings [T, H]; hidden: h at the pairs'
        positions [T, H]. Returns the normed output [T, H] (logits are lm_head of it)."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embedded),
                               self.pre_fc_norm_hidden(hidden)), dim=-1))
        cos_sin = rotary.cos_sin(batch.positions, x.dtype)
        return run_layers(self.layers, x, batch, cache, rotary, cos_sin, self.norm)


def _table_device(table: nn.Module) -> torch.device:
    quant = getattr(table, "quant", None)  # a QuantEmbedding holds packed rows
    return quant.device if quant is not None else table.weight.device


def embed_rows(table: nn.Module, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows `ids` (a CPU tensor) of a token table in host memory, on `device`:
    gathered on the host, copied, and (packed tables) dequantized on the
    device, so the copy moves the packed bytes and the host does no math."""
    quant = getattr(table, "quant", None)
    if quant is not None:
        rows = quant.select_rows(ids).to(device)
        return rows.dequantize(table.compute_dtype)
    return table.weight.index_select(0, ids).to(device, non_blocking=True)


def _full_attention_view(config: ModelConfig) -> ModelConfig:
    """A config whose every layer (including MTP ones past the end) is full attention."""
    total = config.num_layers + config.mtp_num_layers
    return replace(config, num_layers=total, layer_types=("full_attention",) * total)


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> norm -> lm_head, over paged KV."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.mtp = MTPHead(config) if config.mtp_num_layers else None
        self.rotary = Rotary(config)
        # the output head's matmul (x, weight): engine/dense_gemv.py may take it over
        self.head_linear = F.linear

    @property
    def embeds_on_host(self) -> bool:
        """The token table lives in host memory while the model computes on a
        GPU (the KV store keeps it there: a 27B's table is 0.7-2.4 GiB that a
        lookup of a few rows per step does not need on the card)."""
        return (_table_device(self.model.embed_tokens).type == "cpu"
                and self.compute_device.type != "cpu")

    @property
    def compute_device(self) -> torch.device:
        return self.model.norm.weight.device

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The new tokens' embeddings [T, H] on the batch's device."""
        if batch.input_embeds is not None:
            return batch.input_embeds
        if not self.embeds_on_host:
            return self.model.embed_tokens(batch.input_ids)
        return embed_rows(self.model.embed_tokens, batch.host_token_ids(), batch.input_ids.device)

    @property
    def output_embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def decode_projections(self) -> list[nn.Module]:
        """The decoder layers' weight projections in the order a step runs
        them (DecoderLayer.forward_deferred): each mixer's first and last,
        then the MLP's two; a weight-read-ahead chain follows this order
        (engine/quant/linear.read_ahead_chain)."""
        order = []
        for layer in self.model.layers:
            if layer.is_linear:
                order += [layer.linear_attn.in_proj, layer.linear_attn.out_proj]
            else:
                order += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            order += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        return order

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache, all_logits: bool = False,
                return_hidden: bool = False,
                streams: dict[int, torch.Tensor | None] | None = None):
        """Runs the batch, updating its pages and state slots. Returns logits for
        the last token of each sequence [B, V] (or of every token [T, V] with
        all_logits), and with return_hidden also the final hidden states after
        the norm of every token [T, H] (what the MTP head consumes). `streams`
        (run_layers) receives the residual streams of the layers it names."""
        x = self.embed(batch)
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        hidden = run_layers(self.model.layers, x, batch, cache, self.rotary, cos_sin,
                            self.model.norm, streams)
        picked = hidden if all_logits else hidden.index_select(0, batch.last_token_indices())
        logits = self.head_linear(picked, self.output_embedding)
        return (logits, hidden) if return_hidden else logits

    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, hidden: torch.Tensor, cache: PagedKVCache,
                    all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head over pairs: batch.input_ids are the next tokens, its
        positions those of `hidden` [T, H]; writes the MTP layers' KV there.
        Returns (logits of the last pair per sequence [B, V], or of every pair
        with all_logits; the normed output of every pair [T, H])."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head")
        out = self.mtp(self.embed(batch), hidden, batch, cache, self.rotary)
        picked = out if all_logits else out.index_select(0, batch.last_token_indices())
        return self.head_linear(picked, self.output_embedding), out
