"""Hugging Face model directories: config.json, *.safetensors (single file or
sharded with an index), and the tokenizer files beside them."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError, UnsupportedModelError

# Multimodal Qwen3.5 checkpoints nest the text model; we serve text only.
_PREFIX_RENAMES = (("model.language_model.", "model."),)
_DROPPED_PREFIXES = ("model.visual.", "visual.")


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_config(path: Path) -> dict:
    file = path / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file}: cannot read the model config ({e})") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file}: the model config must be a JSON object, got "
                             f"{type(config).__name__}")
    return config


# Sizes ModelConfig.from_hf builds the model from (and divides by): each must
# be an integer >= its minimum. Keys absent here get from_hf's defaults;
# head_dim and num_key_value_heads may also be null (derived, as transformers
# reads them); max_position_embeddings may be absent but not null.
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
_DERIVED_WHEN_NULL = ("head_dim", "num_key_value_heads")
_OPTIONAL_SIZES = ("max_position_embeddings", "linear_conv_kernel_dim", "linear_key_head_dim",
                   "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")
_OPTIONAL_COUNTS = ("mtp_num_hidden_layers",)  # may be 0


def hf_model_config(hf: dict, path: Path) -> ModelConfig:
    """The ModelConfig of a directory's config.json, or a ModelLoadError naming
    the file and the key at fault (from_hf alone gives KeyError, TypeError
    and ZeroDivisionError tracebacks on a bad config)."""
    file = path / "config.json"
    _check_sizes(hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf, file)
    try:
        return ModelConfig.from_hf(hf)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{file}: {e}") from e
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{file}: the config does not describe a valid model ({e})") from e


def _check_sizes(text: dict, file: Path) -> None:
    def check(key: str, minimum: int = 1) -> None:
        value = text[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ModelLoadError(f"{file}: {key} must be an integer >= {minimum}, got {value!r}")

    for key in _REQUIRED_SIZES:
        if key not in text:
            raise ModelLoadError(f"{file}: {key} is missing; the config does not describe a model")
        check(key)
    for key in _DERIVED_WHEN_NULL:
        if text.get(key) is not None:
            check(key)
    for key in _OPTIONAL_SIZES:
        if key in text:
            check(key)
    for key in _OPTIONAL_COUNTS:
        if text.get(key) is not None:
            check(key, 0)
    # the layer pattern of a hybrid config without layer_types: layer i is
    # full attention when (i + 1) % interval == 0
    if not text.get("layer_types") and "full_attention_interval" in text:
        check("full_attention_interval")


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


SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names when it has one
    (a directory may also hold other copies of the weights, such as
    Mistral's consolidated.safetensors, which would double host memory and
    let file order decide which copy wins), else every *.safetensors but a
    trained MTP head."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        return _indexed_files(path, index)
    files = sorted(f for f in path.glob("*.safetensors") if f.name != TRAINED_HEAD_FILE)
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files in the model directory")
    return files


def _indexed_files(path: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{index}: not a safetensors index ({e!r}); download it again or "
                             "remove it") from e
    files = [path / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise ModelLoadError(f"{index} names weight files that are not there: "
                             f"{', '.join(missing) or '(none listed)'}: download them")
    return files


def _checked_once(name: str, file: Path, seen: dict[str, Path]) -> None:
    """A tensor may come from one file only: two copies would leave the load
    to whichever file sorts last."""
    first = seen.setdefault(name, file)
    if first != file:
        raise ModelLoadError(f"{file.parent}: tensor {name} is in both {first.name} and "
                             f"{file.name}: keep one copy of the weights (or add "
                             f"{SAFETENSORS_INDEX} naming the files to read)")


def read_safetensors(path: Path, dtype: torch.dtype, progress: bool = True,
                     hf_config: dict | None = None, keep_quantized: bool = False
                     ) -> dict[str, torch.Tensor]:
    """All text-model tensors of a directory: floats converted to `dtype`;
    a GPTQ/AWQ checkpoint's int4 matrices repacked (engine/weights/gptq.py),
    kept packed with keep_quantized, else dequantized."""
    from tqdm import tqdm

    quant = (hf_config or {}).get("quantization_config")
    if quant:  # refuse an unsupported scheme before reading gigabytes
        from engine.weights.gptq import quant_scheme
        quant_scheme(quant, str(path))
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[str, Path] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in tqdm(list(f.keys()), desc=f"loading {file.name}", unit="tensor",
                                disable=not progress, leave=False):
                    name = canonical_name(key)
                    if name is not None:
                        _checked_once(name, file, seen)
                        t = f.get_tensor(key)
                        keep = not t.is_floating_point() or (quant and _is_quant_scale(name))
                        tensors[name] = t if keep else t.to(dtype)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise _unreadable(file, e) from e
    if quant:
        from engine.weights.gptq import repack_checkpoint
        tensors = repack_checkpoint(tensors, quant, dtype, keep_quantized, str(path))
    return tensors


def _is_quant_scale(name: str) -> bool:
    """A GPTQ/AWQ matrix's scales: repacked as stored ("without
    re-quantizing"); cast to a bf16 compute dtype first, fp16 scales would
    lose 3 mantissa bits."""
    return name.endswith(".scales")


def _unreadable(file: Path, e: Exception) -> ModelLoadError:
    return ModelLoadError(f"{file}: cannot read the safetensors file ({e}); it may be truncated "
                          "or corrupt: download it again")


# safetensors' dtype names (its format spec) -> torch
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise RuntimeError(f"tensor dtype {name} is not one tandem reads")
    return _DTYPES[name]


def quantized_matrices(path: Path, quant: dict) -> dict:
    """A GPTQ/AWQ directory's packed matrices (name -> gptq.MatrixLayout) from
    the safetensors headers, checked as loading checks them (the only data
    read is GPTQ's small g_idx): what `tandem plan` needs of the checkpoint."""
    from engine.weights.gptq import plan_matrices, quant_scheme

    quant_scheme(quant, str(path))  # as read_safetensors: before any file
    header: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    where: dict[str, tuple[Path, str]] = {}
    seen: dict[str, Path] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = canonical_name(key)
                    if name is not None:
                        _checked_once(name, file, seen)
                        entry = f.get_slice(key)
                        header[name] = (tuple(entry.get_shape()), _dtype(entry.get_dtype()))
                        where[name] = (file, key)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise _unreadable(file, e) from e

    def read(name: str) -> torch.Tensor:
        file, key = where[name]
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise _unreadable(file, e) from e

    return plan_matrices(header, read, quant, str(path))
