#!/usr/bin/env bash
# slime-meta on one node of 8 GPUs, one shared pool (docs/cluster.md has the topology table).
#
# Megatron trains the teacher on all 8 GPUs; SGLang serves the teacher from the same 8 GPUs
# (--colocate: each side is offloaded while the other runs). The student shares that pool: it is
# the evolving teacher itself. Run inside slime's docker image with this repo `pip install -e .`'d.
#
#   bash scripts/launch_1node_8gpu_shared.sh --dry-run        # print the plan; no GPU, no Ray
#   bash scripts/launch_1node_8gpu_shared.sh                  # grade with the built-in verifier
#   GRADER=openai OPENAI_API_KEY=sk-... bash scripts/launch_1node_8gpu_shared.sh
#   GRADER=self-hosted GRADER_BASE_URL=http://10.0.0.5:8000/v1 GRADER_MODEL=Qwen3-32B \
#       bash scripts/launch_1node_8gpu_shared.sh              # your own OpenAI-compatible grader
#   MODEL=qwen3-8B HF_CHECKPOINT=/root/Qwen3-8B REF_LOAD=/root/Qwen3-8B_torch_dist \
#       bash scripts/launch_1node_8gpu_shared.sh --num-rollout 300 --lr 5e-7   # extra flags go last
#
# Environment: SLIME_DIR (slime checkout, for its scripts/models/$MODEL.sh), MEGATRON_DIR,
# HF_CHECKPOINT, REF_LOAD (Megatron torch_dist copy of it), SAVE_DIR, DATA, RUN_DIR, GRADER,
# TRANSFORMER_IMPL (local without TransformerEngine), RECOMPUTE (full or none), STOP_GRACE_S (the
# seconds processes get between SIGTERM and SIGKILL when the launch ends: 15).
set -euo pipefail
REPO_DIR="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO_DIR"
PYTHON=${PYTHON:-python3}
DRY_RUN=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY_RUN=1; done

SLIME_DIR=${SLIME_DIR:-/root/slime}
MEGATRON_DIR=${MEGATRON_DIR:-/root/Megatron-LM}
MODEL=${MODEL:-qwen3-4B}
HF_CHECKPOINT=${HF_CHECKPOINT:-/root/Qwen3-4B}
REF_LOAD=${REF_LOAD:-/root/Qwen3-4B_torch_dist}
SAVE_DIR=${SAVE_DIR:-/root/slime-meta-ckpt/shared}
DATA=${DATA:-data/math_word_problems.jsonl}
RUN_DIR=${RUN_DIR:-$REPO_DIR/runs/cluster-shared-$(date +%Y%m%d-%H%M%S)}
PROMPTS="$RUN_DIR/prompts.slime.jsonl"   # DATA with rubric and id under `metadata`, for slime's data source

# shellcheck source=scripts/_launch.sh
source "$REPO_DIR/scripts/_launch.sh"
load_model_args   # Megatron's model shape (MODEL_ARGS), from slime's own script for the model

CKPT_ARGS=(
  --hf-checkpoint "$HF_CHECKPOINT"   # the teacher: SGLang serves it, its tokenizer renders prompts
  --ref-load "$REF_LOAD"             # Megatron's starting weights
  --save "$SAVE_DIR" --save-interval 20
)
DATA_ARGS=(
  --prompt-data "$PROMPTS" --input-key prompt --label-key label
  --rollout-shuffle
)
META_ARGS=(
  --use-meta-learning
  --rollout-batch-size 11            # problems per step: 8 train + 3 holdout
  --heldout-ipb 3                    # holdout problems, judged with every info
  --n-problems-per-prompt 1          # k train problems per teacher prompt: 8 teacher prompts = GRPO groups
  --n-samples-per-prompt 8           # G infos per teacher prompt
  --num-inner-iterations 2           # K: student -> grader -> teacher rounds
  --n-samples-per-inner-prompt 4     # m student attempts per problem per round
  --num-rollout 200
)
SAMPLING_ARGS=(
  --apply-chat-template
  --teacher-temperature 1.0 --teacher-max-tokens 512        # the trained policy
  --rollout-temperature 1.0 --rollout-max-response-len 1024 # the student: the same model, at the same
)                                                           # temperature (slime scores the solver samples at one)
# The student is the trained model: without these it drifts (docs/performance.md section 6). The KL
# term to --ref-load is the default here (0.1, k3); the solver-role GRPO term on the policy's own
# graded attempts is the local backend's default and given here, as slime needs equal temperatures.
ANTI_DRIFT_ARGS=(--adv-tau 1 --kl-loss-coef 0.1)
layer_args        # LAYER_ARGS: TransformerEngine's layers, or Megatron's own (TRANSFORMER_IMPL=local)
grader_args       # GRADER_ARGS: the built-in verifier, openai or self-hosted
POOL_ARGS=(
  --actor-num-nodes 1 --actor-num-gpus-per-node 8
  --colocate                         # training and inference on the same 8 GPUs
  --rollout-num-gpus 8 --rollout-num-gpus-per-engine 2
  # no --student-*: the student is the teacher's pool
)
TRAIN_ARGS=(
  --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
  --eps-clip 0.2 --eps-clip-high 0.28
)
recompute_args full  # RECOMPUTE_ARGS: every layer recomputed in the backward (RECOMPUTE=none where they fit)
PERF_ARGS=(
  --tensor-model-parallel-size 2 --sequence-parallel
  "${RECOMPUTE_ARGS[@]}"
  --use-dynamic-batch-size --max-tokens-per-gpu 9216
)
SGLANG_ARGS=(--sglang-mem-fraction-static 0.7)
MISC_ARGS=(
  --attention-dropout 0.0 --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
)
OUTPUT_ARGS=(--run-dir "$RUN_DIR")

ARGS=(
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${DATA_ARGS[@]}" "${META_ARGS[@]}" "${SAMPLING_ARGS[@]}" "${ANTI_DRIFT_ARGS[@]}"
  "${GRADER_ARGS[@]}" "${POOL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}"
  "${MISC_ARGS[@]}" "${LAYER_ARGS[@]}" "${OUTPUT_ARGS[@]}"
)

plan_only_if_dry_run "$@"

MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
start_head 8
submit_run "$@"
