"""What a train step holds of the GPU's memory, as the caching allocator counts it.

The driver's figure for a process (nvidia-smi, what benchmarks/soak.py reads) includes the caching
allocator's reserve, which grows when a step needs a block that no cached one fits and is kept for
later steps: a rise there may be a longer batch, or fragmentation, or tensors kept. The allocator's
own figures tell them apart: `memory/gpu_allocated_mib` after the step (the weights, the optimizer's
moments and whatever a step keeps), `memory/gpu_peak_allocated_mib`, the most it has held so far
(the process's peak: benchmarks reset it around what they time, so the trainer leaves it alone),
and `memory/gpu_reserved_mib`, the reserve. Reading them costs no synchronisation.
"""

from __future__ import annotations

import torch

MIB = 1024 * 1024


def step_metrics(device: torch.device) -> dict[str, float]:
    """The allocator's figures after a step (none off the GPU)."""
    if device.type != "cuda":
        return {}
    return {
        "memory/gpu_allocated_mib": torch.cuda.memory_allocated(device) / MIB,
        "memory/gpu_peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
        "memory/gpu_reserved_mib": torch.cuda.memory_reserved(device) / MIB,
    }
