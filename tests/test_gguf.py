"""GGUF loading: the embedded SmolLM2 file against transformers' own GGUF
loader (config and every dequantized tensor), tiny synthetic files for the
other architectures and for the error paths, and bad files."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.weights.gguf import GGUFModel, embedded_model_path, read_gguf

EMBEDDED = embedded_model_path()


# ---------------------------------------------------------------------------
# The embedded model against transformers
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ours() -> GGUFModel:
    return read_gguf(EMBEDDED, progress=False)


@pytest.fixture(scope="module")
def reference():
    """transformers' model loaded from the same file; its .config is what
    AutoConfig.from_pretrained(dir, gguf_file=name) returns (loaded once: the
    GGUF metadata parse alone takes seconds)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(EMBEDDED.parent), gguf_file=EMBEDDED.name,
                                                 dtype=torch.float32)
    return model.config, model.state_dict()


def test_embedded_model_is_found():
    assert EMBEDDED.is_file() and EMBEDDED.suffix == ".gguf"


def test_config_matches_transformers(ours, reference):
    ref, _ = reference
    cfg = ours.hf_config
    assert cfg["model_type"] == ref.model_type == "llama"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "head_dim"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps)
    assert cfg["rope_theta"] == pytest.approx(ref.rope_parameters["rope_theta"])
    model = ours.config  # and it is a valid engine config
    assert isinstance(model, ModelConfig) and model.num_layers == 30 and model.num_kv_heads == 3


def test_every_tensor_matches_transformers(ours, reference):
    _, state = reference
    # tied embeddings: transformers lists lm_head as an alias, the file has no output.weight
    assert set(ours.tensors) == set(state) - {"lm_head.weight"}
    for name, tensor in ours.tensors.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == state[name].shape, name
        # q/k are compared too: a wrong rope un-permute shows up here
        assert (tensor - state[name]).abs().max().item() < 1e-6, name


def test_tokenizer_comes_with_the_model(ours):
    assert ours.tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert 2 in ours.tokenizer.eos_token_ids


# ---------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------
def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nowhere.gguf"
    with pytest.raises(ModelLoadError, match="nowhere.gguf"):
        read_gguf(path, progress=False)


def test_non_gguf_file_is_named(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ModelLoadError, match=r"weights\.gguf.*not a GGUF"):
        read_gguf(path, progress=False)


@pytest.mark.parametrize("keep", [1_000_000, 0.6], ids=["first-1MB", "first-60pct"])
def test_truncated_file_is_named(tmp_path, keep):
    data = EMBEDDED.read_bytes()
    size = keep if isinstance(keep, int) else int(len(data) * keep)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:size])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated"):
        read_gguf(path, progress=False)


# ---------------------------------------------------------------------------
# Tiny synthetic files, written the way llama.cpp's converter writes them
# ---------------------------------------------------------------------------
H, INTER, HEADS, KV = 64, 128, 4, 2
LIN = dict(nk=2, nv=4, dk=16, dv=16, kernel=4)
VOCAB_TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["<|endoftext|>", "<|im_end|>"]


def _hf_tensors(family: str, layers: int, mtp: int = 0, tied: bool = True) -> dict[str, torch.Tensor]:
    """Random weights with HF names for a tiny model of `family`."""
    g = torch.Generator().manual_seed(7)
    d = 32 if family in ("qwen3", "qwen35") else H // HEADS
    vocab = len(VOCAB_TOKENS)
    shapes = {"model.embed_tokens.weight": (vocab, H), "model.norm.weight": (H,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, H)

    def layer(prefix: str, full: bool):
        shapes.update({f"{prefix}.input_layernorm.weight": (H,),
                       f"{prefix}.post_attention_layernorm.weight": (H,),
                       f"{prefix}.mlp.gate_proj.weight": (INTER, H),
                       f"{prefix}.mlp.up_proj.weight": (INTER, H),
                       f"{prefix}.mlp.down_proj.weight": (H, INTER)})
        if full:
            q_rows = HEADS * d * (2 if family == "qwen35" else 1)
            a = f"{prefix}.self_attn"
            shapes.update({f"{a}.q_proj.weight": (q_rows, H), f"{a}.k_proj.weight": (KV * d, H),
                           f"{a}.v_proj.weight": (KV * d, H), f"{a}.o_proj.weight": (H, HEADS * d)})
            if family == "qwen2":
                shapes.update({f"{a}.q_proj.bias": (q_rows,), f"{a}.k_proj.bias": (KV * d,),
                               f"{a}.v_proj.bias": (KV * d,)})
            if family in ("qwen3", "qwen35"):
                shapes.update({f"{a}.q_norm.weight": (d,), f"{a}.k_norm.weight": (d,)})
        else:
            nk, nv, dk, dv, k = (LIN[x] for x in ("nk", "nv", "dk", "dv", "kernel"))
            conv = 2 * nk * dk + nv * dv
            a = f"{prefix}.linear_attn"
            shapes.update({f"{a}.in_proj_qkv.weight": (conv, H), f"{a}.in_proj_z.weight": (nv * dv, H),
                           f"{a}.in_proj_a.weight": (nv, H), f"{a}.in_proj_b.weight": (nv, H),
                           f"{a}.out_proj.weight": (H, nv * dv), f"{a}.conv1d.weight": (conv, 1, k),
                           f"{a}.A_log": (nv,), f"{a}.dt_bias": (nv,), f"{a}.norm.weight": (dv,)})

    for i in range(layers):
        layer(f"model.layers.{i}", family != "qwen35" or (i + 1) % 4 == 0)
    for j in range(mtp):
        layer(f"mtp.layers.{j}", True)
    if mtp:
        shapes.update({"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
                       "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)})
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute, as documented there."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tile_v(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's grouped -> tiled V-head reorder for Qwen3.5."""
    nk, per_k = LIN["nk"], LIN["nv"] // LIN["nk"]
    shape = list(t.shape)
    grouped = t.reshape(*shape[:dim], nk, per_k, head_dim, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


_GGUF_NAMES = [  # HF leaf -> GGUF leaf, as gguf's tensor_mapping has them
    ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"),
    ("linear_attn.in_proj_qkv", "attn_qkv"), ("linear_attn.in_proj_z", "attn_gate"),
    ("linear_attn.in_proj_a", "ssm_alpha"), ("linear_attn.in_proj_b", "ssm_beta"),
    ("linear_attn.out_proj", "ssm_out"), ("linear_attn.conv1d", "ssm_conv1d"),
    ("linear_attn.norm", "ssm_norm"), ("linear_attn.A_log", "ssm_a"),
    ("linear_attn.dt_bias", "ssm_dt.bias"),
]


def _to_gguf(family: str, name: str, w: torch.Tensor, layers: int) -> tuple[str, torch.Tensor]:
    """One tensor as llama.cpp's converter writes it."""
    qwen35 = family == "qwen35"
    # every Qwen3.5 norm but GDN's gated one is stored as 1 + w (MTP norms too:
    # llama.cpp renames them to *.enorm / *.hnorm before it offsets)
    if qwen35 and "norm" in name and not name.endswith("linear_attn.norm.weight"):
        w = w + 1
    if family == "llama" and ".q_proj." in name:
        w = _llama_cpp_permute(w, HEADS)
    if family == "llama" and ".k_proj." in name:
        w = _llama_cpp_permute(w, KV)
    if qwen35 and ".linear_attn." in name:
        qk, dv = 2 * LIN["nk"] * LIN["dk"], LIN["dv"]
        if "in_proj_qkv" in name or "conv1d" in name:
            w = w.squeeze(1) if "conv1d" in name else w
            w = torch.cat([w[:qk], _tile_v(w[qk:], 0, dv)])
        elif "in_proj_z" in name:
            w = _tile_v(w, 0, dv)
        elif "in_proj_a" in name or "in_proj_b" in name or "dt_bias" in name:
            w = _tile_v(w, 0, 1)
        elif "A_log" in name:
            w = _tile_v(-torch.exp(w), 0, 1)
        elif "out_proj" in name:
            w = _tile_v(w, 1, dv)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight", "mtp.fc.weight": f"blk.{layers}.nextn.eh_proj.weight",
           "mtp.pre_fc_norm_embedding.weight": f"blk.{layers}.nextn.enorm.weight",
           "mtp.pre_fc_norm_hidden.weight": f"blk.{layers}.nextn.hnorm.weight",
           "mtp.norm.weight": f"blk.{layers}.nextn.shared_head_norm.weight"}
    if name in top:
        return top[name], w
    _, _, index, rest = name.split(".", 3)  # model.layers.N.rest or mtp.layers.J.rest
    if name.startswith("mtp."):
        index = str(layers + int(index))  # the MTP block follows the decoder blocks
    second = "post_attention_norm" if qwen35 else "ffn_norm"
    for hf_leaf, gguf_leaf in [*_GGUF_NAMES, ("post_attention_layernorm", second)]:
        if rest == hf_leaf or rest.startswith(hf_leaf + "."):
            suffix = "" if gguf_leaf.endswith(".bias") else rest[len(hf_leaf):]
            return f"blk.{index}.{gguf_leaf}{suffix}", w
    raise AssertionError(f"no GGUF name for {name}")


def write_tiny_gguf(path: Path, family: str, *, layers: int = 2, mtp: int = 0, tied: bool = True,
                    edit=None, types=None) -> dict[str, torch.Tensor]:
    """Write a tiny model of `family` and return its HF tensors. `edit(dict)`
    may change the GGUF-named tensors before they are written; `types(name)`
    may name a ggml type (e.g. "Q8_0") a tensor is quantized to (None: F32):
    by the gguf package, K-quants by tests/kquant_pack.py, and a type neither
    can write (Q2_K, IQ4_NL, ...) as random blocks of its size (for files
    tandem must refuse); a tensor that is not a matrix of whole blocks stays F32."""
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen35": "qwen35"}[family]
    hf = _hf_tensors(family, layers, mtp, tied)
    out = dict(_to_gguf(family, n, w, layers) for n, w in hf.items())
    if edit:
        edit(out)
    d = 32 if family in ("qwen3", "qwen35") else H // HEADS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers + mtp)
    w.add_context_length(2048)
    w.add_embedding_length(H)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(d)
    w.add_value_length(d)
    if family == "qwen35":
        w.add_rope_dimension_count(d // 4)
        w.add_rope_dimension_sections([2, 1, 1, 0])
        w.add_full_attention_interval(4)
        w.add_ssm_conv_kernel(LIN["kernel"])
        w.add_ssm_state_size(LIN["dk"])
        w.add_ssm_group_count(LIN["nk"])
        w.add_ssm_time_step_rank(LIN["nv"])
        w.add_ssm_inner_size(LIN["nv"] * LIN["dv"])
        if mtp:
            w.add_nextn_predict_layers(mtp)
    else:
        w.add_rope_dimension_count(d)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if family.startswith("qwen") else "default")
    w.add_token_list(VOCAB_TOKENS)
    w.add_token_types([1] * 26 + [3, 3])
    w.add_token_merges([])
    w.add_eos_token_id(len(VOCAB_TOKENS) - 1)
    for name, tensor in out.items():
        data = tensor.numpy().astype(np.float32)
        kind = types(name) if types else None
        if kind is None or data.ndim != 2 \
                or data.shape[-1] % gguf.GGML_QUANT_SIZES[_ggml_type(kind)][0]:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, _ggml_blocks(data, kind), raw_dtype=_ggml_type(kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _ggml_type(kind: str):
    return getattr(gguf.GGMLQuantizationType, kind)


def _ggml_blocks(data: np.ndarray, kind: str) -> np.ndarray:
    """data [rows, cols] as the raw blocks of ggml type `kind`."""
    from tests.kquant_pack import PACKERS

    if kind in PACKERS:
        return PACKERS[kind](data)
    try:
        return gguf.quants.quantize(data, _ggml_type(kind))
    except NotImplementedError:  # a type only llama.cpp writes: random blocks of its size
        block, nbytes = gguf.GGML_QUANT_SIZES[_ggml_type(kind)]
        rows = data.reshape(-1, data.shape[-1]).shape[0]
        return np.random.default_rng(0).integers(0, 256, (rows, data.shape[-1] // block * nbytes),
                                                 dtype=np.uint8)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen35"])
def test_tiny_round_trip(tmp_path, family):
    path = tmp_path / f"{family}.gguf"
    layers = 4 if family == "qwen35" else 2
    hf = write_tiny_gguf(path, family, layers=layers, mtp=1 if family == "qwen35" else 0,
                         tied=family != "qwen2")
    model = read_gguf(path, progress=False)
    config = model.config  # ModelConfig accepts what we produced
    assert config.num_layers == layers
    assert set(model.tensors) == set(hf)
    for name, tensor in hf.items():
        assert model.tensors[name].shape == tensor.shape, name
        # qwen3.5 norms round-trip through +1/-1 in fp32
        torch.testing.assert_close(model.tensors[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    if family == "qwen35":
        assert config.is_hybrid and config.mtp_num_layers == 1
        assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert config.partial_rotary_factor == 0.25
        assert (config.linear_num_k_heads, config.linear_num_v_heads) == (LIN["nk"], LIN["nv"])
    if family == "qwen2":
        assert config.attention_bias and not config.tie_word_embeddings


def test_tiny_qwen35_matches_transformers(tmp_path):
    """transformers has its own Qwen3.5 GGUF loader: both must undo the
    converter the same way (norm offsets, A_log, V-head tiling, conv1d)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "q35.gguf"
    write_tiny_gguf(path, "qwen35", layers=4)
    ours = read_gguf(path, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                               dtype=torch.float32).state_dict()
    assert set(ours.tensors) == set(ref) - {"lm_head.weight"}
    for name, tensor in ours.tensors.items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-6, rtol=1e-5, msg=name)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "gptneox")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"odd\.gguf.*'gptneox'.*llama"):
        read_gguf(path, progress=False)


def test_missing_tensor_is_named(tmp_path):
    path = tmp_path / "holey.gguf"
    write_tiny_gguf(path, "llama", edit=lambda t: t.pop("blk.1.ffn_up.weight"))
    with pytest.raises(ModelLoadError, match=r"holey\.gguf.*blk\.1\.ffn_up\.weight.*missing"):
        read_gguf(path, progress=False)


def test_misshapen_tensor_names_both_shapes(tmp_path):
    path = tmp_path / "bent.gguf"

    def shrink(t):
        t["blk.0.attn_v.weight"] = t["blk.0.attn_v.weight"][:8]

    write_tiny_gguf(path, "llama", edit=shrink)
    with pytest.raises(ModelLoadError, match=r"bent\.gguf.*blk\.0\.attn_v\.weight.*\(8, 64\).*\(32, 64\)"):
        read_gguf(path, progress=False)


def test_dtype_and_progress_bar(tmp_path, capfd):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen3")
    capfd.readouterr()
    model = read_gguf(path, dtype=torch.bfloat16, progress=True)
    assert all(t.dtype == torch.bfloat16 for t in model.tensors.values())
    assert "tiny.gguf" in capfd.readouterr().err
    read_gguf(path, progress=False)
    assert capfd.readouterr().err == ""


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    """llama.cpp writes Llama 3.1 rope scaling as per-frequency divisors."""
    import math

    d, theta, factor, low, high, original = H // HEADS, 10000.0, 8.0, 1.0, 4.0, 8192
    divisors = []
    for i in range(0, d, 2):  # convert_hf_to_gguf's LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi * theta ** (i / d)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    path = tmp_path / "llama31.gguf"
    write_tiny_gguf(path, "llama", edit=lambda t: t.update(
        {"rope_freqs.weight": torch.tensor(divisors, dtype=torch.float32)}))
    model = read_gguf(path, progress=False)
    assert model.hf_config["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert model.config.rope_scaling["rope_type"] == "llama3"
    assert "rope_freqs.weight" not in model.tensors


# ---------------------------------------------------------------------------
# `tandem plan` reads the same files: it refuses what loading refuses and
# counts the bytes loading makes
# ---------------------------------------------------------------------------
@pytest.fixture
def wide(monkeypatch):
    """Rows of 256 and more (K-quant superblocks; V heads of 128 as the 27B's)."""
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "H", 256)
    monkeypatch.setattr(module, "INTER", 512)
    monkeypatch.setitem(LIN, "dk", 32)
    monkeypatch.setitem(LIN, "dv", 128)


def _plan_cli(path: Path, capsys) -> tuple[int, str]:
    from tandem.cli import main

    code = main(["plan", "--model", str(path), "--weights", "native", "--device", "cpu",
                 "--gpu-memory-budget", "24GiB"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("kind", ["Q2_K", "IQ4_NL"])
def test_plan_refuses_a_quant_type_loading_refuses(tmp_path, wide, capsys, kind):
    """An undecodable type fell into the plan's dense branch: it planned (exit
    0) a file every load refuses."""
    from engine.weights.gguf import gguf_plan_inputs

    path = tmp_path / f"{kind}.gguf"
    write_tiny_gguf(path, "llama", types=lambda n: kind if n == "blk.0.ffn_up.weight" else None)
    with pytest.raises(ModelLoadError, match=rf"blk\.0\.ffn_up\.weight.*{kind}") as loading:
        read_gguf(path, progress=False, keep_quantized=True)
    for packed in (True, False):
        with pytest.raises(ModelLoadError) as planning:
            gguf_plan_inputs(path, packed, torch.float32)
        assert str(planning.value) == str(loading.value)
    code, err = _plan_cli(path, capsys)
    assert code == 2 and str(loading.value) in err


@pytest.mark.parametrize("method, key", [
    ("add_ssm_time_step_rank", "qwen35.ssm.time_step_rank"),
    ("add_full_attention_interval", "qwen35.full_attention_interval")])
def test_qwen35_counts_of_zero_are_named(tmp_path, monkeypatch, capsys, method, key):
    """Both divide: 0 was a ZeroDivisionError traceback."""
    from engine.weights.gguf import gguf_plan_inputs

    write = getattr(gguf.GGUFWriter, method)
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, n: write(self, 0))
    path = tmp_path / "zero.gguf"
    write_tiny_gguf(path, "qwen35", layers=4)
    for read in (lambda: read_gguf(path, progress=False),
                 lambda: gguf_plan_inputs(path, True, torch.float32)):
        with pytest.raises(ModelLoadError, match=rf"zero\.gguf.*{re.escape(key)}.*>= 1.*0"):
            read()
    code, err = _plan_cli(path, capsys)
    assert code == 2 and key in err and "Traceback" not in err


def _unique_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_qwen35_k_quant_plan_equals_the_loaded_bytes(tmp_path, wide, kind):
    """Un-tiling the V heads of ssm_out moves blocks of 128 columns, so its
    256-superblocks are narrowed to 128 (twice the d/dmin); the plan counted
    256 (~22 MiB short on the 27B). Planned as the CUDA store loads (bf16
    compute, packed, read on the CPU)."""
    from engine.loader import load_model, plan_inputs

    path = tmp_path / f"q35-{kind}.gguf"
    write_tiny_gguf(path, "qwen35", layers=4, mtp=1, types=lambda n: kind)
    loaded = load_model(str(path), "cpu", dtype=torch.bfloat16, progress=False, weights="native")
    out_proj = loaded.model.model.layers[0].linear_attn.out_proj
    assert out_proj.qd.shape[1] == LIN["nv"] * LIN["dv"] // 128  # narrowed superblocks
    assert plan_inputs(str(path), "native", "cuda").weight_bytes == _unique_bytes(loaded.model)
