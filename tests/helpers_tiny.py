"""A random-init tiny Llama checkpoint for tests that need a real model on disk.

Tests run offline on a 2-core machine: no hub downloads, and a model small enough that a forward
pass costs well under a millisecond. The tokenizer is character level (one token per character),
so expected texts and token counts are easy to reason about. Everything is deterministic: the
same call always writes the same weights and vocabulary.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHARACTERS = " \n" + string.ascii_letters + string.digits + string.punctuation
# A plain chat template so that the OpenAI-style chat endpoint has one to apply.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_random_tiny_checkpoint(out_dir: str | Path) -> Path:
    """Write a tokenizer and a random-init `LlamaForCausalLM` (safetensors) into `out_dir`."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)

    vocabulary = {token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    # One token per character, newlines included ([\s\S] because Oniguruma's '.' skips '\n').
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join characters back without separators
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_path)

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=len(vocabulary),
        max_position_embeddings=256,
        tie_word_embeddings=True,
        # Larger than the default 0.02 so the next-token distributions are far from uniform:
        # greedy decoding then has clear winners instead of near-ties.
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_path)
    return out_path


def full_logprobs(model, ids: list[int], temperature: float = 1.0):
    """log_softmax(logits / T) at every position of `ids`, computed without any cache or padding."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)
