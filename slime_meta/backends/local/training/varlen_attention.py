"""Attention for rows that share a prompt prefix (`packing.py`), as variable-length flash attention on CUDA.

A shared row's mask is block-structured: the prefix is causal, and each branch sees the prefix
and itself, causally. As a dense `[T, T]` mask it runs on SDPA's memory-efficient kernel, which
reads the whole mask and skips nothing: measured on an H200 at the 0.5B shape, rows of 15k
tokens with 2k-token branches took 14.4 s a step against 6.0 s with one row per sample, nearly
all of it in attention (benchmarks/shared_prompts.py). Here each run of columns is a sequence of
its own for flash attention's variable-length kernel: the prefix as a causal sequence; each
branch's queries against the prefix's keys followed by the branch's own, causal with the
diagonal at the bottom right (a query sees every key up to its own position); the padding as
its own sequence. The keys of each branch are gathered from the row (a copy of the prefix's
keys and values per branch; their gradients add back in the gather's backward). Exactly the
dense mask's attention, in FLOPs that are the sum of the sequences' own. In the loop at the 0.5B
shape (one H200) the train part of a step fell from 6.0 s (one row per sequence) to 2.35 s.

The layout reaches the attention through the model's keyword arguments (transformers passes
them from the decoder's call to every attention call, and activation checkpointing keeps them for
the recompute): `shared_prefix_layout=`. The attention implementation is registered with
transformers under `ATTENTION_NAME`; without a layout it is SDPA, unchanged. The call carries
`no_mask()` as its attention mask: transformers takes a 4D mask as already prepared, so it builds
no dense `[B, 1, T, T]` mask for a kernel that ignores it (about 268 MB per 16k-token micro-batch)
and does not search the position ids for packed sequences (a host sync).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from slime_meta.backends.local.training.packing import PADDING

ATTENTION_NAME = "slime_meta_shared_prefix"


def varlen_kernel():
    """torch's variable-length flash attention, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@dataclass
class VarlenLayout:
    """Sequences over the flattened `[B * T]` columns: each query run, and the columns it attends to."""

    key_index: torch.Tensor  # [K] columns gathered into the keys, sequence after sequence
    cu_seq_q: torch.Tensor  # [S + 1] int32
    cu_seq_k: torch.Tensor  # [S + 1] int32
    max_q: int
    max_k: int

    def to(self, device: torch.device) -> "VarlenLayout":
        return VarlenLayout(
            self.key_index.to(device), self.cu_seq_q.to(device), self.cu_seq_k.to(device), self.max_q, self.max_k
        )


def _offsets(lengths: list[int]) -> torch.Tensor:
    """Each sequence's start in the packed tokens, and the total last (the varlen kernels' cu_seqlens)."""
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def varlen_layout(branch_B_T: torch.Tensor) -> VarlenLayout:
    """The sequences of a packed batch's branch layout (host tensor): per row, the leading run of
    0s (the prefix, or the whole sequence), each branch, the padding."""
    width = branch_B_T.shape[1]
    key_index: list[int] = []
    q_lengths: list[int] = []
    k_lengths: list[int] = []
    for r, row in enumerate(branch_B_T.tolist()):
        runs: list[tuple[int, int, int]] = []  # (branch, first column, end column)
        for column, value in enumerate(row):
            if runs and runs[-1][0] == value:
                runs[-1] = (value, runs[-1][1], column + 1)
            else:
                runs.append((value, column, column + 1))
        prefix = range(0)
        for value, first, end in runs:
            own = range(r * width + first, r * width + end)
            keys = list(own) if value == 0 or value == PADDING else [*prefix, *own]
            if value == 0:
                prefix = own
            key_index.extend(keys)
            q_lengths.append(end - first)
            k_lengths.append(len(keys))
    return VarlenLayout(
        torch.tensor(key_index, dtype=torch.long),
        _offsets(q_lengths),
        _offsets(k_lengths),
        max(q_lengths),
        max(k_lengths),
    )


def no_mask(device: torch.device) -> torch.Tensor:
    """The attention mask of a call with a layout: an empty 4D tensor, which transformers returns as
    an already prepared mask (no mask built) and `shared_prefix_attention` ignores."""
    return torch.empty((0, 0, 0, 0), dtype=torch.bool, device=device)


def _keywords(kernel, scaling: float | None, head_dim: int) -> dict:
    """Causal with the diagonal at the bottom right, and the score scale, in this torch's spelling."""
    parameters = inspect.signature(kernel).parameters
    out = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
    if "scale" in parameters:
        out["scale"] = scaling
    elif scaling is not None and abs(scaling - head_dim**-0.5) > 1e-12:
        raise ValueError(f"this torch's varlen attention has no scale argument; the model's is {scaling}")
    return out


def shared_prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention call: `query` `[B, H, T, D]`, `key`/`value` `[B, KV, T, D]`; returns
    `([B, T, H, D], None)`. SDPA unless the call carries a `shared_prefix_layout` (its
    `attention_mask` is then `no_mask()`, unused)."""
    layout: VarlenLayout | None = kwargs.pop("shared_prefix_layout", None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return _varlen_attention(query, key, value, layout, scaling), None


@torch.compiler.disable  # a graph break in a compiled layer: the layout's lengths are plain ints, not traced
def _varlen_attention(query, key, value, layout: VarlenLayout, scaling: float | None) -> torch.Tensor:
    kernel = varlen_kernel()
    batch, heads, width, head_dim = query.shape
    kv_heads = key.shape[1]
    q_N_H_D = query.transpose(1, 2).reshape(batch * width, heads, head_dim)
    k_K_H_D = key.transpose(1, 2).reshape(batch * width, kv_heads, head_dim).index_select(0, layout.key_index)
    v_K_H_D = value.transpose(1, 2).reshape(batch * width, kv_heads, head_dim).index_select(0, layout.key_index)
    if kv_heads != heads:  # grouped-query attention: each key head serves heads / kv_heads query heads
        k_K_H_D = k_K_H_D.repeat_interleave(heads // kv_heads, dim=1)
        v_K_H_D = v_K_H_D.repeat_interleave(heads // kv_heads, dim=1)
    # SDPA casts to autocast's dtype itself; this kernel is not on autocast's list (and takes half types only).
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    q_N_H_D, k_K_H_D, v_K_H_D = (x.to(dtype) for x in (q_N_H_D, k_K_H_D, v_K_H_D))
    out_N_H_D = kernel(
        q_N_H_D,
        k_K_H_D,
        v_K_H_D,
        layout.cu_seq_q,
        layout.cu_seq_k,
        layout.max_q,
        layout.max_k,
        **_keywords(kernel, scaling, head_dim),
    )
    return out_N_H_D.reshape(batch, width, heads, head_dim)


def install(model: torch.nn.Module) -> bool:
    """Make `model` (an SDPA model) call `shared_prefix_attention`; False where it cannot."""
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", ATTENTION_NAME):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # the padded rows' masks as SDPA's
    model.config._attn_implementation = ATTENTION_NAME
    return True
