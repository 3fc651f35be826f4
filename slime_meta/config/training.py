"""Flags and config of the trainer: the optimizer, PPO clipping, batching, and the weight sync."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime_meta.config.flag_types import AddFlag, positive_int


@dataclass(frozen=True)
class TrainConfig:
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    clip_grad: float
    eps_clip: float
    eps_clip_high: float | None
    micro_batch_size: int
    std_normalize: bool
    compile_layers: bool | None = None  # None: chosen at start (local backend on CUDA), else off
    share_prompt_forward: bool = True
    max_skipped_steps: int = 3
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None  # None: chosen at start on CUDA, 8192 elsewhere
    recompute_granularity: str | None = None  # None: full on CUDA (chosen at start), the CPU always recomputes
    weight_sync: str = "auto"


def add_train_flags(add: AddFlag) -> None:
    """The optimizer step, micro-batches, memory and how weights reach the workers."""
    add("--lr", type=float, default=1e-5, help="AdamW learning rate.")
    add("--weight-decay", type=float, default=0.0, help="AdamW weight decay.")
    add("--adam-beta1", type=float, default=0.9, help="AdamW beta1.")
    add("--adam-beta2", type=float, default=0.999, help="AdamW beta2.")
    add("--clip-grad", type=float, default=1.0, help="Clip the gradient's global norm to this.")
    add("--eps-clip", type=float, default=0.2, help="PPO clip: the ratio pi/pi_old is kept within [1 - eps, 1 + eps].")
    add(
        "--eps-clip-high",
        type=float,
        default=None,
        help="Upper PPO clip (1 + eps_high), e.g. 0.28 (DAPO's clip-higher); default: --eps-clip.",
    )
    add("--micro-batch-size", type=positive_int, default=8, help="Sequences per forward pass (gradients accumulate).")
    add(
        "--std-normalize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Divide GRPO advantages by the group's std (--no-std-normalize, or slime's spelling "
        "--disable-grpo-std-normalization: Dr.GRPO).",
    )
    add(
        "--disable-grpo-std-normalization",
        dest="std_normalize",
        action="store_false",
        default=argparse.SUPPRESS,  # the default is --std-normalize's
        help="slime's name for --no-std-normalize, the same on both backends.",
    )
    add(
        "--compile-layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Local backend on CUDA: torch.compile each decoder layer (H100, 0.5B model: MFU 0.31 -> 0.49; "
        "about 8 s of compile in the first step and once more for new sequence lengths). Default: on for "
        "runs of 4 steps or more, off otherwise (the start line says which).",
    )
    add(
        "--share-prompt-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Local backend: the sequences of one prompt (a GRPO group's samples) are one row in the trainer's "
        "forward and backward, the prompt computed once and each response attending to it and to its own "
        "tokens: the same loss and gradient up to float rounding, for about G times fewer prompt tokens. "
        "Runs where the model's attention is SDPA (transformers' default); --no-share-prompt-forward: one "
        "row per sequence.",
    )
    add(
        "--use-dynamic-batch-size",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Local backend: micro-batches by token count (slime's meaning): sequences packed, shortest first, while "
        "rows x longest row stays within --max-tokens-per-gpu; a longer sequence is a micro-batch of its own; "
        "--micro-batch-size is then unused. The loss is the step's token mean either way. Default: on locally "
        "(a step's memory then has a bound whatever the prompt lengths; slime's own default is off); "
        "--no-use-dynamic-batch-size: --micro-batch-size sequences per forward.",
    )
    add(
        "--max-tokens-per-gpu",
        type=positive_int,
        default=None,
        help="Token budget per micro-batch with --use-dynamic-batch-size (padded tokens of one forward); "
        "with --no-use-dynamic-batch-size the local trainer does not use it (slime also reads it on its own). "
        "Default locally: on CUDA the largest of 16384 / 8192 / 4096 that fits the trainer's share of the GPU "
        "(the start line says which); 8192 on the CPU.",
    )
    add(
        "--recompute-granularity",
        choices=["full", "selective", "none"],
        default=None,
        help="Activation checkpointing, Megatron's flag. Local backend: 'full' checkpoints every decoder layer "
        "(as full / --recompute-method uniform / --recompute-num-layers 1): the backward recomputes each "
        "layer's forward, about one extra forward for the layer activations' memory; 'none' keeps the "
        "activations (on a GPU; local only); 'selective' is slime's only. Default locally: 'full' (kept "
        "activations measured 4.6x the trainer's memory for 7%% of a step, docs/performance.md section 8).",
    )
    add(
        "--max-skipped-steps",
        type=positive_int,
        default=3,
        help="Local backend: a step whose loss or gradient norm is not finite is skipped (weights, optimizer state "
        "unchanged, nothing pushed); this many in a row stop the run, the last checkpoint intact.",
    )
    add(
        "--weight-sync",
        choices=["auto", "disk", "shared-memory", "cuda-ipc"],
        default="auto",
        help="Local backend: how the trained weights reach the teacher workers after each step. disk: safetensors "
        "under the run directory + /update_weights_from_disk; shared-memory: one /dev/shm buffer in the "
        "workers' dtype; cuda-ipc: one CUDA buffer the workers copy from on the same GPU. Default auto: "
        "cuda-ipc when the trainer and every teacher worker are on one and the same GPU, shared-memory for "
        "the run's own workers otherwise, disk when /dev/shm has no room. Checkpoints (--save) are unchanged.",
    )
