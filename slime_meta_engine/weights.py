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


# ----- same-host transfers: one flat buffer, a table of (name, shape, dtype, offset) ------------
#
# The trainer packs every tensor (in the worker's dtype) into one flat buffer and sends the table
# over HTTP; the worker builds views into the buffer and copies them in place like a disk update.
# Shared memory: a file under SHARED_MEMORY_DIR whose name must start with the buffer prefix the
# worker was launched with (without one, such updates are refused), so an HTTP caller cannot make
# the worker map an arbitrary file. CUDA IPC: a CUDA allocation of the trainer, on the same GPU.

SHARED_MEMORY_DIR = "/dev/shm"
_BUFFER_NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_buffer_prefix(prefix: str | None) -> str:
    """The launch-time prefix, refusing transfers when there is none."""
    if not prefix:
        raise WeightUpdateError(
            "this worker was started without --weight-buffer-prefix: same-host weight transfers are off"
        )
    return prefix


def shared_buffer_path(name: str, prefix: str | None) -> Path:
    """Path of a shared-memory buffer, refused unless its plain file name starts with `prefix`."""
    prefix = check_buffer_prefix(prefix)
    if not isinstance(name, str) or not name.startswith(prefix) or not set(name) <= _BUFFER_NAME_CHARACTERS:
        raise WeightUpdateError(f"refusing shared-memory buffer {name!r}: its name must start with {prefix!r}")
    path = Path(SHARED_MEMORY_DIR) / name
    if path.is_symlink() or not path.is_file():
        raise WeightUpdateError(f"shared-memory buffer {name} does not exist")
    return path


def parse_layout(entries: object, buffer_bytes: int) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """Check the table of (name, shape, dtype, byte offset); every tensor must lie inside the buffer."""
    if not isinstance(entries, list) or not entries:
        raise WeightUpdateError("'tensors' must be a non-empty list of {name, shape, dtype, offset}")
    layout = []
    for entry in entries:
        try:
            name, shape, dtype_name, offset = entry["name"], entry["shape"], entry["dtype"], entry["offset"]
            shape = tuple(int(size) for size in shape)
        except (TypeError, KeyError, ValueError):
            raise WeightUpdateError(f"bad tensor entry {str(entry)[:200]}: needs name, shape, dtype, offset") from None
        dtype = _DTYPES.get(dtype_name)
        if (
            dtype is None
            or not isinstance(name, str)
            or not isinstance(offset, int)
            or offset < 0
            or min(shape, default=1) < 0
        ):
            raise WeightUpdateError(f"bad tensor entry {str(entry)[:200]}: dtype one of {sorted(_DTYPES)}, offset >= 0")
        element_size = torch.empty(0, dtype=dtype).element_size()
        if offset % element_size or offset + element_size * _numel(shape) > buffer_bytes:
            raise WeightUpdateError(f"tensor {name} at byte {offset} does not fit the {buffer_bytes}-byte buffer")
        layout.append((name, shape, dtype, offset))
    return layout


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def views_of(flat_bytes: torch.Tensor, layout, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Tensors of `layout` as views into the flat uint8 buffer, checked against the running model."""
    tensors = {}
    for name, shape, dtype, offset in layout:
        size = torch.empty(0, dtype=dtype).element_size() * _numel(shape)
        tensors[name] = flat_bytes[offset : offset + size].view(dtype).view(shape)
    _check_fits(tensors, model)
    return tensors


def read_shared_memory(
    name: str, entries: object, prefix: str | None, model: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """Map the buffer (private, copy-on-write: the worker never writes to it) and return views."""
    import mmap

    path = shared_buffer_path(name, prefix)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            raise WeightUpdateError(f"shared-memory buffer {name} is empty")
        mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    layout = parse_layout(entries, size)
    return views_of(torch.frombuffer(mapped, dtype=torch.uint8), layout, model)


# A worker opens the trainer's CUDA allocation once and keeps it: the trainer exports one buffer
# for its lifetime, and opening an IPC handle costs milliseconds per update otherwise.
_OPENED_IPC_BUFFERS: dict[str, torch.Tensor] = {}


def read_cuda_ipc(
    descriptor: object, entries: object, prefix: str | None, model: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """Open the trainer's flat CUDA buffer (same physical GPU) and return views into it."""
    import base64

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    check_buffer_prefix(prefix)
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise WeightUpdateError("CUDA IPC updates need a worker on CUDA; this one runs on the CPU")
    if not isinstance(descriptor, dict):
        raise WeightUpdateError("'ipc_buffer' must be an object")
    if descriptor.get("gpu_uuid") != gpu_uuid(device):
        raise WeightUpdateError(f"the buffer is on GPU {descriptor.get('gpu_uuid')}, this worker on {gpu_uuid(device)}")
    try:
        handle = base64.b64decode(descriptor["handle"])
        key = f"{descriptor['handle']}@{descriptor['storage_offset_bytes']}"
        flat = _OPENED_IPC_BUFFERS.get(key)
        if flat is None:
            event = descriptor["event_handle"]
            flat = rebuild_cuda_tensor(
                torch.Tensor,
                (int(descriptor["storage_size_bytes"]),),
                (1,),
                0,
                torch.storage.TypedStorage,
                torch.uint8,
                device.index or 0,
                handle,
                int(descriptor["storage_size_bytes"]),
                int(descriptor["storage_offset_bytes"]),
                False,
                base64.b64decode(descriptor["ref_counter_handle"]),
                int(descriptor["ref_counter_offset"]),
                None if event is None else base64.b64decode(event),
                bool(descriptor["event_sync_required"]),
            )
            _OPENED_IPC_BUFFERS.clear()  # a new buffer replaces the old one
            _OPENED_IPC_BUFFERS[key] = flat
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise WeightUpdateError(f"cannot open the CUDA IPC buffer: {error}") from None
    return views_of(flat, parse_layout(entries, flat.numel()), model)


def gpu_uuid(device: torch.device) -> str | None:
    """The physical GPU's id (the same across processes whatever CUDA_VISIBLE_DEVICES says)."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def remove_buffers(prefix: str) -> list[str]:
    """Delete the shared-memory buffers whose names start with `prefix`; returns their names."""
    removed = []
    if not prefix or not set(prefix) <= _BUFFER_NAME_CHARACTERS:
        return removed
    for path in Path(SHARED_MEMORY_DIR).glob(prefix + "*"):
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed


def release_cuda_ipc_buffers() -> None:
    """Close the trainer's buffer before this worker exits: the trainer's CUDA IPC reference counts
    then reach zero, so it exits without torch's "shared CUDA tensors not released" warning."""
    if _OPENED_IPC_BUFFERS:
        _OPENED_IPC_BUFFERS.clear()
        torch.cuda.synchronize()
