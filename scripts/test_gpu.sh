#!/usr/bin/env bash
# The tests that run on a CUDA GPU, in one run: the engine's kernels, CUDA graphs, paged and static
# caches, fused losses, weight sync over CUDA, the GPU split and packing: every test file with a case
# that needs CUDA (tests/test_gpu_selection.py checks the list). On a machine without a GPU these same
# files run in scripts/test.sh, where their CUDA cases skip; the CPU-only files are left to it.
#
#   bash scripts/test_gpu.sh                      # on a machine with a CUDA GPU and this repo's deps
#   CUDA_VISIBLE_DEVICES=1 bash scripts/test_gpu.sh -x --durations=60   # pytest arguments pass through
#
# Left out here: the `_interpreted` cases (each Triton kernel under Triton's CPU interpreter, in a child
# process, minutes apiece). Every one has a twin on CUDA that runs the same kernels, compiled, against
# the same references (tests/test_gpu_selection.py names the pairs); the interpreted cases exist so
# that a machine without a GPU checks the kernels too, and they run in scripts/test.sh.
# INTERPRETED=1 keeps them here as well.
#
# Uses the active Python (python3) as it is: a GPU host's torch is its own CUDA build, so no .venv
# is made. The worker tests need sglang-router; without it they skip and the run says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || {
  echo "error: no CUDA device visible to $PYTHON (torch.cuda.is_available() is False): run scripts/test.sh on a machine without a GPU" >&2
  exit 2
}
"$PYTHON" -c "import sglang_router" 2>/dev/null ||
  echo "[test-gpu] sglang-router is not installed: the worker tests behind the router skip (pip install sglang-router)" >&2

GPU_TEST_FILES=(
  tests/test_losses_fused.py tests/test_prefill_graphs.py tests/test_fused_ops.py
  tests/test_paged_attention.py tests/test_sampling_kernel.py tests/test_qwen3_engine.py
  tests/test_weight_sync_cuda.py tests/test_gpu_split.py tests/test_packing.py
  tests/test_worker_chunked_prefill.py tests/test_worker_static_decode.py tests/test_worker_paged_cache.py
  tests/test_worker_memory_budget.py tests/test_step_timing.py tests/test_eager_prefill_width.py
  tests/test_trainer_padded_width.py
)
SELECTION=(-m "not slow")
[ "${INTERPRETED:-0}" = 1 ] || SELECTION+=(-k "not interpreted")
# Most of the time is worker start-up (model load, CUDA graph capture) and compilation, not GPU work:
# with pytest-xdist the files run side by side on the one GPU, each file in one process (its module
# fixtures start once). GPU_TEST_WORKERS=0 runs them one after another.
PARALLEL=()
if [ "${GPU_TEST_WORKERS:-4}" != 0 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
  PARALLEL=(-n "${GPU_TEST_WORKERS:-4}" --dist loadfile)
  # The files' CPU cases (the real model's references, float32) share the cores: each process its part.
  CORES=$(nproc 2>/dev/null || echo 4)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / ${GPU_TEST_WORKERS:-4} > 0 ? CORES / ${GPU_TEST_WORKERS:-4} : 1 ))}
else
  echo "[test-gpu] the files run one after another (pytest-xdist not installed, or GPU_TEST_WORKERS=0)" >&2
fi
"$PYTHON" -c "import torch; print('[test-gpu]', torch.__version__, torch.cuda.get_device_name(0))"
exec "$PYTHON" -m pytest -q -p no:cacheprovider --durations=20 "${SELECTION[@]}" "${PARALLEL[@]}" "${GPU_TEST_FILES[@]}" "$@"
