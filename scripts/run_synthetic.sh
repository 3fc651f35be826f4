#!/usr/bin/env bash
# The meta-learning loop on the synthetic suffix task, on one machine (CPU or one GPU, picked
# automatically). Expects an environment with slime-meta importable (scripts/demo.sh makes one).
#
# The task (data/synthetic_suffix.jsonl): each family of words hides a two-letter suffix; the
# student appends the suffix the teacher's hint names. A good hint is worth everything here, so
# the holdout grade shows what the teacher learned. slime_meta/data/tasks/synthetic.py has the details.
#
#   bash scripts/run_synthetic.sh                        # 20 outer steps
#   NUM_ROLLOUT=40 bash scripts/run_synthetic.sh         # longer
#   MODEL_DIR=/path/to/ckpt bash scripts/run_synthetic.sh --lr 3e-4   # any extra train.py flags
#   FROZEN_STUDENT=1 bash scripts/run_synthetic.sh       # the student a frozen copy of the start model
#   TASK=bracket bash scripts/run_synthetic.sh           # the bracket task (slime_meta/data/tasks/bracket.py):
#                                                        # its teacher never saw the key in pretraining
#   NO_ORACLE=1 bash scripts/run_synthetic.sh            # skip measuring R_oracle before step 1
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
NUM_ROLLOUT=${NUM_ROLLOUT:-20}
# The task picks the data, the templates and the small model's build (docs/tasks.md).
TASK=${TASK:-synthetic_suffix}
case "$TASK" in
  synthetic_suffix) TASK_MODULE=slime_meta.data.tasks.synthetic; TEMPLATE_PREFIX=Synthetic ;;
  bracket) TASK_MODULE=slime_meta.data.tasks.bracket; TEMPLATE_PREFIX=Bracket ;;
  *) echo "TASK=$TASK: unknown task; use synthetic_suffix (the default) or bracket" >&2; exit 2 ;;
esac

if [ -z "${MODEL_DIR:-}" ]; then
  echo "[demo] building (or reusing) the small model"
  MODEL_DIR=$(${PYTHON:-python} -m slime_meta.models.tiny --task "$TASK" --cache-dir "${MODEL_CACHE:-.cache/models}" ${MODEL_BUILD_ARGS:-} | tail -n 1)
fi

MODEL_ARGS=(--hf-checkpoint "$MODEL_DIR")
# Shared (default): the student is the model being trained, as in the demo. With shared weights the
# teacher's updates alone let the student role drift (400 steps on an H100: gain 0.81 -> 0.61), so
# train.py's shared-student defaults add a GRPO term on the policy's own graded no-info attempts
# (--adv-tau 1) and k3 KL to the start weights (--kl-loss-coef 0.1): gain 0.98 over the last 50 of
# 400 steps (docs/performance.md, section 6). Frozen: a pool of its own serving the start weights.
if [ -n "${FROZEN_STUDENT:-}" ]; then
  MODEL_ARGS+=(--student-checkpoint "$MODEL_DIR")
fi
DATA_ARGS=(
  --prompt-data "data/$TASK.jsonl"
  --input-key prompt --label-key label --rubric-key rubric
  --group-key family        # a teacher prompt and its holdout problems share one hidden rule
  --rollout-shuffle
)
META_ARGS=(
  --use-meta-learning
  --rollout-batch-size 28         # problems per step: 12 train + 16 holdout
  --heldout-ipb 16                # holdout problems per step: 4 per teacher prompt, of its family
  --n-problems-per-prompt 3       # k train problems the teacher sees together: 12 / 3 = 4 teacher prompts (GRPO groups)
  --n-samples-per-prompt 8        # G infos per teacher prompt
  --num-inner-iterations 2        # K
  --n-samples-per-inner-prompt 2  # m
  --num-rollout "$NUM_ROLLOUT"
)
TEMPLATE_ARGS=(
  --generator-template "$TASK_MODULE.${TEMPLATE_PREFIX}GeneratorTemplate"
  --teacher-template "$TASK_MODULE.${TEMPLATE_PREFIX}TeacherTemplate"
)
SAMPLING_ARGS=(
  --teacher-temperature 1.0 --teacher-max-tokens 4
  --rollout-temperature 1.0 --rollout-max-response-len 10   # both tasks: a 6-letter answer, `.` and EOS fit
)
GRADER_ARGS=(--grader verifier --verifier-metric char)   # partial credit per character
# R_oracle: before step 1 the student is graded with the hand-written hint (the data's oracle_hint
# column) and without, so the step line shows the normalised gain and the plot the oracle's line.
# Left out with NO_ORACLE=1, or when the extra flags choose a context of their own (a run takes one).
ORACLE_ARGS=()
case " $* " in
  *" --context-key"* | *" --teacher-context"* | *" --distill-context"* | *" --teacher-tau"* | *" --student-tau"*) NO_ORACLE=1 ;;
esac
if [ -z "${NO_ORACLE:-}" ] && head -n 1 "data/$TASK.jsonl" | grep -q '"oracle_hint"'; then
  ORACLE_ARGS=(--context-key oracle_hint --eval-baseline)
fi
TRAIN_ARGS=(--lr 1e-4 --micro-batch-size 32)
OUTPUT_ARGS=(--run-dir "$RUN_DIR" --save "$RUN_DIR/checkpoints" --save-interval 2)

${PYTHON:-python} train.py "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${META_ARGS[@]}" "${TEMPLATE_ARGS[@]}" \
  "${SAMPLING_ARGS[@]}" "${GRADER_ARGS[@]}" ${ORACLE_ARGS[@]+"${ORACLE_ARGS[@]}"} "${TRAIN_ARGS[@]}" \
  "${OUTPUT_ARGS[@]}" "$@"

echo
echo "[demo] done"
echo "  metrics:    $RUN_DIR/metrics.jsonl"
echo "  traces:     $RUN_DIR/traces.jsonl"
echo "  plot:       $RUN_DIR/holdout.png"
echo "  checkpoint: $RUN_DIR/checkpoints/$(cat "$RUN_DIR/checkpoints/latest_checkpointed_iteration.txt" | xargs printf 'iter_%07d')"
echo "  config:     $RUN_DIR/config.json"
