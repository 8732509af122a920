"""Decode and verify forwards replayed from CUDA graphs (engine/cuda_graphs.py)
against the eager forward. Replays need a GPU (skipped elsewhere; run by
scripts/device_gpu.sh and scripts/device_gdn.sh); on the CPU the pass-through
and a padded static verify batch (the graph's inputs, run eagerly through the
fused GDN steps under the Triton interpreter) are checked."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from engine import gdn_batched  # noqa: E402
from engine.batch import ForwardBatch, SequenceInput  # noqa: E402
from engine.cache import CacheShape, PagedKVCache  # noqa: E402
from engine.cuda_graphs import (DEFAULT_BUCKETS, DecodeForward, DraftForward,  # noqa: E402
                                 VerifyForward, _Graph)
from engine.kv import make_format  # noqa: E402
from engine.loader import load_model  # noqa: E402


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


def test_the_offline_engine_has_a_bucket_for_every_batch_up_to_its_widest():
    """Past 32 sequences the offline engine's decode pads into wider buckets
    (48, 64, 96, ... and max_batch) instead of running eagerly; narrower
    engines keep the exact buckets 1..32."""
    from engine.cuda_graphs import batch_buckets
    from engine.llm import EngineConfig, OfflineEngine

    assert batch_buckets(8) == batch_buckets(32) == DEFAULT_BUCKETS
    assert batch_buckets(100) == DEFAULT_BUCKETS + (48, 64, 96, 100)
    assert batch_buckets(256) == DEFAULT_BUCKETS + (48, 64, 96, 128, 192, 256)
    for widest in (33, 100, 256, 300):
        buckets = batch_buckets(widest)
        assert buckets[-1] == widest and list(buckets) == sorted(set(buckets))
        # no batch pads by more than half again
        assert all(b <= 1.5 * a for a, b in zip(buckets, buckets[1:]) if a >= 32)
    loaded = load_model("tiny-llama", progress=False)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=100, max_context=64))
    assert engine.decode_forward.buckets == batch_buckets(100)


def _decode_logits(loaded, kv_format: str, graphs: bool,
                   buckets: tuple[int, ...] = DEFAULT_BUCKETS, device: str = "cuda"
                   ) -> torch.Tensor:
    """Three prompts prefilled, then six decode steps (three sequences, then
    one: buckets 3 and 1 by default, 4 padded and 1 with buckets=(1, 2, 4));
    the logits of every step."""
    prompts = [[(7 * i + 3) % 512 for i in range(n)] for n in (19, 40, 7)]
    options = {"dtype": loaded.dtype} if kv_format == "bf16" else {}
    cache = PagedKVCache(loaded.config, CacheShape(30, 16, 3), device,
                         make_format(kv_format, **options))
    forward = DecodeForward(loaded.model, cache, max_context=160, buckets=buckets,
                            enabled=graphs)
    tables = [tuple(range(10 * i, 10 * i + 10)) for i in range(3)]
    for i, p in enumerate(prompts):
        loaded.model(ForwardBatch.build([SequenceInput(tuple(p), 0, tables[i], i)], 16,
                                        device), cache)
    lengths = [len(p) for p in prompts]
    steps = []
    for step in range(6):
        active = [0, 1, 2] if step < 4 else [1]
        batch = ForwardBatch.build(
            [SequenceInput(((step * 11 + i) % 512,), lengths[i], tables[i], i)
             for i in active], 16, device)
        steps.append(forward(batch).float())
        for i in active:
            lengths[i] += 1
    if graphs:
        assert forward.replays == 4, forward.capture_errors  # each bucket's first step is eager
    return torch.cat(steps)


# bf16, the GPU's compute dtype: on the H200 (2026-12-01,
# scripts/device_graphdiag.py) bf16 replays equal the eager steps, padded
# buckets included, while the fp32 tiny model's replays of steps 1-2 differ
# (steps 3-5 agree); not explained yet, recorded in BENCHMARKS.md.
GRAPH_DTYPE = torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_format", ["bf16", "int8", "rk4"])
def test_graph_replay_matches_eager_decode(kv_format):
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=GRAPH_DTYPE, seed=3)
    eager, replayed = (_decode_logits(loaded, kv_format, graphs) for graphs in (False, True))
    # eager and graph steps may split the keys differently (tf32 dots either way)
    torch.testing.assert_close(replayed, eager, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int4_replays_with_the_gemv_epilogues_match_eager_steps_without(monkeypatch):
    """int4 weights: the one-sequence steps run GDN's conv in in_proj's CUDA
    GEMV epilogue and the MLP's activation in gate_up's (TANDEM_CONV_EPILOGUE,
    TANDEM_SILU_EPILOGUE, on by default), captured with the slot and
    position tensors the graph replays; they agree with eager steps that
    launch both apart."""
    from engine.quant.linear import CONV_EPILOGUE_ENV, SILU_EPILOGUE_ENV

    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=GRAPH_DTYPE, seed=3,
                        weights="int4")
    for switch in (CONV_EPILOGUE_ENV, SILU_EPILOGUE_ENV):
        monkeypatch.setenv(switch, "0")
    eager = _decode_logits(loaded, "bf16", graphs=False)
    for switch in (CONV_EPILOGUE_ENV, SILU_EPILOGUE_ENV):
        monkeypatch.setenv(switch, "1")
    replayed = _decode_logits(loaded, "bf16", graphs=True)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2 * eager.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_padded_bucket_replay_matches_eager_decode():
    # failed in fp32 until 2026-12-01 and passed in bf16 on the H200 (BENCHMARKS.md:
    # the fp32 replay question); custom buckets pad, the default ones do not
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=GRAPH_DTYPE, seed=3)
    eager = _decode_logits(loaded, "int8", graphs=False)
    padded = _decode_logits(loaded, "int8", graphs=True, buckets=(1, 2, 4))
    torch.testing.assert_close(padded, eager, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_with_the_token_table_in_host_memory():
    # the KV store's --embeddings host: rows are looked up before the graph
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=GRAPH_DTYPE, seed=3)
    on_device = _decode_logits(loaded, "int8", graphs=False)
    loaded.model.model.embed_tokens.to("cpu")
    assert loaded.model.embeds_on_host
    torch.testing.assert_close(_decode_logits(loaded, "int8", graphs=True), on_device,
                               rtol=1e-2, atol=1e-2)


def _verify_setup(loaded, device, kv_format="bf16", **options):
    """A cache with three prefilled sequences (slots 0-2, spares from 3)."""
    if kv_format == "bf16":
        options["dtype"] = loaded.dtype
    cache = PagedKVCache(loaded.config, CacheShape(30, 16, 12), device,
                         make_format(kv_format, **options))
    tables = [tuple(range(10 * i, 10 * i + 10)) for i in range(3)]
    prompts = [[(7 * i + 3) % 512 for i in range(n)] for n in (19, 40, 7)]
    for i, p in enumerate(prompts):
        loaded.model(ForwardBatch.build([SequenceInput(tuple(p), 0, tables[i], i)], 16,
                                        device), cache)
    return cache, tables, [len(p) for p in prompts]


def _verify_batch(tables, lengths, active, step, k, device):
    """Each active sequence verifies [last token, k drafts]; its position slots
    are its own slot then k spares."""
    seqs = []
    for i in active:
        tokens = tuple((step * 13 + 5 * i + j) % 512 for j in range(k + 1))
        spares = tuple(3 + 3 * i + j for j in range(k))
        seqs.append(SequenceInput(tokens, lengths[i] - 1, tables[i], i, (i, *spares)))
    return ForwardBatch.build(seqs, 16, device)


@pytest.mark.skipif(os.environ["TRITON_INTERPRET"] in ("", "0"),
                    reason="runs the kernels interpreted on CPU tensors (the GPU run replays)")
def test_padded_static_verify_batch_matches_eager(monkeypatch):
    """What a verify graph replays, run eagerly on the CPU: two sequences in a
    bucket of 4 (two padding copies of the second). The copies must neither
    change the real rows nor write any GDN slot."""
    monkeypatch.setattr(gdn_batched, "use_fused_path",
                        lambda x, batch: batch.attention.max_new_tokens <= 8)
    loaded = load_model("tiny-qwen3.5", dtype=torch.float32, seed=3)
    k = 2
    results = []
    for padded in (False, True):
        # attention through the Triton kernel (interpreted): the static batch
        # carries device metadata only, as on the GPU
        cache, tables, lengths = _verify_setup(loaded, "cpu", use_triton=True)
        batch = _verify_batch(tables, lengths, [0, 1], 0, k, "cpu")
        if padded:
            graph = _Graph(4, k + 1, 10, torch.device("cpu"), None, 160, 16)
            graph.fill(batch)
            batch = graph.batch(list(batch.seqs))
        logits, hidden = loaded.model(batch, cache, all_logits=True, return_hidden=True)
        results.append((logits[:2 * (k + 1)], hidden[:2 * (k + 1)],
                        [t.clone() for t in cache.recurrent + cache.conv]))
    (ref_logits, ref_hidden, ref_states), (logits, hidden, states) = results
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
    for s, r in zip(states, ref_states):
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-4)


def test_cpu_verify_forward_is_the_eager_model():
    loaded = load_model("tiny-qwen3.5", dtype=torch.float32, seed=3)
    cache, tables, lengths = _verify_setup(loaded, "cpu")
    forward = VerifyForward(loaded.model, cache, max_context=160)
    assert not forward.enabled
    logits, hidden = forward(_verify_batch(tables, lengths, [0, 2], 0, 3, "cpu"))
    assert logits.shape == (8, loaded.config.vocab_size)
    assert hidden.shape == (8, loaded.config.hidden_size) and forward.replays == 0


def _verify_steps(loaded, kv_format: str, graphs: bool):
    """Verify steps of k+1 = 3 tokens: three sequences (bucket 4, padded), then
    one (bucket 1). Returns the logits and hidden states of every step and
    every GDN slot at the end (position slots included)."""
    k = 2
    cache, tables, lengths = _verify_setup(loaded, "cuda", kv_format)
    forward = VerifyForward(loaded.model, cache, max_context=160, enabled=graphs)
    outs = []
    for step in range(6):
        active = [0, 1, 2] if step < 4 else [1]
        logits, hidden = forward(_verify_batch(tables, lengths, active, step, k, "cuda"))
        outs += [logits.float(), hidden.float()]
        for i in active:  # as if one draft was accepted: the next step starts 2 on
            lengths[i] += 2
            cache.copy_state(3 + 3 * i, i)  # the state after token 1 of the step
    if graphs:
        assert forward.replays == 4 and not forward.capture_errors, forward.capture_errors
    return outs + [t.clone() for t in cache.recurrent + cache.conv]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_format", ["bf16", "int8"])
def test_verify_graph_replay_matches_eager(kv_format):
    """Each replayed verify step against the eager forward on its own cache."""
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=torch.float32, seed=3)
    eager, replayed = (_verify_steps(loaded, kv_format, graphs) for graphs in (False, True))
    for got, ref in zip(replayed, eager):
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verify_graph_with_the_token_table_in_host_memory():
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=torch.float32, seed=3)
    on_device = _verify_steps(loaded, "int8", graphs=False)
    loaded.model.model.embed_tokens.to("cpu")
    assert loaded.model.embeds_on_host
    for got, ref in zip(_verify_steps(loaded, "int8", graphs=True), on_device):
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def _draft_steps(loaded, graphs: bool):
    """MTP head forwards as the drafter runs them: catch-up forwards of 1..3
    pairs and single-pair drafts, at batch 1 and for three sequences (bucket
    4, padded). Returns every step's logits and outputs."""
    config = loaded.config
    cache = PagedKVCache(config, CacheShape(40, 16, 4, mtp_layers=config.mtp_num_layers), "cuda",
                         make_format("bf16", dtype=loaded.dtype))
    forward = DraftForward(loaded.model, cache, max_context=160, enabled=graphs)
    tables = [tuple(range(10 * i, 10 * i + 10)) for i in range(3)]
    positions = [0, 0, 0]
    generator = torch.Generator().manual_seed(11)
    outs = []
    for step, (active, pairs) in enumerate([([0], 3), ([0], 1), ([0], 1), ([0], 2), ([0], 3),
                                            ([0, 1, 2], 1), ([0, 1, 2], 1), ([0], 1)]):
        seqs = [SequenceInput(tuple((step * 11 + 3 * i + j) % 512 for j in range(pairs)),
                              positions[i], tables[i]) for i in active]
        hidden = torch.randn(len(active) * pairs, config.hidden_size, generator=generator)
        logits, out = forward(ForwardBatch.build(seqs, 16, "cuda"),
                              hidden.to("cuda", loaded.dtype))
        outs += [logits.float(), out.float()]
        for i in active:
            positions[i] += pairs
    if graphs:  # (1, 1) and (1, 3) and (4, 1) met again
        assert forward.replays == 4 and not forward.capture_errors, forward.capture_errors
    return outs


def _with_head_layers(monkeypatch, layers: int) -> None:
    """tiny-qwen3.5 with an MTP head of `layers` decoder layers (a head grown
    by train-mtp --head-layers): each layer has its own KV pool to replay."""
    from engine import config as config_module
    shape = dict(config_module._TINY_SHAPES["tiny-qwen3.5"], mtp_num_hidden_layers=layers)
    monkeypatch.setitem(config_module._TINY_SHAPES, "tiny-qwen3.5", shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("head_layers", [1, 2])
def test_draft_graph_replay_matches_eager(monkeypatch, head_layers):
    """The MTP head's forwards replayed from graphs against the eager head:
    each step also reads the MTP KV the earlier ones wrote."""
    _with_head_layers(monkeypatch, head_layers)
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=torch.float32, seed=3)
    assert loaded.config.mtp_num_layers == head_layers
    eager, replayed = (_draft_steps(loaded, graphs) for graphs in (False, True))
    for got, ref in zip(replayed, eager):
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("head_layers", [1, 2])
def test_cpu_draft_forward_is_the_eager_head(monkeypatch, head_layers):
    _with_head_layers(monkeypatch, head_layers)
    loaded = load_model("tiny-qwen3.5", dtype=torch.float32, seed=3)
    config = loaded.config
    assert config.mtp_num_layers == head_layers
    cache = PagedKVCache(config, CacheShape(10, 16, 2, mtp_layers=config.mtp_num_layers), "cpu",
                         make_format("bf16", dtype=torch.float32))
    forward = DraftForward(loaded.model, cache, max_context=160)
    assert not forward.enabled
    batch = ForwardBatch.build([SequenceInput((5, 6), 0, (0, 1))], 16, "cpu")
    hidden = torch.randn(2, config.hidden_size)
    logits, out = forward(batch, hidden)
    ref_logits, ref_out = loaded.model.mtp_forward(batch, hidden, cache)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(out, ref_out)
    assert logits.shape == (1, config.vocab_size) and forward.replays == 0
