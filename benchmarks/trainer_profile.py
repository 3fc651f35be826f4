"""Profiling helpers of benchmarks/trainer.py (also read by shared_prompts.py): one step under
torch.profiler, its device time by kernel class, and the device sync the timings need."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_step(step: Callable[[], dict], device: torch.device, top: int = 12) -> dict[str, Any]:
    """One more step under torch.profiler: the ops that take the most device time, and the CPU's share."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        sync(device)
    wall_ms = 1000 * (time.perf_counter() - t0)
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        dev = getattr(e, "self_cuda_time_total", 0) if dev is None else dev
        rows.append(
            {
                "name": e.key[:100],
                "self_device_ms": dev / 1000,
                "self_cpu_ms": e.self_cpu_time_total / 1000,
                "calls": e.count,
            }
        )
    by_device = sorted(rows, key=lambda r: -r["self_device_ms"])
    by_cpu = sorted(rows, key=lambda r: -r["self_cpu_ms"])
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):  # kernels only: no double count with their ops
            dev = getattr(e, "self_device_time_total", None)
            dev = getattr(e, "self_cuda_time_total", 0) if dev is None else dev
            category = kernel_category(e.key)
            kernels[category] = kernels.get(category, 0.0) + dev / 1000
    return {
        "wall_ms_profiled": wall_ms,
        "kernel_ms_total": sum(kernels.values()),
        "kernel_ms_by_category": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
        "top_device": by_device[:top],
        "top_cpu": by_cpu[:6],
    }


def kernel_category(name: str) -> str:
    """Coarse class of a CUDA kernel by its name: where the step's device time goes."""
    lowered = name.lower()
    if "flash" in lowered or "fmha" in lowered or "attention" in lowered:  # before matmul: built on cutlass
        return "attention"
    if any(k in lowered for k in ("nvjet", "gemm", "xmma", "cutlass", "sm90_")):
        return "matmul"
    if any(k in name for k in ("token_stats_forward", "token_logp_backward", "divergence_")):
        return "fused loss kernels"
    if lowered.startswith("triton_"):
        return "compiled elementwise (inductor)"
    if "adam" in lowered or "multi_tensor" in lowered:
        return "optimizer"
    if "reduce" in lowered or "norm" in lowered:
        return "reductions (eager)"
    if "memcpy" in lowered or "memset" in lowered or "copy" in lowered:
        return "copies"
    if "elementwise" in lowered or "index" in lowered or "scatter" in lowered or "gather" in lowered:
        return "elementwise (eager)"
    return "other"
