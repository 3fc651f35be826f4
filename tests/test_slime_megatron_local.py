"""Megatron's local layer spec on slime: the layer-norm names it keeps apart are read by slime's
HF->Megatron loaders and written by its Megatron->HF conversion (the weight sync to SGLang) as the
TransformerEngine spec's fused names. slime's own loader and converter are used when slime's source
is at hand (SLIME_SRC)."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from argparse import Namespace

import pytest
import torch

from slime_meta.backends.slime.megatron_local import te_name


def test_the_two_local_layer_norm_names_map_to_the_fused_ones_and_nothing_else_changes():
    assert te_name("module.module.decoder.layers.11.input_layernorm.weight") == (
        "module.module.decoder.layers.11.self_attention.linear_qkv.layer_norm_weight"
    )
    assert te_name("decoder.layers.0.pre_mlp_layernorm.weight") == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    for name in (
        "module.module.decoder.layers.3.self_attention.linear_qkv.weight",
        "module.module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
        "module.module.decoder.final_layernorm.weight",
        "module.module.embedding.word_embeddings.weight",
        "decoder.layers.2.input_layernorm.bias",
    ):
        assert te_name(name) == name


@pytest.fixture
def slime_modules():
    """slime's HF->Megatron loaders and Megatron->HF conversion, imported from SLIME_SRC for this test
    only: the path and slime's modules (patched by the test) are gone afterwards."""
    source = os.environ.get("SLIME_SRC")
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    if source:
        sys.path.insert(0, source)
    try:
        if importlib.util.find_spec("slime") is None:
            pytest.skip("needs slime's source: set SLIME_SRC to a THUDM/slime checkout")
        with warnings.catch_warnings():  # without Megatron slime warns that its grad-coalesce patch is off
            warnings.simplefilter("ignore")
            from slime.backends.megatron_utils import hf_to_megatron, megatron_to_hf
        yield hf_to_megatron, megatron_to_hf
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name == "slime" or name.startswith("slime."):
                del sys.modules[name]


# Qwen2.5-0.5B's shape, shrunk: 4 heads in 2 KV groups of head dim 2, hidden 8.
QWEN2_ARGS = Namespace(
    num_attention_heads=4, num_query_groups=2, hidden_size=8, kv_channels=2, vocab_size=16, q_lora_rank=None
)


class _Reader:
    """The HF tensors of one layer, by name (what slime's SafetensorReader answers)."""

    def __init__(self):
        self.tensors = {
            "model.layers.0.input_layernorm.weight": torch.full((8,), 1.5),
            "model.layers.0.post_attention_layernorm.weight": torch.full((8,), 2.5),
        }

    def get_tensor(self, name):
        return self.tensors[name]

    def __contains__(self, name):
        return name in self.tensors


def test_slime_loads_and_syncs_the_local_specs_layer_norms_as_the_hf_ones(slime_modules):
    hf_to_megatron, megatron_to_hf = slime_modules
    from slime_meta.backends.slime.megatron_local import translate_local_spec_names

    norm = torch.arange(8.0)
    local = "module.module.decoder.layers.0.input_layernorm.weight"
    with pytest.raises(ValueError, match="Unknown parameter name"):  # slime's converter alone refuses the name
        megatron_to_hf.convert_to_hf(QWEN2_ARGS, "qwen2", local, norm)

    translate_local_spec_names()
    translate_local_spec_names()  # idempotent: wrapped once
    assert [n for n, _ in megatron_to_hf.convert_to_hf(QWEN2_ARGS, "qwen2", local, norm)] == [
        "model.layers.0.input_layernorm.weight"
    ]
    pre_mlp = "module.module.decoder.layers.0.pre_mlp_layernorm.weight"
    (name, tensor), *rest = megatron_to_hf.convert_to_hf(QWEN2_ARGS, "qwen2", pre_mlp, norm)
    assert (name, rest) == ("model.layers.0.post_attention_layernorm.weight", []) and torch.equal(tensor, norm)
    # A TransformerEngine name is converted as before.
    fused = "module.module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert (
        megatron_to_hf.convert_to_hf(QWEN2_ARGS, "qwen2", fused, norm)[0][0] == "model.layers.0.input_layernorm.weight"
    )

    reader, config = _Reader(), Namespace(tie_word_embeddings=True)
    for model_type in ("qwen2", "llama"):
        load = hf_to_megatron._LOADERS[model_type]
        assert float(load("decoder.layers.0.input_layernorm.weight", reader, config)[0]) == 1.5
        assert float(load("decoder.layers.0.pre_mlp_layernorm.weight", reader, config)[0]) == 2.5
