"""benchmarks/step.py's shapes: the synthetic Qwen2 shapes and the real models with run_real.sh's
settings, the steps they run, and how a synthetic shape's model, tokenizer and problems are built
(see step.py's docstring for what each is for)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

from model_shapes import QWEN25_05B, QWEN25_15B, QWEN25_COMMON

SHAPES = {
    "0.5b": QWEN25_05B,
    "1.5b": QWEN25_15B,
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **dict(QWEN25_COMMON, vocab_size=1024, max_position_embeddings=8192),
    ),
}
# The real models and run_real.sh's settings for them (see the module docstring).
REAL_SHAPES = {
    "smollm2": dict(
        model="smollm2-135m",
        data="data/easy_word_problems.jsonl",
        teacher_tokens=128,
        student_tokens=192,
        lr="1e-5",
        flags=(),
    ),
    "qwen0.5b": dict(
        model="qwen2.5-coder-0.5b",
        data="data/house_rules.jsonl",
        teacher_tokens=192,
        student_tokens=320,
        lr="3e-6",
        flags=("--n-holdout-samples", "2"),
    ),
}
# run_real.sh's step on a GPU and on the CPU: rollout batch, holdout, k, G, K, m.
REAL_GPU_STEP = dict(rollout_batch_size=24, heldout_ipb=16, k=2, g=8, inner_iterations=2, m=2)
REAL_CPU_STEP = dict(rollout_batch_size=6, heldout_ipb=4, k=1, g=4, inner_iterations=1, m=2)
SYNTHETIC_STEP = dict(rollout_batch_size=8, heldout_ipb=4, k=2, g=8, inner_iterations=2, m=2)
STEP_KEYS = tuple(SYNTHETIC_STEP)
WORDS = (
    "the farmer market basket apples crate river boat morning evening price coins bag sold bought each "
    "between friends shared travelled miles garden rows seeds planted baker loaves oven hour workers "
    "factory boxes shelf library books pages class students teacher bus trip tickets"
).split()


def make_rows(count: int, chars: int, seed: int) -> list[dict[str, Any]]:
    """Word problems of about `chars` characters: a long story with two numbers, then the question."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        story = []
        while sum(len(s) + 1 for s in story) < chars - 120:
            story.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
        middle = len(story) // 2
        story.insert(middle, f"In the first part there were {a} items.")
        story.append(f"Later {b} more items arrived.")
        rows.append(
            {
                "prompt": " ".join(story) + " How many items were there in total?",
                "label": str(a + b),
                "rubric": f"Full credit: final answer {a + b}; {a} + {b}.",
                "topic": f"topic{i % 8}",
            }
        )
    return rows


def padded_char_tokenizer(texts: Sequence[str], vocab_size: int):
    """The project's character tokenizer, its vocabulary filled up to `vocab_size` with one token per
    further Unicode character, so every id the random model samples decodes to one character that
    encodes back to that id: a 64-token reply is 64 characters, and 64 tokens in the next prompt."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from slime_meta.models.tiny.tokenizer import train_char_tokenizer

    base = train_char_tokenizer(texts)
    backend = base.backend_tokenizer
    vocab = dict(backend.get_vocab(with_added_tokens=False))
    codepoint = 0x100
    while len(vocab) < vocab_size:
        character = chr(codepoint)
        if not 0xD800 <= codepoint <= 0xDFFF and codepoint & 0xFFFE != 0xFFFE and character not in vocab:
            vocab[character] = len(vocab)  # not a surrogate, not a noncharacter, not there yet
        codepoint += 1
    padded = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=base.unk_token, byte_fallback=True))
    padded.add_special_tokens([base.bos_token, base.eos_token, base.pad_token, base.unk_token])
    padded.decoder, padded.post_processor = backend.decoder, backend.post_processor
    return PreTrainedTokenizerFast(
        tokenizer_object=padded,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        unk_token=base.unk_token,
        model_max_length=10**9,
    )


def build_model_dir(shape: dict, tokenizer, out: Path, device: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape, **ids))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model.to(dtype).save_pretrained(out)
    del model
    tokenizer.save_pretrained(out)
    if device == "cuda":
        torch.cuda.empty_cache()
    return out
