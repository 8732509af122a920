"""Decode steps replayed from CUDA graphs (engine/cuda_graphs.py) against the
eager forward. Needs a GPU (skipped elsewhere; run by scripts/device_gpu.sh);
on the CPU only the pass-through is checked."""
import pytest
import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.cuda_graphs import DecodeForward
from engine.kv import make_format
from engine.loader import load_model


def test_cpu_decode_forward_is_the_eager_model():
    loaded = load_model("tiny-qwen3.5", dtype=torch.float32, seed=2)
    cache = PagedKVCache(loaded.config, CacheShape(4, 8, 1), "cpu", make_format("int8"))
    forward = DecodeForward(loaded.model, cache, max_context=32)
    assert not forward.enabled
    batch = ForwardBatch.build([SequenceInput((5,), 0, (0,), 0)], 8, "cpu")
    logits = forward(batch)
    assert logits.shape == (1, loaded.config.vocab_size) and forward.replays == 0
    with pytest.raises(ValueError, match="CUDA"):
        DecodeForward(loaded.model, cache, max_context=32, enabled=True)


def _decode_logits(loaded, kv_format: str, graphs: bool) -> torch.Tensor:
    """Three prompts prefilled, then six decode steps (bucket 4 padded, then
    bucket 1); the logits of every step."""
    prompts = [[(7 * i + 3) % 512 for i in range(n)] for n in (19, 40, 7)]
    options = {"dtype": torch.float32} if kv_format == "bf16" else {}
    cache = PagedKVCache(loaded.config, CacheShape(30, 16, 3), "cuda",
                         make_format(kv_format, **options))
    forward = DecodeForward(loaded.model, cache, max_context=160, enabled=graphs)
    tables = [tuple(range(10 * i, 10 * i + 10)) for i in range(3)]
    for i, p in enumerate(prompts):
        loaded.model(ForwardBatch.build([SequenceInput(tuple(p), 0, tables[i], i)], 16,
                                        "cuda"), cache)
    lengths = [len(p) for p in prompts]
    steps = []
    for step in range(6):
        active = [0, 1, 2] if step < 4 else [1]
        batch = ForwardBatch.build(
            [SequenceInput(((step * 11 + i) % 512,), lengths[i], tables[i], i)
             for i in active], 16, "cuda")
        steps.append(forward(batch).float())
        for i in active:
            lengths[i] += 1
    if graphs:
        assert forward.replays == 4, forward.capture_errors  # each bucket's first step is eager
    return torch.cat(steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_format", ["bf16", "int8", "rk4"])
def test_graph_replay_matches_eager_decode(kv_format):
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=torch.float32, seed=3)
    eager, replayed = (_decode_logits(loaded, kv_format, graphs) for graphs in (False, True))
    # eager and graph steps may split the keys differently (tf32 dots either way)
    torch.testing.assert_close(replayed, eager, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_with_the_token_table_in_host_memory():
    # the KV store's --embeddings host: rows are looked up before the graph
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=torch.float32, seed=3)
    on_device = _decode_logits(loaded, "int8", graphs=False)
    loaded.model.model.embed_tokens.to("cpu")
    assert loaded.model.embeds_on_host
    torch.testing.assert_close(_decode_logits(loaded, "int8", graphs=True), on_device,
                               rtol=1e-2, atol=1e-2)
