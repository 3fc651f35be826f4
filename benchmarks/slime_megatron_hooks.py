"""What slime (624b824) needs from Megatron for `benchmarks/slime_megatron.py` without TransformerEngine,
at any tensor and data parallel size: hooks slime takes by flag, named in the training command line.

  --spec slime_megatron_hooks packed_local_layer_spec     Megatron's local layer spec with an attention that
                                                          takes slime's THD-packed micro-batches
  --custom-megatron-init-path slime_megatron_hooks.actor_init
                                                          the local spec's input norm for slime's HF loader
                                                          (local_spec_hf_names), and each rank's peak GPU
                                                          memory in the log (report_peak_memory)
  --custom-megatron-init-path slime_megatron_hooks.actor_init_fp32
                                                          the same, with the model and optimizer in float32
                                                          (the train stage's --fp32)
  --custom-megatron-before-train-step-hook-path slime_megatron_hooks.grad_norm_report
                                                          each parameter's gradient norm in the log (--grad-report)
  numpy_gate_site(out)                                    a sitecustomize for slime's numpy-1.x assertion

Imported by slime's Megatron actor (a Ray worker): benchmarks/ is on its PYTHONPATH (the train stage sets it).
Nothing here imports Megatron or slime at module level.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

# The spec for Megatron's local layers over slime's packed micro-batches, and the name translation,
# are the product's (`--transformer-impl local` on the slime backend); re-exported for the flags above.
from slime_meta.backends.slime.megatron_local import packed_local_layer_spec, translate_local_spec_names

__all__ = ["packed_local_layer_spec", "actor_init", "actor_init_fp32", "grad_norm_report", "numpy_gate_site"]


def actor_init(args) -> None:
    """--custom-megatron-init-path hook: runs in every Megatron actor after torch.distributed is up."""
    local_spec_hf_names(args)
    report_peak_memory()


def report_peak_memory(interval_s: float = 0.5) -> None:
    """Log this rank's torch allocator peak whenever it grows by 1% or more (a daemon thread): slime logs
    memory only between steps, and the benchmark wants each rank's peak during the step. The lines read
    `peak_memory rank R: allocated A GiB reserved B GiB` (the benchmark's train stage parses them)."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.cuda.current_device()

    def watch():
        logged = 0
        while True:
            allocated = torch.cuda.max_memory_allocated(device)
            if allocated > logged * 1.01:
                logged = allocated
                reserved = torch.cuda.max_memory_reserved(device)
                print(
                    f"peak_memory rank {rank}: allocated {allocated / 2**30:.3f} GiB "
                    f"reserved {reserved / 2**30:.3f} GiB",
                    flush=True,
                )
            time.sleep(interval_s)

    threading.Thread(target=watch, name="peak-memory", daemon=True).start()


def local_spec_hf_names(args) -> None:
    """The local spec's layer-norm names for slime's HF->Megatron loaders and Megatron->HF converters
    (slime_meta.backends.slime.megatron_local, which `--transformer-impl local` runs use too)."""
    translate_local_spec_names()


NUMPY_GATE_SITE = '''"""slime's Megatron init asserts numpy 1.x (slime/backends/megatron_utils/initialize.py, after
Megatron-LM issue 1563: its dataset index helpers); slime's trainer does not use those helpers. Where numpy is
2.x (and the installed scipy needs it), this lets that one module see a 1.x version string: `np` in
slime.backends.megatron_utils.initialize forwards everything else to numpy. Written by
benchmarks/slime_megatron_hooks.py; on PYTHONPATH of the training run only."""
import importlib, importlib.abc, sys

TARGET = "slime.backends.megatron_utils.initialize"


class _NumpyUnderGate:
    def __init__(self, numpy):
        self._numpy, self.__version__ = numpy, "1.99 (numpy " + numpy.__version__ + " past slime's 1.x gate)"

    def __getattr__(self, name):
        return getattr(self._numpy, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import numpy
            module.np = _NumpyUnderGate(numpy)

        spec.loader.exec_module = exec_module
        return spec


import importlib.util  # noqa: E402

sys.meta_path.insert(0, _Finder())
# Then any sitecustomize this one shadows.
_here = __file__.rsplit("/", 1)[0]
del sys.modules["sitecustomize"]
_saved = list(sys.path)
sys.path[:] = [p for p in sys.path if p.rstrip("/") != _here]
try:
    importlib.import_module("sitecustomize")
except ImportError:
    pass
finally:
    sys.path[:] = _saved
'''


def numpy_gate_site(out: Path) -> str | None:
    """A sitecustomize directory for the training run when numpy is 2.x (see NUMPY_GATE_SITE), else None."""
    import numpy

    if numpy.__version__.startswith("1."):
        return None
    site = out / "numpy_gate_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(NUMPY_GATE_SITE)
    return str(site)


def grad_norm_report(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    """--custom-megatron-before-train-step-hook-path hook (the train stage's --grad-report): when the optimizer
    steps, log each parameter's gradient norm (DDP's fp32 main_grad, as Megatron's grad norm reads it), a
    tensor-parallel parameter's shards summed over the TP group, and for the replicated ones their spread
    over the TP ranks (they must agree). Lines read `grad_report R: {...}` (JSON), from data parallel rank 0;
    one `grad_report total: {...}` line with the norm in Megatron's accounting and the one the optimizer's
    step returns."""
    import json

    import torch.distributed as dist
    from megatron.core import mpu

    step = optimizer.step
    if getattr(step, "_grad_report", False):
        return

    def grad_of(param):
        grad = getattr(param, "main_grad", None)
        return grad if grad is not None else param.grad

    def reporting_step(*a, **k):
        tp_group = mpu.get_tensor_model_parallel_group()
        tp_rank = mpu.get_tensor_model_parallel_rank()
        rows, sharded, replicated = {}, 0.0, 0.0
        for chunk in model:
            for name, param in chunk.named_parameters():
                grad = grad_of(param)
                if grad is None:
                    continue
                sq = grad.detach().double().pow(2).sum().reshape(1)
                if getattr(param, "tensor_model_parallel", False):
                    dist.all_reduce(sq, group=tp_group)
                    sharded += float(sq)
                    rows[name] = {"norm": float(sq.sqrt()), "tp_sharded": True}
                else:
                    low, high = sq.clone(), sq.clone()
                    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=tp_group)
                    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=tp_group)
                    replicated += float(sq)
                    rows[name] = {"norm": float(sq.sqrt()), "tp_min": float(low.sqrt()), "tp_max": float(high.sqrt())}
                rows[name]["shape"] = list(param.shape)
                rows[name]["shared"] = bool(getattr(param, "shared", False))
        result = step(*a, **k)  # (update_successful, grad_norm, num_zeros_in_grad): Megatron's own norm
        if mpu.get_data_parallel_rank() == 0 and tp_rank == 0:
            for name, row in rows.items():
                print(f"grad_report {name}: {json.dumps(row)}", flush=True)
            total = {
                "step": step_id,
                "megatron_accounting": (sharded + replicated) ** 0.5,
                "tp_sharded": sharded**0.5,
                "replicated": replicated**0.5,
                "optimizer_step_grad_norm": float(result[1]) if isinstance(result, tuple) else None,
                "tp": mpu.get_tensor_model_parallel_world_size(),
                "dp": mpu.get_data_parallel_world_size(),
            }
            print(f"grad_report total: {json.dumps(total)}", flush=True)
        return result

    reporting_step._grad_report = True
    optimizer.step = reporting_step


def actor_init_fp32(args) -> None:
    """--custom-megatron-init-path hook (the train stage's --fp32): `actor_init`, and the model, its gradients
    and the optimizer in float32 instead of the bf16 slime always sets (its `_set_default_megatron_args`).
    Runs before slime builds the model and optimizer, which read these from the same namespace."""
    import torch

    args.bf16, args.fp16, args.params_dtype = False, False, torch.float32
    actor_init(args)
