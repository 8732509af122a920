"""GPTQ checkpoints (Hugging Face directories written by transformers, their
projections packed by tests/test_quant_weights.py's GPTQ packer): the scales
load as the file stores them, `tandem plan` counts exactly the bytes loading
makes, and refuses exactly what loading refuses, with the same message."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader import load_model, plan_inputs
from tests.test_quant_weights import _gptq_pack

# hidden 256: rows hold whole groups of 128 (down_proj's 512 four)
SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    import transformers as tf

    from tests.conftest import _tiny_tokenizer_json

    directory = tmp_path_factory.mktemp("llama-256")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE)).save_pretrained(directory,
                                                                 safe_serialization=True)
    _tiny_tokenizer_json(directory)
    return directory


def gptq_dir(dense: Path, out: Path, group: int = 128, act_order: bool = False,
             **quant) -> Path:
    """`dense` with every projection GPTQ-packed (v1, fp16 scales, as AutoGPTQ
    writes them) and a quantization_config; `quant` overrides its keys."""
    shutil.copytree(dense, out)
    file = next(out.glob("*.safetensors"))
    tensors = {}
    for name, w in load_file(str(file)).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = w
            continue
        prefix, k = name.removesuffix(".weight"), w.shape[1]
        size = k if group == -1 else group
        qweight, qzeros, scales, _ = _gptq_pack(w.float(), size, sym=False)
        g_idx = torch.arange(k, dtype=torch.int32) // size
        if act_order:  # desc_act: the channels' groups in activation order
            g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(0))]
        tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros,
                        f"{prefix}.scales": scales, f"{prefix}.g_idx": g_idx})
    file.unlink()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                     "desc_act": act_order, "sym": False, **quant}
    (out / "config.json").write_text(json.dumps(config))
    return out


def _loaded_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_scales_load_as_stored_under_a_bf16_compute_dtype(dense_dir, tmp_path):
    """The CUDA store reads the checkpoint on the CPU in bf16: the fp16
    scales were cast to bf16 (3 mantissa bits lost) and then widened to fp32."""
    d = gptq_dir(dense_dir, tmp_path / "g128")
    prefix = "model.layers.0.mlp.down_proj"
    stored = load_file(str(d / "model.safetensors"))[f"{prefix}.scales"]
    loaded = load_model(str(d), "cpu", dtype=torch.bfloat16, progress=False, weights="native")
    module = loaded.model.get_submodule(prefix)
    assert module.qd.dtype == module.qdmin.dtype == torch.float16
    assert torch.equal(module.qd, stored.t())


@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("device, dtype", [("cuda", torch.bfloat16), ("cpu", torch.float32)])
def test_plan_counts_the_bytes_loading_makes(dense_dir, tmp_path, group, device, dtype):
    """The plan assumed group 128 and fp16 scales whatever the checkpoint
    said; group -1 (one group a row) loads as groups of 128, its scale
    repeated. Planned for `device` as the store loads for it (on the CPU, in
    that device's compute dtype)."""
    d = gptq_dir(dense_dir, tmp_path / f"g{group}", group=group)
    loaded = load_model(str(d), "cpu", dtype=dtype, progress=False, weights="native")
    assert plan_inputs(str(d), "native", device).weight_bytes == _loaded_bytes(loaded.model)
    # dequantized (--weights bf16): every matrix dense in the dtype
    dense = load_model(str(d), "cpu", dtype=dtype, progress=False, weights="bf16")
    assert plan_inputs(str(d), "bf16", device).weight_bytes == _loaded_bytes(dense.model)


@pytest.mark.parametrize("case, match", [
    (dict(quant_method="fp8"), "quantization 'fp8' is not supported"),
    (dict(bits=8), "gptq with 8 bits is not supported"),
    (dict(act_order=True), r"model\.layers\.0\..*_proj.*desc_act"),
    (dict(group_size=0), "group_size"),
    (dict(group_size="big"), "group_size"),
], ids=["fp8", "bits-8", "act-order", "group-0", "group-text"])
def test_plan_refuses_what_loading_refuses_with_its_message(dense_dir, tmp_path, capsys, case,
                                                            match):
    from tandem.cli import main

    case = dict(case)
    d = gptq_dir(dense_dir, tmp_path / "bad", act_order=case.pop("act_order", False), **case)
    with pytest.raises(ModelLoadError, match=match) as loading:
        load_model(str(d), "cpu", progress=False, weights="native")
    assert str(d) in str(loading.value)  # the act-order error named neither file nor tensor
    for weights in ("native", "bf16"):
        with pytest.raises(ModelLoadError) as planning:
            plan_inputs(str(d), weights, "cuda")
        assert str(planning.value) == str(loading.value)
        assert type(planning.value) is type(loading.value)
    assert main(["plan", "--model", str(d), "--gpu-memory-budget", "24GiB"]) == 2
    assert str(loading.value) in capsys.readouterr().err


def test_act_order_with_static_groups_still_loads(dense_dir, tmp_path):
    """desc_act=True with static groups keeps g_idx = k // group: nothing is
    reordered, so neither loading nor the plan may refuse it on the config."""
    d = gptq_dir(dense_dir, tmp_path / "static", desc_act=True, static_groups=True)
    loaded = load_model(str(d), "cpu", progress=False, weights="native")
    assert plan_inputs(str(d), "native", "cpu").weight_bytes == _loaded_bytes(loaded.model)


def test_unsupported_is_still_an_unsupported_model_error(dense_dir, tmp_path):
    d = gptq_dir(dense_dir, tmp_path / "fp8", quant_method="fp8")
    with pytest.raises(UnsupportedModelError):
        plan_inputs(str(d), "native", "cuda")


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_planned_layout_is_the_repacked_tensors(method, group, scale_dtype):
    """matrix_layout (all the plan sees: shapes and dtypes) against the
    QuantTensor repacking makes of the same tensors: bf16 scales are widened
    to fp32 (QuantTensor holds fp16 or fp32), fp16 and fp32 kept."""
    from engine.weights.gptq import awq_tensor, gptq_tensor, matrix_layout

    n, k = 64, 512
    size = k if group == -1 else group
    gen = torch.Generator().manual_seed(0)
    words = lambda *shape: torch.randint(-2**31, 2**31, shape, generator=gen,  # noqa: E731
                                         dtype=torch.int64).to(torch.int32)
    scales = torch.rand(k // size, n, generator=gen).to(scale_dtype)
    if method == "gptq":
        qweight, qzeros = words(k // 8, n), words(k // size, n // 8)
        qt = gptq_tensor(qweight, qzeros, scales, torch.arange(k) // size, group)
    else:
        qweight, qzeros = words(k, n // 8), words(k // size, n // 8)
        qt = awq_tensor(qweight, qzeros, scales, group)
    layout = matrix_layout(method, group, tuple(qweight.shape), tuple(qzeros.shape),
                           tuple(scales.shape), {"qweight": torch.int32, "qzeros": torch.int32,
                                                 "scales": scale_dtype})
    assert (layout.rows, layout.cols) == qt.shape and layout.group == qt.group
    assert layout.scale_dtype == qt.d.dtype
    assert layout.quant_format.nbytes(layout.rows, layout.cols) == qt.nbytes
    assert qt.d.dtype == (torch.float32 if scale_dtype == torch.bfloat16 else scale_dtype)
