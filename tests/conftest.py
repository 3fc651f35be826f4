"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_tiny import make_random_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding a random-init tiny Llama and its character-level tokenizer."""
    return make_random_tiny_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))
