"""Shared fixtures: tiny random models written as real Hugging Face directories
(config.json + safetensors + tokenizer.json) by transformers itself, so the
loader and the forward are checked against an implementation we did not write."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run interpreted; triton reads the switch
# once, when first imported, so it is set before any test module imports it
# (test modules set it too, but a run that collects another module first,
# e.g. `pytest tests/test_decode_warmup.py tests/test_cuda_graphs.py`, found
# no driver). The device machine sets TRITON_INTERPRET=0 itself.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# transformers config kwargs for each tiny family; vocab 512 everywhere
TINY_FAMILIES = {
    "llama": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True),
    "llama3-scaled": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                          max_position_embeddings=8192, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                           "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64}),
    "qwen2": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen3": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen3_5": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    max_position_embeddings=4096, rms_norm_eps=1e-6,
                    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                     "partial_rotary_factor": 0.25}),
}


def _torch_only_gdn() -> None:
    """transformers binds its Qwen3.5 GDN to fla-core's Triton kernels when fla
    is importable (the GPU machines install it), and runs them even on the
    CPU tensors of our reference model, where they fail. The oracle must be
    transformers' own PyTorch code: put the undecorated functions back."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update"):
        fn = getattr(modeling, name, None)
        if fn is not None:
            setattr(modeling, name, getattr(fn, "__wrapped__", fn))


def _transformers_model(family: str):
    import transformers as tf

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "llama3-scaled": ("LlamaConfig", "LlamaForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM")}
    config_cls, model_cls = (getattr(tf, n) for n in classes[family])
    if family == "qwen3_5":
        _torch_only_gdn()
    torch.manual_seed(1234)
    model = model_cls(config_cls(**TINY_FAMILIES[family])).eval()
    with torch.no_grad():  # norms start at 1 (or 0): perturb them so they matter
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
            if "bias" in name and "dt_bias" not in name:
                p.normal_(0, 0.1)
    return model


def _tiny_tokenizer_json(directory: Path) -> None:
    """A real byte-level BPE tokenizer with a 512-token vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog " * 20,
            "hello world, tandem serves tokens from pages and slots. " * 20]
    tok.train_from_iterator(text, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """family -> (directory, transformers model); written once per session."""
    made: dict[str, tuple[Path, object]] = {}

    def make(family: str):
        if family not in made:
            directory = tmp_path_factory.mktemp(f"tiny-{family}")
            model = _transformers_model(family)
            model.save_pretrained(directory, safe_serialization=True)
            _tiny_tokenizer_json(directory)
            made[family] = (directory, model)
        return made[family]

    return make


@pytest.fixture
def reference_rotation(monkeypatch):
    """Triton K/V writes rotating by the reference's matmul by R: bit-for-bit
    write tests need it, as the Hadamard kernel agrees with the matmul to
    fp32 rounding only (tests/test_hadamard.py holds it to that)."""
    monkeypatch.setenv("TANDEM_HADAMARD_KERNEL", "0")


@pytest.fixture(scope="session")
def nvrtc():
    """NVRTC 13 (the nvidia-cuda-nvrtc wheel) for sm_90 builds without a GPU
    (engine/quant/sm90_builds.py); where the test extra installs the wheel,
    its absence is a broken set-up, not a skip."""
    import platform

    from engine.quant.sm90_builds import load_nvrtc

    lib = load_nvrtc()
    if lib is None:
        if platform.system() == "Linux" and platform.machine() == "x86_64":
            pytest.fail("no NVRTC 13: `bash scripts/setup.sh --test` installs nvidia-cuda-nvrtc")
        pytest.skip("no NVRTC 13 wheel for this platform (x86-64 Linux only)")
    return lib
