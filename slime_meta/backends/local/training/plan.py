"""The local trainer's memory settings on a GPU, chosen at start from the memory it is left.

Three settings trade memory for speed: the token budget of one micro-batch
(--max-tokens-per-gpu), activation checkpointing (--recompute-granularity full) and compiled
decoder layers (--compile-layers). Each one the run leaves out is chosen here, on CUDA, from the
trainer's share of GPU 0 (the GPU's memory less the workers' share, `gpu_split.py`) and the
trainer estimate (`estimate_trainer`):

- every layer recomputed, with the largest of RECOMPUTE_TOKEN_BUDGETS that fits (the smallest when
  none does: the split check then refuses the run with the numbers). Measured in the whole loop
  (benchmarks/step.py, one H200, 2026-11-25, 0.5B shape, 16,384-token micro-batches): recomputed,
  trainer peak 16.3 GiB (estimate 16.3) and train 7.15 s per step; activations kept, 75.6 GiB
  (estimate 44.7) for 5.96 s. The estimate of kept activations misses the loop's mix of lengths
  and passes by up to 1.7x, and the 17% it saves on the train part is 7% of a step: kept
  activations are chosen only when asked for (--recompute-granularity none);
- layers compiled when the run is long enough to earn the first step's compile back
  (AUTO_COMPILE_MIN_STEPS; benchmarks/trainer.py: 0.5B MFU 0.32 -> 0.48, 7-9 s of compile).

A setting the run gives is kept as given, and the others are chosen around it. On the CPU nothing
is chosen: the budget is DEFAULT_TOKENS_PER_GPU, and the trainer recomputes there by design.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_meta.backends.local.training.gpu_split import (
    AUTO_WORKERS_SHARE,
    DEFAULT_TOKENS_PER_GPU,
    GB,
    PROCESS_OVERHEAD_BYTES,
    TrainerEstimate,
    estimate_trainer,
)

__all__ = ["DEFAULT_TOKENS_PER_GPU", "TrainerPlan", "choose_trainer_plan", "plan_trainer", "trainer_budget_bytes"]
# 16,384 is the largest micro-batch measured (8 x 2,048 tokens); larger ones hold more memory for
# a gain not measured, and a longer sequence still runs alone in its own micro-batch. Kept
# activations (asked for) try the same budgets.
KEPT_TOKEN_BUDGETS = (16384, 8192)
RECOMPUTE_TOKEN_BUDGETS = (16384, 8192, 4096)
AUTO_COMPILE_MIN_STEPS = 4


@dataclass(frozen=True)
class TrainerPlan:
    max_tokens_per_gpu: int
    recompute: bool
    compile_layers: bool
    estimate: TrainerEstimate
    budget_bytes: int  # what the trainer may hold on GPU 0
    given: frozenset[str]  # of "tokens", "recompute", "compile": those the run set itself

    def line(self) -> str:
        """The start line: each setting and whether it was chosen or given."""

        def how(name: str) -> str:
            return "given" if name in self.given else "chosen"

        activations = "every layer recomputed" if self.recompute else "activations kept"
        compiled = "layers compiled" if self.compile_layers else "layers not compiled"
        return (
            f"trainer on GPU 0: micro-batches of {self.max_tokens_per_gpu} tokens ({how('tokens')}), "
            f"{activations} ({how('recompute')}), {compiled} ({how('compile')}): "
            f"~{self.estimate.total_bytes / GB:.1f} GB of the {self.budget_bytes / GB:.1f} GB the workers leave"
        )


def trainer_budget_bytes(*, total_bytes: int, num_workers: int, worker_fraction: float | None) -> int:
    """GPU 0's memory less the workers on it: each its --sglang-mem-fraction-static share (without
    one, all of them together AUTO_WORKERS_SHARE, as `default_worker_fraction` gives them at most)
    and its process overhead."""
    if worker_fraction is not None:
        workers = num_workers * worker_fraction * total_bytes
    else:
        workers = AUTO_WORKERS_SHARE * total_bytes if num_workers else 0.0
    return int(total_bytes - workers - num_workers * PROCESS_OVERHEAD_BYTES)


def choose_trainer_plan(
    *,
    params: int,
    num_layers: int,
    hidden_size: int,
    with_reference: bool,
    budget_bytes: int,
    num_steps: int,
    max_tokens_per_gpu: int | None = None,
    recompute: bool | None = None,
    compile_layers: bool | None = None,
) -> TrainerPlan:
    """The settings for a trainer that may hold `budget_bytes`; None for a setting: choose it."""

    def estimate(tokens: int, recomputes: bool) -> TrainerEstimate:
        return estimate_trainer(
            params=params,
            num_layers=num_layers,
            hidden_size=hidden_size,
            micro_batch_tokens=tokens,
            recompute=recomputes,
            with_reference=with_reference,
        )

    # In order of preference: the largest budget first; kept activations only when asked for.
    recomputes = True if recompute is None else recompute
    budgets = RECOMPUTE_TOKEN_BUDGETS if recomputes else KEPT_TOKEN_BUDGETS
    candidates = [(tokens, recomputes) for tokens in ((max_tokens_per_gpu,) if max_tokens_per_gpu else budgets)]
    fitting = [c for c in candidates if estimate(*c).total_bytes <= budget_bytes]
    tokens, recomputes = fitting[0] if fitting else candidates[-1]
    given = {
        name
        for name, value in (("tokens", max_tokens_per_gpu), ("recompute", recompute), ("compile", compile_layers))
        if value is not None
    }
    compiled = compile_layers if compile_layers is not None else num_steps >= AUTO_COMPILE_MIN_STEPS
    return TrainerPlan(tokens, recomputes, compiled, estimate(tokens, recomputes), budget_bytes, frozenset(given))


# ----- the call site (not pure: reads the model config and the GPU) ---------------------------


def plan_trainer(cfg, model_dir: str, workers_on_gpu0: int):
    """`cfg` (the run's MetaConfig) with the trainer's memory settings it leaves out chosen, and the
    start line saying what was chosen (None where nothing is: the CPU, or a trainer without CUDA)."""
    import dataclasses

    import torch

    from slime_meta.backends.local.training.gpu_split import model_size

    t = cfg.train
    if cfg.pools.device == "cpu" or not torch.cuda.is_available():
        tokens = t.max_tokens_per_gpu or DEFAULT_TOKENS_PER_GPU
        train = dataclasses.replace(t, max_tokens_per_gpu=tokens, compile_layers=bool(t.compile_layers))
        return dataclasses.replace(cfg, train=train), None
    params, num_layers, hidden_size = model_size(model_dir)
    total = torch.cuda.get_device_properties(0).total_memory
    budget = trainer_budget_bytes(
        total_bytes=total, num_workers=workers_on_gpu0, worker_fraction=cfg.pools.sglang_mem_fraction_static
    )
    recompute = None if t.recompute_granularity is None else t.recompute_granularity == "full"
    # Without dynamic batches a micro-batch is --micro-batch-size sequences: its tokens are not chosen here.
    longest_response = max(cfg.sampling.teacher_max_tokens, cfg.sampling.rollout_max_response_len)
    tokens = t.max_tokens_per_gpu if t.use_dynamic_batch_size else t.micro_batch_size * longest_response
    plan = choose_trainer_plan(
        params=params,
        num_layers=num_layers,
        hidden_size=hidden_size,
        with_reference=cfg.objectives.needs_reference,
        budget_bytes=budget,
        num_steps=cfg.meta.num_rollout,
        recompute=recompute,
        compile_layers=t.compile_layers,
        max_tokens_per_gpu=tokens,
    )
    train = dataclasses.replace(
        t,
        max_tokens_per_gpu=plan.max_tokens_per_gpu if t.use_dynamic_batch_size else t.max_tokens_per_gpu,
        compile_layers=plan.compile_layers,
        recompute_granularity="full" if plan.recompute else "none",
    )
    return dataclasses.replace(cfg, train=train), plan.line()
