#!/usr/bin/env bash
# slime's whole loop on four GPUs of one host: scripts/launch_1node_4gpu_split.sh as written (Megatron
# trains the teacher on GPUs 0-1, SGLang serves it on GPU 2 with new weights after every step, a frozen
# student on GPU 3 behind its own router), with Qwen2.5-Coder-0.5B-Instruct on price lists at exactly
# the flags of benchmarks/run_slime_2gpu.sh (seed, batch shape, lr, eval set, SGLang's kernels), so the
# two runs' curves compare: what differs is the topology (a frozen student of its own, tensor or data
# parallel training) and what follows from it (no anti-drift terms: the student does not move).
#
#   source BUNDLE/env.sh                              # an offline install (docs/cluster.md, Install)
#   bash benchmarks/run_slime_4gpu.sh slime           # tensor parallel 2 on GPUs 0-1
#   bash benchmarks/run_slime_4gpu.sh dp2             # data parallel 2 x tensor parallel 1 on GPUs 0-1
#   bash benchmarks/run_slime_4gpu.sh check           # TP 2, steps in turn, no evals: slime's weight check
#                                                     # at the first sync, SGLang-vs-Megatron log-probs
#   bash benchmarks/run_slime_4gpu.sh results slime   # no GPU: the finished run's figures and files
#                                                     # into benchmarks/results/ (or: results dp2)
#   bash benchmarks/run_slime_4gpu.sh slime --flag v  # any extra flags go last
#
# A run saves every SAVE_EVERY steps and the same command again resumes it from its last checkpoint
# (slime's --load of its own --save directory): a run cut short (a machine's time limit, Ctrl-C)
# continues where it was saved. The console goes to RUN_DIR.console.log as well.
#
# Environment: SEED (31), STEPS (50), SAVE_EVERY (10), OUT (runs/benchmarks: run dirs and logs),
# MACHINE (names the results files: h200x4), SLIME_DIR and MEGATRON_DIR (the sources env.sh names),
# TRANSFORMER_IMPL (local where TransformerEngine is missing), MODEL_DIR (the HF directory; default:
# python -m slime_meta.models.real qwen2.5-coder-0.5b).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SEED=${SEED:-31}
STEPS=${STEPS:-50}
SAVE_EVERY=${SAVE_EVERY:-10}
MACHINE=${MACHINE:-h200x4}
OUT=${OUT:-runs/benchmarks}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODE=${1:-slime}
shift || true
EXTRA_ARGS=("$@")
DRY_RUN=0   # --dry-run among the extra flags: the launch script's plan, nothing written
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY_RUN=1; done

run_dir_of() {
  case "$1" in
    slime) echo "$OUT/slime_4gpu_seed$SEED" ;;
    dp2) echo "$OUT/slime_4gpu_dp2_seed$SEED" ;;
    check) echo "$OUT/slime_4gpu_check_seed$SEED" ;;
    *) echo "usage: $0 slime|dp2|check|results [slime|dp2] [extra train.py flags]" >&2; exit 2 ;;
  esac
}

if [ "$MODE" = results ]; then
  # The figures of a finished run (python benchmarks/efficacy.py --summarise), named as the two-GPU
  # run's are: benchmarks/results/slime_4gpu[_dp2]_MACHINE_qwen05b_price_lists_seedS.{json,png}, the
  # metrics and the console gzipped beside them.
  RUN=${EXTRA_ARGS[0]:-slime}
  RUN_DIR=$(run_dir_of "$RUN")
  NAME="slime_4gpu$([ "$RUN" = dp2 ] && echo _dp2)_${MACHINE}_qwen05b_price_lists_seed$SEED"
  SUMMARY=$(mktemp -d)
  $PY benchmarks/efficacy.py --summarise "$RUN_DIR" --task price_lists --out "$SUMMARY"
  cp "$SUMMARY/efficacy.json" "benchmarks/results/$NAME.json"
  cp "$SUMMARY/efficacy.png" "benchmarks/results/$NAME.png"
  rm -rf "$SUMMARY"
  gzip -c "$RUN_DIR/metrics.jsonl" >"benchmarks/results/${NAME}_metrics.jsonl.gz"
  if [ -f "$RUN_DIR.console.log" ]; then gzip -c "$RUN_DIR.console.log" >"benchmarks/results/${NAME}_console.log.gz"; fi
  ls -l benchmarks/results/"$NAME"*
  exit 0
fi

RUN_DIR=$(run_dir_of "$MODE")
MODEL_DIR=${MODEL_DIR:-$($PY -m slime_meta.models.real qwen2.5-coder-0.5b | tail -n 1)}

# What the two-GPU run runs (benchmarks/run_slime_2gpu.sh; keep the two the same): run_real.sh's
# price-lists settings on a GPU, the student sampled at the teacher's temperature, the same clipping.
TASK_ARGS=(
  --rubric-key rubric --group-key category
  --teacher-template prompt_templates/teacher_rules.txt
)
EVAL_ARGS=(
  --context-key oracle_hint --eval-baseline      # R_oracle and the no-info control before training
  --eval-prompt-data price_lists_eval "$PWD/data/price_lists_eval.jsonl" --eval-interval 10 --eval-num-batches 2
)
BATCH_ARGS=(
  --rollout-batch-size 24 --heldout-ipb 16 --n-problems-per-prompt 2 --n-samples-per-prompt 8
  --num-inner-iterations 2 --n-samples-per-inner-prompt 2 --n-holdout-samples 2
  --teacher-max-tokens 192 --rollout-max-response-len 320
)
OPTIM_ARGS=(--lr 3e-6 --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.999 --eps-clip 0.2 --eps-clip-high 0.28)
COMMON=("${TASK_ARGS[@]}" "${BATCH_ARGS[@]}" "${OPTIM_ARGS[@]}" --num-rollout "$STEPS" --seed "$SEED")

# SGLang's kernels: an offline bundle made with --hopper-only leaves FlashAttention 3 out (578 MB), so
# the server attends with its Triton kernels and samples in torch (flashinfer would JIT-compile first).
SGLANG_KERNEL_ARGS=(--sglang-attention-backend triton --sglang-sampling-backend pytorch --sglang-cuda-graph-max-bs 128)

# Megatron's shape must match the checkpoint's config exactly (slime checks it): the model converted from
# the GGUF keeps its own output layer (untied) and the file's float32 epsilon; slime's qwen2.5-0.5B.sh says
# tied and 1e-6.
read -r NORM_EPS TIED < <($PY -c "import json, sys; c = json.load(open(sys.argv[1] + '/config.json')); \
print(repr(c['rms_norm_eps']), int(bool(c.get('tie_word_embeddings'))))" "$MODEL_DIR")
SHAPE_ARGS=(--norm-epsilon "$NORM_EPS")
[ "$TIED" = 1 ] || SHAPE_ARGS+=(--untie-embeddings-and-output-weights)

# The launch script as written, our settings after it (the last value of a flag wins). --load of the
# --save directory: a second call resumes from the last checkpoint (nothing saved yet: --ref-load).
launch_4gpu() {
  local tp=$1 log=/dev/null
  shift
  if [ "$DRY_RUN" = 0 ]; then mkdir -p "$RUN_DIR" && log="$RUN_DIR.console.log"; fi
  export RUN_DIR
  TP=$tp MODEL=qwen2.5-0.5B HF_CHECKPOINT="$MODEL_DIR" REF_LOAD="$MODEL_DIR" DATA=data/price_lists.jsonl \
    SAVE_DIR="$RUN_DIR/checkpoints" PYTHON="$PY" \
    bash scripts/launch_1node_4gpu_split.sh "${SHAPE_ARGS[@]}" "${COMMON[@]}" "${SGLANG_KERNEL_ARGS[@]}" \
    --sglang-dtype bfloat16 --load "$RUN_DIR/checkpoints" "$@" "${EXTRA_ARGS[@]}" \
    > >(tee -a "$log") 2>&1
}

case "$MODE" in
  slime) launch_4gpu 2 "${EVAL_ARGS[@]}" --save-interval "$SAVE_EVERY" ;;
  dp2) launch_4gpu 1 "${EVAL_ARGS[@]}" --save-interval "$SAVE_EVERY" ;;
  check)
    # Steps in turn (--max-async-level 0): each step's rollout is drawn with the weights the trainer
    # then scores it with, so slime's train/train_rollout_logprob_abs_diff compares SGLang's log-probs
    # with Megatron's on the same weights after every sync; slime's bitwise check after the first sync.
    launch_4gpu 2 --max-async-level 0 --check-weight-update-equal --save-interval 100000
    ;;
esac
echo "run directory: $RUN_DIR (figures: bash $0 results $MODE)"
