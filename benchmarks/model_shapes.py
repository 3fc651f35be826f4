"""The Qwen2.5 shapes the benchmarks build random-init models of: each one's Hugging Face config
(Qwen2Config keywords) as the released model has it."""

from __future__ import annotations

QWEN25_COMMON = dict(
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    use_sliding_window=False,
)
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    **QWEN25_COMMON,
)
QWEN25_15B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    **QWEN25_COMMON,
)
