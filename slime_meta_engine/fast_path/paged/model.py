"""The Llama/Qwen2/Qwen3 forward (fast_path/family_forward.py) over a paged KV cache (fast_path/paged/cache.py).

The layers compute what the static forward computes (same projections, norms and MLP in the same
dtypes); only where keys and values live differs. A row's tokens are found through its page table
row, a persistent (rows, max pages) tensor on the device. Decode writes the new token's key/value
at its page and offset, then attends in one of two ways (`attention`):
- "kernel" (kernels/paged_attention.py): a Triton kernel follows each row's page table in place and stops
  at the row's own length (position + 1); nothing is copied. The default wherever it can run (CUDA
  with triton installed, or Triton's CPU interpreter under TRITON_INTERPRET=1).
- "gather": gather each row's first `attended // page_size` pages into a contiguous
  (rows, attended, kv_heads, head_dim) block, one indexed copy per layer for keys and one for
  values, and attend to it with SDPA under a mask of the row's length, as the static forward does.
  Every row pays for the bucket's length and the copies; the fallback everywhere else (the CPU).
Both keep every shape fixed for a (rows, attended) pair and read the page numbers and lengths from
device memory, so a decode step can still be captured in a CUDA graph (fast_path/decode_graphs.py) and
replayed whatever pages the rows hold. Prefill attends with SDPA either way, over the prompts'
own keys (in windows, with the earlier windows' keys gathered by slot).
"""

from __future__ import annotations

import torch
from torch.nn.attention import sdpa_kernel

from slime_meta_engine.fast_path.family_forward import _ATTENTION_BACKENDS, LlamaFamilyForward
from slime_meta_engine.fast_path.paged.cache import SCRATCH_PAGE, PagedKVCache
from slime_meta_engine.kernels import layer_ops
from slime_meta_engine.kernels.paged_attention import paged_attention_unavailable_reason, paged_decode_attention

ATTENTION_CHOICES = ("auto", "kernel", "gather")


class PagedDecoder(LlamaFamilyForward):
    """Prefill and single-token decode over a `PagedKVCache`, for up to `num_rows` rows at once.

    `attention`: how decode reads the cache, "kernel", "gather" or "auto" (the kernel where it can
    run, else the gather); `self.attention` says which one is used.
    """

    # Decode inputs per row that DecodeGraphs keeps in persistent buffers: token, position, page.
    step_inputs = 3

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        *,
        num_rows: int,
        max_row_tokens: int,
        attention: str = "auto",
        fused_kernels: bool | None = None,
    ):
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"paged decode attention {attention!r}: give one of {', '.join(ATTENTION_CHOICES)}")
        page_size = cache.page_size
        max_pages_per_row = -(-max_row_tokens // page_size)
        super().__init__(model, max_pages_per_row * page_size, fused_kernels=fused_kernels)
        self.cache = cache
        self.page_size = page_size
        self.num_rows = num_rows
        self.capacity = max_pages_per_row * page_size  # tokens one row may hold
        # Row r's page for its tokens p*S .. p*S+S-1 is page_table_R_M[r, p]; unused entries are scratch.
        self.page_table_R_M = torch.full(
            (num_rows, max_pages_per_row), SCRATCH_PAGE, dtype=torch.int64, device=self.shape.device
        )
        self._rows_R = torch.arange(num_rows, device=self.shape.device)
        s = self.shape
        reason = paged_attention_unavailable_reason(s.device, s.dtype, s.head_dim)
        if attention == "kernel" and reason is not None:
            raise ValueError(f"the paged attention kernel cannot run: {reason}")
        self.attention = "kernel" if reason is None and attention != "gather" else "gather"

    # ----- prefill ---------------------------------------------------------------------------

    def prefill(
        self,
        input_ids_N_L: torch.Tensor,
        lengths_N: torch.Tensor,
        rows_N: torch.Tensor,
        chunk_tokens: int | None = None,
    ) -> torch.Tensor:
        """Run right-padded prompts from position 0 into the pages of page-table rows `rows_N`.

        The caller has written those rows' page tables (pages for every prompt token). Returns the
        logits after each prompt's last real token, (N, V). Padding columns write to the scratch
        page. `chunk_tokens`: column windows over all rows, as in `StaticDecoder.prefill`.
        """
        width = input_ids_N_L.shape[1]
        if width > self.capacity:
            raise ValueError(f"prompt of {width} tokens exceeds the longest row ({self.capacity})")
        columns_W = self._positions_T[:width]
        pages_N_W = self.page_table_R_M[rows_N][:, columns_W // self.page_size]
        offsets_W = columns_W % self.page_size
        real_N_W = columns_W[None, :] < lengths_N[:, None]
        # Flat token index into (pages * page_size); padding goes to the scratch page.
        token_slots_N_W = torch.where(real_N_W, pages_N_W * self.page_size + offsets_W, offsets_W)
        return self._prefill_windows(input_ids_N_L, lengths_N, token_slots_N_W, chunk_tokens)

    def _cache_prefill_columns(
        self,
        layer_index: int,
        k_N_K_C_D: torch.Tensor,
        v_N_K_C_D: torch.Tensor,
        start: int,
        token_slots_N_W: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys_X_K_D = self.cache.keys_L_P_S_K_D[layer_index].flatten(0, 1)  # X = pages * page_size
        values_X_K_D = self.cache.values_L_P_S_K_D[layer_index].flatten(0, 1)
        end = start + k_N_K_C_D.shape[2]
        window_slots_N_C = token_slots_N_W[:, start:end]
        keys_X_K_D[window_slots_N_C] = k_N_K_C_D.transpose(1, 2)
        values_X_K_D[window_slots_N_C] = v_N_K_C_D.transpose(1, 2)
        if start == 0:
            return k_N_K_C_D, v_N_K_C_D
        # Earlier windows' keys and values, with this window's just written.
        earlier_slots_N_T = token_slots_N_W[:, :end]
        return keys_X_K_D[earlier_slots_N_T].transpose(1, 2), values_X_K_D[earlier_slots_N_T].transpose(1, 2)

    # ----- decode ----------------------------------------------------------------------------

    def decode(
        self, token_ids_B: torch.Tensor, positions_B: torch.Tensor, write_pages_B: torch.Tensor, attended: int
    ) -> torch.Tensor:
        """One new token for each of the page-table rows 0..B-1; returns their logits, (B, V).

        `positions_B[i]`: row i's new position (= tokens it holds); `write_pages_B[i]`: the page
        that position falls in, recorded in the page table here (new pages arrive this way, with
        no other host-to-device copy). `attended` (fixed per graph, a multiple of the page size)
        must exceed every position. No host synchronisation happens here.
        """
        with sdpa_kernel(_ATTENTION_BACKENDS):
            return self._decode(token_ids_B, positions_B, write_pages_B, attended)

    def _decode(
        self, token_ids_B: torch.Tensor, positions_B: torch.Tensor, write_pages_B: torch.Tensor, attended: int
    ) -> torch.Tensor:
        s = self.shape
        rows = token_ids_B.shape[0]
        page_size = self.page_size
        self.page_table_R_M[self._rows_R[:rows], positions_B // page_size] = write_pages_B
        write_slots_B = write_pages_B * page_size + positions_B % page_size
        pages_B_A = self.page_table_R_M[:rows, : attended // page_size]
        lengths_B = positions_B + 1  # the new token is attended to as well
        hidden_B_E, cos_B_1_D, sin_B_1_D, mask_B_1_1_T = self._decode_inputs(token_ids_B, positions_B, attended)
        for index, layer in enumerate(self._layers):
            keys_P_S_K_D = self.cache.keys_L_P_S_K_D[index]
            values_P_S_K_D = self.cache.values_L_P_S_K_D[index]
            # The rotation and both cache writes: one kernel with the fused kernels, three without
            # (the product's queries and keys are already head-normalised where the model does so).
            q_B_H_D = layer_ops.rotate_into_cache(
                self._decode_qkv_product(layer, hidden_B_E),
                cos_B_1_D,
                sin_B_1_D,
                keys_P_S_K_D.view(-1, s.num_kv_heads, s.head_dim),
                values_P_S_K_D.view(-1, s.num_kv_heads, s.head_dim),
                write_slots_B,
                s.num_heads,
                use_kernel=self.fused_kernels,
            )
            if self.attention == "kernel":
                attended_B_HD = paged_decode_attention(
                    q_B_H_D,
                    keys_P_S_K_D,
                    values_P_S_K_D,
                    self.page_table_R_M,
                    lengths_B,
                    self._scaling,
                    max_length=attended,
                )
            else:
                # Each row's pages in order make its keys 0..attended-1 (one gather per tensor).
                keys_B_T_K_D = keys_P_S_K_D[pages_B_A].view(rows, attended, s.num_kv_heads, s.head_dim)
                values_B_T_K_D = values_P_S_K_D[pages_B_A].view(rows, attended, s.num_kv_heads, s.head_dim)
                attended_B_HD = self._decode_attention(
                    q_B_H_D, keys_B_T_K_D.transpose(1, 2), values_B_T_K_D.transpose(1, 2), mask_B_1_1_T
                )
            hidden_B_E = self._finish_layer(layer, hidden_B_E, attended_B_HD)
        return self._logits(hidden_B_E)
