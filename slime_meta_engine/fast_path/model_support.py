"""Which Hugging Face models the engine's fast path runs, and the shapes its caches are built to.

The fast path (fast_path/static/model.py, fast_path/paged/model.py) computes the Llama/Qwen2/Qwen3 decoder itself:
`model_type` llama, qwen2 or qwen3, SiLU activation, full attention in every layer, rotary types
whose frequencies do not depend on the sequence length (default, linear, llama3, yarn).
Anything else uses the generic DynamicCache path; `unsupported_reason` says why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
# Model types whose attention normalises each query and key head (RMSNorm over head_dim) before
# the rotation: they need these modules in every layer.
QK_NORM_MODEL_TYPES = frozenset({"qwen3"})
_QK_NORM_MODULES = ("self_attn.q_norm", "self_attn.k_norm")
# Rotary types whose inverse frequencies are fixed once the model is built (the "dynamic" and
# "longrope" types rescale with the sequence length, which a fixed table cannot follow).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
_LAYER_MODULES = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the static path cannot run this model, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(layer_type != "full_attention" for layer_type in layer_types):
        return "some layers use sliding-window attention"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "the model uses sliding-window attention"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 is not supported"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return "no rotary embedding module with inv_freq"
    if getattr(rotary, "rope_type", None) not in STATIC_ROPE_TYPES:
        return f"rotary type {getattr(rotary, 'rope_type', None)!r} depends on the sequence length"
    lm_head = getattr(model, "lm_head", None)
    if not isinstance(lm_head, torch.nn.Linear) or lm_head.bias is not None:
        return "lm_head is not a bias-free linear layer"
    if not getattr(inner, "layers", None):
        return "the model has no decoder layers"
    required = _LAYER_MODULES + (_QK_NORM_MODULES if model_type in QK_NORM_MODEL_TYPES else ())
    for index, layer in enumerate(inner.layers):
        for name in required:
            try:
                layer.get_submodule(name)
            except AttributeError:
                return f"layer {index} has no {name}"
    return None


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's keys and values take across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def model_shape(model: torch.nn.Module) -> ModelShape:
    config = model.config
    first_attention = model.model.layers[0].self_attn
    num_heads = config.num_attention_heads
    head_dim = first_attention.head_dim
    return ModelShape(
        num_layers=len(model.model.layers),
        num_heads=num_heads,
        num_kv_heads=config.num_key_value_heads or num_heads,
        head_dim=head_dim,
        vocab_size=model.lm_head.weight.shape[0],
        dtype=model.lm_head.weight.dtype,
        device=model.lm_head.weight.device,
    )
