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

# Megatron's transformer layers (LAYER_ARGS) by TRANSFORMER_IMPL: TransformerEngine's (the default;
# slime's docker image has it) with FlashAttention, or `local` on a host without TransformerEngine:
# Megatron's own layers (the translation adds the spec and hooks slime needs for them,
# slime_meta/backends/slime/megatron_local.py) with the fused kernels of TE and apex turned off.
layer_args() {
  case "${TRANSFORMER_IMPL:-transformer_engine}" in
    transformer_engine) LAYER_ARGS=(--attention-backend flash) ;;
    local)
      LAYER_ARGS=(
        --transformer-impl local
        --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion
        --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm
      ) ;;
    *) echo "error: TRANSFORMER_IMPL=$TRANSFORMER_IMPL: use transformer_engine (the default) or local" >&2; exit 2 ;;
  esac
}

# Megatron's activation recompute (RECOMPUTE_ARGS) by RECOMPUTE, default the script's: `full` recomputes
# every layer in the backward (activation memory for models that fill the training GPUs), `none` keeps
# the activations (no second forward: faster where they fit, as a model under 1B does on one 80 GB GPU
# at --max-tokens-per-gpu 9216).
recompute_args() {
  case "${RECOMPUTE:-$1}" in
    full) RECOMPUTE_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
    none) RECOMPUTE_ARGS=() ;;
    *) echo "error: RECOMPUTE=${RECOMPUTE:-$1}: use full or none" >&2; exit 2 ;;
  esac
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

# The data in slime's layout, then Ray's head on this node with GPUS GPUs. Ray's workers (slime's
# actors, the SGLang engines) inherit this environment: Megatron and this repository on PYTHONPATH.
start_head() {
  local gpus=$1
  "$PYTHON" -m slime_meta.backends.slime.data "$DATA" "$PROMPTS"
  export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
  export PYTHONPATH="$MEGATRON_DIR:$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
  local launch_id
  launch_id="$(hostname)-$$-$(date +%s%N)"
  SLIME_META_LAUNCH="$launch_id" ray start --head --node-ip-address "$MASTER_ADDR" --num-gpus "$gpus" --disable-usage-stats
  # From here on this launch owns Ray on this node (a Ray already running makes `ray start` fail above).
  LAUNCH_ID=$launch_id
  trap stop_everything EXIT
  trap 'echo "[launch] interrupted: stopping the run and Ray on this node" >&2; exit 130' INT
  trap 'echo "[launch] terminated: stopping the run and Ray on this node" >&2; exit 143' TERM
}

# Ctrl-C, SIGTERM, a failed run or its end: every process this launch started goes, with the GPU
# memory it held. `ray stop` ends Ray's own processes and actors, but an SGLang server is a child
# process of its engine actor and outlives a killed actor; so every process that inherited this
# launch's marker (Ray's head and workers get it from `ray start`, the driver from submit_run) is
# signalled as well: SIGTERM, then SIGKILL for what is left after a grace period.
stop_everything() {
  local status=$?
  trap - EXIT INT TERM
  [ -n "${LAUNCH_ID:-}" ] || exit "$status"
  ray stop --force >/dev/null 2>&1 || true
  signal_launched TERM
  local waited=0
  while [ -n "$(launched_pids)" ] && [ "$waited" -lt "${STOP_GRACE_S:-15}" ]; do sleep 1; waited=$((waited + 1)); done
  signal_launched KILL
  # SIGKILL is delivered at once but a process takes a moment to die (its memory is freed first):
  # report only what is seen, after waiting up to 10 s for the last of them.
  waited=0
  while [ -n "$(launched_pids)" ] && [ "$waited" -lt 100 ]; do sleep 0.1; waited=$((waited + 1)); done
  if [ -n "$(launched_pids)" ]; then
    echo "[launch] still alive after SIGKILL on $(hostname): $(launched_pids | tr '\n' ' ')" >&2
  else
    echo "[launch] stopped: no process of this launch is left on $(hostname)" >&2
  fi
  exit "$status"
}

launched_pids() {
  grep -lsza "^SLIME_META_LAUNCH=$LAUNCH_ID\$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | grep -vx "$$" || true
}

signal_launched() {
  local pids
  pids=$(launched_pids)
  # shellcheck disable=SC2086
  [ -z "$pids" ] || kill -"$1" $pids 2>/dev/null || true
}

# The run itself: slime's driver with our flags and any given after them, as a Ray job where Ray's
# job server runs (ray[default]), else on this node, attached to the cluster started above.
submit_run() {
  if "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8265/api/version', timeout=5)" 2>/dev/null; then
    local runtime_env="{\"env_vars\": {\"PYTHONPATH\": \"$PYTHONPATH\", \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\"}}"
    SLIME_META_LAUNCH="$LAUNCH_ID" ray job submit --address="http://127.0.0.1:8265" --runtime-env-json="$runtime_env" \
      -- "$PYTHON" "$REPO_DIR/train.py" --backend slime "${ARGS[@]}" "$@" &
  else
    echo "[launch] no Ray job server at 127.0.0.1:8265 (it comes with ray[default]): the driver runs here"
    SLIME_META_LAUNCH="$LAUNCH_ID" RAY_ADDRESS="$MASTER_ADDR:6379" \
      "$PYTHON" "$REPO_DIR/train.py" --backend slime "${ARGS[@]}" "$@" &
  fi
  # In the background so that a signal reaches this script's trap at once (bash runs a trap only
  # after the foreground command ends); the run's exit status is this script's.
  wait $!
}
