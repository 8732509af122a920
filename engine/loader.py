"""Turns a `--model` argument into a ready model: the embedded default, a GGUF
file, a Hugging Face directory, or a named dummy shape.

The model is built on the meta device and its tensors assigned once, so a
checkpoint is never held twice in memory."""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import ModelConfig, shape_hf_config, shape_names
from engine.errors import ModelLoadError
from engine.model import CausalLM

EMBEDDED = "embedded"


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: object  # engine.tokenizer.Tokenizer or ByteTokenizer
    source: str
    device: torch.device
    dtype: torch.dtype


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs; fp32 on the CPU, where bf16 matmuls are slow and we check
    logits against transformers."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(spec: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, progress: bool = True, seed: int = 0) -> LoadedModel:
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    spec = spec or EMBEDDED
    if spec == EMBEDDED:
        from engine.weights.gguf import embedded_model_path
        return _load_gguf(embedded_model_path(), device, dtype, progress)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" or path.is_file():
        return _load_gguf(path, device, dtype, progress)
    if path.is_dir():
        return _load_hf_dir(path, device, dtype, progress)
    if spec in shape_names():
        return _load_dummy(spec, device, dtype, seed)
    raise ModelLoadError(
        f"--model {spec!r} is neither a GGUF file, a Hugging Face directory (with "
        f"config.json) nor a known shape; shapes: {shape_names()}; or omit --model for "
        "the embedded default")


def _load_gguf(path: Path, device, dtype, progress) -> LoadedModel:
    from engine.weights.gguf import read_gguf

    _log(f"loading {path}")
    gguf = read_gguf(path, dtype=dtype, progress=progress)
    config = ModelConfig.from_hf(gguf.hf_config)
    config = _with_trained_head(config, gguf.tensors, path, dtype)
    model = build_model(config, gguf.tensors, device, dtype, source=str(path))
    return LoadedModel(config, model, gguf.tokenizer, str(path), device, dtype)


def _load_hf_dir(path: Path, device, dtype, progress) -> LoadedModel:
    from engine.tokenizer import Tokenizer
    from engine.weights.hf import read_hf_config, read_safetensors

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a model directory (no config.json)")
    _log(f"loading {path}")
    config = ModelConfig.from_hf(read_hf_config(path))
    tensors = read_safetensors(path, dtype, progress)
    config = _with_trained_head(config, tensors, path, dtype)
    model = build_model(config, tensors, device, dtype, source=str(path))
    return LoadedModel(config, model, Tokenizer.from_hf_dir(path), str(path), device, dtype)


def _load_dummy(name: str, device, dtype, seed: int) -> LoadedModel:
    from engine.tokenizer import ByteTokenizer
    from engine.weights.dummy import randomize

    config = ModelConfig.from_hf(shape_hf_config(name))
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    randomize(model, seed)
    model.eval()
    return LoadedModel(config, model, ByteTokenizer(config.vocab_size), f"dummy:{name}", device, dtype)


def _with_trained_head(config: ModelConfig, tensors: dict, source: Path,
                       dtype: torch.dtype) -> ModelConfig:
    """A model without MTP weights picks up a head trained by `tandem train-mtp`
    (engine/speculative/heads.py says where it looks); its tensors join `tensors`."""
    from engine.speculative.heads import head_path_for, read_head

    if config.mtp_num_layers or any(n.startswith("mtp.") for n in tensors):
        return config
    head = head_path_for(source)
    if head is None:
        return config
    _log(f"using the MTP head {head}")
    tensors.update(read_head(head, config, dtype))
    return replace(config, mtp_num_layers=1)


def build_model(config: ModelConfig, tensors: dict[str, torch.Tensor], device, dtype,
                source: str) -> CausalLM:
    """A CausalLM whose parameters are exactly `tensors` (checked by name and shape)."""
    if config.mtp_num_layers and not any(n.startswith("mtp.") for n in tensors):
        _log(f"{source}: no mtp.* tensors; the model runs without its MTP head")
        config = replace(config, mtp_num_layers=0)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    check_tensors(expected, tensors, source)
    state = {name: tensors[name].to(device=device, dtype=dtype) for name in expected}
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    return model


def check_tensors(expected: dict[str, tuple[int, ...]], found: dict[str, torch.Tensor],
                  source: str) -> None:
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"{source}: tensor {missing[0]!r} is missing{more}; the file does not match "
            "its own config: re-download or re-convert it")
    for name, shape in expected.items():
        if tuple(found[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(found[name].shape)}, but the "
                f"config implies {shape}; the weights and config.json do not belong together")
    extra = sorted(set(found) - set(expected))
    if extra:
        _log(f"{source}: ignoring {len(extra)} tensors tandem does not use (e.g. {extra[0]})")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def peek_config(spec: str | None) -> ModelConfig | None:
    """The config of `spec` without reading any weights, where that is cheap: a
    named shape or a Hugging Face directory. None for a GGUF file (its config
    comes from the same parse as its tensors): load it to know."""
    spec = spec or EMBEDDED
    if spec in shape_names():
        return ModelConfig.from_hf(shape_hf_config(spec))
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        from engine.weights.hf import read_hf_config
        return ModelConfig.from_hf(read_hf_config(path))
    return None


def load_tokenizer(spec: str | None):
    """Just the tokenizer of `spec` (the router needs no weights): from GGUF
    metadata, an HF directory's tokenizer files, or a byte tokenizer for shapes."""
    from engine.tokenizer import ByteTokenizer, Tokenizer

    spec = spec or EMBEDDED
    spec = spec.removeprefix("dummy:")  # LoadedModel.source of a shape
    if spec in shape_names():
        return ByteTokenizer(ModelConfig.from_hf(shape_hf_config(spec)).vocab_size)
    if spec == EMBEDDED:
        from engine.weights.gguf import embedded_model_path
        spec = str(embedded_model_path())
    path = Path(spec).expanduser()
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    from engine.weights.gguf import open_gguf
    return Tokenizer.from_gguf(open_gguf(path))
