#!/usr/bin/env bash
# slime-meta on one node of 8 GPUs, split by role (docs/cluster.md has the topology table).
#
#   GPUs 0-3  Megatron trains the teacher
#   GPUs 4-5  SGLang serves the teacher (model 'actor'; new weights after every step)
#   GPUs 6-7  SGLang serves a frozen student (model 'student', from STUDENT_CHECKPOINT)
# Nothing is offloaded: training and the two pools never share a GPU. The student pool is a
# second model in the generated --sglang-config, with its own router. Run inside slime's docker
# image with this repo `pip install -e .`'d.
#
#   bash scripts/launch_1node_8gpu_split.sh --dry-run        # print the plan; no GPU, no Ray
#   bash scripts/launch_1node_8gpu_split.sh                  # grade with the built-in verifier
#   GRADER=openai OPENAI_API_KEY=sk-... bash scripts/launch_1node_8gpu_split.sh
#   GRADER=self-hosted GRADER_BASE_URL=http://10.0.0.5:8000/v1 GRADER_MODEL=Qwen3-32B \
#       bash scripts/launch_1node_8gpu_split.sh              # your own OpenAI-compatible grader
#   STUDENT_CHECKPOINT=/root/Qwen3-1.7B bash scripts/launch_1node_8gpu_split.sh   # a smaller student
#   bash scripts/launch_1node_8gpu_split.sh --num-rollout 300 --lr 5e-7             # extra flags go last
#
# Environment: SLIME_DIR (slime checkout, for its scripts/models/$MODEL.sh), MEGATRON_DIR,
# HF_CHECKPOINT, REF_LOAD (Megatron torch_dist copy of it), STUDENT_CHECKPOINT (default: the
# teacher's starting checkpoint, frozen), SAVE_DIR, DATA, RUN_DIR, GRADER,
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
STUDENT_CHECKPOINT=${STUDENT_CHECKPOINT:-}   # empty: --student-num-gpus alone, a frozen copy of HF_CHECKPOINT
SAVE_DIR=${SAVE_DIR:-/root/slime-meta-ckpt/split}
DATA=${DATA:-data/math_word_problems.jsonl}
RUN_DIR=${RUN_DIR:-$REPO_DIR/runs/cluster-split-$(date +%Y%m%d-%H%M%S)}
PROMPTS="$RUN_DIR/prompts.slime.jsonl"   # DATA with rubric and id under `metadata`, for slime's data source

# The topology (functions in _launch.sh, shared with launch_1node_4gpu_split.sh, which has the smallest
# counts): engines of one GPU each, the student's as large as the teacher's.
TRAIN_GPUS=4 TEACHER_GPUS=2 TEACHER_GPUS_PER_ENGINE=1 STUDENT_GPUS=2 STUDENT_GPUS_PER_ENGINE='' COLOCATE=0 STUDENT_NODE=0

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
  --rollout-temperature 0.7 --rollout-max-response-len 1024 # the student
)
layer_args        # LAYER_ARGS: TransformerEngine's layers, or Megatron's own (TRANSFORMER_IMPL=local)
grader_args       # GRADER_ARGS: the built-in verifier, openai or self-hosted
split_pool_args   # POOL_ARGS: training GPUs 0-3, teacher inference GPUs 4-5 (2 engines), student GPUs 6-7 (2 engines)
TRAIN_ARGS=(
  --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
  --eps-clip 0.2 --eps-clip-high 0.28
)
recompute_args full  # RECOMPUTE_ARGS: every layer recomputed in the backward (RECOMPUTE=none where they fit)
tensor_parallel_args 2   # TP_ARGS: tensor parallel 2 (with sequence parallelism on TransformerEngine), data parallel 2
PERF_ARGS=(
  "${TP_ARGS[@]}"
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
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${DATA_ARGS[@]}" "${META_ARGS[@]}" "${SAMPLING_ARGS[@]}"
  "${GRADER_ARGS[@]}" "${POOL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}"
  "${MISC_ARGS[@]}" "${LAYER_ARGS[@]}" "${OUTPUT_ARGS[@]}"
)

launch_split "$@"   # the GPU map; --dry-run: the plan; else Ray on this node with 8 GPUs, then the run
