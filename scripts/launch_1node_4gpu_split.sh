#!/usr/bin/env bash
# slime-meta on one node of 4 GPUs, split by role (docs/cluster.md has the topology table): the
# 8-GPU split topology at its smallest, and the two-GPU run's model and task, so the two compare.
#
#   GPUs 0-1  Megatron trains the teacher (tensor parallel 2; TP=1: data parallel 2)
#   GPU 2     SGLang serves the teacher (model 'actor'; new weights after every step)
#   GPU 3     SGLang serves a frozen student (model 'student' of the generated --sglang-config, with
#             its own router; from STUDENT_CHECKPOINT, default the teacher's starting weights)
# Nothing is offloaded: training and the two pools never share a GPU, so the next step's rollout
# runs while the trainer trains (--max-async-level 1, as on two GPUs). Qwen2.5-Coder-0.5B-Instruct
# on price lists at the settings of the two-GPU run (benchmarks/run_slime_2gpu.sh: batch shape,
# grader, lr, eval set); what differs is the topology's point: the student is frozen, not the
# evolving teacher, so the shared student's anti-drift terms (--adv-tau 1 --kl-loss-coef 0.1) are
# not needed (give them as extra flags to keep them). Run inside slime's docker image (or with the
# offline bundle's env.sh sourced) with this repo `pip install -e .`'d.
#
#   bash scripts/launch_1node_4gpu_split.sh --dry-run         # print the plan; no GPU, no Ray
#   bash scripts/launch_1node_4gpu_split.sh                   # grade with the built-in verifier
#   TP=1 bash scripts/launch_1node_4gpu_split.sh              # data parallel 2 x tensor parallel 1
#   TRANSFORMER_IMPL=local bash scripts/launch_1node_4gpu_split.sh   # a host without TransformerEngine
#   STUDENT_CHECKPOINT=/root/Qwen2.5-0.5B-Instruct bash scripts/launch_1node_4gpu_split.sh   # another student
#   bash scripts/launch_1node_4gpu_split.sh --num-rollout 100 --lr 1e-6     # extra flags go last
#   bash benchmarks/run_slime_4gpu.sh slime                   # the benchmark run (seed 31, 50 steps)
#
# Environment: TP (Megatron's tensor parallel size over the 2 training GPUs: 2, or 1 for data
# parallel 2), SLIME_DIR (slime checkout, for its scripts/models/$MODEL.sh), MEGATRON_DIR, MODEL,
# HF_CHECKPOINT, REF_LOAD (Megatron's starting weights: slime reads the HF directory itself),
# STUDENT_CHECKPOINT (default: the teacher's starting checkpoint, frozen), SAVE_DIR, DATA, EVAL_DATA,
# RUN_DIR, GRADER, TRANSFORMER_IMPL (local without TransformerEngine), RECOMPUTE (full or none),
# STOP_GRACE_S (the seconds processes get between SIGTERM and SIGKILL when the launch ends: 15).
set -euo pipefail
REPO_DIR="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO_DIR"
PYTHON=${PYTHON:-python3}
DRY_RUN=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY_RUN=1; done

SLIME_DIR=${SLIME_DIR:-/root/slime}
MEGATRON_DIR=${MEGATRON_DIR:-/root/Megatron-LM}
MODEL=${MODEL:-qwen2.5-0.5B}
HF_CHECKPOINT=${HF_CHECKPOINT:-/root/Qwen2.5-Coder-0.5B-Instruct}
REF_LOAD=${REF_LOAD:-$HF_CHECKPOINT}
STUDENT_CHECKPOINT=${STUDENT_CHECKPOINT:-}   # empty: --student-num-gpus alone, a frozen copy of HF_CHECKPOINT
SAVE_DIR=${SAVE_DIR:-/root/slime-meta-ckpt/4gpu}
DATA=${DATA:-data/price_lists.jsonl}
EVAL_DATA=${EVAL_DATA:-data/price_lists_eval.jsonl}
RUN_DIR=${RUN_DIR:-$REPO_DIR/runs/cluster-4gpu-$(date +%Y%m%d-%H%M%S)}
PROMPTS="$RUN_DIR/prompts.slime.jsonl"   # DATA with rubric and id under `metadata`, for slime's data source

# The topology (functions in _launch.sh; the 8-GPU split and the two-node scripts set other counts).
TRAIN_GPUS=2 TEACHER_GPUS=1 TEACHER_GPUS_PER_ENGINE=1 STUDENT_GPUS=1 STUDENT_GPUS_PER_ENGINE='' COLOCATE=0 STUDENT_NODE=0

# shellcheck source=scripts/_launch.sh
source "$REPO_DIR/scripts/_launch.sh"
load_model_args   # Megatron's model shape (MODEL_ARGS), from slime's own script for the model

CKPT_ARGS=(
  --hf-checkpoint "$HF_CHECKPOINT"   # the teacher: SGLang serves it, its tokenizer renders prompts
  --ref-load "$REF_LOAD"             # Megatron's starting weights
  --save "$SAVE_DIR" --save-interval 25
)
DATA_ARGS=(
  --prompt-data "$PROMPTS" --input-key prompt --label-key label
  --rubric-key rubric --group-key category   # the shop's price line is in the rubric; prompts per shop
  --rollout-shuffle
)
EVAL_ARGS=(
  --context-key oracle_hint --eval-baseline   # R_oracle and the no-info control before training
  --eval-prompt-data price_lists_eval "$REPO_DIR/$EVAL_DATA" --eval-interval 10 --eval-num-batches 2
)
META_ARGS=(
  --use-meta-learning
  --teacher-template prompt_templates/teacher_rules.txt
  --rollout-batch-size 24            # problems per step: 8 train + 16 holdout
  --heldout-ipb 16                   # holdout problems, judged with every info
  --n-problems-per-prompt 2          # k train problems per teacher prompt: 4 teacher prompts = GRPO groups
  --n-samples-per-prompt 8           # G infos per teacher prompt
  --num-inner-iterations 2           # K: student -> grader -> teacher rounds
  --n-samples-per-inner-prompt 2     # m student attempts per problem per round
  --n-holdout-samples 2              # student attempts per holdout problem with each final info
  --num-rollout 50
)
SAMPLING_ARGS=(
  --apply-chat-template
  --teacher-temperature 1.0 --teacher-max-tokens 192        # the trained policy
  --rollout-temperature 1.0 --rollout-max-response-len 320  # the student, at the two-GPU run's temperature
)
layer_args        # LAYER_ARGS: TransformerEngine's layers, or Megatron's own (TRANSFORMER_IMPL=local)
grader_args       # GRADER_ARGS: the built-in verifier, openai or self-hosted
split_pool_args   # POOL_ARGS: training GPUs 0-1, teacher inference GPU 2, student inference GPU 3
POOL_ARGS+=(
  --num-gpus-per-node 4              # the machine's GPUs
  --max-async-level 1                # step t+1's rollout while step t trains
)
TRAIN_ARGS=(
  --lr 3e-6 --lr-decay-style constant --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.999
  --eps-clip 0.2 --eps-clip-high 0.28
)
tensor_parallel_args "${TP:-2}"   # TP_ARGS: tensor parallel TP, data parallel 2 / TP
recompute_args none  # RECOMPUTE_ARGS: a 0.5B model keeps its activations; RECOMPUTE=full for larger ones
PERF_ARGS=(
  "${TP_ARGS[@]}"
  # Megatron pads the vocabulary to a multiple of this x TP: 128 at every TP, so the 151,936 tokens
  # stay unpadded at TP 1 and 2 alike (a zero row's logit 0 would take a share of every softmax).
  --make-vocab-size-divisible-by $((128 / TENSOR_PARALLEL))
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
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_ARGS[@]}" "${META_ARGS[@]}" "${SAMPLING_ARGS[@]}"
  "${GRADER_ARGS[@]}" "${POOL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}"
  "${MISC_ARGS[@]}" "${LAYER_ARGS[@]}" "${OUTPUT_ARGS[@]}"
)

launch_split "$@"   # the GPU map; --dry-run: the plan; else Ray on this node with 4 GPUs, then the run
