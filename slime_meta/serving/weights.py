"""In-place weight updates for the embedded worker (`POST /update_weights_from_disk`).

The trainer writes a new policy with `model.save_pretrained(dir)` and asks each worker to load
it. Tensors are copied into the existing parameters rather than building a new model: no second
copy of the model on the accelerator, no re-allocation, and the generation loop keeps its
references. Reading and validating the files happens before the generation loop is paused, so
the pause lasts only as long as the copies.

Security: the path comes from an HTTP body. With a weights root configured, anything that does
not resolve (symlinks followed) inside that root is refused, so a caller cannot make the worker
read arbitrary files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

SUPPORTED_LOAD_FORMATS = (None, "auto", "safetensors")


class WeightUpdateError(Exception):
    """The update was refused or the checkpoint does not fit the running model."""


def resolve_update_path(model_path: str, weights_root: str | None) -> Path:
    """Real path of the checkpoint directory, refused if it escapes `weights_root`."""
    real_path = os.path.realpath(model_path)
    if weights_root is not None:
        root = os.path.realpath(weights_root)
        if os.path.commonpath([real_path, root]) != root:
            raise WeightUpdateError(
                f"refusing to load weights from {model_path}: it is outside the weights root {root}"
            )
    if not os.path.isdir(real_path):
        raise WeightUpdateError(f"{model_path} is not a directory")
    return Path(real_path)


def _safetensors_files(directory: Path) -> list[Path]:
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no .safetensors files in {directory}")
    return files


def _check_fits(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    targets = model.state_dict(keep_vars=True)
    unexpected = sorted(set(tensors) - set(targets))
    if unexpected:
        raise WeightUpdateError(
            f"{len(unexpected)} tensor(s) in the checkpoint are not in the running model, e.g. {unexpected[:3]}"
        )
    # Tied weights (lm_head = embeddings) are saved once; they are covered if their storage is.
    loaded_storage = {targets[name].data_ptr() for name in tensors}
    missing = sorted(
        name for name, target in targets.items() if name not in tensors and target.data_ptr() not in loaded_storage
    )
    if missing:
        raise WeightUpdateError(f"{len(missing)} tensor(s) of the running model are missing, e.g. {missing[:3]}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise WeightUpdateError(
                f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(targets[name].shape)}"
            )


def _read_through_transformers(directory: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Fallback for architectures whose saved names differ from their module names.

    transformers renames such keys while loading, so let it build a CPU copy and take its tensors.
    """
    from transformers import AutoModelForCausalLM

    donor = AutoModelForCausalLM.from_pretrained(directory, dtype=next(model.parameters()).dtype)
    return dict(donor.state_dict())


def read_checkpoint(directory: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Read a `save_pretrained` directory into CPU tensors named like `model.state_dict()`."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(directory):
        try:
            tensors.update(load_file(path, device="cpu"))
        except Exception as error:
            raise WeightUpdateError(f"cannot read {path}: {error}") from error
    try:
        _check_fits(tensors, model)
        return tensors
    except WeightUpdateError as direct_error:
        try:
            tensors = _read_through_transformers(directory, model)
        except Exception as error:
            raise WeightUpdateError(f"{direct_error} (loading through transformers also failed: {error})") from error
        _check_fits(tensors, model)
        return tensors


def copy_into_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite the model's parameters in place (dtype converted by `copy_`)."""
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
