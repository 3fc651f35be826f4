"""Dividing one GPU between the local trainer and the workers that share it, checked at start.

The workers' share is given, as in slime, by --sglang-mem-fraction-static F: each worker may hold
F x the GPU's total memory for its weights and static KV cache (slime_meta_engine/fast_path/memory_budget.py). The
trainer's need is estimated from its model and settings (`estimate_trainer`); a split whose sum
exceeds the GPU is refused before anything starts, with the numbers and the flag to change,
instead of an out-of-memory error in the first rollout or step.

Trainer estimate (bytes), P parameters, L layers, H hidden size, T tokens of one micro-batch:
- weights, gradients and AdamW's two moments, all float32 (the local trainer keeps fp32 master
  weights under bf16 autocast): 16 P; a frozen reference model (KL, replay DPO) adds 4 P;
- activations: T x H x 96 x L kept for the backward, or with --recompute-granularity full the
  layer inputs T x H x 8 x L plus one layer recomputed, T x H x 180. The factors are calibrated
  on benchmarks/results/trainer_memory_h200.json (0.5B and 1.5B Qwen2 shapes, 8192-token
  micro-batches: measured 84 and 90 per layer unit without recompute, 281 and 368 per token unit
  with it; the estimate is at or above every measurement);
- T: --max-tokens-per-gpu with --use-dynamic-batch-size, else --micro-batch-size x the longest
  response asked for (a lower bound: prompts add to it; dynamic batching gives a real bound);
- 1 GB per process (trainer and each worker) for the CUDA context and allocator slack, and each
  worker's activations (bounded by --sglang-chunked-prefill-size).

Without --sglang-mem-fraction-static, workers that share the trainer's GPU get a share chosen
here (`default_worker_fraction`): together at most AUTO_WORKERS_SHARE of the GPU and never more
than the trainer's estimate leaves. The fraction caps each worker's static KV cache; a small model
whose --max-batch-size x --static-cache-len slots need less takes only what they need.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from slime_meta.errors import UserInputError

logger = logging.getLogger(__name__)
GB = 1e9
PROCESS_OVERHEAD_BYTES = int(1 * GB)
STATE_BYTES_PER_PARAM = 16  # fp32 weights + fp32 gradients + AdamW's two fp32 moments
REFERENCE_BYTES_PER_PARAM = 4
AUTO_WORKERS_SHARE = 0.3  # of the trainer's GPU, for all the workers on it together, when not given
ACTIVATION_BYTES_PER_TOKEN_LAYER_UNIT = 96  # per token, per hidden unit, per layer, all kept
RECOMPUTE_INPUT_BYTES_PER_TOKEN_LAYER_UNIT = 8  # layer inputs kept with full recompute
RECOMPUTE_LAYER_BYTES_PER_TOKEN_UNIT = 180  # the one layer being recomputed and its backward
DEFAULT_TOKENS_PER_GPU = 8192  # --max-tokens-per-gpu where no choice is made (the CPU; plan.py)


@dataclass(frozen=True)
class TrainerEstimate:
    state_bytes: int  # weights, gradients, optimizer state, reference weights
    activation_bytes: int
    micro_batch_tokens: int

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes + PROCESS_OVERHEAD_BYTES


def estimate_trainer(
    *, params: int, num_layers: int, hidden_size: int, micro_batch_tokens: int, recompute: bool, with_reference: bool
) -> TrainerEstimate:
    state = params * (STATE_BYTES_PER_PARAM + (REFERENCE_BYTES_PER_PARAM if with_reference else 0))
    token_units = micro_batch_tokens * hidden_size
    if recompute:
        per_token_unit = RECOMPUTE_INPUT_BYTES_PER_TOKEN_LAYER_UNIT * num_layers + RECOMPUTE_LAYER_BYTES_PER_TOKEN_UNIT
        activations = token_units * per_token_unit
    else:
        activations = token_units * ACTIVATION_BYTES_PER_TOKEN_LAYER_UNIT * num_layers
    return TrainerEstimate(state, activations, micro_batch_tokens)


def gpu_split_problem(
    *, total_bytes: int, trainer: TrainerEstimate, num_workers: int, worker_fraction: float | None
) -> str | None:
    """None when the trainer and `num_workers` workers fit one GPU of `total_bytes`, else one line
    with the numbers and the flag to change. Workers without a fraction are not budgeted and count
    only their process overhead."""
    fraction = worker_fraction or 0.0
    worker_bytes = num_workers * (fraction * total_bytes + PROCESS_OVERHEAD_BYTES)
    need = trainer.total_bytes + worker_bytes
    if need <= total_bytes:
        return None
    trainer_text = (
        f"the trainer ~{trainer.total_bytes / GB:.1f} GB (weights, gradients, AdamW {trainer.state_bytes / GB:.1f} + "
        f"activations {trainer.activation_bytes / GB:.1f} for {trainer.micro_batch_tokens} tokens per micro-batch + "
        f"{PROCESS_OVERHEAD_BYTES / GB:.0f})"
    )
    workers_text = f"{num_workers} worker(s) at --sglang-mem-fraction-static {fraction:g} ~{worker_bytes / GB:.1f} GB"
    room = total_bytes - trainer.total_bytes - num_workers * PROCESS_OVERHEAD_BYTES
    if worker_fraction and room > 0:
        fits = math.floor(room / num_workers / total_bytes * 1000) / 1000  # rounded down: it must fit
        fix = f"lower --sglang-mem-fraction-static to at most {fits:.3f}"
    else:
        fix = (
            "shrink the trainer: --use-dynamic-batch-size with a smaller --max-tokens-per-gpu, "
            "--recompute-granularity full, or put the workers on other GPUs (--rollout-num-gpus)"
        )
    return (
        f"one GPU of {total_bytes / GB:.1f} GB cannot hold {trainer_text} and {workers_text}: "
        f"{need / GB:.1f} GB needed; {fix}"
    )


def default_worker_fraction(*, total_bytes: int, trainer: TrainerEstimate, num_workers: int) -> float | None:
    """Each worker's --mem-fraction-static when the run gives none: an equal part of what the trainer
    leaves, at most AUTO_WORKERS_SHARE of the GPU for them all, rounded down to 0.001. None when
    the trainer leaves nothing (gpu_split_problem then says so)."""
    room = total_bytes - trainer.total_bytes - num_workers * PROCESS_OVERHEAD_BYTES
    share = min(room, AUTO_WORKERS_SHARE * total_bytes) / num_workers / total_bytes
    fraction = math.floor(share * 1000) / 1000
    return fraction if fraction > 0 else None


# ----- the call site's inputs (not pure: reads the model config and the GPU) -------------------


def worker_memory_args(
    mem_fraction_static: float | None,
    chunked_prefill_size: int | None,
    context_length: int | None = None,
    page_size: int | None = None,
    kv_cache: str = "paged",
) -> list[str]:
    """The run-level flags as the worker's own (`python -m slime_meta_engine`)."""
    args = ["--static-cache-len", str(context_length)] if context_length is not None else []
    args += ["--kv-cache", kv_cache]
    if page_size is not None:
        args += ["--page-size", str(page_size)]
    if mem_fraction_static is not None:
        args += ["--mem-fraction-static", repr(mem_fraction_static)]
    if chunked_prefill_size is not None:
        args += ["--chunked-prefill-size", str(chunked_prefill_size)]
    return args


def workers_on_first_gpu(layouts: list[tuple[int, tuple[int, ...] | None]]) -> int:
    """Workers sharing GPU 0 (the trainer's) among `(num_workers, gpu_ids)` pools: all of a pool
    without GPU ids (they see the devices as they are), else those placed on GPU 0."""
    return sum(n if ids is None else sum(ids[i % len(ids)] == 0 for i in range(n)) for n, ids in layouts)


def model_size(model_dir: str) -> tuple[int, int, int]:
    """(parameters, layers, hidden size) of a checkpoint, counted on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # tied weights are yielded once
    text = config.get_text_config()
    return params, text.num_hidden_layers, text.hidden_size


def check_shared_gpu(cfg, model_dir: str, layouts: list[tuple[int, tuple[int, ...] | None]]) -> float | None:
    """The workers' --mem-fraction-static for a trainer-plus-workers split of GPU 0, refusing
    (UserInputError, exit 2) one that cannot fit.

    The run's --sglang-mem-fraction-static when given, else `default_worker_fraction`'s share.
    Nothing is checked (the given fraction, or None, is returned) on a machine without CUDA, with
    --device cpu, or when no worker shares GPU 0. `cfg` is the run's MetaConfig, `layouts` the
    `(num_workers, gpu_ids)` of the pools started.
    """
    import torch

    shared = workers_on_first_gpu(layouts)
    fraction = cfg.pools.sglang_mem_fraction_static
    if cfg.pools.device == "cpu" or not torch.cuda.is_available() or shared == 0:
        return fraction
    t, sampling = cfg.train, cfg.sampling
    if t.use_dynamic_batch_size:
        tokens = t.max_tokens_per_gpu or DEFAULT_TOKENS_PER_GPU
    else:
        tokens = t.micro_batch_size * max(sampling.teacher_max_tokens, sampling.rollout_max_response_len)
    params, num_layers, hidden_size = model_size(model_dir)
    trainer = estimate_trainer(
        params=params,
        num_layers=num_layers,
        hidden_size=hidden_size,
        micro_batch_tokens=tokens,
        recompute=t.recompute_granularity == "full",
        with_reference=cfg.objectives.needs_reference,
    )
    total = torch.cuda.get_device_properties(0).total_memory
    if fraction is None:
        fraction = default_worker_fraction(total_bytes=total, trainer=trainer, num_workers=shared)
    problem = gpu_split_problem(total_bytes=total, trainer=trainer, num_workers=shared, worker_fraction=fraction)
    if problem is not None:
        raise UserInputError(problem)
    logger.info(
        "GPU 0 (%.1f GB): trainer ~%.1f GB, %d worker(s) at --sglang-mem-fraction-static %s",
        total / GB,
        trainer.total_bytes / GB,
        shared,
        fraction,
    )
    return fraction
