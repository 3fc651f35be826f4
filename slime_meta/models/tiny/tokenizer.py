"""The tiny model's tokenizer and shape: a character-level tokenizer and a 0.6M-parameter Llama.

The tokenizer is character-level (a BPE model with no merges, trained with `tokenizers` on the
shipped data, printable ASCII always in the vocabulary, byte fallback for anything else), so every
character is one token and `decode(encode(s)) == s` for any text. Encoding adds no special tokens:
no BOS is prepended (the post-processor is explicit about it); EOS ends every completion.
"""

from __future__ import annotations

import string
from typing import Sequence

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
# Printable ASCII (less \v, \f and \r, which byte fallback still covers exactly): ordinary text,
# the math sample included, is one token a character and never <unk>.
ALPHABET = [ch for ch in string.printable if ch not in "\x0b\x0c\r"]
MODEL_SHAPE = dict(
    hidden_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=384,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    # Sequences are short (17 tokens for the student): a small RoPE base spends the rotary
    # frequencies on the distances that matter (copy the word from 4 back), which the prototype's
    # 10000 left to the slowest dimensions; runs here reached exact copying in fewer steps.
    rope_parameters={"rope_type": "default", "rope_theta": 100.0},
)


def train_char_tokenizer(texts: Sequence[str]):
    """A character-level PreTrainedTokenizerFast trained on `texts` (plus printable ASCII).

    BPE with exactly as many tokens as specials + characters, hence no merges: one token per
    character, fixed-length prompts. No normaliser or pre-tokeniser, so spaces and newlines are
    kept as they are; byte fallback (<0xNN> tokens) covers any other character exactly.
    """
    from tokenizers import Tokenizer, decoders, models, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [BOS, EOS, PAD, UNK]
    probe = Tokenizer(models.BPE(unk_token=UNK))
    seen = sorted(set(ALPHABET) | {ch for text in texts for ch in text})
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + len(seen), special_tokens=specials, initial_alphabet=ALPHABET, show_progress=False
    )
    probe.train_from_iterator(texts, trainer=trainer)
    characters = sorted(token for token in probe.get_vocab() if token not in specials)
    # An explicit order (specials, characters, bytes) makes ids independent of trainer internals.
    vocab = {token: index for index, token in enumerate(specials + characters)}
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, byte_fallback=True))
    tokenizer.add_special_tokens(specials)
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")  # adds no BOS/EOS
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )


def new_model(tokenizer):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **MODEL_SHAPE, **ids))
    model.generation_config = GenerationConfig(**ids)
    return model
