"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_real import hf_greedy_references, real_checkpoint_or_skip
from helpers_tiny import make_random_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding a random-init tiny Llama and its character-level tokenizer."""
    return make_random_tiny_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))


@pytest.fixture(scope="session")
def real_checkpoint() -> Path:
    """The shipped real model (SmolLM2-135M-Instruct) as an HF directory, fetched and converted once per machine."""
    return real_checkpoint_or_skip()


@pytest.fixture(scope="session")
def real_hf_greedy(real_checkpoint: Path) -> dict[str, tuple[list[int], list[int]]]:
    """HF generate's greedy answers of the real model, the reference of more than one engine test: computed once."""
    return hf_greedy_references(real_checkpoint)


# The tiny checkpoint's model and tokenizer, as the worker tests compare against them.
@pytest.fixture(scope="module")
def reference_model(tiny_checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)
