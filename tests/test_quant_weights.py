"""Low-bit weight sources against oracles we did not write: our GGUF block
decoders against the gguf package's dequantization (bit for bit), a K-quant
GGUF written from the embedded model's real weights, GPTQ/AWQ repacking
against the format's own formula, and the embedded model's packed int4 path
against its dequantized path."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.loader import load_model
from engine.quant.recipes import recipe_weight_bytes
from engine.weights import ggml
from engine.weights.gguf import (_fix_packed, _unpermute_rope, _untile_v_heads,
                                 embedded_model_path, open_gguf)
from engine.weights.gptq import awq_tensor, gptq_tensor
from tests.kquant_pack import PACKERS


@pytest.fixture(scope="module")
def embedded():
    reader = open_gguf(embedded_model_path())
    return reader, {t.name: t for t in reader.tensors}


def _oracle(data, type_name, shape):
    return gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, type_name)
                                  ).reshape(shape).astype(np.float32)


def _real_weight(tensors, name="blk.0.ffn_down.weight"):
    t = tensors[name]
    return _oracle(t.data, t.tensor_type.name, (int(t.shape[1]), int(t.shape[0])))


def test_embedded_file_tensors_decode_bit_for_bit(embedded):
    _, tensors = embedded
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.3.ffn_up.weight"):
        t = tensors[name]
        rows, cols = int(t.shape[1]), int(t.shape[0])
        ours = ggml.decode_blocks(t.data, t.tensor_type.name, rows, cols).dequantize().numpy()
        assert np.array_equal(ours.view(np.uint32),
                              _oracle(t.data, t.tensor_type.name, (rows, cols)).view(np.uint32))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_packed_from_real_weights_decode_bit_for_bit(embedded, kind):
    w = _real_weight(embedded[1])  # [576, 1536]: rows of 1536 = 6 superblocks
    blocks = PACKERS[kind](w)
    oracle = _oracle(blocks, kind, w.shape)
    # the packer's layout is right: the oracle gets the weights back within 4-6 bit error
    assert np.abs(oracle - w).max() <= 0.05 * np.abs(w).max()
    qt = ggml.decode_blocks(blocks, kind, *w.shape)
    assert qt.bits == (4 if kind == "Q4_K" else 8)
    assert np.array_equal(qt.dequantize().numpy().view(np.uint32), oracle.view(np.uint32))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1"])
def test_legacy_quants_decode_exactly(embedded, kind):
    w = _real_weight(embedded[1])
    blocks = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))
    ours = ggml.decode_blocks(blocks, kind, *w.shape).dequantize().numpy()
    # equal values (Q4_0 as d*q - 8d can give +0.0 where the oracle has -0.0)
    assert np.array_equal(ours, _oracle(blocks, kind, w.shape))


def test_reorderings_apply_to_packed_codes(embedded):
    """llama.cpp's row and column reorderings, learnt from index tensors and
    applied to codes and scales, equal reordering the dense weight; a column
    move that splits 256-superblocks narrows them without changing values."""
    w = _real_weight(embedded[1], "blk.0.ffn_gate.weight")[:, :512]  # [1536, 512]... rows
    w = np.ascontiguousarray(w[:512])
    qt = ggml.decode_blocks(PACKERS["Q4_K"](w), "Q4_K", *w.shape)
    dense = qt.dequantize()
    heads = _untile_v_heads(2, 4)  # 4 value heads of 128 in 2 groups (Qwen3.5 style)
    for fix in (_unpermute_rope(8), lambda t: heads(t, 0, 128), lambda t: heads(t, 1, 128)):
        fixed = _fix_packed(qt, fix)
        assert torch.equal(fixed.dequantize(), fix(dense))
    assert _fix_packed(qt, lambda t: heads(t, 1, 128)).superblock == 128


def _gptq_pack(w: torch.Tensor, group: int, sym: bool):
    """A GPTQ v1 checkpoint's tensors for w [N, K] (plain min/max rounding)."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    if sym:
        scale = g.abs().amax(-1) / 7.5
        zero = torch.full_like(scale, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15
        zero = torch.round(-lo / scale).long().clamp(0, 15)
    scale = scale.half()
    q = torch.clamp(torch.round(g / scale.float()[..., None]) + zero[..., None], 0, 15).long()
    q = q.view(n, k).t().contiguous()  # [K, N]
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qweight |= q[j::8] << (4 * j)
    zt = (zero - 1).t().contiguous()  # v1 stores zero - 1, [K/G, N]
    qzeros = torch.zeros(k // group, n // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= zt[:, j::8] << (4 * j)
    as_int32 = lambda t: (t & 0xFFFFFFFF).to(torch.int64).apply_(  # noqa: E731
        lambda v: v - (1 << 32) if v >= 1 << 31 else v).to(torch.int32)
    expected = scale.float()[..., None] * (q.t().reshape(n, k // group, group)
                                           - zero[..., None]).float()
    return as_int32(qweight), as_int32(qzeros), scale.t().contiguous(), expected.view(n, k)


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_gptq_repacks_to_the_formats_own_dequantization(embedded, sym):
    w = torch.from_numpy(_real_weight(embedded[1]))[:64, :512]
    qweight, qzeros, scales, expected = _gptq_pack(w, 128, sym)
    g_idx = torch.arange(512, dtype=torch.int32) // 128
    qt = gptq_tensor(qweight, qzeros, scales, g_idx, 128, v1=True)
    assert torch.equal(qt.dequantize(), expected)
    assert (qt.dequantize() - w).abs().max() <= 0.2 * w.abs().max()
    with pytest.raises(Exception, match="desc_act"):
        gptq_tensor(qweight, qzeros, scales, g_idx.flip(0), 128)


def test_awq_column_order(embedded):
    w = torch.from_numpy(_real_weight(embedded[1]))[:64, :256]
    qweight, qzeros, scales, expected = _gptq_pack(w, 128, sym=False)
    # re-pack the same codes the AWQ way: [K, N/8], nibble i = column 8c + ORDER[i]
    codes = ((qweight.to(torch.int64) & 0xFFFFFFFF)[:, None, :] >> (4 * torch.arange(8))[None, :, None]
             ) & 15  # [K/8, 8, N]
    q = codes.permute(0, 1, 2).reshape(256, 64)  # [K, N]
    zeros = ((qzeros.to(torch.int64) & 0xFFFFFFFF)[:, :, None] >> (4 * torch.arange(8))) & 15
    zeros = zeros.reshape(2, 64) + 1
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def awq_pack(x):
        out = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int64)
        for i, col in enumerate(order):
            out |= x[:, col::8] << (4 * i)
        return (out - ((out >= 1 << 31).long() << 32)).to(torch.int32)
    qt = awq_tensor(awq_pack(q), awq_pack(zeros), scales, 128)
    assert torch.equal(qt.dequantize(), expected)


def test_quantized_dummy_shape_matches_its_byte_count():
    loaded = load_model("tiny-qwen3.5", weights="q4_k_m")
    from engine.model import CausalLM
    with torch.device("meta"):
        meta = CausalLM(loaded.config)
    stored = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
    assert stored == recipe_weight_bytes(meta, "q4_k_m", loaded.dtype)
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert {"QuantLinear", "QuantEmbedding"} <= kinds and "Linear" not in kinds


def test_embedded_int4_path_agrees_with_dequantized_path():
    """The packed path (int4 Q4_1 matrices, int8 Q8_0 embedding and tied head)
    against the same weights dequantized: logits within 1e-3 (fp32 sums in
    another order), greedy continuations identical for 32 tokens."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format
    from engine.llm import EngineConfig, OfflineEngine
    from engine.sampling import SamplingParams

    packed = load_model(None, progress=False, weights="native")
    dense = load_model(None, progress=False, weights="bf16")
    kinds = {type(m).__name__ for m in packed.model.modules()}
    assert {"QuantLinear", "QuantEmbedding"} <= kinds
    prompts = [packed.tokenizer.encode(t) for t in
               ("The capital of France is", "def fibonacci(n):", "Water boils at")]
    logits = []
    for loaded in (packed, dense):
        cache = PagedKVCache(loaded.config, CacheShape(4, 16, 1), "cpu",
                             make_format("bf16", dtype=torch.float32))
        batch = ForwardBatch.build([SequenceInput(tuple(prompts[0]), 0, (0,), 0)], 16, "cpu")
        logits.append(loaded.model(batch, cache, all_logits=True))
    assert (logits[0] - logits[1]).abs().max() < 1e-3
    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    outputs = []
    for loaded in (packed, dense):
        engine = OfflineEngine(loaded, EngineConfig(max_batch=3, max_context=128))
        got = {i: [] for i in range(3)}
        for event in engine.generate(prompts, params):
            got[event.index].append(event.token_id)
        outputs.append(got)
    assert outputs[0] == outputs[1]
    assert all(len(v) == 32 for v in outputs[0].values())


def test_packed_weights_travel_through_the_weights_arena():
    """What a worker does: map the store's weights arena and rebuild the model
    on it. Packed modules come back (from tensor names alone), as views of the
    arena, and compute the same logits."""
    import os

    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format
    from kvstore.memory import KVFormatSpec, create_arenas, model_on_arena, open_arenas

    loaded = load_model("tiny-qwen3.5", seed=1, weights="q4_k_m")
    shape = CacheShape(8, 4, 2)
    arenas = create_arenas(loaded.model, loaded.config, shape, KVFormatSpec("int8").build(),
                           "cpu", f"tandem-test-quant-{os.getpid()}")
    try:
        mapped = open_arenas(arenas.handles())
        model = model_on_arena(loaded.config, mapped, torch.float32, "test")
        packed = [m for m in model.modules() if type(m).__name__ == "QuantLinear"]
        assert packed and all(mapped.weights.contains(m.qweight) for m in packed)
        logits = []
        for m in (loaded.model, model):
            cache = PagedKVCache(loaded.config, shape, "cpu", make_format("bf16", dtype=torch.float32))
            batch = ForwardBatch.build([SequenceInput((5, 9, 200), 0, (0,), 0)], 4, "cpu")
            logits.append(m(batch, cache))
        assert torch.isfinite(logits[0]).all()
        assert torch.equal(logits[0], logits[1])
    finally:
        arenas.close()
