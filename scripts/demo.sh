#!/usr/bin/env bash
# The embedded default, end to end, on one machine with no GPU and no API key:
#   1. a .venv with slime-meta installed (made once),
#   2. a small Llama-style model and its tokenizer, built and cached by the project's own script
#      (no model hub needed),
#   3. the meta-learning loop for a few outer steps: embedded inference workers behind the real
#      sglang-router on 127.0.0.1, the built-in verifier as grader, a torch trainer for the teacher.
#
# The task (data/synthetic_suffix.jsonl): each family of words hides a two-letter suffix; the
# student appends the suffix the teacher's hint names. A good hint is worth everything here, so
# the holdout grade shows what the teacher learned. See docs/synthetic_task.md.
#
#   scripts/demo.sh                      # 4 outer steps, about 2-4 minutes on 2 CPU cores
#   NUM_ROLLOUT=20 scripts/demo.sh       # longer
#   RUN_DIR=runs/mine scripts/demo.sh    # where outputs go
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh

RUN_DIR=${RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
NUM_ROLLOUT=${NUM_ROLLOUT:-4}

echo "[demo] building (or reusing) the small model"
MODEL_DIR=$(python -m slime_meta.models.tiny --cache-dir .cache/models | tail -n 1)

MODEL_ARGS=(--hf-checkpoint "$MODEL_DIR")
DATA_ARGS=(
  --prompt-data data/synthetic_suffix.jsonl
  --input-key prompt --label-key label --rubric-key rubric
  --group-key family        # a teacher prompt and its holdout problems share one hidden rule
  --rollout-shuffle
)
META_ARGS=(
  --use-meta-learning
  --rollout-batch-size 4          # teacher prompts (GRPO groups) per step, one family each
  --n-samples-per-prompt 8        # G infos per teacher prompt
  --n-problems-per-prompt 3       # k train problems the teacher sees together
  --heldout-ipb 4                 # holdout problems of the same family per teacher prompt
  --num-inner-iterations 2        # K
  --n-samples-per-inner-prompt 2  # m
  --num-rollout "$NUM_ROLLOUT"
)
TEMPLATE_ARGS=(
  --generator-template slime_meta.tasks.synthetic.SyntheticGeneratorTemplate
  --teacher-template slime_meta.tasks.synthetic.SyntheticTeacherTemplate
)
SAMPLING_ARGS=(
  --teacher-temperature 1.0 --teacher-max-tokens 4
  --rollout-temperature 1.0 --rollout-max-response-len 10
)
GRADER_ARGS=(--grader verifier --verifier-metric char)   # partial credit per character
TRAIN_ARGS=(--lr 1e-4 --micro-batch-size 32)
OUTPUT_ARGS=(--run-dir "$RUN_DIR" --save "$RUN_DIR/checkpoints" --save-interval 2)

python train.py "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${META_ARGS[@]}" "${TEMPLATE_ARGS[@]}" \
  "${SAMPLING_ARGS[@]}" "${GRADER_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"

echo
echo "[demo] done"
echo "  metrics:    $RUN_DIR/metrics.jsonl"
echo "  traces:     $RUN_DIR/traces.jsonl"
echo "  plot:       $RUN_DIR/holdout.png"
echo "  checkpoint: $RUN_DIR/checkpoints/$(cat "$RUN_DIR/checkpoints/latest_checkpointed_iteration.txt" | xargs printf 'iter_%07d')"
echo "  config:     $RUN_DIR/config.json"
