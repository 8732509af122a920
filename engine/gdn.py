"""Gated DeltaNet (the linear-attention layers of Qwen3.5) in pure PyTorch: the
reference the GPU kernels are checked against, and the CPU path.

Per value head the state S is a [k_dim, v_dim] matrix. One token does
    S <- exp(g) * S
    S <- S + k (beta * (v - S^T k))^T        (the delta rule)
    o  = S^T q
with q, k L2-normalised and q scaled by k_dim^-1/2. Two forms compute it:
`recurrent_gated_delta_rule` token by token (decode), `chunked_gated_delta_rule`
in chunks with the WY/UT transform (prefill). They agree to float tolerance.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """To fp32 [batch, heads, time, dim], q/k normalised, q scaled, k heads repeated
    so that each q/k head serves its group of consecutive v heads."""
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_all_states=False):
    """q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv].
    Returns (o [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] fp32), and
    with output_all_states the state after every token [B, T, Hv, Dk, Dv]."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, heads, steps, dk = k.shape
    state = (torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.float().clone())
    outs, states = [], []
    for t in range(steps):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
        if output_all_states:
            states.append(state)
    o = torch.stack(outs, dim=2).transpose(1, 2).to(out_dtype)
    if output_all_states:
        return o, state, torch.stack(states, dim=1)
    return o, state


def chunked_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """Same contract as `recurrent_gated_delta_rule` (without all-states).

    Within a chunk with cumulative log-decay c_i, the per-token updates
    u_j = beta_j (v_j - S_{j-1}^T k_j) solve a unit lower-triangular system
    (I + A) u = beta*v - beta*exp(c)*k S0, A_jl = beta_j exp(c_j - c_l) k_j.k_l
    for l < j; outputs and the next chunk's state then follow by matmuls.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, heads, steps, dk = k.shape
    dv = v.shape[-1]
    pad = (-steps) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (steps + pad) // chunk_size

    def chunks(x):
        return x.reshape(batch, heads, n, chunk_size, *x.shape[3:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    c = g.cumsum(dim=-1)  # [B, H, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    strictly_lower = (beta[..., None] * kk * decay).tril(-1)
    system = strictly_lower + torch.eye(chunk_size, device=v.device)
    rhs_v = beta[..., None] * v
    rhs_k = beta[..., None] * c.exp()[..., None] * k
    u_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    u_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    chunk_decay = c[..., -1].exp()[..., None, None]

    state = (torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.float().clone())
    out = torch.empty(batch, heads, n, chunk_size, dv, dtype=torch.float32, device=v.device)
    for i in range(n):
        u = u_v[:, :, i] - u_k[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + qk[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = out.reshape(batch, heads, n * chunk_size, dv)[:, :, :steps]
    return o.transpose(1, 2).to(out_dtype), state


def causal_conv1d(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor):
    """Depthwise causal conv over time followed by SiLU.

    x: [T, C] new inputs; window: [C, K-1] the inputs before them; weight: [C, K].
    Returns (y [T, C], the new window [C, K-1])."""
    kernel = weight.shape[-1]
    seq = torch.cat((window.to(x.dtype), x.t()), dim=-1)  # [C, K-1+T]
    y = F.conv1d(seq[None].to(weight.dtype), weight[:, None, :], groups=seq.shape[0])[0]
    new_window = seq[:, seq.shape[-1] - (kernel - 1):]
    return F.silu(y).t().to(x.dtype), new_window
