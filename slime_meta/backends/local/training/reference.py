"""The frozen start weights (KL anchor, replay-DPO reference) without a second resident model on the CPU.

A second float32 copy of the model held for the whole run costs its full size (538 MB for
SmolLM2-135M, 2 GB for a 0.5B model) in a process whose budget is a few GB. The reference is only
read once per step, before the policy's passes (`LocalTrainer` computes the reference log-probs of
every sequence first), so on the CPU its weights are read from the start checkpoint for that
read and dropped after it: exact (the same float32 values the policy started from, not a bf16
rounding of them), and at that moment the policy's gradients do not exist yet, so the peak is no
higher than the step's own. The cost is one read of the checkpoint per step (about 0.5 s for
538 MB from the page cache), against a step of minutes. On a GPU the reference stays resident
(memory is not the constraint there, and the read would be a host-to-device copy per step).

On CUDA a resident reference whose checkpoint holds bf16 (or fp16) weights keeps them in that
dtype (`half_dtype_of`): half the memory of float32 copies (1 GB less at 0.5B), and the same
numbers, because the trainer runs under bf16 autocast there: every matrix product casts its
weights to bf16 anyway (exact for weights that are bf16 already), the norms multiply their
weights into float32 activations, and the embeddings' output is cast to float32 so that the
residual stream stays float32 as in the policy (`upcast_embeddings`).

The streamed weights go into a copy of the policy's module tree whose parameter slots are empty
between uses (`parameterless_copy`): the policy's own modules are never touched, so the weights
that are pushed to the workers or saved can never be the reference's, whatever runs beside the
read. A checkpoint that is not plain safetensors, or whose tensor names do not cover the
policy's parameters, is loaded with transformers instead (same values, one transient copy).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoModelForCausalLM

from slime_meta.backends.local.training.model_call import SPLIT_HEAD_MODEL_TYPES

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(path: Path, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one .safetensors file, read with plain file reads into fresh tensors.

    Not through a memory map: mapped pages of the file would count in the process's resident
    memory beside the copies, doubling the transient size.
    """
    tensors = {}
    with open(path, "rb") as f:
        header_length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_length))
        for name, info in header.items():
            if name == "__metadata__" or (wanted is not None and name not in wanted):
                continue
            start, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=SAFETENSORS_DTYPES[info["dtype"]])
            if end > start:
                f.seek(8 + header_length + start)
                f.readinto(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            tensors[name] = tensor
    return tensors


def safetensors_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        return sorted({checkpoint / name for name in json.loads(index.read_text())["weight_map"].values()})
    single = checkpoint / "model.safetensors"
    return [single] if single.is_file() else []


def start_weights_like(policy: torch.nn.Module, checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every parameter name of `policy` (tied names too) -> the checkpoint's tensor, in that
    parameter's dtype and on its device; tied parameters share one tensor, as in the policy."""
    tied: dict[int, tuple[torch.nn.Parameter, list[str]]] = {}
    for name, parameter in policy.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), (parameter, []))[1].append(name)
    stored: dict[str, torch.Tensor] = {}
    for file in safetensors_files(checkpoint):
        stored.update(read_safetensors(file, {n for _, names in tied.values() for n in names}))
    if not all(any(n in stored for n in names) for _, names in tied.values()):
        # Not plain safetensors under the parameters' names: transformers knows how to read it.
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=next(policy.parameters()).dtype)
        stored = {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}
        del model
    out: dict[str, torch.Tensor] = {}
    for parameter, names in tied.values():
        source = next(stored[n] for n in names if n in stored)
        out.update(dict.fromkeys(names, source.to(dtype=parameter.dtype, device=parameter.device)))
    return out


def parameterless_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`model`'s module tree (config, buffers, hooks) with every parameter an empty meta tensor of
    its shape: no memory, tied parameters still one object."""
    placeholders = {
        id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo=dict(placeholders)).eval()


def assign_parameters(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put `tensors` (full parameter names, tied names included) into `model`'s parameter slots,
    one Parameter per distinct tensor, so tied slots stay tied."""
    made: dict[int, torch.nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, slot in list(module._parameters.items()):
            if slot is None:  # a registered but absent parameter (bias=False)
                continue
            tensor = tensors[f"{module_name}.{name}" if module_name else name]
            module._parameters[name] = made.setdefault(id(tensor), torch.nn.Parameter(tensor, requires_grad=False))


def half_dtype_of(checkpoint: Path) -> torch.dtype | None:
    """bf16 or fp16 when every floating tensor of the checkpoint's safetensors is stored in it."""
    dtypes: set[str] = set()
    for file in safetensors_files(checkpoint):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        dtypes |= {info["dtype"] for name, info in header.items() if name != "__metadata__"}
    floating = dtypes & {"F64", "F32", "F16", "BF16"}
    return SAFETENSORS_DTYPES[floating.pop()] if floating in ({"BF16"}, {"F16"}) else None


def upcast_embeddings(model: torch.nn.Module) -> None:
    """The input embeddings' output in float32, as a float32 policy's is (the residual stream's dtype)."""
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.float())


class StartWeights:
    """The reference model: resident (loaded once), or a parameterless copy of the policy filled
    from the checkpoint for each use (`loaded`) and emptied after it.

    `keep_half`: a resident reference of a bf16/fp16 checkpoint keeps that dtype (only exact under
    autocast: None means on CUDA, where the trainer autocasts, for the Llama family's forward)."""

    def __init__(
        self,
        checkpoint: str,
        policy: torch.nn.Module,
        device: torch.device,
        resident: bool,
        keep_half: bool | None = None,
    ):
        self.checkpoint = Path(checkpoint)
        self.policy = policy  # whose parameters' names, dtypes and device the start weights take
        self.resident = resident
        if resident:
            if keep_half is None:
                llama_family = getattr(policy.config, "model_type", None) in SPLIT_HEAD_MODEL_TYPES
                keep_half = device.type == "cuda" and llama_family
            half = half_dtype_of(self.checkpoint) if keep_half else None
            self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=half or torch.float32).to(device)
            self.model.eval().requires_grad_(False)
            if half is not None:
                upcast_embeddings(self.model)
        else:
            self.model = parameterless_copy(policy)
        self._empty = {name: p for name, p in self.model.named_parameters(remove_duplicate=False)}

    @property
    def resident_model(self) -> torch.nn.Module | None:
        return self.model if self.resident else None

    @contextlib.contextmanager
    def loaded(self) -> Iterator[torch.nn.Module]:
        """The reference model with the start weights in it, for the `with` block."""
        if self.resident:
            yield self.model
            return
        assign_parameters(self.model, start_weights_like(self.policy, self.checkpoint))
        try:
            yield self.model
        finally:
            assign_parameters(self.model, self._empty)
