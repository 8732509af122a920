"""Turns a `--model` argument into a ready model: the embedded default, a GGUF
file, a Hugging Face directory, or a named dummy shape.

The model is built on the meta device and its tensors assigned once, so a
checkpoint is never held twice in memory.

Weight formats (`weights`): "auto" keeps a GGUF file's (or GPTQ/AWQ
checkpoint's) low-bit matrices packed on CUDA and dequantizes them on the
CPU (where the dense fp32 matmul is faster than dequantizing every step);
"native" keeps them packed on any device; "bf16" always dequantizes (to the
compute dtype: fp32 on the CPU). For a dummy shape, a recipe name from
engine/quant/recipes.py draws random low-bit weights directly. Packed
matrices live in QuantLinear / QuantEmbedding modules swapped in after the
model is built (engine/quant/linear.py), so engine/model.py never sees them."""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import NamedTuple
from pathlib import Path

import torch

from engine.config import ModelConfig, shape_hf_config, shape_names
from engine.errors import ModelLoadError
from engine.model import CausalLM

EMBEDDED = "embedded"
AUTO, NATIVE = "auto", "native"
FILE_WEIGHTS = (AUTO, NATIVE, "bf16")


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


def weight_choices() -> list[str]:
    from engine.quant.recipes import recipe_names
    return list(dict.fromkeys([*FILE_WEIGHTS, *recipe_names()]))


def check_weights(spec: str | None, weights: str) -> None:
    """ModelLoadError unless `weights` applies to `spec` (a file or a shape)."""
    from engine.quant.recipes import recipe_names

    is_shape = (spec or EMBEDDED) in shape_names()
    if is_shape and weights not in (AUTO, *recipe_names()):
        raise ModelLoadError(f"--weights {weights!r} does not apply to the dummy shape {spec!r}; "
                             f"pick one of {', '.join(recipe_names())}")
    if not is_shape and weights not in FILE_WEIGHTS:
        raise ModelLoadError(f"--weights {weights!r} applies to dummy shapes only; a model file's "
                             f"weights are as stored: use one of {', '.join(FILE_WEIGHTS)}")


def keeps_quantized(weights: str, device: torch.device) -> bool:
    return weights == NATIVE or (weights == AUTO and device.type == "cuda")


def load_model(spec: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, progress: bool = True, seed: int = 0,
               weights: str = AUTO, trained_head: bool = True) -> LoadedModel:
    """trained_head=False ignores a head file from `tandem train-mtp` (the
    trainer itself must see the model as it is, to train a new one)."""
    loaded = _load(spec, torch.device(device), dtype, progress, seed, weights, trained_head)
    if loaded.device.type == "cuda":  # (imports triton)
        from engine.dense_gemv import adopt_dense_gemv
        from engine.quant.linear import adopt_read_ahead
        adopt_dense_gemv(loaded.model, loaded.device)
        adopt_read_ahead(loaded.model)
    return loaded


def _load(spec: str | None, device: torch.device, dtype: torch.dtype | None, progress: bool,
          seed: int, weights: str, trained_head: bool) -> LoadedModel:
    dtype = dtype or default_dtype(device)
    spec = spec or EMBEDDED
    check_weights(spec, weights)
    packed = keeps_quantized(weights, device)
    if spec == EMBEDDED:
        from engine.weights.gguf import embedded_model_path
        return _load_gguf(embedded_model_path(), device, dtype, progress, packed, trained_head)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" or path.is_file():
        return _load_gguf(path, device, dtype, progress, packed, trained_head)
    if path.is_dir():
        return _load_hf_dir(path, device, dtype, progress, packed, trained_head)
    if spec in shape_names():
        return _load_dummy(spec, device, dtype, seed, "bf16" if weights == AUTO else weights)
    raise ModelLoadError(
        f"--model {spec!r} is neither a GGUF file, a Hugging Face directory (with "
        f"config.json) nor a known shape; shapes: {shape_names()}; or omit --model for "
        "the embedded default")


def _load_gguf(path: Path, device, dtype, progress, packed: bool = False,
               trained_head: bool = True) -> LoadedModel:
    from engine.weights.gguf import read_gguf

    _log(f"loading {path}")
    gguf = read_gguf(path, dtype=dtype, progress=progress, keep_quantized=packed)
    config = ModelConfig.from_hf(gguf.hf_config)
    if trained_head:
        config = _with_trained_head(config, gguf.tensors, path, dtype)
    model = build_model(config, gguf.tensors, device, dtype, source=str(path))
    return LoadedModel(config, model, gguf.tokenizer, str(path), device, dtype)


def _load_hf_dir(path: Path, device, dtype, progress, packed: bool = False,
                 trained_head: bool = True) -> LoadedModel:
    from engine.tokenizer import Tokenizer
    from engine.weights.hf import hf_model_config, read_hf_config, read_safetensors

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a model directory (no config.json)")
    _log(f"loading {path}")
    hf_config = read_hf_config(path)
    config = hf_model_config(hf_config, path)
    tensors = read_safetensors(path, dtype, progress, hf_config, keep_quantized=packed)
    if trained_head:
        config = _with_trained_head(config, tensors, path, dtype)
    model = build_model(config, tensors, device, dtype, source=str(path))
    return LoadedModel(config, model, Tokenizer.from_hf_dir(path), str(path), device, dtype)


def _load_dummy(name: str, device, dtype, seed: int, recipe: str = "bf16") -> LoadedModel:
    from engine.quant.recipes import randomize_quantized, swap_in_meta
    from engine.tokenizer import ByteTokenizer
    from engine.weights.dummy import randomize

    config = ModelConfig.from_hf(shape_hf_config(name))
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)
    # packed modules are swapped in while still on meta: no dense copy is ever made
    formats = swap_in_meta(model, recipe, dtype)
    model = model.to_empty(device=device)
    randomize(model, seed)
    randomize_quantized(model, formats, seed)
    model.eval()
    return LoadedModel(config, model, ByteTokenizer(config.vocab_size), f"dummy:{name}", device, dtype)


def _with_trained_head(config: ModelConfig, tensors: dict, source: Path,
                       dtype: torch.dtype) -> ModelConfig:
    """A model without MTP weights picks up a head trained by `tandem train-mtp`
    (engine/speculative/heads.py says where it looks); its tensors join `tensors`."""
    from engine.speculative.heads import head_layer_count, head_path_for, read_head

    if config.mtp_num_layers or any(n.startswith("mtp.") for n in tensors):
        return config
    head = head_path_for(source)
    if head is None:
        return config
    _log(f"using the MTP head {head}")
    head_tensors = read_head(head, config, dtype)
    tensors.update(head_tensors)
    return replace(config, mtp_num_layers=head_layer_count(head_tensors))


def build_model(config: ModelConfig, tensors: dict[str, torch.Tensor], device, dtype,
                source: str, host_prefixes: tuple[str, ...] = ()) -> CausalLM:
    """A CausalLM whose parameters are exactly `tensors` (checked by name and
    shape). A checkpoint's per-matrix tensors (q_proj, k_proj, ...) are first
    joined into the model's merged projections (engine/weights/merge.py; this
    consumes them from `tensors`, so the caller's dict ends up holding the
    merged ones); tensors already merged pass through. Packed entries
    (`{module}.qweight`, ...) put a quantized module in place of that
    nn.Linear / nn.Embedding; they keep their dtypes; a merged projection
    whose parts' formats differ becomes a SplitLinear of its `parts.{j}`.
    Tensors under `host_prefixes` stay where they are (host memory: the
    token table, see CausalLM.embeds_on_host); everything else moves to
    `device`."""
    from engine.weights.merge import merge_checkpoint, merge_groups

    def place(name: str) -> torch.device | str:
        return "cpu" if host_prefixes and name.startswith(host_prefixes) else device

    if config.mtp_num_layers and not any(n.startswith("mtp.") for n in tensors):
        _log(f"{source}: no mtp.* tensors; the model runs without its MTP head")
        config = replace(config, mtp_num_layers=0)
    with torch.device("meta"):
        model = CausalLM(config)
    groups = merge_groups(model)
    merge_checkpoint(tensors, groups, dtype, source)
    _swap_split(model, groups, tensors, source)
    tensors, packed_names = _swap_packed(model, tensors, place, dtype, source)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    check_tensors(expected, tensors, source)
    state = {name: tensors[name].to(device=place(name)) if name in packed_names
             else tensors[name].to(device=place(name), dtype=dtype) for name in expected}
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    return model


def _swap_split(model: CausalLM, groups, tensors: dict[str, torch.Tensor], source: str) -> None:
    """A SplitLinear (meta parts) wherever `tensors` keep a merged projection
    as `parts.{j}`."""
    from engine.quant.linear import split_in
    from engine.weights.merge import split_rows

    for group in groups:
        rows = split_rows(tensors, group.name)
        if rows:
            try:
                split_in(model, group.name, rows)
            except ValueError as e:
                raise ModelLoadError(f"{source}: {e}") from e


def _swap_packed(model: CausalLM, tensors: dict[str, torch.Tensor], place, dtype, source: str
                 ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Swap quantized modules in for the packed entries of `tensors`. A packed
    matrix whose module cannot hold one is dequantized into `.weight`."""
    from engine.quant.linear import quantizable_modules, swap_in
    from engine.quant.tensor import QuantTensor, quant_prefixes

    prefixes = quant_prefixes(tensors)
    if not prefixes:
        return tensors, set()
    tensors = dict(tensors)
    holders = quantizable_modules(model)
    swap, names = {}, set()
    for prefix in prefixes:
        try:
            qt = QuantTensor.from_state(tensors, prefix)
        except ValueError as e:
            raise ModelLoadError(f"{source}: packed weight {prefix!r} is malformed ({e})") from e
        for suffix in qt.tensors():
            name = f"{prefix}.{suffix}"
            tensors[name] = tensors[name].to(place(name))
            names.add(name)
        if prefix in holders:
            swap[prefix] = QuantTensor.from_state(tensors, prefix)
        else:
            for name in [n for n in names if n.startswith(prefix + ".")]:
                del tensors[name]
                names.discard(name)
            tensors[f"{prefix}.weight"] = qt.dequantize(dtype)
    try:
        swap_in(model, swap, dtype)
    except ValueError as e:
        raise ModelLoadError(f"{source}: {e}") from e
    return tensors, names


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


class PlanInputs(NamedTuple):
    """What the capacity plan needs of a model before loading it."""
    config: ModelConfig
    weight_bytes: int  # every parameter as it will be held
    label: str  # how weight_bytes was counted
    embedding_bytes: int  # the token table among them (it may live in host memory)
    packed_in_features: int = 0  # the longest row of a matrix held packed (0: none is)


def plan_inputs(spec: str | None, weights: str, device: torch.device | str) -> PlanInputs:
    """The plan's inputs without reading any weight: shapes and HF directories
    from their config, GGUF files from their metadata and tensor table."""
    from kvstore.plan import weight_counts

    device = torch.device(device)
    dtype = default_dtype(device)
    spec = spec or EMBEDDED
    check_weights(spec, weights)

    def counted(config: ModelConfig, recipe, label: str) -> PlanInputs:
        (total, table), widest = weight_counts(config, dtype, recipe, ("", "model.embed_tokens."))
        return PlanInputs(config, total, label, table, widest)

    if spec in shape_names():
        recipe = "bf16" if weights == AUTO else weights
        return counted(ModelConfig.from_hf(shape_hf_config(spec)), recipe, recipe)
    packed = keeps_quantized(weights, device)
    label = "as stored (packed)" if packed else f"dequantized to {str(dtype).removeprefix('torch.')}"
    path = Path(spec).expanduser()
    if spec == EMBEDDED:
        from engine.weights.gguf import embedded_model_path
        path = embedded_model_path()
    if path.is_dir():
        from engine.weights.hf import hf_model_config, read_hf_config
        hf = read_hf_config(path)
        config = hf_model_config(hf, path)
        formats = _checkpoint_formats(path, hf, packed)
        return _planned_with_head(counted(config, formats, label), path, dtype)
    from engine.weights.gguf import gguf_plan_inputs
    hf, nbytes, embedding, widest = gguf_plan_inputs(path, packed, dtype)
    return _planned_with_head(PlanInputs(ModelConfig.from_hf(hf), nbytes, label, embedding,
                                         widest), path, dtype)


def _checkpoint_formats(path: Path, hf: dict, packed: bool):
    """How the plan counts a Hugging Face checkpoint's matrices: "bf16" (dense
    in the compute dtype), or for a GPTQ/AWQ checkpoint loaded packed, each
    matrix's own layout as loading makes it (its group, which may be -1 or
    32, and its scales' dtype; from the safetensors headers). A GPTQ/AWQ
    checkpoint is checked as loading checks it either way, so the plan
    refuses what loading refuses, with the same message."""
    quant = hf.get("quantization_config")
    if not quant:  # as read_safetensors tells a quantized checkpoint
        return "bf16"
    from engine.weights.hf import quantized_matrices

    matrices = quantized_matrices(path, quant)
    if not packed:
        return "bf16"
    formats = {name: m.quant_format for name, m in matrices.items()}
    return lambda name, module, layers: formats.get(name)


def _planned_with_head(inputs: PlanInputs, source: Path, dtype: torch.dtype) -> PlanInputs:
    """The plan of a model that ships no MTP head but has a trained one beside
    it (as load_model picks it up): its layers join the config, so that
    `--speculative mtp` plans their KV, and its weights the weight bytes."""
    from engine.speculative.heads import head_path_for, head_shape

    config = inputs.config
    head = None if config.mtp_num_layers else head_path_for(source)
    if head is None:
        return inputs
    shape = head_shape(head, config)
    return inputs._replace(config=replace(config, mtp_num_layers=shape.layers),
                           weight_bytes=inputs.weight_bytes + shape.parameters * dtype.itemsize)


def peek_config(spec: str | None) -> ModelConfig | None:
    """The config of `spec` without reading any weights, where that is cheap: a
    named shape or a Hugging Face directory. None for a GGUF file (its config
    comes from the same parse as its tensors): load it to know."""
    spec = spec or EMBEDDED
    if spec in shape_names():
        return ModelConfig.from_hf(shape_hf_config(spec))
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        from engine.weights.hf import hf_model_config, read_hf_config
        return hf_model_config(read_hf_config(path), path)
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
