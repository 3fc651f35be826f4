"""A random-init tiny Llama with a 4,096-token context and a small BPE tokenizer, and long rows.

Why not the character-level model of `helpers_tiny`: with one token a character, a 2-3k-character
problem fills most of a 4k context by itself; a BPE tokenizer gives the few characters a token
that real tokenizers give, so the rows behave as math problems and rubrics do. The tokenizer is
trained here on the same pseudo-English as the rows (deterministic for a seed), and the model is
as narrow as `helpers_tiny`'s so that thousands of positions stay cheap on a CPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CONTEXT_LENGTH = 4096
VOCAB_SIZE = 1500


def pseudo_words(seed: int = 0, count: int = 400) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghiklmnoprstuvwy") for _ in range(rng.randint(2, 9))) for _ in range(count)]


def pseudo_text(rng: random.Random, words: list[str], chars: int) -> str:
    """Sentences of pseudo-words, about `chars` characters long."""
    out, length = [], 0
    while length < chars:
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "."
        out.append(sentence)
        length += len(sentence) + 1
    return " ".join(out)


def make_long_context_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a BPE tokenizer and a random `LlamaForCausalLM` with `CONTEXT_LENGTH` positions."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    rng, words = random.Random(seed), pseudo_words(seed)
    corpus = [pseudo_text(rng, words, 400) for _ in range(200)] + [
        "0123456789 +-*/=()., Answer: GRADE FEEDBACK Problem Attempt"
    ]
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(out_path)

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=len(tokenizer),
        max_position_embeddings=CONTEXT_LENGTH,
        tie_word_embeddings=True,
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out_path)
    return out_path


def long_rows(seed: int = 1, count: int = 4, chars: int = 2500) -> list[dict]:
    """Rows with problems and rubrics of about `chars` characters each (2-3k: real math problems)."""
    rng, words = random.Random(seed), pseudo_words(0)
    return [
        {
            "prompt": pseudo_text(rng, words, chars),
            "label": str(rng.randint(10, 99)),
            "rubric": pseudo_text(rng, words, chars),
        }
        for _ in range(count)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
