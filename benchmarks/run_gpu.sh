#!/usr/bin/env bash
# The GPU benchmarks in one command (losses, trainer, generation), each checking correctness
# before it times. JSON and logs go to $OUT when it is set, else runs/benchmarks.
#
#   bash benchmarks/run_gpu.sh
#
# The generation benchmark needs sglang-router; on a GPU machine without network access install
# it (and its dependencies) from wheels first (see docs/performance.md).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/benchmarks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  $PY -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
} > "$OUT/gpu_env.txt" 2>&1
cat "$OUT/gpu_env.txt"

# Each under its own time limit, so one that hangs leaves the others their time; the trainer
# (last: it compiles) writes its JSON after every configuration.
timeout "${LOSSES_TIMEOUT:-150}" $PY benchmarks/losses.py --out "$OUT/losses.json" > "$OUT/losses.log" 2>&1
echo "losses rc=$?"; tail -n 22 "$OUT/losses.log"
timeout "${GENERATION_TIMEOUT:-140}" $PY benchmarks/generation.py --out "$OUT/generation.json" > "$OUT/generation.log" 2>&1
echo "generation rc=$?"; tail -n 12 "$OUT/generation.log"
TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache} \
  timeout "${TRAINER_TIMEOUT:-300}" $PY benchmarks/trainer.py --out "$OUT/trainer.json" > "$OUT/trainer.log" 2>&1
echo "trainer rc=$?"; tail -n 14 "$OUT/trainer.log"
