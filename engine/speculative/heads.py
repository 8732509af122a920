"""MTP head files for models that ship no MTP weights (`tandem train-mtp`).

A head file is a safetensors file holding exactly the `mtp.*` tensors of a
checkpoint, per matrix (q_proj, k_proj, gate_proj, ...; the loader merges
them as it merges any checkpoint; a file under the merged names loads too)
(Qwen3.5's structure: fc, pre_fc_norm_embedding,
pre_fc_norm_hidden, decoder layers of the base model's type, one unless
`train-mtp --head-layers` says more (Qwen3.5's `mtp_num_hidden_layers`),
norm; the lm_head is the base model's), stored in bf16, with metadata naming
the base shape so a head never loads onto a model it was not trained for.
How many layers a head has is read from its tensor names.

Where `--model` finds it (the first that exists):
  * a GGUF file `DIR/NAME.gguf`:   `DIR/NAME.mtp.safetensors`, then the head
    shipped in this package, `engine/heads/<name lowercased>.mtp.safetensors`
    (how the embedded SmolLM2 GGUF, which lives in site-packages, finds its
    head);
  * a Hugging Face directory:      `DIR/mtp.safetensors`.
A model that ships its own mtp.* weights never looks for a file.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError

FORMAT = "tandem-mtp-head-v1"
SHIPPED = Path(__file__).resolve().parent.parent / "heads"


def head_paths(source: str | Path) -> list[Path]:
    """Where a head for a model file or directory may live, in the order
    --model looks (the module docstring)."""
    path = Path(source)
    if path.is_dir():
        from engine.weights.hf import TRAINED_HEAD_FILE
        return [path / TRAINED_HEAD_FILE]
    return [path.with_name(path.stem + ".mtp.safetensors"),
            SHIPPED / f"{path.stem.lower()}.mtp.safetensors"]


def head_path_for(source: str | Path) -> Path | None:
    """The head file that belongs to a model file or directory, or None."""
    return next((c for c in head_paths(source) if c.is_file()), None)


def _signature(config: ModelConfig) -> dict[str, str]:
    return {"format": FORMAT, "arch": config.arch, "vocab_size": str(config.vocab_size),
            "hidden_size": str(config.hidden_size), "num_layers": str(config.num_layers)}


def head_state(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An MTPHead's tensors as a head file holds them: `mtp.`-prefixed, under
    checkpoint names (q_proj, k_proj, gate_proj, ...: the model's merged
    projections cut back into their parts), as Qwen3.5 files carry their head."""
    from engine.weights.merge import merge_groups, unmerged_state

    return unmerged_state({f"mtp.{name}": t for name, t in head.state_dict().items()},
                          merge_groups(head, prefix="mtp."))


def save_head(path: str | Path, config: ModelConfig, tensors: dict[str, torch.Tensor],
              extra: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    meta = {**_signature(config), **(extra or {})}
    out = {name: t.detach().to(torch.bfloat16).contiguous().cpu() for name, t in tensors.items()
           if name.startswith("mtp.")}
    # through a side file and a rename: train-mtp rewrites its head at each
    # new best, and a run killed mid-write must leave the last whole one
    partial = Path(f"{path}.partial")
    save_file(out, str(partial), metadata=meta)
    os.replace(partial, path)


def best_head_writer(path: str | Path, config: ModelConfig, base_model: str):
    """train_head's on_best for `tandem train-mtp --dev-every`: writes each new
    best head to `path` as it is found, marked as a checkpoint; the finished
    run overwrites it with the chosen head and its held-out figures."""
    def write(head: torch.nn.Module, step: int, lengths: dict[str, float]) -> None:
        save_head(path, config, head_state(head),
                  {"base_model": base_model, "dev_chosen_step": str(step), "checkpoint": "yes",
                   **{f"dev_{kind}_loop_length": f"{v:.3f}" for kind, v in lengths.items()}})
    return write


_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")


def head_layer_count(names: Iterable[str]) -> int:
    """Decoder layers of a head, from its tensor names (mtp.layers.{i}.*)."""
    found = {int(m.group(1)) for m in map(_LAYER.match, names) if m}
    if found != set(range(len(found))):
        raise ModelLoadError(f"an MTP head's layers must be numbered 0.., found {sorted(found)}")
    return len(found)


class HeadShape(NamedTuple):
    """What the memory plan needs of a head file, read from its header."""
    layers: int
    parameters: int


def _checked(f, path: Path, config: ModelConfig) -> None:
    meta = f.metadata() or {}
    want = _signature(config)
    wrong = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if wrong:
        raise ModelLoadError(
            f"{path}: this MTP head was not made for this model ({json.dumps(wrong)}: "
            "(head, model)); delete it or retrain with `tandem train-mtp`")


@contextmanager
def _readable(path: Path):
    """Opens a head file; one that safetensors cannot read (empty, cut short
    by a killed run, corrupt) is a ModelLoadError saying what to do, not a
    safetensors traceback. The model loads without it once it is deleted."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ModelLoadError(f"{path}: unreadable MTP head; delete it or retrain it with "
                             "tandem train-mtp") from e


def read_head(path: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors in `dtype`, after checking it was made for this base model."""
    with _readable(path) as f:
        _checked(f, path, config)
        return {name: f.get_tensor(name).to(dtype) for name in f.keys()}


def head_shape(path: Path, config: ModelConfig) -> HeadShape:
    """A head file's layers and parameter count without reading its tensors
    (`tandem plan` loads no weights), after the same check as read_head."""
    with _readable(path) as f:
        _checked(f, path, config)
        names = list(f.keys())
        parameters = sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    return HeadShape(head_layer_count(names), parameters)
