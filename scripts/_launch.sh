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

# ---------------------------------------------------------------- split topologies
# The scripts whose student is a separate, frozen SGLang pool (launch_1node_4gpu_split.sh,
# launch_1node_8gpu_split.sh, launch_2node_teacher8_student4.sh) share what follows; each sets its
# counts and keeps its own flag groups:
#   TRAIN_GPUS                Megatron's GPUs (one node)
#   TEACHER_GPUS              SGLang model 'actor', engines of TEACHER_GPUS_PER_ENGINE (default 1)
#   STUDENT_GPUS              SGLang model 'student' (frozen, its own router), engines of
#                             STUDENT_GPUS_PER_ENGINE (empty: the teacher's engine size)
#   STUDENT_CHECKPOINT        empty: a frozen copy of the teacher's start weights (HF_CHECKPOINT)
#   COLOCATE=1                teacher inference on the training GPUs (offloaded while Megatron trains)
#   STUDENT_NODE=1            the student pool is a second node of STUDENT_GPUS GPUs (NODE_RANK=1 there)

# POOL_ARGS (slime's placement flags and our student flags), and the arithmetic slime does with them
# (docs/cluster.md, Topology): PLACEMENT_GPUS in the Ray placement group, HEAD_GPUS on this node.
split_pool_args() {
  local teacher_per_engine=${TEACHER_GPUS_PER_ENGINE:-1}
  local student_per_engine=${STUDENT_GPUS_PER_ENGINE:-$teacher_per_engine}
  if [ $((TEACHER_GPUS % teacher_per_engine)) != 0 ] || [ $((STUDENT_GPUS % student_per_engine)) != 0 ]; then
    echo "error: TEACHER_GPUS=$TEACHER_GPUS, STUDENT_GPUS=$STUDENT_GPUS: not whole engines of $teacher_per_engine / $student_per_engine GPUs" >&2
    exit 2
  fi
  POOL_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node "$TRAIN_GPUS")
  if [ "${COLOCATE:-0}" = 1 ]; then
    POOL_ARGS+=(--colocate)
    PLACEMENT_GPUS=$(( (TRAIN_GPUS > TEACHER_GPUS ? TRAIN_GPUS : TEACHER_GPUS) + STUDENT_GPUS ))
  else
    PLACEMENT_GPUS=$((TRAIN_GPUS + TEACHER_GPUS + STUDENT_GPUS))
  fi
  POOL_ARGS+=(--rollout-num-gpus "$TEACHER_GPUS" --rollout-num-gpus-per-engine "$teacher_per_engine")
  if [ -n "${STUDENT_CHECKPOINT:-}" ]; then POOL_ARGS+=(--student-checkpoint "$STUDENT_CHECKPOINT"); fi
  POOL_ARGS+=(--student-num-gpus "$STUDENT_GPUS")
  if [ -n "${STUDENT_GPUS_PER_ENGINE:-}" ]; then POOL_ARGS+=(--student-num-gpus-per-engine "$STUDENT_GPUS_PER_ENGINE"); fi
  HEAD_GPUS=$PLACEMENT_GPUS
  [ "${STUDENT_NODE:-0}" != 1 ] || HEAD_GPUS=$((PLACEMENT_GPUS - STUDENT_GPUS))
}

# The GPU map in words (after split_pool_args and tensor_parallel_args), with GPU numbers as slime
# places the bundles: training first, then the teacher's engines (from GPU 0 when colocated), then the student's.
topology() {
  local teacher_per_engine=${TEACHER_GPUS_PER_ENGINE:-1}
  local student_per_engine=${STUDENT_GPUS_PER_ENGINE:-$teacher_per_engine}
  local inference_start=$TRAIN_GPUS student_where
  [ "${COLOCATE:-0}" != 1 ] || inference_start=0
  if [ "${STUDENT_NODE:-0}" = 1 ]; then
    student_where="node 1's GPUs $(gpu_range 0 "$STUDENT_GPUS")"
  else
    student_where="GPU(s) $(gpu_range $((inference_start + TEACHER_GPUS)) "$STUDENT_GPUS")"
  fi
  local text
  text="GPU(s) $(gpu_range 0 "$TRAIN_GPUS") Megatron, tensor parallel $TENSOR_PARALLEL x data parallel $DATA_PARALLEL"
  text+="; GPU(s) $(gpu_range "$inference_start" "$TEACHER_GPUS") SGLang 'actor', $((TEACHER_GPUS / teacher_per_engine)) engine(s) x $teacher_per_engine GPU"
  [ "${COLOCATE:-0}" != 1 ] || text+=" (colocated: offloaded while Megatron trains)"
  text+="; $student_where SGLang 'student', $((STUDENT_GPUS / student_per_engine)) engine(s) x $student_per_engine GPU, own router, frozen ${STUDENT_CHECKPOINT:-$HF_CHECKPOINT}"
  echo "$text; Ray: $HEAD_GPUS GPUs on the head, $PLACEMENT_GPUS in the placement group"
}

# "0-1" for GPUs 0 and 1, "2" for GPU 2: COUNT GPUs from FIRST.
gpu_range() {
  if [ "$2" -le 1 ]; then echo "$1"; else echo "$1-$(($1 + $2 - 1))"; fi
}

# TP_ARGS for Megatron's tensor parallel size TP over the TRAIN_GPUS training GPUs: the data parallel
# size is what is left (DATA_PARALLEL = TRAIN_GPUS / TP, as Megatron derives it). Sequence parallelism
# comes with TP > 1 where the layers are TransformerEngine's; Megatron's local layers (TRANSFORMER_IMPL=local)
# have no sequence-parallel norm, so there it is left out.
tensor_parallel_args() {
  TENSOR_PARALLEL=$1
  if [ "$TENSOR_PARALLEL" -lt 1 ] || [ $((TRAIN_GPUS % TENSOR_PARALLEL)) != 0 ]; then
    echo "error: tensor parallel $TENSOR_PARALLEL does not divide the $TRAIN_GPUS training GPUs" >&2
    exit 2
  fi
  DATA_PARALLEL=$((TRAIN_GPUS / TENSOR_PARALLEL))
  TP_ARGS=(--tensor-model-parallel-size "$TENSOR_PARALLEL")
  if [ "$TENSOR_PARALLEL" -gt 1 ] && [ "${TRANSFORMER_IMPL:-transformer_engine}" != local ]; then
    TP_ARGS+=(--sequence-parallel)
  fi
}

# The rest of a split launch: print the GPU map; --dry-run prints the plan and stops; on NODE_RANK 1
# (STUDENT_NODE=1) this node joins the head's Ray with its STUDENT_GPUS GPUs and blocks; on the head,
# Ray with HEAD_GPUS GPUs, a wait until every node's GPUs have joined, then the run.
launch_split() {
  echo "[topology] $(topology)"
  plan_only_if_dry_run "$@"
  MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
  export PYTHONUNBUFFERED=1
  if [ "${NODE_RANK:-0}" != 0 ]; then
    # The student node only lends its GPUs to the cluster; the head schedules everything. Its workers
    # (SGLang engines) import this repository, as the head's do.
    export PYTHONPATH="$MEGATRON_DIR:$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
    exec ray start --address "$MASTER_ADDR:6379" --num-gpus "$STUDENT_GPUS" --disable-usage-stats --block
  fi
  start_head "$HEAD_GPUS"
  if [ "$PLACEMENT_GPUS" -gt "$HEAD_GPUS" ]; then
    until [ "$("$PYTHON" -c "import ray; ray.init(address='auto', logging_level='ERROR'); print(int(ray.cluster_resources().get('GPU', 0)))" 2>/dev/null)" = "$PLACEMENT_GPUS" ]; do
      echo "[head] waiting for node 1 (NODE_RANK=1 MASTER_ADDR=$MASTER_ADDR) to join with its $STUDENT_GPUS GPUs ..."; sleep 10
    done
  fi
  submit_run "$@"
}
