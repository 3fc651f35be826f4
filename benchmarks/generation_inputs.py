"""benchmarks/generation.py's inputs: the models it measures (a random-init Qwen2.5-0.5B shape or
the tiny Llama, with a word-level tokenizer whose every id decodes), the random prompts of the
timed requests and the greedy check's prompts (chat-template questions for a real checkpoint)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from model_shapes import QWEN25_05B

CHAT_QUESTIONS = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and what is it famous for?",
    "Ana has 3 marbles and gets 5 more. How many marbles does she have now?",
    "Give three tips for learning a new language.",
    "Describe how a bicycle works to a child.",
    "A train travels 60 km in 1.5 hours. What is its average speed?",
    "Name two planets of the solar system and one fact about each.",
)


def wordlevel_tokenizer(vocab_size: int):
    """A tokenizer with exactly `vocab_size` ids (w0 w1 ...), so any sampled id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=10**9,
    )


def build_model_dir(kind: str, out: Path, dtype: torch.dtype) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if kind == "qwen0.5b":
        config = Qwen2Config(**QWEN25_05B, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        from slime_meta.models.tiny.tokenizer import MODEL_SHAPE

        shape = dict(MODEL_SHAPE, max_position_embeddings=1024)  # 128 + 128 tokens fit with room
        config = LlamaConfig(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(0)
    with torch.device("cuda" if kind == "qwen0.5b" and torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config).to(dtype)  # random init on the GPU: seconds
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    del model
    wordlevel_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (count, length), generator=g).tolist()


def check_prompts(args: argparse.Namespace, model_dir: Path, vocab: int) -> list[list[int]]:
    """The greedy and log-prob check's prompts: chat-template questions for a real checkpoint (through
    its own tokenizer), else the first random prompts of the timed batch."""
    if not args.model_path:
        return prompts(args.concurrency, args.prompt_len, vocab, seed=1)[: args.check_prompts]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(args.check_prompts)]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
    ]
