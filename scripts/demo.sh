#!/usr/bin/env bash
# The embedded default, end to end, on one machine with no GPU and no API key:
#   1. a .venv with slime-meta installed (made once),
#   2. a small Llama-style model and its tokenizer, built and cached by the project's own script
#      (no model hub needed),
#   3. R_oracle: the student graded with the hand-written hint of each problem (oracle_hint),
#      and without, before training (--eval-baseline), so the step line shows the normalised gain,
#   4. the meta-learning loop for a few outer steps (scripts/run_synthetic.sh): embedded
#      inference workers behind the real sglang-router on 127.0.0.1, the built-in verifier as
#      grader, a torch trainer for the teacher.
#
#   scripts/demo.sh                      # 20 outer steps: about 3 minutes on 2 CPU cores once the .venv
#                                        # and the small model exist (made the first time, which takes longer)
#   NUM_ROLLOUT=40 scripts/demo.sh       # longer
#   RUN_DIR=runs/mine scripts/demo.sh    # where outputs go
#   scripts/demo.sh --use-tis            # any train.py flags at the end
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh ""   # no extras: this script's own arguments are train.py flags for the run
exec bash scripts/run_synthetic.sh "$@"
