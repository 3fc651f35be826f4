"""The trainer's memory settings chosen at start on a GPU (`backends/local/training/plan.py`), at Qwen2.5 shapes on
80 GiB and 141 GiB GPUs, and the CPU left as it was."""

from __future__ import annotations

import pytest

from slime_meta.backends.local.training.gpu_split import default_worker_fraction, gpu_split_problem
from slime_meta.backends.local.training.plan import (
    DEFAULT_TOKENS_PER_GPU,
    RECOMPUTE_TOKEN_BUDGETS,
    choose_trainer_plan,
    plan_trainer,
    trainer_budget_bytes,
)
from slime_meta.config.arguments import parse_config

H100 = 81559 * 2**20  # torch's total_memory of an 80 GB H100
H200 = 143771 * 2**20
SHAPES = {
    "0.5b": dict(params=494_032_768, num_layers=24, hidden_size=896),
    "1.5b": dict(params=1_543_714_304, num_layers=28, hidden_size=1536),
}


def plan(shape: str, total: int, **given):
    budget = trainer_budget_bytes(total_bytes=total, num_workers=1, worker_fraction=given.pop("fraction", None))
    return choose_trainer_plan(**SHAPES[shape], with_reference=True, budget_bytes=budget, num_steps=4, **given)


@pytest.mark.parametrize(
    "shape, total, tokens",
    [
        ("0.5b", H100, 16384),
        ("1.5b", H100, 16384),
        ("0.5b", H200, 16384),
        ("1.5b", H200, 16384),
        ("0.5b", 24 * 10**9, 8192),
        ("1.5b", 52 * 10**9, 4096),
    ],
)
def test_layers_are_recomputed_at_the_largest_budget_that_fits(shape, total, tokens):
    chosen = plan(shape, total)
    assert (chosen.max_tokens_per_gpu, chosen.recompute, chosen.compile_layers) == (tokens, True, True)
    assert chosen.estimate.total_bytes <= chosen.budget_bytes and not chosen.given
    # The split check at start agrees: the workers' default share still fits beside the trainer.
    fraction = default_worker_fraction(total_bytes=total, trainer=chosen.estimate, num_workers=1)
    assert (
        gpu_split_problem(total_bytes=total, trainer=chosen.estimate, num_workers=1, worker_fraction=fraction) is None
    )
    if tokens < max(RECOMPUTE_TOKEN_BUDGETS):  # the next larger budget would not have fitted
        larger = plan(shape, total, max_tokens_per_gpu=tokens * 2)
        assert larger.estimate.total_bytes > larger.budget_bytes


def test_a_given_setting_is_kept_and_the_others_chosen_around_it():
    kept = plan("1.5b", H100, recompute=False)  # activations kept only when asked for
    assert (kept.max_tokens_per_gpu, kept.recompute) == (8192, False) and kept.given == {"recompute"}
    assert "activations kept (given)" in kept.line()
    chosen = plan("1.5b", H100, max_tokens_per_gpu=4096)
    assert (chosen.max_tokens_per_gpu, chosen.recompute) == (4096, True) and chosen.given == {"tokens"}
    forced = plan("0.5b", H100, recompute=True, compile_layers=False)
    assert (forced.max_tokens_per_gpu, forced.recompute, forced.compile_layers) == (16384, True, False)
    line = forced.line()
    assert (
        "16384 tokens (chosen)" in line and "every layer recomputed (given)" in line and "not compiled (given)" in line
    )
    # Nothing fits: the smallest recomputed budget, which the split check then refuses with its numbers.
    tiny_gpu = plan("1.5b", 20 * 10**9)
    assert (tiny_gpu.max_tokens_per_gpu, tiny_gpu.recompute) == (4096, True)
    assert tiny_gpu.estimate.total_bytes > tiny_gpu.budget_bytes


def test_short_runs_are_not_compiled():
    budget = trainer_budget_bytes(total_bytes=H100, num_workers=1, worker_fraction=None)
    short = choose_trainer_plan(**SHAPES["0.5b"], with_reference=False, budget_bytes=budget, num_steps=3)
    assert not short.compile_layers


def test_the_cpu_keeps_its_settings(tiny_checkpoint):
    base = [
        "--use-meta-learning",
        "--prompt-data",
        "data/math_word_problems.jsonl",
        "--hf-checkpoint",
        str(tiny_checkpoint),
        "--device",
        "cpu",
    ]
    cfg, line = plan_trainer(parse_config(base), str(tiny_checkpoint), workers_on_gpu0=1)
    assert line is None and cfg.train.max_tokens_per_gpu == DEFAULT_TOKENS_PER_GPU == 8192
    assert cfg.train.recompute_granularity is None and cfg.train.compile_layers is False
    given, _ = plan_trainer(parse_config(base + ["--max-tokens-per-gpu", "2048"]), str(tiny_checkpoint), 1)
    assert given.train.max_tokens_per_gpu == 2048
