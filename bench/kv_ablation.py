"""KV quantization ablations that are not storage formats (yet): what would a
scheme cost in quality, before anyone writes its kernels?

Each variant fake-quantizes K and V on write (quantize, then store the
dequantized fp32 values) and is scored exactly like a real format by
bench/kv_quality.py (teacher-forced KL, top-1, perplexity against bf16 KV).
The schemes measured so far (BENCHMARKS.md, "rk4 ablations"):

  token      per-token blocks along head_dim, symmetric 4-bit with one fp16
             scale per block, optionally after the rk4 Hadamard rotation:
             exactly rk4's quantizer (reference functions from formats.py);
  channel    KIVI-style: per channel, asymmetric 4-bit over the tokens of one
             page (fp16 min and step per channel per page);
  pre-RoPE   K quantized before the rotary embedding (KVQuant), undone and
             redone here around the quantizer;
  open page  the page holding a sequence's newest token is read unquantized,
             as a server that quantizes a page only once it is full would;
             the prefill chunk equals the page so every query sees it
             (open_pages > 1: that many newest pages; sinks: the first
             tokens read unquantized too);
  e8m0 step  channel groups with a power-of-two step (8 bits, not 16);
  e5m3 step  channel groups with rk4p's 8-bit float step (formats.k_step_encode);
  codebook   per-token blocks with a Gaussian Lloyd-Max 16-level codebook, or
             the uniform -8..7 levels (rk4 leaves -8 out).
The `v2*` variants are rk4p's first design (K pre-RoPE per channel over
32-token pages with fp16 min + e8m0 step, V rotated per token with fp16 scales
per 64 channels, open page) and its cheap levers; the `v3*` variants replace
the e8m0 step by rk4p's e5m3 one (v3-sinks is rk4p as built: first page exact).

Variants are named on the command line from VARIANTS. Positions are taken
from write slots, which bench/kv_quality.py's runs make equal to positions
(one sequence over pages 0, 1, 2, ...).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from bench import kv_quality as kq
from bench.common import environment, now, print_table, write_json
from engine.kv import rotation
from engine.kv.formats import (Bf16Format, k_step_decode, k_step_encode, page_table_slots,
                               rk4_dequantize, rk4_quantize)

Quantizer = Callable[[torch.Tensor], torch.Tensor]  # fp32 [T, H, D] -> fake-quantized fp32


# ------------------------------------------------------------ quantizers


def token_blocks(x: torch.Tensor, block: int = 32, rotate: bool = True) -> torch.Tensor:
    """rk4's own quantizer (fp16 scales), round trip, back in the original space."""
    r = rotation.rotation_matrix(x.shape[-1], rotation.DEFAULT_ROTATION_SEED, x.device)
    stored = rotation.rotate(x, r) if rotate else x.float()
    codes, scales = rk4_quantize(stored, block, "fp16")
    back = rk4_dequantize(codes, scales, block, "fp16")
    return rotation.unrotate(back, r) if rotate else back


def channel_groups(x: torch.Tensor, group: int, bits: int = 4,
                   step_format: str = "fp16") -> torch.Tensor:
    """Asymmetric `bits`-bit codes per channel over `group` consecutive tokens,
    with an fp16 min and a step per (group, head, channel): fp16, or "e8m0"
    (the smallest power of two that covers the range: 8 bits instead of 16)."""
    tokens, heads, dim = x.shape
    if tokens % group:
        raise ValueError(f"channel groups of {group} tokens need whole groups, got {tokens} "
                         "tokens (use a prefill chunk that is a multiple of the group)")
    g = x.float().reshape(tokens // group, group, heads, dim)
    lo = g.amin(1, keepdim=True).half().float()
    levels = 2 ** bits - 1
    span = (g.amax(1, keepdim=True) - lo) / levels
    if step_format == "e8m0":
        step = torch.exp2(torch.ceil(torch.log2(span.clamp(min=2.0 ** -126))))
    elif step_format == "e5m3":  # rk4p's 8-bit float step (formats.k_step_encode)
        step = k_step_decode(k_step_encode(g.amax(1, keepdim=True) - lo))
    else:
        step = span.half().float().clamp(min=1e-8)
    codes = torch.round((g - lo) / step).clamp(0, levels)
    return (codes * step + lo).reshape(tokens, heads, dim)


# Lloyd-Max levels of a unit Gaussian for 16 levels (Max 1960): the MSE-optimal
# 4-bit codebook for rotated values, which are close to Gaussian.
LLOYD_MAX_16 = (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326)


def codebook_blocks(x: torch.Tensor, block: int = 64, codebook: str = "lloyd",
                    rotate: bool = True) -> torch.Tensor:
    """Per-token blocks with one fp16 scale and a non-uniform 16-level codebook:
    "lloyd" (Gaussian Lloyd-Max, scale = amax / outer level) or "int4" (the
    uniform levels -8..7, using the -8 level rk4 leaves out: scale = amax / 8
    with the sign of the largest value picking which end it lands on)."""
    r = rotation.rotation_matrix(x.shape[-1], rotation.DEFAULT_ROTATION_SEED, x.device)
    stored = rotation.rotate(x, r) if rotate else x.float()
    blocks = stored.reshape(-1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    if codebook == "lloyd":
        half = torch.tensor(LLOYD_MAX_16, device=x.device)
        levels = torch.cat([-half.flip(0), half])
        scale = (amax / half[-1]).half().float().clamp(min=1e-12)
        idx = (blocks[..., None] / scale[..., None] - levels).abs().argmin(-1)
        back = levels[idx] * scale
    else:
        scale = (amax / 8).half().float().clamp(min=1e-12)
        back = torch.round(blocks / scale).clamp(-8, 7) * scale
    back = back.reshape(stored.shape)
    return rotation.unrotate(back, r) if rotate else back


def channel_bits(group: int, bits: int = 4) -> float:
    return bits + 32 / group


def token_bits(block: int = 32) -> float:
    return 4 + 16 / block


# --------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """How K and V are fake-quantized; None keeps a side exact."""

    k: Quantizer | None
    v: Quantizer | None
    k_bits: float
    v_bits: float
    pre_rope: bool = False  # K quantized before the rotary embedding
    open_page: int = 0      # > 0: the newest token's page (of this many tokens) reads exact
    open_pages: int = 1     # how many of the newest pages read exact (with open_page)
    sinks: int = 0          # the first `sinks` tokens read exact

    @property
    def bits(self) -> float:
        return (self.k_bits + self.v_bits) / 2


RK4 = partial(token_blocks, block=32, rotate=True)
VARIANTS: dict[str, Variant] = {
    "rk4": Variant(RK4, RK4, token_bits(32), token_bits(32)),
    "rk4-k-only": Variant(RK4, None, token_bits(32), 16),
    "rk4-v-only": Variant(None, RK4, 16, token_bits(32)),
    "k-channel16+v-rk4": Variant(partial(channel_groups, group=16), RK4,
                                 channel_bits(16), token_bits(32)),
    "k-channel32+v-rk4": Variant(partial(channel_groups, group=32), RK4,
                                 channel_bits(32), token_bits(32)),
    "k-prerope-channel32": Variant(partial(channel_groups, group=32), None,
                                   channel_bits(32), 16, pre_rope=True),
    "k-prerope-channel32+v-rk4": Variant(partial(channel_groups, group=32), RK4,
                                         channel_bits(32), token_bits(32), pre_rope=True),
    "k-prerope-channel64+v-rk4": Variant(partial(channel_groups, group=64), RK4,
                                         channel_bits(64), token_bits(32), pre_rope=True),
    "rk4+open16": Variant(RK4, RK4, token_bits(32), token_bits(32), open_page=16),
    "k-channel16+v-rk4+open16": Variant(partial(channel_groups, group=16), RK4,
                                        channel_bits(16), token_bits(32), open_page=16),
    "k-prerope-channel32+v-rk4+open32": Variant(partial(channel_groups, group=32), RK4,
                                                channel_bits(32), token_bits(32),
                                                pre_rope=True, open_page=32),
}
# The rk4 v2 candidates (BENCHMARKS.md, "rk4 v2 design ablation"): 32-token
# pages, K pre-RoPE per channel, V rotated per token, open page(s) in bf16.
_K32E = partial(channel_groups, group=32, step_format="e8m0")
_K64F = partial(channel_groups, group=64)
_V64 = partial(token_blocks, block=64, rotate=True)
_V64_LLOYD = partial(codebook_blocks, block=64, codebook="lloyd")
_V64_INT4 = partial(codebook_blocks, block=64, codebook="int4")
_V32_LLOYD = partial(codebook_blocks, block=32, codebook="lloyd")
_K_E8 = 4 + 24 / 32  # fp16 min + e8m0 step per 32 tokens
VARIANTS.update({
    "v2": Variant(_K32E, _V64, _K_E8, token_bits(64), pre_rope=True, open_page=32),
    "v2-kfp16": Variant(partial(channel_groups, group=32), _V64, channel_bits(32),
                        token_bits(64), pre_rope=True, open_page=32),
    "v2-open2": Variant(_K32E, _V64, _K_E8, token_bits(64), pre_rope=True, open_page=32,
                        open_pages=2),
    "v2-sinks": Variant(_K32E, _V64, _K_E8, token_bits(64), pre_rope=True, open_page=32,
                        sinks=32),
    "v2-vlloyd": Variant(_K32E, _V64_LLOYD, _K_E8, token_bits(64), pre_rope=True,
                         open_page=32),
    "v2-vint4": Variant(_K32E, _V64_INT4, _K_E8, token_bits(64), pre_rope=True, open_page=32),
    "v2-vlloyd32": Variant(_K32E, _V32_LLOYD, _K_E8, token_bits(32), pre_rope=True,
                           open_page=32),
    "v2-k-only": Variant(_K32E, None, _K_E8, 16, pre_rope=True, open_page=32),
    "v2-v-only": Variant(None, _V64, 16, token_bits(64), open_page=32),
    "v2-vlloyd-open2": Variant(_K32E, _V64_LLOYD, _K_E8, token_bits(64), pre_rope=True,
                               open_page=32, open_pages=2),
    "v2-vlloyd-open2-sinks": Variant(_K32E, _V64_LLOYD, _K_E8, token_bits(64), pre_rope=True,
                                     open_page=32, open_pages=2, sinks=32),
})
# rk4p v3 candidates: K's step as an 8-bit float (e5m3), still 4.75 bits for K.
_K32F8 = partial(channel_groups, group=32, step_format="e5m3")
VARIANTS.update({
    "v3": Variant(_K32F8, _V64, _K_E8, token_bits(64), pre_rope=True, open_page=32),
    "v3-sinks": Variant(_K32F8, _V64, _K_E8, token_bits(64), pre_rope=True, open_page=32,
                        sinks=32),
    "v3-sinks-open2": Variant(_K32F8, _V64, _K_E8, token_bits(64), pre_rope=True,
                              open_page=32, open_pages=2, sinks=32),
    "v3-open2": Variant(_K32F8, _V64, _K_E8, token_bits(64), pre_rope=True, open_page=32,
                        open_pages=2),
    "v2-kfp16-sinks": Variant(partial(channel_groups, group=32), _V64, channel_bits(32),
                              token_bits(64), pre_rope=True, open_page=32, sinks=32),
})


class FakeQuantKV(Bf16Format):
    """Stores fake-quantized fp32 K/V (and, for open pages, the exact values)."""

    def __init__(self, variant: Variant, rotary=None) -> None:
        super().__init__(dtype=torch.float32)
        if variant.pre_rope and rotary is None:
            raise ValueError("a pre-RoPE variant needs the model's rotary embedding")
        self.variant, self.rotary = variant, rotary

    def bits_per_element(self, head_dim: int = 256) -> float:
        return self.variant.bits

    def allocate(self, num_pages, page_size, num_kv_heads, head_dim, device):
        buffers = super().allocate(num_pages, page_size, num_kv_heads, head_dim, device)
        if self.variant.open_page or self.variant.sinks:
            buffers.update({f"{side}_exact": torch.zeros_like(buffers[side]) for side in "kv"})
        return buffers

    def _write_side(self, buffers, side, slots, x, triton):
        quantize = self.variant.k if side == "k" else self.variant.v
        x = x.float()
        stored = x if quantize is None else self._fake_quantize(side, quantize, x, slots)
        _flat(buffers[side]).index_copy_(0, slots, stored)
        if self.variant.open_page or self.variant.sinks:
            _flat(buffers[f"{side}_exact"]).index_copy_(0, slots, x)

    def _fake_quantize(self, side: str, quantize: Quantizer, x: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        if side != "k" or not self.variant.pre_rope:
            return quantize(x)
        cos, sin = self.rotary.cos_sin(positions, torch.float32)
        before_rope = self.rotary.apply(x, cos, -sin)  # rotary is orthogonal: -sin undoes it
        return self.rotary.apply(quantize(before_rope), cos, sin)

    def _read_side(self, buffers, side, page_table, length, dtype, triton, rotated, out=None):
        slots = page_table_slots(page_table, length, buffers[side].shape[1])
        quantized = _flat(buffers[side])[slots]
        if not self.variant.open_page:
            if self.variant.sinks:
                raise ValueError("sinks are only emulated together with an open page")
            return quantized.to(dtype)
        page = self.variant.open_page
        open_from = max(0, ((length - 1) // page - (self.variant.open_pages - 1)) * page)
        exact = _flat(buffers[f"{side}_exact"])[slots]
        keep = torch.zeros(length, dtype=torch.bool, device=slots.device)
        keep[open_from:] = True
        keep[:self.variant.sinks] = True
        return torch.where(keep[:, None, None], exact, quantized).to(dtype)


def _flat(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.view(-1, *buffer.shape[2:])


# -------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench kv-ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=512,
                   help="prefill chunk; open-page variants run with chunk = their page")
    p.add_argument("--text", default=str(kq.DEFAULT_TEXT))
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if not Path(args.text).is_file():
        p.error(f"--text {args.text}: no such file")
    if args.context < 2 or args.chunk < 1:
        p.error("--context must be >= 2 and --chunk >= 1")

    from engine.loader import load_model
    from engine.rotary import Rotary

    loaded = load_model(args.model, device="cpu", progress=False)
    tokens = kq.text_tokens(loaded.tokenizer, Path(args.text), args.context)
    rotary = Rotary(loaded.config)
    results, t_start = [], now()
    for chunk, names in _by_chunk(args).items():
        formats = {name: FakeQuantKV(VARIANTS[name], rotary) for name in names}
        ref_ppl, summaries = kq.evaluate_context(loaded, tokens, formats, chunk,
                                                 max(1, chunk * 3 // 4))
        for label, summary in summaries.items():
            variant = VARIANTS.get(label)
            results.append({"variant": label, "chunk": chunk,
                            "bits_per_element": variant.bits if variant else 16.0,
                            "reference_perplexity": ref_ppl, **summary})
    write_json(args.json, {"env": environment(), "model": loaded.source, "args": vars(args),
                           "wall_s": now() - t_start, "results": results})
    print_table(f"KV ablations vs bf16 KV, context {args.context} ({Path(loaded.source).name})",
                ["variant", "chunk", "bits", "mean KL", "p99 KL", "top-1 %", "ppl %"],
                [[r["variant"], r["chunk"], f"{r['bits_per_element']:g}",
                  kq._kl_text(r["mean_kl"]), kq._kl_text(r["p99_kl"]),
                  f"{r['top1_agreement_pct']:.2f}", f"{r['ppl_change_pct']:+.2f}"]
                 for r in results])
    return 0


def _by_chunk(args) -> dict[int, list[str]]:
    """Variants grouped by the prefill chunk they run with (an open page forces its own)."""
    groups: dict[int, list[str]] = {}
    for name in args.variants:
        chunk = VARIANTS[name].open_page or args.chunk
        groups.setdefault(chunk, []).append(name)
    return groups


if __name__ == "__main__":
    sys.exit(main())
