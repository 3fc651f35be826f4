"""The local trainer's settings (`TrainerSettings`, `DistillSettings`) and the process-level
choices it makes: its device, glibc's handling of large freed blocks, and freed memory handed back
after each step."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field

import torch

from slime_meta.backends.local.training.channels import LossSettings


def release_freed_memory_promptly() -> bool:
    """glibc: blocks of 1 MiB and more mapped on their own and unmapped when freed, at a fixed size.

    By default glibc raises that size (up to 32 MiB) after each such block is freed, so the next
    step's activations come from the heap, where freed memory stays resident: measured on the real
    model, the second step's peak was 2 GB above the first for 1 GB of AdamW state. With a fixed
    size, resident memory follows the live tensors. False where this is not glibc, or where the
    environment sets the size itself (MALLOC_MMAP_THRESHOLD_, which then stays as set).
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 20))


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def return_freed_heap() -> bool:
    """glibc: hand the free pages of every malloc arena back to the system (`malloc_trim(0)`).

    A step's tensors under the mmap threshold (1 MiB, above) come from the trainer thread's arena, and
    glibc gives an arena's freed memory back only from its top: the rest stays resident. On the demo
    run (2-core CPU) that arena held 7 MiB of live data and 10-60 MiB of free memory, a different
    amount after each step, so the trainer's resident memory jumped by tens of MiB from step to step
    and a soak's medians moved with it. Called after each step, once its tensors are freed: 7-56 MiB
    went back each time, in 1-11 ms (median 4); the next step faults its pages in again. False where
    this is not glibc.
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass(frozen=True)
class DistillSettings:
    """Context distillation of the policy's own solutions (the solver side of channel 1).

    `adv_tau` weights the solver samples' task advantage (a GRPO term on the solver's tokens): 0
    unless asked, so that turning distillation on adds only the distillation signal. `adv_tau`
    alone (both taus 0) is a solver-role GRPO term of its own: it needs no context's log-probs.
    """

    adv_tau: float = 0.0
    teacher_tau: float = 0.0
    student_tau: float = 0.0

    @property
    def on(self) -> bool:
        return self.adv_tau != 0.0 or self.teacher_tau != 0.0 or self.student_tau != 0.0


@dataclass(frozen=True)
class TrainerSettings:
    lr: float
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    micro_batch_size: int = 8
    temperature: float = 1.0  # the teacher's sampling temperature
    device: str = "auto"
    loss: LossSettings = field(default_factory=LossSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)
    # Output projection on the loss rows only (response tokens), from the decoder's hidden states,
    # for model types whose logits are exactly lm_head(hidden) (SPLIT_HEAD_MODEL_TYPES); others,
    # or False, take the full logits. Same function either way, up to float rounding.
    split_head: bool = True
    # torch.compile of each decoder layer (CUDA only; identical layers share one compiled graph).
    # Fuses the elementwise work between the matmuls (RMSNorm, rotary, SiLU, residual adds, the
    # autocast casts). Measured on an H100, Qwen2.5-0.5B shape, 8 x 2,048 tokens: MFU 0.31 -> 0.50,
    # peak memory 38 -> 29 GB, about 8 s of compile in the first step (benchmarks/trainer.py).
    # New sequence lengths recompile once into a dynamic-shape graph. Ignored on CPU. Off unless
    # asked (--compile-layers): the compile is a cost a short or small-model run does not earn back.
    compile_layers: bool = False
    # Sequences with the same prompt (a GRPO group) as one row: the prompt once, each response after
    # it (`packing.py`). Same loss and gradient up to float rounding, the prompt computed once.
    share_prompt_forward: bool = True
    # Steps in a row with a non-finite loss or gradient norm (each skipped) before the run stops.
    max_skipped_steps: int = 3
    # Dynamic batch size: micro-batches packed by padded tokens (rows x longest row) up to this
    # many, `micro_batch_size` then unused; None: `micro_batch_size` sequences each. The loss is
    # the same either way (each micro-batch weighted by its share of the step's tokens).
    max_tokens_per_gpu: int | None = None
    # Activation checkpointing of every decoder layer (slime's --recompute-granularity full): the
    # backward recomputes each layer's forward instead of keeping its activations.
    recompute_layers: bool = False
    # On the CPU, recompute whatever `recompute_layers` says: kept activations cost about 1.4 MB per
    # token of SmolLM2-135M in float32 (a 2k-token teacher sequence alone: 3 GB), the recompute
    # +22% of the step's CPU time (docs/performance.md, "Trainer memory on CPU with a real model").
    recompute_on_cpu: bool = True
    # The start weights as a second resident model (True) or read from the checkpoint once per
    # step (False, `reference.py`); None: resident on CUDA, read per step on the CPU.
    reference_resident: bool | None = None
    # Steps in a row without a training signal (each skipped) before one console line says so.
    no_signal_warn_after: int = 3
