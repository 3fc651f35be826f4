#!/usr/bin/env bash
# slime's whole loop on two GPUs of one host: scripts/launch_1node_2gpu.sh as written (SGLang serves
# the teacher on GPU 1, Megatron trains it on GPU 0, new weights to SGLang after every step), with
# Qwen2.5-Coder-0.5B-Instruct on price lists at run_real.sh's GPU settings; and the local backend at
# the same seed and settings, for the comparison.
#
#   source BUNDLE/env.sh                              # an offline install (docs/cluster.md, Install)
#   bash benchmarks/run_slime_2gpu.sh slime           # the two-GPU run
#   bash benchmarks/run_slime_2gpu.sh local           # the local backend on one GPU, same flags
#   bash benchmarks/run_slime_2gpu.sh check           # the two-GPU run, steps in turn, no evals: slime's
#                                                     # weight check at the first sync, and each step's
#                                                     # SGLang-vs-Megatron log-probs on the same weights
#   bash benchmarks/run_slime_2gpu.sh slime --flag v  # any extra flags go last
#
# Environment: SEED (31), STEPS (50), OUT (runs/benchmarks: run dirs and logs), SLIME_DIR and
# MEGATRON_DIR (the sources env.sh names), TRANSFORMER_IMPL (local where TransformerEngine is
# missing), MODEL_DIR (the HF directory; default: python -m slime_meta.models.real qwen2.5-coder-0.5b).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SEED=${SEED:-31}
STEPS=${STEPS:-50}
OUT=${OUT:-runs/benchmarks}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL_DIR=${MODEL_DIR:-$($PY -m slime_meta.models.real qwen2.5-coder-0.5b | tail -n 1)}

# What both backends run: run_real.sh's price-lists settings on a GPU, with the launch script's
# sampling (the student is the teacher, sampled at the teacher's temperature: slime scores every
# sample at one temperature) and its clipping.
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
MODE=${1:-slime}
shift || true
EXTRA_ARGS=("$@")

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

launch_2gpu() {  # the launch script as written; our settings go after it (the last value of a flag wins)
  MODEL=qwen2.5-0.5B HF_CHECKPOINT="$MODEL_DIR" REF_LOAD="$MODEL_DIR" DATA=data/price_lists.jsonl \
    RUN_DIR="$RUN_DIR" SAVE_DIR="$RUN_DIR/checkpoints" PYTHON="$PY" \
    bash scripts/launch_1node_2gpu.sh "${SHAPE_ARGS[@]}" "${COMMON[@]}" "${SGLANG_KERNEL_ARGS[@]}" --sglang-dtype bfloat16 \
    "$@" "${EXTRA_ARGS[@]}"
}

case "$MODE" in
  slime)
    RUN_DIR="$OUT/slime_2gpu_seed$SEED"
    launch_2gpu "${EVAL_ARGS[@]}" --save-interval "$STEPS"
    ;;
  check)
    # Steps in turn (--max-async-level 0): each step's rollout is drawn with the weights the trainer
    # then scores it with, so slime's train/train_rollout_logprob_abs_diff compares SGLang's log-probs
    # with Megatron's on the same weights after every sync (one step ahead, the two differ by a step).
    RUN_DIR="$OUT/slime_2gpu_check_seed$SEED"
    launch_2gpu --max-async-level 0 --check-weight-update-equal --save-interval 100000
    ;;
  local)
    RUN_DIR="$OUT/local_1gpu_seed$SEED"
    $PY train.py --use-meta-learning --hf-checkpoint "$MODEL_DIR" --prompt-data data/price_lists.jsonl \
      --input-key prompt --label-key label --rollout-shuffle --apply-chat-template \
      --teacher-temperature 1.0 --rollout-temperature 1.0 --adv-tau 1 --kl-loss-coef 0.1 \
      --grader verifier --verifier-metric numeric --max-async-level 1 \
      "${COMMON[@]}" "${EVAL_ARGS[@]}" --run-dir "$RUN_DIR" "${EXTRA_ARGS[@]}"
    ;;
  *) echo "usage: $0 slime|check|local [extra train.py flags]" >&2; exit 2 ;;
esac
echo "run directory: $RUN_DIR"
