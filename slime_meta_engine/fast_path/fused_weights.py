"""The fast path's fused projections: q/k/v as one weight, gate/up as one, the model's own
parameters made views into them, so one matrix product replaces several and in-place weight
updates reach both."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _fused_rows(owner: torch.nn.Module, attribute: str, modules: Sequence[torch.nn.Linear], name: str):
    """One tensor holding the `name` tensors (weight or bias) of `modules` stacked by rows, each
    module's own tensor made a view into it; None when they have none. Kept on `owner` as a plain
    attribute (not a parameter: the state dict does not change).

    Why views: every weight update copies into the modules' parameters in place (weights.py), so
    it lands in the fused tensor too, and one matrix product replaces several. A second forward
    over the same model finds the views in place and reuses the tensor.
    """
    tensors = [getattr(module, name) for module in modules]
    if any(tensor is None for tensor in tensors):
        return None
    fused = owner.__dict__.get(attribute)
    if fused is not None and _are_consecutive_views(fused, tensors):
        return fused
    with torch.no_grad():
        fused = torch.cat([tensor.detach() for tensor in tensors])
    start = 0
    for module, tensor in zip(modules, tensors):
        rows = tensor.shape[0]
        setattr(module, name, torch.nn.Parameter(fused[start : start + rows], requires_grad=tensor.requires_grad))
        start += rows
    owner.__dict__[attribute] = fused
    return fused


def fuse_linear(owner: torch.nn.Module, attribute: str, modules: Sequence[torch.nn.Linear]) -> None:
    """Put (weight, bias) of `modules` fused on `owner.<attribute>`; left out (each module used on
    its own) when some have a bias and others not."""
    if len({module.bias is None for module in modules}) > 1:
        owner.__dict__.pop(attribute, None)
        return
    weight = _fused_rows(owner, attribute + "_weight", modules, "weight")
    owner.__dict__[attribute] = (weight, _fused_rows(owner, attribute + "_bias", modules, "bias"))


def _are_consecutive_views(fused: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    address = fused.data_ptr()
    for tensor in tensors:
        if tensor.data_ptr() != address or not tensor.is_contiguous():
            return False
        address += tensor.numel() * tensor.element_size()
    return address == fused.data_ptr() + fused.numel() * fused.element_size()
