"""Hugging Face model directories: config.json, *.safetensors (single file or
sharded with an index), and the tokenizer files beside them."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import ModelLoadError

# Multimodal Qwen3.5 checkpoints nest the text model; we serve text only.
_PREFIX_RENAMES = (("model.language_model.", "model."),)
_DROPPED_PREFIXES = ("model.visual.", "visual.")


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: cannot read the model config ({e})") from e


def canonical_name(name: str) -> str | None:
    """The HF text-model name of a checkpoint tensor, or None when it is not ours."""
    if name.startswith(_DROPPED_PREFIXES):
        return None
    for old, new in _PREFIX_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


# the head `tandem train-mtp` writes into a directory whose model has none
# (engine/speculative/heads.py): beside the checkpoint, not a shard of it
TRAINED_HEAD_FILE = "mtp.safetensors"


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(f for f in path.glob("*.safetensors") if f.name != TRAINED_HEAD_FILE)
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files in the model directory")
    return files


def read_safetensors(path: Path, dtype: torch.dtype, progress: bool = True,
                     hf_config: dict | None = None, keep_quantized: bool = False
                     ) -> dict[str, torch.Tensor]:
    """All text-model tensors of a directory: floats converted to `dtype`;
    a GPTQ/AWQ checkpoint's int4 matrices repacked (engine/weights/gptq.py),
    kept packed with keep_quantized, else dequantized."""
    from tqdm import tqdm

    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in tqdm(list(f.keys()), desc=f"loading {file.name}", unit="tensor",
                                disable=not progress, leave=False):
                    name = canonical_name(key)
                    if name is not None:
                        t = f.get_tensor(key)
                        tensors[name] = t.to(dtype) if t.is_floating_point() else t
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(
                f"{file}: cannot read the safetensors file ({e}); it may be truncated or "
                "corrupt: download it again") from e
    quant = (hf_config or {}).get("quantization_config")
    if quant:
        from engine.weights.gptq import repack_checkpoint
        tensors = repack_checkpoint(tensors, quant, dtype, keep_quantized, str(path))
    return tensors
