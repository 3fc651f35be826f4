#!/usr/bin/env bash
# slime-meta on two nodes: the teacher on 8 GPUs, a separate student pool on 4 more
# (docs/cluster.md has the topology table).
#
#   node 0 (head), 8 GPUs  Megatron trains the teacher and SGLang serves it (model 'actor'),
#                          colocated: each side is offloaded while the other runs
#   node 1, 4 GPUs         SGLang serves a frozen student from another checkpoint (model 'student')
# One Ray placement group of 12 GPUs; slime orders its bundles by node IP, so give the head the
# lower IP (or the trainer straddles both nodes; it still runs). Run inside slime's docker image
# on both nodes, this repo `pip install -e .`'d at the same path, RUN_DIR on a shared filesystem.
#
#   MASTER_ADDR=10.0.0.1 bash scripts/launch_2node_teacher8_student4.sh               # node 0: starts Ray, waits
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash scripts/launch_2node_teacher8_student4.sh   # node 1: joins; the run starts
#   bash scripts/launch_2node_teacher8_student4.sh --dry-run        # print the plan; no GPU, no Ray
#   GRADER=openai OPENAI_API_KEY=sk-... ...                         # export the key on BOTH nodes
#   GRADER=self-hosted GRADER_BASE_URL=http://10.0.0.5:8000/v1 GRADER_MODEL=Qwen3-32B ...
#
# Environment: SLIME_DIR (slime checkout, for its scripts/models/$MODEL.sh), MEGATRON_DIR,
# HF_CHECKPOINT, REF_LOAD (Megatron torch_dist copy of it), STUDENT_CHECKPOINT, SAVE_DIR, DATA,
# RUN_DIR, GRADER, NODE_RANK (0 head, 1 student node), MASTER_ADDR (the head's IP),
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
STUDENT_CHECKPOINT=${STUDENT_CHECKPOINT:-/root/Qwen3-1.7B}
SAVE_DIR=${SAVE_DIR:-/root/slime-meta-ckpt/2node}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
DATA=${DATA:-data/math_word_problems.jsonl}
RUN_DIR=${RUN_DIR:-$REPO_DIR/runs/cluster-2node-$(date +%Y%m%d-%H%M%S)}
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
  --rollout-temperature 0.7 --rollout-max-response-len 1024 # the student
)
layer_args        # LAYER_ARGS: TransformerEngine's layers, or Megatron's own (TRANSFORMER_IMPL=local)
grader_args       # GRADER_ARGS: the built-in verifier, openai or self-hosted
POOL_ARGS=(
  --actor-num-nodes 1 --actor-num-gpus-per-node 8          # training: node 0
  --colocate                                               # teacher inference on the training GPUs
  --rollout-num-gpus 8 --rollout-num-gpus-per-engine 2     # teacher inference: 4 engines on node 0
  --student-checkpoint "$STUDENT_CHECKPOINT"               # a separate, frozen student pool ...
  --student-num-gpus 4 --student-num-gpus-per-engine 1     # ... 4 engines on node 1 (never offloaded)
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
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${DATA_ARGS[@]}" "${META_ARGS[@]}" "${SAMPLING_ARGS[@]}"
  "${GRADER_ARGS[@]}" "${POOL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}"
  "${MISC_ARGS[@]}" "${LAYER_ARGS[@]}" "${OUTPUT_ARGS[@]}"
)

plan_only_if_dry_run "$@"

export PYTHONUNBUFFERED=1
if [ "$NODE_RANK" != 0 ]; then
  # The student node only lends its GPUs to the cluster; the head schedules everything. Its workers
  # (SGLang engines) import this repository, as the head's do.
  export PYTHONPATH="$MEGATRON_DIR:$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
  exec ray start --address "$MASTER_ADDR:6379" --num-gpus 4 --disable-usage-stats --block
fi
start_head 8
until [ "$("$PYTHON" -c "import ray; ray.init(address='auto', logging_level='ERROR'); print(int(ray.cluster_resources().get('GPU', 0)))" 2>/dev/null)" = 12 ]; do
  echo "[head] waiting for node 1 (NODE_RANK=1 MASTER_ADDR=$MASTER_ADDR) to join with its 4 GPUs ..."; sleep 10
done
submit_run "$@"
