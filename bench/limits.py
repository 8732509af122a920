"""The floors that benchmark times are compared with: bytes a decode step
must read, FLOPs a prefill must do, and what this device measurably moves
and multiplies (copy bandwidth, matmul rate)."""
from __future__ import annotations

import torch

from bench.common import now


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int | None = None, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    megabytes = megabytes or (2048 if device.type == "cuda" else 64)
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = now()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * repeats / (now() - t0)


def matmul_flops(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """FLOP/s of a large square matmul in the compute dtype (the achievable peak)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = now()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (now() - t0)


def decode_weight_bytes(model) -> int:
    """Weights one plain decode step reads: everything but the embedding table
    (one row per token) and the MTP head; a tied table is read as the lm_head.
    Packed (low-bit) matrices are buffers, not parameters: their codes and
    scales count as stored (_packed_bytes)."""
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            continue
        if name == "model.embed_tokens.weight" and model.lm_head is not None:
            continue
        total += p.numel() * p.element_size()
    return total + _packed_bytes(model)


def _packed_bytes(model) -> int:
    """Bytes of the packed matrices a plain decode step reads: the packed
    matmuls, and a packed token table where it is the (tied) lm_head."""
    from engine.quant.linear import QuantEmbedding

    table = model.model.embed_tokens
    tied = model.lm_head is None and isinstance(table, QuantEmbedding)
    return (sum(m.quant.nbytes for m in _packed_matmuls(model))
            + (table.quant.nbytes if tied else 0))


def _packed_matmuls(model):
    """The packed (low-bit) matmul modules outside the MTP head: their
    weights are buffers, not parameters (engine/quant/linear.py)."""
    from engine.quant.linear import QuantLinear

    return [m for n, m in model.named_modules()
            if isinstance(m, QuantLinear) and not n.startswith("mtp.")]


def kv_bytes(config, kv_format, tokens: int) -> int:
    """K and V of `tokens` tokens over all full-attention layers."""
    per_token = kv_format.bytes_per_token(config.num_kv_heads, config.head_dim)
    return len(config.attention_layers) * per_token * tokens


def gdn_state_bytes(config, conv_itemsize: int = 4) -> int:
    """One sequence's GDN state over all layers (recurrent fp32 + conv window)."""
    if not config.is_hybrid:
        return 0
    recurrent = config.linear_num_v_heads * config.linear_k_head_dim * config.linear_v_head_dim * 4
    conv = config.linear_conv_dim * (config.linear_conv_kernel - 1) * conv_itemsize
    return len(config.linear_layers) * (recurrent + conv)


def decode_step_bytes(model, config, kv_format, batch: int, context: int) -> int:
    """Bytes that must move per decode step: weights once, each sequence's KV
    at its context, and its GDN state read and written back."""
    return (decode_weight_bytes(model) + batch * kv_bytes(config, kv_format, context)
            + batch * 2 * gdn_state_bytes(config))


def _packed_matmul_weights(model) -> int:
    """Weights of the packed matmuls (the token table excluded)."""
    return sum(m.quant.out_features * m.quant.in_features for m in _packed_matmuls(model))


def prefill_flops(model, config, tokens: int, start: int = 0) -> float:
    """Model FLOPs of prefilling `tokens` new tokens after `start` cached ones:
    2 per weight per token for the matmuls (embedding excluded), causal
    attention (QK^T and PV), and the GDN chunked recurrence (state update and
    output per token, as matmuls)."""
    params = sum(p.numel() for n, p in model.named_parameters()
                 if not n.startswith("mtp.") and n != "model.embed_tokens.weight")
    params += _packed_matmul_weights(model)
    if model.lm_head is None:
        params += model.model.embed_tokens.weight.numel()
    flops = 2.0 * params * tokens
    # each new token attends to (start + its index + 1) keys on average
    keys = tokens * start + tokens * (tokens + 1) / 2
    flops += len(config.attention_layers) * 4.0 * config.num_heads * config.head_dim * keys
    if config.is_hybrid:
        per_token = 6.0 * config.linear_num_v_heads * config.linear_k_head_dim * config.linear_v_head_dim
        flops += len(config.linear_layers) * per_token * tokens
    return flops
