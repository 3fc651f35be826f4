"""The Llama/Qwen2/Qwen3 decoder layers of the fast path, whatever cache holds the keys and values.

Why our own forward: Hugging Face's forward is dozens of small Python-driven kernel launches per
layer with shapes that change every step, so a decode step is bound by the CPU, not the GPU. This
forward has fixed shapes for a given (rows, attended length) pair, touches no Python state that
changes between steps and never synchronises with the host, so one decode step can be captured in
a CUDA graph (fast_path/decode_graphs.py) and replayed.

It computes what the HF modules compute in the same dtypes (RMSNorm in float32 then cast back
before the weight, rotary tables in float32 cast to the model dtype, SiLU-gated MLP, q/k/v biases
where the module has them, Qwen3's RMSNorm of each query and key head before the rotation,
grouped-query attention), in fewer kernels, since a replayed step costs about one launch latency
per kernel: the rotation is a roll against a sign-folded sine table (bit-identical to HF's),
queries and keys rotate in one pass, the attention mask is built once per step, and RMSNorm's
float32 part is torch's fused `rms_norm` (on CUDA its float32 sum may round differently from
HF's, far below bf16 resolution). On CUDA with triton, the norms, the rotation
and SiLU-and-multiply are one Triton kernel each, and each residual add joins the norm after it,
the MLP's that of the next layer (kernels/layer_ops.py, which says how they round: as torch does, but
for RMSNorm's float32 sum); `SLIME_META_FUSED_OPS=0` or `fused_kernels=False` keeps torch's.

It reads every weight from the loaded HF modules at call time, so an in-place weight update
(`/update_weights_from_disk` copies into the existing parameters) reaches this path, and the
captured graphs, which hold the same storage, too.

Each cache layout (fast_path/static/model.py: one slot per row; fast_path/paged/model.py: pages) subclasses
`LlamaFamilyForward` and says only how it stores and reads keys and values; which models are
supported: fast_path/model_support.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from slime_meta_engine.fast_path.fused_weights import fuse_linear
from slime_meta_engine.fast_path.model_support import QK_NORM_MODEL_TYPES, model_shape, unsupported_reason
from slime_meta_engine.kernels import layer_ops

# cuDNN's attention plans anew for every shape and is not needed here; the others are all fine.
_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module, use_kernel: bool) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale (the cast comes before the weight).

    torch's `rms_norm` does the float32 part in one kernel on CUDA instead of five; `use_kernel`:
    all of it in one Triton kernel (layer_ops.rms_norm).
    """
    return layer_ops.rms_norm(x, norm.weight, norm.variance_epsilon, use_kernel=use_kernel)


def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, use_kernel: bool) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, where rotate_half(x) = (-x2, x1).

    (x2, x1) is a roll by half the head, and the minus sign lives in `signed_sin` = (-sin1, sin2):
    negating a factor is exact, so every element is the same product and sum as HF's. `use_kernel`:
    in one Triton kernel, rounded as torch rounds (layer_ops.rotary).
    """
    return layer_ops.rotary(x, cos, signed_sin, use_kernel=use_kernel)


class LlamaFamilyForward:
    """What every cache layout's forward shares: the weights, rotary tables and MLP/head of a
    loaded HF Llama/Qwen2/Qwen3 model, for positions 0..`max_positions`-1.

    `fused_kernels`: whether the norms, rotation and gated activation run as Triton kernels
    (kernels/layer_ops.py); None: where they can on CUDA, unless SLIME_META_FUSED_OPS=0 (read here, once).
    """

    def __init__(self, model: torch.nn.Module, max_positions: int, *, fused_kernels: bool | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"static decoding is not supported: {reason}")
        self.model = model
        self.shape = model_shape(model)
        if fused_kernels is None:
            fused_kernels = layer_ops.kernels_by_default(self.shape.device, self.shape.dtype)
        elif fused_kernels:
            reason = layer_ops.kernels_unavailable_reason(self.shape.device, self.shape.dtype)
            if reason is not None:
                raise ValueError(f"the fused kernels cannot run: {reason}")
        self.fused_kernels = fused_kernels
        self._inner = model.model
        self._layers = list(model.model.layers)
        self._scaling = self._layers[0].self_attn.scaling
        self._qk_norm = getattr(model.config, "model_type", None) in QK_NORM_MODEL_TYPES
        for layer in self._layers:  # q/k/v in one product, gate/up in one (views: see fast_path/fused_weights.py)
            attention, mlp = layer.self_attn, layer.mlp
            fuse_linear(attention, "_fused_qkv", (attention.q_proj, attention.k_proj, attention.v_proj))
            fuse_linear(mlp, "_fused_gate_up", (mlp.gate_proj, mlp.up_proj))
        self.cos_P_D, self.signed_sin_P_D = self._rotary_tables(max_positions)
        self._positions_T = torch.arange(max_positions, device=self.shape.device)
        self._next_layer = dict(zip(self._layers, self._layers[1:]))
        # (hidden, layer, that layer's input norm of hidden): made by `_finish_layer` together with
        # the residual add, taken by the next `_input_norm` (see there).
        self._normed_ahead: tuple[torch.Tensor, torch.nn.Module, torch.Tensor] | None = None

    def _rotary_tables(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see `_apply_rotary`) for every position the cache can hold, computed
        as HF computes cos/sin per step."""
        rotary = self._inner.rotary_emb
        positions_P = torch.arange(capacity, device=self.shape.device)
        inv_freq = rotary.inv_freq.to(device=self.shape.device, dtype=torch.float)
        freqs_P_half = positions_P[:, None].float() * inv_freq
        angles_P_D = torch.cat((freqs_P_half, freqs_P_half), dim=-1)
        scaling = rotary.attention_scaling
        cos_P_D = (angles_P_D.cos() * scaling).to(self.shape.dtype)
        sin_P_D = (angles_P_D.sin() * scaling).to(self.shape.dtype)
        half = sin_P_D.shape[-1] // 2
        return cos_P_D, torch.cat((-sin_P_D[:, :half], sin_P_D[:, half:]), dim=-1)

    def _mlp(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        mlp = layer.mlp
        fused = mlp.__dict__.get("_fused_gate_up")
        if fused is None:
            return _linear(F.silu(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj), mlp.down_proj)
        activated = layer_ops.silu_mul(F.linear(x, *fused), use_kernel=self.fused_kernels)
        return _linear(activated, mlp.down_proj)

    def _qkv(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The q, k and v projections of `x` (..., E) side by side: (..., (H + 2K) x D)."""
        attention = layer.self_attn
        fused = attention.__dict__.get("_fused_qkv")
        if fused is None:
            projections = (attention.q_proj, attention.k_proj, attention.v_proj)
            return torch.cat([_linear(x, projection) for projection in projections], dim=-1)
        return F.linear(x, *fused)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._normed_ahead = None
        return _linear(_rms_norm(hidden, self._inner.norm, self.fused_kernels), self.model.lm_head)

    def _input_norm(self, layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input RMSNorm of `hidden`, taken from `_normed_ahead` when the previous
        layer made it for this very tensor (the forwards call `_finish_layer` then the next layer's
        projections with its result); otherwise computed."""
        ahead, self._normed_ahead = self._normed_ahead, None
        if ahead is not None and ahead[0] is hidden and ahead[1] is layer:
            return ahead[2]
        return _rms_norm(hidden, layer.input_layernorm, self.fused_kernels)

    def _project_qkv(self, layer: torch.nn.Module, hidden_N_C_E: torch.Tensor, cos_C_D, sin_C_D):
        """Queries (N, H, C, D) and keys/values (N, K, C, D) of C columns, rotated as HF rotates them."""
        s = self.shape
        num_rows, columns = hidden_N_C_E.shape[:2]
        qkv_N_C_X_D = self._qkv(layer, self._input_norm(layer, hidden_N_C_E)).view(
            num_rows, columns, s.num_heads + 2 * s.num_kv_heads, s.head_dim
        )
        q_N_H_C_D, k_N_K_C_D, v_N_K_C_D = qkv_N_C_X_D.transpose(1, 2).split(
            (s.num_heads, s.num_kv_heads, s.num_kv_heads), dim=1
        )
        q_N_H_C_D, k_N_K_C_D = self._normed_qk(layer, q_N_H_C_D, k_N_K_C_D)
        q_N_H_C_D = _apply_rotary(q_N_H_C_D, cos_C_D, sin_C_D, self.fused_kernels)
        return q_N_H_C_D, _apply_rotary(k_N_K_C_D, cos_C_D, sin_C_D, self.fused_kernels), v_N_K_C_D

    def _normed_qk(self, layer: torch.nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys (..., D) through the layer's per-head RMSNorm (`q_norm`, `k_norm`: Qwen3),
        as HF applies it, before the rotation; unchanged for models without one.

        It is `layer_ops.rms_norm` over the last dimension, the layers' own norm, so with
        `fused_kernels` it is the Triton RMSNorm kernel on (rows x heads, D) and its output then
        enters the rotation kernels (`rotary`, `rotate_into_cache`) like any q/k/v product. That
        GPU path was written by reading the kernels and was not run on a CPU (Triton does not run
        there without its interpreter); the torch path is checked against HF (tests/test_qwen3_engine.py).
        """
        if not self._qk_norm:
            return q, k
        attention = layer.self_attn
        use_kernel = self.fused_kernels
        return _rms_norm(q, attention.q_norm, use_kernel), _rms_norm(k, attention.k_norm, use_kernel)

    # ----- prefill, whatever holds the keys -------------------------------------------------------

    def _prefill_windows(
        self, input_ids_N_L: torch.Tensor, lengths_N: torch.Tensor, where, chunk_tokens: int | None
    ) -> torch.Tensor:
        """Run right-padded prompts from position 0; returns the logits after each prompt's last
        real token, (N, V). `where` says where the rows' keys and values go (the cache layout's
        own index, handed to `_cache_prefill_columns`).

        `chunk_tokens` (chunked prefill): run the prompts in column windows of about that many
        tokens over all rows (at least one column), each window attending to the keys already in
        the cache, so no forward holds activations or an attention mask for every prompt token.
        """
        num_rows, width = input_ids_N_L.shape
        window = width if chunk_tokens is None else max(1, chunk_tokens // num_rows)
        last_positions_N = lengths_N - 1
        rows_N = torch.arange(num_rows, device=input_ids_N_L.device)
        last_N_E = None
        with sdpa_kernel(_ATTENTION_BACKENDS):
            for start in range(0, width, window):
                end = min(width, start + window)
                hidden_N_C_E = self._prefill_columns(input_ids_N_L[:, start:end], start, lengths_N, where)
                # Each row's last real token lies in exactly one window; keep its hidden state.
                in_window_N = (last_positions_N >= start) & (last_positions_N < end)
                picked_N_E = hidden_N_C_E[rows_N, (last_positions_N - start).clamp(0, end - start - 1)]
                last_N_E = picked_N_E if last_N_E is None else torch.where(in_window_N[:, None], picked_N_E, last_N_E)
        return self._logits(last_N_E)

    def _prefill_columns(self, input_ids_N_C: torch.Tensor, start: int, lengths_N: torch.Tensor, where):
        """Columns start..start+C of every prompt: caches their keys/values, returns hidden (N, C, E).

        Queries attend to the rows' columns 0..start+C-1 (earlier windows' keys are cached already).
        """
        s = self.shape
        num_rows, columns = input_ids_N_C.shape
        end = start + columns
        cos_C_D, sin_C_D = self.cos_P_D[start:end], self.signed_sin_P_D[start:end]
        mask_N_1_C_T = self._prefill_mask(start, end, lengths_N)
        hidden_N_C_E = self._inner.embed_tokens(input_ids_N_C)
        for index, layer in enumerate(self._layers):
            q_N_H_C_D, k_N_K_C_D, v_N_K_C_D = self._project_qkv(layer, hidden_N_C_E, cos_C_D, sin_C_D)
            k_N_K_T_D, v_N_K_T_D = self._cache_prefill_columns(index, k_N_K_C_D, v_N_K_C_D, start, where)
            # Prefill runs once per request, so repeating the kv heads (as HF does) costs little.
            k_N_H_T_D = k_N_K_T_D.repeat_interleave(s.group_size, dim=1)
            v_N_H_T_D = v_N_K_T_D.repeat_interleave(s.group_size, dim=1)
            attended_N_H_C_D = F.scaled_dot_product_attention(
                q_N_H_C_D,
                k_N_H_T_D,
                v_N_H_T_D,
                attn_mask=mask_N_1_C_T,
                is_causal=mask_N_1_C_T is None,
                scale=self._scaling,
            )
            attended_N_C_HD = attended_N_H_C_D.transpose(1, 2).reshape(num_rows, columns, s.num_heads * s.head_dim)
            hidden_N_C_E = self._finish_layer(layer, hidden_N_C_E, attended_N_C_HD)
        return hidden_N_C_E

    def _cache_prefill_columns(
        self, layer_index: int, k_N_K_C_D: torch.Tensor, v_N_K_C_D: torch.Tensor, start: int, where
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's keys/values of columns start..start+C-1 and return those the window's
        queries attend to, columns 0..start+C-1 of each row: (N, K, T, D) each. Up to the cache layout."""
        raise NotImplementedError

    def _prefill_mask(self, start: int, end: int, lengths_N: torch.Tensor) -> torch.Tensor | None:
        """The attention mask of prefill columns start..end-1 of right-padded prompts, or None when
        plain causal attention computes the same (the first window).

        Why the first window needs no mask: prompts are right-padded from position 0, so a real
        query at position p < length sees keys 0..p, all real; only padding queries see padding
        keys, and their outputs are never read. Without a mask the fused causal kernel runs (and
        the step reads nothing back from the device). A later window's queries are the last C of
        its T keys, which top-left causal alignment gets wrong: it keeps the explicit mask.
        """
        if start == 0:
            return None
        causal_C_T = self._positions_T[start:end, None] >= self._positions_T[None, :end]
        real_keys_N_T = self._positions_T[None, :end] < lengths_N[:, None]
        return (causal_C_T[None] & real_keys_N_T[:, None, :])[:, None]

    # ----- one decode step, whatever holds the keys ---------------------------------------------

    def _decode_inputs(self, token_ids_B: torch.Tensor, positions_B: torch.Tensor, attended: int):
        """The step's embeddings (B, E), rotary cos/sin (B, 1, D) and additive mask (B, 1, 1, T)."""
        s = self.shape
        cos_B_1_D = self.cos_P_D[positions_B][:, None, :]
        sin_B_1_D = self.signed_sin_P_D[positions_B][:, None, :]
        # Key column t is visible to a row when t <= its new position; an additive mask made once
        # here rather than converted from booleans in every layer.
        hidden_columns_B_T = self._positions_T[None, :attended] > positions_B[:, None]
        mask_B_1_1_T = torch.zeros(hidden_columns_B_T.shape, dtype=s.dtype, device=s.device).masked_fill(
            hidden_columns_B_T, float("-inf")
        )[:, None, None, :]
        return self._inner.embed_tokens(token_ids_B), cos_B_1_D, sin_B_1_D, mask_B_1_1_T

    def _decode_qkv_product(self, layer: torch.nn.Module, hidden_B_E: torch.Tensor) -> torch.Tensor:
        """The new token's q/k/v product before the rotation, (B, H + 2K, D): queries, keys, values
        (queries and keys head-normalised where the model does so, ready for the rotation)."""
        s = self.shape
        rows = hidden_B_E.shape[0]
        qkv_B_X_D = self._qkv(layer, self._input_norm(layer, hidden_B_E)).view(
            rows, s.num_heads + 2 * s.num_kv_heads, s.head_dim
        )
        if not self._qk_norm:
            return qkv_B_X_D
        q_B_H_D, k_B_K_D, v_B_K_D = qkv_B_X_D.split((s.num_heads, s.num_kv_heads, s.num_kv_heads), dim=1)
        # Put back side by side: the rotation (and the paged cache write) reads them from one product.
        return torch.cat((*self._normed_qk(layer, q_B_H_D, k_B_K_D), v_B_K_D), dim=1)

    def _decode_qkv(self, layer: torch.nn.Module, hidden_B_E: torch.Tensor, cos_B_1_D, sin_B_1_D):
        """The new token's query (B, H, D), key and value (B, K, D), rotated as HF rotates them."""
        s = self.shape
        qkv_B_X_D = self._decode_qkv_product(layer, hidden_B_E)
        # Queries and keys sit side by side: one rotation for both, no copy to put them together.
        rotated_B_HK_D = _apply_rotary(
            qkv_B_X_D[:, : s.num_heads + s.num_kv_heads], cos_B_1_D, sin_B_1_D, self.fused_kernels
        )
        v_B_K_D = qkv_B_X_D[:, s.num_heads + s.num_kv_heads :]
        return rotated_B_HK_D[:, : s.num_heads], rotated_B_HK_D[:, s.num_heads :], v_B_K_D

    def _decode_attention(
        self,
        q_B_H_D: torch.Tensor,
        keys_B_K_T_D: torch.Tensor,
        values_B_K_T_D: torch.Tensor,
        mask_B_1_1_T: torch.Tensor,
    ) -> torch.Tensor:
        """Grouped-query attention without copying keys: the G query heads that share a kv head
        become G query positions against that head's keys. Returns (B, H x D)."""
        s = self.shape
        rows = q_B_H_D.shape[0]
        q_B_K_G_D = q_B_H_D.view(rows, s.num_kv_heads, s.group_size, s.head_dim)
        attended_B_K_G_D = F.scaled_dot_product_attention(
            q_B_K_G_D, keys_B_K_T_D, values_B_K_T_D, attn_mask=mask_B_1_1_T, scale=self._scaling
        )
        return attended_B_K_G_D.reshape(rows, s.num_heads * s.head_dim)

    def _finish_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, attended_HD: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP and residual after attention (`attended_HD`: heads flattened).

        Each residual add comes with the norm that reads its sum (one kernel with `fused_kernels`):
        the attention's with this layer's post-attention norm, the MLP's with the next layer's input
        norm, left in `_normed_ahead` for `_input_norm`. The sums are rounded to the model dtype
        before the norms read them, as in the unfused forward.
        """
        use_kernel = self.fused_kernels
        norm = layer.post_attention_layernorm
        attention_out = _linear(attended_HD, layer.self_attn.o_proj)
        hidden, normed = layer_ops.add_rms_norm(
            hidden, attention_out, norm.weight, norm.variance_epsilon, use_kernel=use_kernel
        )
        mlp_out = self._mlp(layer, normed)
        next_layer = self._next_layer.get(layer)
        if next_layer is None:  # the last layer: the final norm reads only the rows `_logits` gets
            return hidden + mlp_out
        norm = next_layer.input_layernorm
        hidden, normed = layer_ops.add_rms_norm(
            hidden, mlp_out, norm.weight, norm.variance_epsilon, use_kernel=use_kernel
        )
        self._normed_ahead = (hidden, next_layer, normed)
        return hidden
