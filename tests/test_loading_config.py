"""A Hugging Face directory's config.json and a trained MTP head file beside
a model: loading, `tandem plan` and the config peek report a bad one as one
error naming the file and the key, never a traceback from deep inside."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from engine.errors import ModelLoadError
from engine.loader import load_model, peek_config, plan_inputs


def _copy(tiny_hf_dir, tmp_path, family="llama"):
    src, _ = tiny_hf_dir(family)
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory, edit) -> None:
    file = directory / "config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


def _every_reader(directory):
    """What reads a directory's config: loading, the plan and the peek."""
    return [lambda: load_model(str(directory), progress=False),
            lambda: plan_inputs(str(directory), "auto", "cpu"),
            lambda: peek_config(str(directory))]


def _set(key, value):
    return lambda c: c.update({key: value})


def _drop(*keys):
    return lambda c: [c.pop(k) for k in keys]


@pytest.mark.parametrize("family, key, edit", [
    ("llama", "hidden_size", _drop("hidden_size")),
    ("llama", "hidden_size", _set("hidden_size", "64")),
    ("llama", "num_attention_heads", _set("num_attention_heads", 0)),
    ("llama", "vocab_size", _set("vocab_size", 12.5)),
    # without layer_types the layers are laid out every `interval`: 0 divided by zero
    ("qwen3_5", "full_attention_interval",
     lambda c: (c.pop("layer_types"), c.update(full_attention_interval=0))),
], ids=["no-hidden_size", "hidden_size-text", "heads-0", "vocab-float", "qwen3.5-interval-0"])
def test_bad_config_values_name_the_file_and_key(tiny_hf_dir, tmp_path, family, key, edit):
    d = _copy(tiny_hf_dir, tmp_path, family)
    _edit_config(d, edit)
    for read in _every_reader(d):
        with pytest.raises(ModelLoadError, match=rf"config\.json.*{key}"):
            read()


def test_null_max_position_embeddings_is_named(tiny_hf_dir, tmp_path):
    """Present but null: from_hf passed None on, and ModelConfig raised a
    TypeError on int(None)."""
    d = _copy(tiny_hf_dir, tmp_path)
    _edit_config(d, lambda c: c.update(max_position_embeddings=None))
    for read in _every_reader(d):
        with pytest.raises(ModelLoadError, match=r"config\.json.*max_position_embeddings.*None"):
            read()


def test_derived_keys_may_be_null(tiny_hf_dir, tmp_path):
    """head_dim and num_key_value_heads: null means derived (as transformers reads them)."""
    d = _copy(tiny_hf_dir, tmp_path)
    _edit_config(d, lambda c: c.update(head_dim=None, num_key_value_heads=None))
    config = peek_config(str(d))
    assert config.head_dim == 16 and config.num_kv_heads == config.num_heads


def test_a_config_that_is_not_an_object_is_named(tiny_hf_dir, tmp_path):
    d = _copy(tiny_hf_dir, tmp_path)
    (d / "config.json").write_text("[1, 2]")
    for read in _every_reader(d):
        with pytest.raises(ModelLoadError, match=r"config\.json.*object"):
            read()


def test_cli_plan_reports_a_bad_config_in_one_line(tiny_hf_dir, tmp_path):
    d = _copy(tiny_hf_dir, tmp_path)
    _edit_config(d, lambda c: c.pop("hidden_size"))
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "plan", "--model", str(d),
                           "--gpu-memory-budget", "24GiB"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "config.json" in proc.stderr and "hidden_size" in proc.stderr


# ---------------------------------------------------------------------------
# A trained head file (`tandem train-mtp`) that cannot be read
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all",
                                     b"truncated"], ids=["empty", "corrupt-header", "short"])
def test_an_unreadable_head_file_says_what_to_do(tiny_hf_dir, tmp_path, capsys, content):
    from tandem.cli import main

    d = _copy(tiny_hf_dir, tmp_path)
    head = d / "mtp.safetensors"
    head.write_bytes(content)
    expected = f"{head}: unreadable MTP head; delete it or retrain it with tandem train-mtp"
    for read in (lambda: load_model(str(d), progress=False),
                 lambda: plan_inputs(str(d), "auto", "cpu")):
        with pytest.raises(ModelLoadError) as e:
            read()
        assert str(e.value) == expected
    assert main(["plan", "--model", str(d), "--device", "cpu", "--gpu-memory-budget",
                 "24GiB"]) == 2
    assert expected in capsys.readouterr().err


def test_a_head_whose_tensor_data_is_cut_short_says_what_to_do(tiny_hf_dir, tmp_path):
    """A header that parses with its tensors cut off: safetensors fails on
    reading them, after the checks on the header."""
    import torch
    from safetensors.torch import save_file

    from engine.speculative.heads import _signature

    d = _copy(tiny_hf_dir, tmp_path)
    head = d / "mtp.safetensors"
    config = peek_config(str(d))
    save_file({"mtp.fc.weight": torch.zeros(64, 128)}, str(head), metadata=_signature(config))
    head.write_bytes(head.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"unreadable MTP head; delete it or retrain it"):
        load_model(str(d), progress=False)


def test_an_index_names_the_weight_files_and_a_second_copy_is_refused(tiny_hf_dir, tmp_path):
    """A directory may hold another copy of the weights beside the checkpoint
    (Mistral's consolidated.safetensors): with model.safetensors.index.json
    only the files it names are read; without one, a tensor found in two
    files is an error naming both, not a load that file order decides."""
    import torch
    from safetensors.torch import load_file, save_file

    d = _copy(tiny_hf_dir, tmp_path)
    weights = load_file(str(d / "model.safetensors"))
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    save_file({**weights, name: torch.zeros_like(weights[name])},
              str(d / "consolidated.safetensors"))
    with pytest.raises(ModelLoadError, match=r"in both consolidated\.safetensors and "
                                             r"model\.safetensors"):
        load_model(str(d), progress=False)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}))
    original = load_model(str(_copy(tiny_hf_dir, tmp_path / "original")), progress=False)
    indexed = load_model(str(d), progress=False)
    for key, value in original.model.state_dict().items():
        assert torch.equal(indexed.model.state_dict()[key], value), key
    assert plan_inputs(str(d), "auto", "cpu").weight_bytes == \
        plan_inputs(str(tmp_path / "original" / "model"), "auto", "cpu").weight_bytes
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors: download them"):
        load_model(str(d), progress=False)
