# Sourced by the launch_*.sh scripts: what every topology does the same way. Each script keeps its
# own narrated flag groups; these functions read the variables it sets (DRY_RUN, SLIME_DIR, MODEL,
# PYTHON, REPO_DIR, MEGATRON_DIR, DATA, PROMPTS, MASTER_ADDR) and the ARGS it assembles.

# Megatron's model shape (MODEL_ARGS) comes from slime's own script for the model.
load_model_args() {
  MODEL_ARGS=()
  local script="$SLIME_DIR/scripts/models/$MODEL.sh"
  if [ -f "$script" ]; then
    # shellcheck disable=SC1090
    source "$script"
  elif [ "$DRY_RUN" = 1 ]; then
    echo "[dry run] $script not found: planning without MODEL_ARGS (set SLIME_DIR)" >&2
  else
    echo "error: $script not found; set SLIME_DIR to your slime checkout and MODEL to one of its scripts/models" >&2
    exit 2
  fi
}

# The grader by GRADER (verifier, openai, self-hosted). A key stays in the environment: Ray's
# workers inherit it from `ray start`, and it never reaches the command line or the run's files.
grader_args() {
  case "${GRADER:-verifier}" in
    verifier) GRADER_ARGS=(--grader verifier --verifier-metric numeric) ;;
    openai)
      : "${OPENAI_API_KEY:?GRADER=openai needs OPENAI_API_KEY in the environment}"
      GRADER_ARGS=(--grader openai --grader-model "${GRADER_MODEL:-gpt-4o-mini}") ;;
    self-hosted)
      : "${GRADER_BASE_URL:?GRADER=self-hosted needs GRADER_BASE_URL, e.g. http://10.0.0.5:8000/v1}"
      GRADER_ARGS=(--grader openai --grader-base-url "$GRADER_BASE_URL" --grader-model "${GRADER_MODEL:-default}") ;;
    *) echo "error: GRADER=$GRADER: use verifier, openai or self-hosted" >&2; exit 2 ;;
  esac
}

# --dry-run: print the plan (train.py --backend slime --dry-run) and stop; nothing is written.
plan_only_if_dry_run() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "[dry run] the run first converts $DATA -> $PROMPTS"
    exec "$PYTHON" train.py --backend slime "${ARGS[@]}" "$@"
  fi
}

# The data in slime's layout, then Ray's head on this node with GPUS GPUs.
start_head() {
  local gpus=$1
  "$PYTHON" -m slime_meta.backends.slime.data "$DATA" "$PROMPTS"
  export PYTHONUNBUFFERED=1
  ray start --head --node-ip-address "$MASTER_ADDR" --num-gpus "$gpus" --disable-usage-stats
}

# The run itself, as a Ray job: slime's driver with our flags and any given after them.
submit_run() {
  local runtime_env="{\"env_vars\": {\"PYTHONPATH\": \"$MEGATRON_DIR:$REPO_DIR\", \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\"}}"
  ray job submit --address="http://127.0.0.1:8265" --runtime-env-json="$runtime_env" \
    -- "$PYTHON" "$REPO_DIR/train.py" --backend slime "${ARGS[@]}" "$@"
}
