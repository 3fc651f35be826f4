"""The fast path's forward over a static, slot-indexed KV cache (fast_path/static/cache.py).

The layers are `LlamaFamilyForward`'s (fast_path/family_forward.py); here, only where keys and values live:
row i of a prefill writes its columns into its slot, and a decode step over rows 0..B-1 writes
each new token's key/value at slot i, column = its position, then attends to the slot's first
`attended` columns under a mask of the row's own length. Shapes are fixed for a (rows, attended)
pair, so a decode step can be captured in a CUDA graph (fast_path/decode_graphs.py) and replayed.
"""

from __future__ import annotations

import torch
from torch.nn.attention import sdpa_kernel

from slime_meta_engine.fast_path.family_forward import _ATTENTION_BACKENDS, LlamaFamilyForward
from slime_meta_engine.fast_path.static.cache import StaticKVCache


class StaticDecoder(LlamaFamilyForward):
    """Prefill and single-token decode of a loaded HF Llama/Qwen2/Qwen3 model over a `StaticKVCache`."""

    step_inputs = 2  # decode inputs per row that DecodeGraphs keeps in persistent buffers: token, position

    def __init__(self, model: torch.nn.Module, cache: StaticKVCache, *, fused_kernels: bool | None = None):
        super().__init__(model, cache.capacity, fused_kernels=fused_kernels)
        self.cache = cache
        self.num_rows = cache.num_slots
        self.capacity = cache.capacity
        self._slots_S = torch.arange(cache.num_slots, device=self.shape.device)

    # ----- prefill ---------------------------------------------------------------------------

    def prefill(
        self,
        input_ids_N_L: torch.Tensor,
        lengths_N: torch.Tensor,
        slots_N: torch.Tensor,
        chunk_tokens: int | None = None,
    ) -> torch.Tensor:
        """Run right-padded prompts from position 0, store their keys/values in `slots_N`.

        Returns the logits after each prompt's last real token, (N, V). Positions past a row's
        length hold padding in the cache; they are never attended to and later steps overwrite them.
        `chunk_tokens`: column windows over all rows (`LlamaFamilyForward._prefill_windows`).
        """
        width = input_ids_N_L.shape[1]
        if width > self.cache.capacity:
            raise ValueError(f"prompt of {width} tokens exceeds the static cache ({self.cache.capacity})")
        return self._prefill_windows(input_ids_N_L, lengths_N, slots_N, chunk_tokens)

    def _cache_prefill_columns(
        self, layer_index: int, k_N_K_C_D: torch.Tensor, v_N_K_C_D: torch.Tensor, start: int, slots_N: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys_S_K_T_D = self.cache.keys_L_S_K_T_D[layer_index]
        values_S_K_T_D = self.cache.values_L_S_K_T_D[layer_index]
        end = start + k_N_K_C_D.shape[2]
        keys_S_K_T_D[slots_N, :, start:end] = k_N_K_C_D
        values_S_K_T_D[slots_N, :, start:end] = v_N_K_C_D
        if start == 0:
            return k_N_K_C_D, v_N_K_C_D
        # Earlier windows' keys and values, with this window's just written.
        return keys_S_K_T_D[slots_N, :, :end], values_S_K_T_D[slots_N, :, :end]

    # ----- decode ----------------------------------------------------------------------------

    def decode(self, token_ids_B: torch.Tensor, positions_B: torch.Tensor, attended: int) -> torch.Tensor:
        """One new token for each of the slots 0..B-1; returns their logits, (B, V).

        `positions_B[i]` is slot i's position of the new token, which is also how many tokens
        the slot already holds; the token's key/value is written there before attending.
        `attended` (a Python int, fixed per captured graph) bounds the key columns read, and must
        exceed every position in `positions_B`. No host synchronisation happens here.
        """
        with sdpa_kernel(_ATTENTION_BACKENDS):
            return self._decode(token_ids_B, positions_B, attended)

    def _decode(self, token_ids_B: torch.Tensor, positions_B: torch.Tensor, attended: int) -> torch.Tensor:
        rows = token_ids_B.shape[0]
        slots_B = self._slots_S[:rows]
        hidden_B_E, cos_B_1_D, sin_B_1_D, mask_B_1_1_T = self._decode_inputs(token_ids_B, positions_B, attended)
        for index, layer in enumerate(self._layers):
            q_B_H_D, k_B_K_D, v_B_K_D = self._decode_qkv(layer, hidden_B_E, cos_B_1_D, sin_B_1_D)
            keys_S_K_T_D = self.cache.keys_L_S_K_T_D[index]
            values_S_K_T_D = self.cache.values_L_S_K_T_D[index]
            keys_S_K_T_D[slots_B, :, positions_B] = k_B_K_D
            values_S_K_T_D[slots_B, :, positions_B] = v_B_K_D
            attended_B_HD = self._decode_attention(
                q_B_H_D, keys_S_K_T_D[:rows, :, :attended], values_S_K_T_D[:rows, :, :attended], mask_B_1_1_T
            )
            hidden_B_E = self._finish_layer(layer, hidden_B_E, attended_B_HD)
        return self._logits(hidden_B_E)
