"""Weight sources and their failure modes: every bad input is an error that
names the file, tensor or limit, never a traceback from deep inside."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, shape_hf_config
from engine.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from engine.llm import EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.model import CausalLM


def _copy(tiny_hf_dir, tmp_path, family="llama"):
    src, _ = tiny_hf_dir(family)
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _edit_weights(directory, edit):
    file = next(directory.glob("*.safetensors"))
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def test_unknown_architecture_is_named(tiny_hf_dir, tmp_path):
    d = _copy(tiny_hf_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        load_model(str(d), progress=False)


def test_missing_tensor_is_named(tiny_hf_dir, tmp_path):
    d = _copy(tiny_hf_dir, tmp_path)
    _edit_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_model(str(d), progress=False)


def test_misshapen_tensor_names_both_shapes(tiny_hf_dir, tmp_path):
    d = _copy(tiny_hf_dir, tmp_path)
    _edit_weights(d, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight",
                                             torch.zeros(16, 64)))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        load_model(str(d), progress=False)


def test_truncated_safetensors_names_the_file(tiny_hf_dir, tmp_path):
    d = _copy(tiny_hf_dir, tmp_path)
    file = next(d.glob("*.safetensors"))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=file.name):
        load_model(str(d), progress=False)


def test_unknown_model_argument_lists_shapes():
    with pytest.raises(ModelLoadError, match="tiny-qwen3.5"):
        load_model("no-such-model-or-path")


def test_prompt_longer_than_context_names_the_limit():
    loaded = load_model("tiny-llama")
    engine = OfflineEngine(loaded, EngineConfig(max_context=64, max_batch=1))
    with pytest.raises(InvalidRequestError, match="70 tokens.*64"):
        engine.generate_ids(list(range(70)), _greedy())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.generate_ids([5, 100000], _greedy())


def _greedy():
    from engine.sampling import SamplingParams
    return SamplingParams(temperature=0.0, max_new_tokens=4)


def test_cli_reports_bad_model_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "--model",
                           str(tmp_path / "missing.gguf"), "hi"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "missing.gguf" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [["generate", "hi"], ["train-mtp"]])
def test_cli_asked_for_cuda_without_one_says_so_in_one_line(command, capsys):
    from tandem.cli import main

    assert main([command[0], "--device", "cuda", *command[1:]]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--device cpu" in err


def test_qwen35_27b_shape_matches_the_mission():
    cfg = ModelConfig.from_hf(shape_hf_config("qwen3.5-27b"))
    assert len(cfg.attention_layers) == 16 and len(cfg.linear_layers) == 48
    assert cfg.attention_layers[0] == 3 and cfg.rotary_dim == 64
    assert cfg.kv_elements_per_token == 32768
    assert cfg.gdn_state_elements * 4 == 144 * 2**20
    with torch.device("meta"):
        model = CausalLM(cfg)
    params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    assert 26.5e9 < params < 28e9, params


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3", "tiny-qwen3.5"])
def test_dummy_shapes_generate(shape):
    from engine.sampling import SamplingParams

    loaded = load_model(shape, seed=1)
    engine = OfflineEngine(loaded, EngineConfig(max_context=256, max_batch=2))
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    a = engine.generate_ids([1, 2, 3, 4, 5], params)
    assert len(a) == 8 and all(0 <= t < loaded.config.vocab_size for t in a)
    assert engine.generate_ids([1, 2, 3, 4, 5], params) == a
    assert load_model(shape, seed=1).model.model.embed_tokens.weight.equal(
        loaded.model.model.embed_tokens.weight)


def test_qwen35_mtp_weights_are_loaded_and_kept(tiny_hf_dir, tmp_path):
    """Real Qwen3.5 checkpoints carry mtp.* tensors (transformers drops them);
    tandem keeps them for speculative decoding, under the same names."""
    d = _copy(tiny_hf_dir, tmp_path, "qwen3_5")
    cfg = json.loads((d / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    from engine.weights.merge import merge_groups, unmerged_state

    gen = torch.Generator().manual_seed(0)
    model = CausalLM(ModelConfig.from_hf(cfg))
    groups = merge_groups(model)
    # under the checkpoint's names (q_proj, k_proj, ..., not the merged qkv_proj)
    mtp = {n: t.contiguous() for n, t in unmerged_state(
        {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()
         if n.startswith("mtp.")}, groups).items()}
    assert "mtp.fc.weight" in mtp and "mtp.layers.0.self_attn.q_proj.weight" in mtp
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in mtp)
    _edit_weights(d, lambda t: t.update(mtp))
    loaded = load_model(str(d), progress=False)
    state = unmerged_state(loaded.model.state_dict(), groups)
    for name, tensor in mtp.items():
        assert torch.equal(state[name], tensor), name
