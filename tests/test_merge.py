"""Merged projections (MLP gate_up_proj, attention qkv_proj, GDN in_proj):
the loader joins a checkpoint's per-matrix tensors (engine/weights/merge.py)
and the model must compute what it computed with the matrices apart.

The oracle is the unmerged forward: the same checkpoint tensors built with
every checkpoint matrix as its own part (a SplitLinear with one part per
q_proj, k_proj, ...), i.e. one matmul per checkpoint matrix, as before the
merge. Packed parts of one layout must be joined (one module), parts of
different layouts kept apart; a merged state loads as it is (the store's
weights arena); the memory plan counts the bytes it counted before."""
from __future__ import annotations

import pytest
import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.config import ModelConfig, shape_hf_config
from engine.kv import make_format
from engine.llm import EngineConfig, OfflineEngine
from engine.loader import LoadedModel, build_model, load_model
from engine.model import CausalLM
from engine.quant.linear import QuantLinear, SplitLinear
from engine.sampling import SamplingParams
from engine.weights.gguf import embedded_model_path, gguf_plan_inputs, read_gguf
from engine.weights.merge import merge_checkpoint, merge_groups, runs


def _per_matrix(config: ModelConfig, tensors: dict, dtype=torch.float32):
    """The unmerged model: each checkpoint matrix of a merged group is its own
    part, so each runs its own matmul."""
    with torch.device("meta"):
        groups = merge_groups(CausalLM(config))
    tensors = dict(tensors)
    for group in groups:
        for j, part in enumerate(group.parts):
            for key in [k for k in tensors if k.startswith(part + ".")]:
                tensors[f"{group.name}.parts.{j}.{key[len(part) + 1:]}"] = tensors.pop(key)
    model = build_model(config, tensors, "cpu", dtype, "per-matrix")
    assert all(len(model.get_submodule(g.name).parts) == len(g.parts) for g in groups)
    return model


def _logits(model, config, tokens):
    cache = PagedKVCache(config, CacheShape(4, 16, 1), "cpu",
                         make_format("bf16", dtype=torch.float32))
    batch = ForwardBatch.build([SequenceInput(tuple(tokens), 0, (0, 1), 0)], 16, "cpu")
    return model(batch, cache, all_logits=True)


def _greedy(loaded: LoadedModel, prompt, tokens: int = 8):
    engine = OfflineEngine(loaded, EngineConfig(max_batch=1, max_context=128))
    return engine.generate_ids(prompt, SamplingParams(temperature=0, max_new_tokens=tokens,
                                                      ignore_eos=True))


def _same_model(merged: LoadedModel, unmerged, prompt):
    """Logits of every prompt position within fp32 rounding of another matmul
    width (a wrong row is off by O(1)), and the same greedy continuation."""
    a, b = (_logits(m, merged.config, prompt) for m in (merged.model, unmerged))
    assert torch.isfinite(a).all()
    # (2.8e-5 seen on one CPU, where BLAS picked other kernels for the widths)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    twin = LoadedModel(merged.config, unmerged, merged.tokenizer, "per-matrix", merged.device,
                       merged.dtype)
    assert _greedy(merged, prompt) == _greedy(twin, prompt)


def test_runs_join_neighbours_only():
    assert runs(["a", "a", "b", "a"]) == [range(0, 2), range(2, 3), range(3, 4)]
    assert runs(["a", "a", "a"]) == [range(0, 3)]


@pytest.mark.parametrize("weights", ["auto", "native"], ids=["dense", "packed-q4_1"])
def test_embedded_model_is_unchanged_by_the_merge(weights):
    """SmolLM2 (all Q4_1: every group joins): one module per group, and the
    same logits and greedy text as the matrices run apart."""
    merged = load_model(None, progress=False, weights=weights, trained_head=False)
    layer = merged.model.model.layers[0]
    kind = QuantLinear if weights == "native" else torch.nn.Linear
    assert type(layer.self_attn.qkv_proj) is kind and type(layer.mlp.gate_up_proj) is kind
    assert not any(isinstance(m, SplitLinear) for m in merged.model.modules())
    gguf = read_gguf(embedded_model_path(), progress=False, keep_quantized=weights == "native")
    unmerged = _per_matrix(merged.config, gguf.tensors)
    _same_model(merged, unmerged, merged.tokenizer.encode("The capital of France is"))


def _mixed_types(name: str) -> str | None:
    """A file whose groups mix formats, as real GGUFs do: v with more bits
    than q and k; GDN's alpha kept in F32 beside quantized qkv/z/beta."""
    if name.endswith(("attn_q.weight", "attn_k.weight")):
        return "Q4_0"
    if name.endswith(("attn_v.weight", "attn_qkv.weight", "attn_gate.weight",
                      "ssm_beta.weight")):
        return "Q8_0"
    if name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")):
        return "Q4_1"
    return None


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    from tests.test_gguf import write_tiny_gguf

    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_tiny_gguf(path, "qwen35", layers=4, mtp=1, types=_mixed_types)
    return path


def test_mixed_formats_stay_split_with_the_same_outputs(mixed_gguf):
    loaded = load_model(str(mixed_gguf), progress=False, weights="native")
    model = loaded.model
    # attention: [q+k] Q4_0 joined, [v] Q8_0 apart (the MTP layer too)
    for attn in (model.model.layers[3].self_attn, model.mtp.layers[0].self_attn):
        qkv = attn.qkv_proj
        assert isinstance(qkv, SplitLinear) and len(qkv.parts) == 2
        assert [p.quant.describe() for p in qkv.parts] == ["int4 G32/S32 asym", "int8 G32/S32 sym"]
        assert [p.out_features for p in qkv.parts] == [attn._qkv_split[0] + attn._qkv_split[1],
                                                       attn._qkv_split[2]]
    # GDN: [qkv+z+b] Q8_0 joined, [a] dense; the MLP joins whole
    in_proj = model.model.layers[0].linear_attn.in_proj
    assert isinstance(in_proj, SplitLinear)
    assert [type(p) for p in in_proj.parts] == [QuantLinear, torch.nn.Linear]
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, QuantLinear)
    gguf = read_gguf(mixed_gguf, progress=False, keep_quantized=True)
    _same_model(loaded, _per_matrix(loaded.config, gguf.tensors), [1, 5, 9, 2, 7, 3])
    # the plan (read from the tensor table) counts what the split model holds
    _, planned, _, packed_k = gguf_plan_inputs(mixed_gguf, True, torch.float32)
    assert planned == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # the longest row among the matrices held packed sizes the prefill's workspace
    assert packed_k == max(m.in_features for m in model.modules() if isinstance(m, QuantLinear))


@pytest.mark.parametrize("source", ["mixed-gguf", "q4_k_m-dummy"])
def test_a_merged_state_loads_as_it_is(source, mixed_gguf):
    """What a worker does with the store's weights arena: build_model on the
    merged (and split) state reuses every tensor (no copy, no second merge)."""
    loaded = load_model(str(mixed_gguf), progress=False, weights="native") \
        if source == "mixed-gguf" else load_model("tiny-qwen3.5", weights="q4_k_m")
    state = loaded.model.state_dict()
    with torch.device("meta"):
        groups = merge_groups(CausalLM(loaded.config))
    again = dict(state)
    merge_checkpoint(again, groups, loaded.dtype, "again")
    assert again.keys() == state.keys() and all(again[n] is state[n] for n in state)
    rebuilt = build_model(loaded.config, dict(state), "cpu", loaded.dtype, "arena")
    kinds = {n: type(m) for n, m in loaded.model.named_modules()}
    assert {n: type(m) for n, m in rebuilt.named_modules()} == kinds
    assert any(k is SplitLinear for k in kinds.values())
    for name, t in rebuilt.state_dict().items():
        assert t.data_ptr() == state[name].data_ptr(), name


# `tandem plan` weight bytes on main before the merge (commit 6c5d008): the
# merge concatenates tensors, so not one byte may change.
PLANNED_27B = {"bf16": 54641395712, "int4": 15798577152, "q4_k_m": 17895217152,
               "q8_0": 29884434432, "gptq-int4": 18639890432}


@pytest.mark.parametrize("recipe", sorted(PLANNED_27B))
def test_plan_bytes_are_unchanged_by_the_merge(recipe):
    from engine.quant.recipes import swap_in_meta
    from kvstore.plan import weight_bytes_of

    config = ModelConfig.from_hf(shape_hf_config("qwen3.5-27b"))
    assert weight_bytes_of(config, torch.bfloat16, recipe) == PLANNED_27B[recipe]
    # and the dummy layout (meta: nothing allocated) holds exactly that
    with torch.device("meta"):
        model = CausalLM(config).to(torch.bfloat16)
    swap_in_meta(model, recipe, torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert held == PLANNED_27B[recipe]
    splits = [n for n, m in model.named_modules() if isinstance(m, SplitLinear)]
    # Q4_K_M: v_proj in Q6_K where llama.cpp gives more bits (8 of 16 attention
    # layers and the MTP layer); everything else joins
    assert len(splits) == (9 if recipe == "q4_k_m" else 0)


def test_a_trained_head_is_written_under_checkpoint_names(tmp_path):
    """tandem train-mtp's file names q_proj/k_proj/gate_proj... and loads
    (merged) beside a base model's merged state."""
    from dataclasses import replace

    from engine.speculative.heads import head_state, read_head, save_head
    from engine.speculative.train import init_head

    base = load_model("tiny-llama", seed=3)
    head = init_head(base.model)
    written = head_state(head)
    assert "mtp.layers.0.self_attn.v_proj.weight" in written
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in written)
    path = tmp_path / "head.mtp.safetensors"
    save_head(path, base.config, written)
    config = replace(base.config, mtp_num_layers=1)
    tensors = {**base.model.state_dict(), **read_head(path, base.config, torch.float32)}
    model = build_model(config, tensors, "cpu", torch.float32, "with head")
    for name, t in head.state_dict().items():
        expected = t.to(torch.bfloat16).float()  # head files are bf16
        assert torch.equal(model.mtp.state_dict()[name], expected), name


def _weight_launches(model) -> int:
    """Matmuls over weights one decode step of the target (no MTP) runs: each
    Linear, each part of a split projection, the output head."""
    skip = ("mtp.", "model.embed_tokens")
    return sum(1 for name, m in model.named_modules()
               if isinstance(m, (torch.nn.Linear, QuantLinear)) and not name.startswith(skip)) \
        + (model.lm_head is None)  # a tied head is F.linear on the token table


def test_27b_decode_step_makes_one_weight_launch_per_merged_group():
    """64 layers x (2 mixer + 2 MLP) + the head = 257 launches (497 with the
    matrices apart); bench.quant's shape list counts the same."""
    from bench.quant import MERGED_FROM, model_shapes
    from engine.quant.recipes import swap_in_meta

    config = ModelConfig.from_hf(shape_hf_config("qwen3.5-27b"))
    with torch.device("meta"):
        model = CausalLM(config)
    swap_in_meta(model, "int4", torch.bfloat16)
    groups = [g for g in merge_groups(model) if not g.name.startswith("mtp.")]
    launches = _weight_launches(model)
    assert launches == 4 * config.num_layers + 1 == 257
    assert launches + sum(len(g.parts) - 1 for g in groups) == 497
    shapes = model_shapes()
    assert sum(per_step for *_, per_step in shapes) == launches
    names = {name for name, *_ in shapes}
    assert all(part in names for parts in MERGED_FROM.values() for part, _ in parts)
