"""Megatron without TransformerEngine: what slime (624b824) needs to train and sync weights with
Megatron's local layer spec (`--transformer-impl local`), for hosts where TransformerEngine is not
installed (it is built from source against the host's torch; slime's docker image has it).

With `--transformer-impl local` the translation (plan.py) adds both hooks unless you give your own:

  --spec slime_meta.backends.slime.megatron_local packed_local_layer_spec
        Megatron's local layer spec with a causal attention that takes slime's THD-packed
        micro-batches (Megatron's local `DotProductAttention` asserts `packed_seq_params is None`;
        only TransformerEngine's attention takes THD)
  --custom-megatron-init-path slime_meta.backends.slime.megatron_local.actor_init
        slime's HF->Megatron loaders and Megatron->HF converters (the weight sync to SGLang) name
        the two layer norms the way the TransformerEngine spec fuses them into the next linear
        layer; the local spec keeps them as modules of their own. The hook translates those two
        names in both directions; every other name and tensor is slime's own.

Runs inside slime's Megatron actors (Ray workers); nothing here imports Megatron or slime at
module level, so the core and the tests import it anywhere.
"""

from __future__ import annotations

import os
import re

# Local spec name (per layer) -> the TransformerEngine spec's name of the same tensor.
_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?decoder\.layers\.\d+\.)(?P<rest>.+)$")


def te_name(name: str) -> str:
    """A Megatron parameter name of the local spec as the TransformerEngine spec names it (other
    names unchanged): `...decoder.layers.3.input_layernorm.weight` ->
    `...decoder.layers.3.self_attention.linear_qkv.layer_norm_weight`."""
    match = _LAYER_NAME.match(name)
    if match and match.group("rest") in _LOCAL_TO_TE:
        return match.group("prefix") + _LOCAL_TO_TE[match.group("rest")]
    return name


def actor_init(args) -> None:
    """--custom-megatron-init-path hook: runs in every Megatron actor before the model is built."""
    translate_local_spec_names()


def translate_local_spec_names() -> None:
    """Wrap slime's HF->Megatron loaders and its Megatron->HF conversion so they read the local
    spec's names as the TransformerEngine spec's (idempotent: a second call changes nothing)."""
    from slime.backends.megatron_utils import hf_to_megatron, megatron_to_hf

    for model_type, loader in list(hf_to_megatron._LOADERS.items()):
        if not getattr(loader, "_local_spec_names", False):
            hf_to_megatron._LOADERS[model_type] = _loader_for_local_names(loader)
    core = megatron_to_hf._convert_to_hf_core
    if not getattr(core, "_local_spec_names", False):
        megatron_to_hf._convert_to_hf_core = _converter_for_local_names(core)


def _loader_for_local_names(loader):
    def load(name, reader, config):
        return loader(te_name(name), reader, config)

    load._local_spec_names = True
    return load


def _converter_for_local_names(convert):
    def convert_local(args, model_name, name, param):
        return convert(args, model_name, te_name(name), param)

    convert_local._local_spec_names = True
    return convert_local


def varlen_causal_attention():
    """torch's FlashAttention over THD-packed sequences in one call (`torch.nn.attention.varlen`), as
    `fn(q_T_H_D, k_T_G_D, v_T_G_D, cu_seqlens, max_seqlen, scale) -> o_T_H_D`; None where this torch
    has none. Its keywords changed across releases: causal is `window_size=(-1, 0)` where that
    exists, else `is_causal=True`; grouped keys and values are repeated where `enable_gqa` is missing."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    native_gqa = "enable_gqa" in params

    def attend(q_T_H_D, k_T_G_D, v_T_G_D, cu_seqlens, max_seqlen: int, scale):
        groups = q_T_H_D.shape[1] // k_T_G_D.shape[1]
        extra = dict(causal)
        if groups > 1 and native_gqa:
            extra["enable_gqa"] = True
        elif groups > 1:
            k_T_G_D = k_T_G_D.repeat_interleave(groups, dim=1)
            v_T_G_D = v_T_G_D.repeat_interleave(groups, dim=1)
        return varlen_attn(
            q_T_H_D, k_T_G_D, v_T_G_D, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **extra
        )

    return attend


def packed_causal_attention_class():
    """Causal attention over slime's packed micro-batches in plain torch, for Megatron's local spec.

    slime packs every micro-batch as THD sequences (`PackedSeqParams`, qkv_format "thd"). This one
    takes query/key/value `[T, H, D]` and lets each packed sequence (cu_seqlens) attend causally to
    itself: on the GPU in one FlashAttention call over the whole micro-batch where torch has
    `varlen_attn` (with slime's padding segment as one more sequence), else sequence by sequence through
    scaled_dot_product_attention. Under tensor parallelism each rank gets its own heads (H / TP and
    G / TP): the counts are read from the tensors, so the same code serves every TP size.
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    class PackedCausalAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_unused):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(
            self,
            query_T_H_D,
            key_T_G_D,
            value_T_G_D,
            attention_mask=None,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
            **_unused,
        ):
            if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                raise NotImplementedError("PackedCausalAttention takes slime's THD-packed micro-batches only")
            if varlen is not None and query_T_H_D.is_cuda and query_T_H_D.dtype in (torch.bfloat16, torch.float16):
                return self._varlen(query_T_H_D, key_T_G_D, value_T_G_D, packed_seq_params.cu_seqlens_q)
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            groups = query_T_H_D.shape[1] // key_T_G_D.shape[1]
            out = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end == start:
                    continue
                q_H_S_D = query_T_H_D[start:end].transpose(0, 1)
                k_H_S_D = key_T_G_D[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
                v_H_S_D = value_T_G_D[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
                o_H_S_D = F.scaled_dot_product_attention(
                    q_H_S_D, k_H_S_D, v_H_S_D, is_causal=True, scale=self.softmax_scale
                )
                out.append(o_H_S_D.transpose(0, 1))
            # Padding past the last sequence (slime pads a micro-batch to a multiple of TP) attends to nothing.
            tail = query_T_H_D.shape[0] - bounds[-1]
            if tail > 0:
                out.append(query_T_H_D.new_zeros((tail, *query_T_H_D.shape[1:])))
            return torch.cat(out)  # [T, H, D]: Megatron's Attention reshapes it to [T, 1, H * D]

        def _varlen(self, query_T_H_D, key_T_G_D, value_T_G_D, cu_seqlens):
            total = query_T_H_D.shape[0]
            bounds = cu_seqlens.to(torch.int32)
            if int(bounds[-1]) < total:  # padding past the last sequence: attends to itself only
                bounds = torch.cat([bounds, bounds.new_tensor([total])])
            max_seqlen = int((bounds[1:] - bounds[:-1]).max())
            return varlen(query_T_H_D, key_T_G_D, value_T_G_D, bounds, max_seqlen, self.softmax_scale)

    # SLIME_META_PACKED_ATTENTION=loop keeps the sequence-by-sequence path (to compare, or where a
    # torch's varlen kernel misbehaves); Ray's workers inherit it from `ray start`.
    varlen = None if os.environ.get("SLIME_META_PACKED_ATTENTION") == "loop" else varlen_causal_attention()
    return PackedCausalAttention


def packed_local_layer_spec(args, config, vp_stage=None):
    """--spec hook: slime's own local layer spec (its model_provider's call) with the attention above."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=args.num_experts,
        moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
        moe_use_legacy_grouped_gemm=args.moe_use_legacy_grouped_gemm,
    )
    spec.submodules.self_attention.submodules.core_attention = packed_causal_attention_class()
    return spec
