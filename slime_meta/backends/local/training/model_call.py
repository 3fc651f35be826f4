"""The policy (or the reference) as the loss channels call it (`SplitModelCall`): decoder hidden
states, then the output projection on the loss rows only; and the per-layer compile of the CUDA path.
"""

from __future__ import annotations

import torch

from slime_meta.backends.local.training import varlen_attention
from slime_meta.backends.local.training.packing import PackedBatch, shared_prompt_mask
from slime_meta.losses.linear_head import linear_token_logps
from slime_meta.losses.token_stats import TokenLogpsOutput, token_logps

# Causal LMs whose forward is `lm_head(decoder(...).last_hidden_state)` with nothing in between.
SPLIT_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class SplitModelCall:
    """One HF causal LM called as decoder, then output projection on chosen rows.

    Under bf16 autocast on CUDA. When the model cannot be split, `hidden_states` returns the full
    logits and `logits` is the identity, so the channels work unchanged.
    """

    def __init__(self, model: torch.nn.Module, autocast: bool, split_head: bool, share_prompts: bool = True):
        self.model = model
        self.autocast = autocast
        self.split = split_head and getattr(model.config, "model_type", None) in SPLIT_HEAD_MODEL_TYPES
        # A row of one prompt and several responses needs a mask that is neither causal nor padding;
        # SDPA takes any boolean mask (eager attention adds its mask, flash attention takes none).
        implementation = getattr(model.config, "_attn_implementation", None)
        self.shares_prompts = (
            share_prompts and implementation in ("sdpa", varlen_attention.ATTENTION_NAME) and full_causal(model.config)
        )
        # On CUDA, shared rows run as variable-length flash attention instead of a dense mask.
        on_cuda = next(model.parameters()).is_cuda
        self.varlen = self.shares_prompts and on_cuda and varlen_attention.varlen_kernel() is not None
        self.varlen = self.varlen and varlen_attention.install(model)
        self.decoder = getattr(model, model.base_model_prefix) if self.split else None
        self.head = model.get_output_embeddings() if self.split else None

    def _autocast(self):
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.autocast)

    def hidden_states(self, tokens_B_T: torch.Tensor, attention_B_T: torch.Tensor) -> torch.Tensor:
        """`[B, T, H]` inputs of the output projection (or `[B, T, V]` logits, with `logits` the identity)."""
        # No KV cache: training never reads it, building it copies every layer's keys and values,
        # and its per-layer state would make a compiled layer recompile once per layer.
        with self._autocast():
            if self.split:
                # Right-padded rows (as the micro-batches are built) need no padding mask: under causal
                # attention a real token sees only earlier positions, all real, and the padding rows'
                # outputs are never read. Without one, attention runs its fused causal kernel and no
                # (B, 1, T, T) mask is built. Position ids count from 0 either way.
                mask_B_T = None if is_right_padded(attention_B_T) else attention_B_T
                out = self.decoder(input_ids=tokens_B_T, attention_mask=mask_B_T, use_cache=False)
                return out.last_hidden_state
            return self.model(input_ids=tokens_B_T, attention_mask=attention_B_T, use_cache=False).logits

    def packed_hidden_states(self, batch: PackedBatch) -> torch.Tensor:
        """`hidden_states` of a `packing.PackedBatch`, whose rows may hold several responses after one prompt."""
        if not batch.shares_prompts:
            return self.hidden_states(batch.tokens_B_T, batch.attention_B_T)
        model = self.decoder if self.split else self.model
        if self.varlen:
            host = batch.host_branch_B_T if batch.host_branch_B_T is not None else batch.branch_B_T
            layout = varlen_attention.varlen_layout(host.cpu()).to(batch.tokens_B_T.device)
            with self._autocast():
                out = model(
                    input_ids=batch.tokens_B_T,
                    attention_mask=varlen_attention.no_mask(batch.tokens_B_T.device),  # none built
                    position_ids=batch.positions_B_T,
                    use_cache=False,
                    shared_prefix_layout=layout,
                )
                return out.last_hidden_state if self.split else out.logits
        mask_B_1_T_T = shared_prompt_mask(batch.branch_B_T)
        if self.autocast:
            mask_B_1_T_T = additive_mask(mask_B_1_T_T, torch.bfloat16)
        with self._autocast():
            out = model(
                input_ids=batch.tokens_B_T,
                attention_mask=mask_B_1_T_T,
                position_ids=batch.positions_B_T,
                use_cache=False,
            )
            return out.last_hidden_state if self.split else out.logits

    def logits(self, hidden_N_H: torch.Tensor) -> torch.Tensor:
        """`[N, V]` logits of the given rows of `hidden_states`."""
        if not self.split:
            return hidden_N_H
        with self._autocast():
            return self.head(hidden_N_H)

    def token_logps(
        self,
        hidden_N_H: torch.Tensor,
        targets_N: torch.Tensor,
        temperature_N: torch.Tensor,
        chunk_size: int | None,
        with_entropy: bool,
    ) -> TokenLogpsOutput:
        """`slime_meta.losses.token_stats.token_logps` of `logits(hidden_N_H)`. Without autocast (the
        CPU), the projection folded into row chunks (`linear_token_logps`): no `[N, V]` logits held.
        Under autocast, the bf16 logits and the fused kernels."""
        if not self.split or self.autocast or getattr(self.head, "bias", None) is not None:
            logits_N_V = self.logits(hidden_N_H)
            return token_logps(logits_N_V, targets_N, temperature_N, chunk_size=chunk_size, with_entropy=with_entropy)
        chunk_size = chunk_size or max(len(targets_N), 1)
        return linear_token_logps(hidden_N_H, self.head.weight, targets_N, temperature_N, chunk_size, with_entropy)


def full_causal(config) -> bool:
    """A Llama-family model whose every layer attends causally to all earlier tokens: the shared
    rows' masks replace transformers' own, which would otherwise add a sliding window."""
    window = getattr(config, "sliding_window", None)
    windowed = bool(window) and getattr(config, "use_sliding_window", True)
    return getattr(config, "model_type", None) in SPLIT_HEAD_MODEL_TYPES and not windowed


def additive_mask(visible_B_1_T_T: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask as SDPA's memory-efficient kernel reads it: 0 where visible, -inf elsewhere,
    in the queries' dtype, its rows 8-element aligned (a view into a slightly wider tensor).
    Given a boolean mask, or an unaligned one, SDPA makes that tensor itself in every layer's call."""
    batch, _, width, _ = visible_B_1_T_T.shape
    padded = -(-width // 8) * 8
    out = torch.full((batch, 1, width, padded), float("-inf"), dtype=dtype, device=visible_B_1_T_T.device)
    return out[..., :width].masked_fill_(visible_B_1_T_T, 0.0)


def is_right_padded(attention_B_T: torch.Tensor) -> bool:
    """Every row's ones come first, then only zeros (a row with no padding counts).

    On a GPU this reads one flag back; the micro-batch was copied from host memory just before,
    so nothing of the step is queued yet and the wait is that of two small comparisons.
    """
    return bool((attention_B_T[:, 0] == 1).all() and (attention_B_T[:, 1:] <= attention_B_T[:, :-1]).all())


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """`torch.compile` each decoder layer in place; returns how many (0 where none are found)."""
    layers = getattr(getattr(model, model.base_model_prefix, None), "layers", None)
    if layers is None:
        return 0
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
