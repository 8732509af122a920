"""Model configuration: one frozen dataclass for every supported architecture,
built from a Hugging Face config dict (config.json, GGUF metadata mapped to HF
keys, or a named dummy shape) and validated on creation."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from engine.errors import UnsupportedModelError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet

# HF model_type -> our architecture family. Qwen2/3 and Mistral are Llama-shaped.
_ARCH_OF_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model.

    `arch` is "llama" (dense: Llama, Mistral, Qwen2, Qwen3) or "qwen3_5" (the
    hybrid of Gated DeltaNet and gated full attention).
    """

    arch: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    partial_rotary_factor: float = 1.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3 dense and Qwen3.5: per-head RMSNorm on q and k
    attn_output_gate: bool = False  # Qwen3.5: q_proj also emits a sigmoid gate
    zero_centered_norm: bool = False  # Qwen3.5: RMSNorm weights are (1 + w)
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel: int = 4
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    mtp_num_layers: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen3_5"):
            raise UnsupportedModelError(f"unknown architecture family {self.arch!r}")
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                    "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"model config: {len(self.layer_types)} layer_types for "
                             f"{self.num_layers} layers")
        bad = set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if bad:
            raise UnsupportedModelError(f"model config: unknown layer types {sorted(bad)}")
        if LINEAR_ATTENTION in self.layer_types:
            if min(self.linear_num_k_heads, self.linear_num_v_heads,
                   self.linear_k_head_dim, self.linear_v_head_dim) <= 0:
                raise ValueError("model config: linear-attention layers need linear_* head sizes")
            if self.linear_num_v_heads % self.linear_num_k_heads:
                raise ValueError("model config: linear_num_value_heads must be a multiple of "
                                 "linear_num_key_heads")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError("model config: partial_rotary_factor must be in (0, 1]")

    # --- derived shapes -------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def linear_conv_dim(self) -> int:
        """Channels through the GDN causal conv: q, k and v stacked."""
        return (2 * self.linear_num_k_heads * self.linear_k_head_dim
                + self.linear_num_v_heads * self.linear_v_head_dim)

    @property
    def kv_elements_per_token(self) -> int:
        """K plus V elements one token adds across all full-attention layers."""
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim

    @property
    def gdn_state_elements(self) -> int:
        """fp32 recurrent-state elements per sequence across all GDN layers."""
        return (len(self.linear_layers) * self.linear_num_v_heads
                * self.linear_k_head_dim * self.linear_v_head_dim)

    # --- construction ---------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config dict (a multimodal wrapper's
        `text_config` is used when present)."""
        if "text_config" in hf and isinstance(hf["text_config"], dict):
            outer_tie = hf.get("tie_word_embeddings")
            hf = dict(hf["text_config"])
            if outer_tie is not None and "tie_word_embeddings" not in hf:
                hf["tie_word_embeddings"] = outer_tie
        model_type = hf.get("model_type")
        arch = _ARCH_OF_MODEL_TYPE.get(model_type)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {model_type!r} is not supported; tandem runs "
                f"{sorted(_ARCH_OF_MODEL_TYPE)}")
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") not in ("default", None):
            scaling = rope
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind in ("default", None):
                scaling = None
            elif kind != "llama3":
                raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (only llama3)")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        hybrid = arch == "qwen3_5"
        layer_types = hf.get("layer_types")
        if hybrid and not layer_types:
            interval = hf.get("full_attention_interval", 4)
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                           for i in range(hf["num_hidden_layers"])]
        return cls(
            arch=arch,
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            partial_rotary_factor=float(partial if hybrid else hf.get("partial_rotary_factor", 1.0)),
            rope_scaling=scaling,
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_5", "qwen3_5_text"),
            attn_output_gate=hybrid,
            zero_centered_norm=hybrid,
            layer_types=tuple(layer_types or ()),
            linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
            linear_num_k_heads=hf.get("linear_num_key_heads", 0) if hybrid else 0,
            linear_num_v_heads=hf.get("linear_num_value_heads", 0) if hybrid else 0,
            linear_k_head_dim=hf.get("linear_key_head_dim", 0) if hybrid else 0,
            linear_v_head_dim=hf.get("linear_value_head_dim", 0) if hybrid else 0,
            mtp_num_layers=hf.get("mtp_num_hidden_layers", 0) if hybrid else 0,
            extra={k: hf[k] for k in ("bos_token_id", "eos_token_id") if k in hf},
        )


# Named shapes for dummy (random) weights. Tiny ones are for tests and CPU runs.
_TINY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, rope_theta=10000.0),
    "tiny-qwen3": dict(model_type="qwen3", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                       rms_norm_eps=1e-6, rope_theta=1e6),
    "tiny-qwen3.5": dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
                         linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         mtp_num_hidden_layers=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                          "partial_rotary_factor": 0.25}),
}
_FILE_SHAPES = {"qwen3.5-27b": "qwen3.5-27b.json"}


def shape_names() -> list[str]:
    return sorted([*_TINY_SHAPES, *_FILE_SHAPES])


def shape_hf_config(name: str) -> dict[str, Any]:
    """The HF config dict of a named dummy shape."""
    if name in _TINY_SHAPES:
        return dict(_TINY_SHAPES[name])
    if name in _FILE_SHAPES:
        text = resources.files("engine.shapes").joinpath(_FILE_SHAPES[name]).read_text()
        return json.loads(text)
    raise UnsupportedModelError(f"unknown model shape {name!r}; known shapes: {shape_names()}")
