"""Every flag, in argparse groups, and the one typed, frozen config built from them.

`add_meta_learning_arguments(parser)` is what slime's `parse_args(add_custom_arguments=...)`
takes: it adds our groups and skips any flag the parser already has, so the flags slime also
defines (`--prompt-data`, `--rollout-batch-size`, `--hf-checkpoint`, `--lr`, `--save`, ...) keep
slime's definition on a cluster and get ours when run on one machine. Names and meanings follow
slime's where both exist.

After parsing, `build_config(namespace)` makes a `MetaConfig` once; nothing mutates it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from slime_meta.artifacts.model_files import resolve_checkpoint_flags
from slime_meta.config.flag_types import open_fraction, page_size, positive_int, positive_seconds, prefill_chunk
from slime_meta.config.objectives import ObjectivesConfig, add_objective_arguments, shared_student_objective_defaults
from slime_meta.config.validation import student_pool_defaults, validate_flags

ADDITIONAL_INFO_POSITIONS = ("prefix", "suffix", "system")
HOLDOUT_ADVANTAGE_MODES = ("mean-then-normalize", "normalize-then-mean")
TEACHER_HISTORY_MODES = ("all", "last")
GRADER_KINDS = ("auto", "verifier", "openai", "local")
VERIFIER_METRICS = ("exact", "normalized", "numeric", "char")


# ----------------------------------------------------------------------------- config types


@dataclass(frozen=True)
class DataConfig:
    prompt_data: str
    input_key: str
    label_key: str
    rubric_key: str
    group_key: str | None
    rollout_shuffle: bool
    apply_chat_template: bool | None  # None: each role's model's chat template when its tokenizer has one


@dataclass(frozen=True)
class MetaLearningConfig:
    rollout_batch_size: int  # problems drawn per outer step: train + holdout
    n_samples_per_prompt: int  # G: infos per teacher prompt
    n_problems_per_prompt: int  # k: train problems in one teacher prompt
    num_inner_iterations: int  # K
    n_samples_per_inner_prompt: int  # m: student attempts per problem per inner iteration
    inner_loop_train_ratio: float
    heldout_ipb: int | None
    additional_info_position: str
    train_all_inner_steps: bool
    holdout_advantage: str
    num_rollout: int
    max_async_level: int
    generator_template: str | None
    grader_template: str | None
    teacher_template: str | None
    trace_sample_rate: float
    n_holdout_samples: int  # S: student attempts per (final info, holdout problem), and per control problem
    eval_prompt_data: tuple[str, ...]  # NAME PATH pairs of fixed evaluation sets
    eval_interval: int | None
    eval_num_batches: int
    teacher_history: str = "all"  # --teacher-history: all rounds' attempts and infos, or the last round's


@dataclass(frozen=True)
class SamplingConfig:
    teacher_temperature: float
    teacher_max_tokens: int
    teacher_concurrency: int
    rollout_temperature: float  # student sampling
    rollout_max_response_len: int
    student_concurrency: int
    request_timeout: float
    request_retries: int


@dataclass(frozen=True)
class GraderConfig:
    grader: str  # auto | verifier | openai | local
    grader_checkpoint: str | None  # --grader local: the grader pool's model; None: the teacher's starting checkpoint
    grader_num_workers: int  # --grader local: workers behind the grader's router
    grader_model: str | None  # None: not named (an LLM grader then uses gpt-4)
    grader_base_url: str | None
    grader_api_key_env: str
    grader_temperature: float
    grader_max_tokens: int
    grader_concurrency: int
    grader_timeout: float  # seconds one grader request may take, reply included
    verifier_metric: str


@dataclass(frozen=True)
class PoolConfig:
    hf_checkpoint: str | None
    rollout_num_gpus: int
    rollout_num_gpus_per_engine: int
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    teacher_port: int | None
    student_checkpoint: str | None
    student_num_gpus: int | None
    student_num_gpus_per_engine: int
    student_router_ip: str | None
    student_router_port: int | None
    external_student_url: str | None
    local_num_workers: int
    local_student_num_workers: int
    device: str
    host: str
    sglang_mem_fraction_static: float | None = None
    sglang_chunked_prefill_size: int | None = None
    sglang_context_length: int | None = None
    sglang_page_size: int | None = None
    local_kv_cache: str = "paged"


@dataclass(frozen=True)
class TrainConfig:
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    clip_grad: float
    eps_clip: float
    eps_clip_high: float | None
    micro_batch_size: int
    std_normalize: bool
    compile_layers: bool | None = None  # None: chosen at start (local backend on CUDA), else off
    share_prompt_forward: bool = True
    max_skipped_steps: int = 3
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None  # None: chosen at start on CUDA, 8192 elsewhere
    recompute_granularity: str | None = None  # None: full on CUDA (chosen at start), the CPU always recomputes
    weight_sync: str = "auto"


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    load: str | None
    save_interval: int | None


@dataclass(frozen=True)
class TrackingConfig:
    run_dir: str
    use_wandb: bool
    wandb_project: str
    wandb_group: str | None
    wandb_mode: str


@dataclass(frozen=True)
class MetaConfig:
    backend: str
    seed: int
    data: DataConfig
    meta: MetaLearningConfig
    sampling: SamplingConfig
    grader: GraderConfig
    pools: PoolConfig
    train: TrainConfig
    objectives: ObjectivesConfig
    checkpoint: CheckpointConfig
    tracking: TrackingConfig

    @property
    def separate_student(self) -> bool:
        """The student is not the evolving teacher: a frozen pool we start, or an external server.

        A frozen pool is asked for by --student-checkpoint or --student-num-gpus (its checkpoint
        then defaults to the teacher's starting weights); an external one by --external-student-url.
        """
        p = self.pools
        return bool(p.student_checkpoint or p.student_num_gpus or p.external_student_url)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        # Secrets never live in the config: API keys are read from the environment by name.
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- flags


class _Groups:
    """Adds flags to argparse groups, skipping those the parser already defines (slime's)."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser

    def group(self, title: str):
        group = self.parser.add_argument_group(title)
        existing = self.parser._option_string_actions  # argparse has no public lookup for this

        def add(*flags: str, **kwargs):
            if any(flag in existing for flag in flags):
                return None
            return group.add_argument(*flags, **kwargs)

        return add


def add_meta_learning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    groups = _Groups(parser)

    add = groups.group("meta-learning")
    add("--use-meta-learning", action="store_true", help="Train a teacher with the meta-learning rollout.")
    add(
        "--num-inner-iterations", type=positive_int, default=3, help="K: student -> grader -> teacher rounds per chain."
    )
    add(
        "--n-samples-per-inner-prompt",
        type=positive_int,
        default=4,
        help="m: student attempts per train problem per round.",
    )
    add(
        "--inner-loop-train-ratio",
        type=float,
        default=0.75,
        help=(
            "Share of the --rollout-batch-size problems used as train problems (rounded half up); the rest is holdout."
        ),
    )
    add(
        "--heldout-ipb",
        type=positive_int,
        default=None,
        help="Holdout problems per batch, out of --rollout-batch-size (instead of --inner-loop-train-ratio); "
        "with --group-key split evenly over the teacher prompts.",
    )
    add(
        "--n-problems-per-prompt",
        type=positive_int,
        default=1,
        help=(
            "k: train problems in one teacher prompt; one info serves all k. Teacher prompts (GRPO groups) = train "
            "problems / k."
        ),
    )
    add(
        "--additional-info-position",
        choices=ADDITIONAL_INFO_POSITIONS,
        default="prefix",
        help="Where the info goes in the student's prompt.",
    )
    add(
        "--train-all-inner-steps",
        action="store_true",
        help="Also train every earlier inner iteration's info with its group's advantage.",
    )
    add(
        "--teacher-history",
        choices=TEACHER_HISTORY_MODES,
        default="all",
        help="What the teacher reads each round: all (every round's attempts and grades so far, each under the info it "
        "was made with; the oldest round is dropped first when the prompt is long) or last (this round's only).",
    )
    add(
        "--holdout-advantage",
        choices=HOLDOUT_ADVANTAGE_MODES,
        default="mean-then-normalize",
        help="mean-then-normalize: reward = mean holdout grade, GRPO over the G infos. "
        "normalize-then-mean: normalise each holdout problem's grades across the G infos, then average.",
    )
    add(
        "--max-async-level",
        type=int,
        default=0,
        help=(
            "Rollouts may run this many steps ahead of training (0: synchronous; 1: step t+1's rollout overlaps step "
            "t's training)."
        ),
    )
    add(
        "--group-key",
        default=None,
        help="Dataset column of task families: each teacher prompt and its holdout come from one family.",
    )
    add(
        "--generator-template",
        default=None,
        help=(
            "Student prompt: a file, a template text, module.name of a GeneratorPromptTemplate instance, or "
            "module.Class (a subclass); default prompt_templates/generator.txt."
        ),
    )
    add(
        "--grader-template",
        default=None,
        help=(
            "Grader prompt: a file, a template text, module.name of a GraderPromptTemplate instance, or module.Class "
            "(a subclass); default prompt_templates/grader.txt."
        ),
    )
    add(
        "--teacher-template",
        default=None,
        help=(
            "Teacher prompt: a file, a template text, module.name of a TeacherPromptTemplate instance, or module.Class "
            "(a subclass); default prompt_templates/teacher.txt."
        ),
    )
    add("--trace-sample-rate", type=float, default=0.1, help="Share of chains written in full to traces.jsonl.")
    add(
        "--n-holdout-samples",
        type=positive_int,
        default=1,
        help="S: student attempts per (final info, holdout problem), and per holdout problem of the no-info control; "
        "the reward is the mean grade over all of them.",
    )
    add(
        "--eval-prompt-data",
        nargs="+",
        default=None,
        metavar="NAME PATH",
        help="Fixed evaluation sets as NAME PATH pairs, never drawn for training: the same meta-learning rollout "
        "without training, logged as eval/NAME/holdout_grade, eval/NAME/holdout_grade_no_info and eval/NAME/gain.",
    )
    add(
        "--eval-interval",
        type=positive_int,
        default=None,
        help="Evaluate every N outer steps (also before the first and after the last); default: only before the first "
        "and after the last step.",
    )
    add(
        "--eval-num-batches",
        type=positive_int,
        default=1,
        help=(
            "Batches of --rollout-batch-size problems drawn from each eval set per evaluation (the same ones every "
            "time)."
        ),
    )

    add = groups.group("data (slime-compatible)")
    add("--prompt-data", default=None, help="Dataset: .parquet, .jsonl or .json.")
    add("--input-key", default="prompt", help="Column with the problem text (a `messages` chat column also works).")
    add(
        "--label-key",
        default="label",
        help='Column with the ground truth (a string or a dict such as {"answer": ...}).',
    )
    add("--rubric-key", default="rubric", help="Column with the grading rubric.")
    add(
        "--rollout-batch-size",
        type=positive_int,
        default=4,
        help="Problems drawn per outer step, split into train and holdout by --inner-loop-train-ratio or --heldout-ipb "
        "(default: 3 train + 1 holdout); teacher prompts (GRPO groups) = train / --n-problems-per-prompt.",
    )
    add("--n-samples-per-prompt", type=positive_int, default=4, help="G: infos sampled per teacher prompt.")
    add("--num-rollout", type=positive_int, default=3, help="Outer steps.")
    add("--rollout-shuffle", action="store_true", help="Shuffle the dataset (seeded) each epoch.")
    add(
        "--apply-chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Render each role's prompts with its own model's chat template. Default: when that model's tokenizer "
        "has one (instruct models), plain text otherwise (base models, the tiny demo models); "
        "--no-apply-chat-template forces plain text.",
    )
    add("--rollout-temperature", type=float, default=1.0, help="Student sampling temperature.")
    add(
        "--rollout-max-response-len",
        type=positive_int,
        default=256,
        help="Student max new tokens (a request gets less when its prompt leaves less of the model's context).",
    )

    add = groups.group("teacher sampling")
    add("--teacher-temperature", type=float, default=0.7)
    add(
        "--teacher-max-tokens",
        type=positive_int,
        default=256,
        help="Teacher max new tokens; the teacher's prompt is shortened to the model's context minus this.",
    )
    add("--teacher-concurrency", type=positive_int, default=64, help="Teacher requests in flight.")
    add("--student-concurrency", type=positive_int, default=128, help="Student requests in flight.")
    add("--request-timeout", type=float, default=300.0, help="Seconds before an inference request is retried.")
    add("--request-retries", type=int, default=3, help="Retries of a failed inference request (with backoff).")

    add = groups.group("grader")
    add(
        "--grader",
        choices=GRADER_KINDS,
        default="auto",
        help="auto: an OpenAI-compatible API if --grader-base-url, --grader-model or the key variable is set, else the "
        "built-in verifier. local: an LLM grader the run serves itself from --grader-checkpoint (no API key).",
    )
    add(
        "--grader-checkpoint",
        default=None,
        help="--grader local: the grader's model, a local HF checkpoint directory or a .gguf file (default: the "
        "teacher's starting --hf-checkpoint, a frozen copy). The run starts a grader pool of embedded workers "
        "behind its own router, serving the OpenAI chat route; rubric + chain-of-thought grading, no API key.",
    )
    add("--grader-num-workers", type=positive_int, default=1, help="--grader local: workers of the grader pool.")
    add(
        "--grader-model",
        default=None,
        help="The LLM grader's model (default: gpt-4 when an LLM grader is used). Naming one asks for the LLM grader: "
        "with --grader auto and no key or --grader-base-url the run stops instead of using the verifier.",
    )
    add(
        "--grader-base-url", default=None, help="A self-hosted OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1."
    )
    add("--grader-api-key-env", default="OPENAI_API_KEY", help="Name of the environment variable holding the API key.")
    add("--grader-temperature", type=float, default=0.0)
    add("--grader-max-tokens", type=positive_int, default=512)
    add("--grader-concurrency", type=positive_int, default=32)
    add(
        "--grader-timeout",
        type=positive_seconds,
        default=600.0,
        metavar="SECONDS",
        help="Seconds one grader request may take, reply included, before it is retried (default 600, the openai "
        "SDK's). A hosted API needs far less; a self-hosted model on CPU may need minutes for "
        "--grader-max-tokens tokens with --grader-concurrency requests at once. (--request-timeout is for "
        "the teacher's and student's servers, not the grader.)",
    )
    add(
        "--verifier-metric",
        choices=VERIFIER_METRICS,
        default="normalized",
        help=(
            "Built-in verifier: how the stated final answer matches the label. normalized (default): math labels by "
            "math-verify (60.0 == 60), others as normalised text; numeric: the same; exact: equal text; char: partial "
            "credit per character."
        ),
    )

    add = groups.group("pools and resources (slime-compatible)")
    add(
        "--hf-checkpoint",
        default=None,
        help="Teacher model: a local HF checkpoint directory, or a .gguf file (converted once into an HF directory "
        "cached under $SLIME_META_CACHE, default ~/.cache/slime-meta; needs the packages gguf and accelerate).",
    )
    add(
        "--rollout-num-gpus",
        type=int,
        default=0,
        help="GPUs of the teacher's inference pool (local backend on GPUs: one worker per engine, GPUs 0..N-1).",
    )
    add(
        "--rollout-num-gpus-per-engine",
        type=positive_int,
        default=1,
        help="GPUs per inference engine (the local worker uses one GPU per engine).",
    )
    add("--actor-num-nodes", type=positive_int, default=1)
    add("--actor-num-gpus-per-node", type=int, default=0)
    add(
        "--teacher-port",
        type=int,
        default=None,
        help="Port of the teacher's router (slime: --sglang-router-port; local: the router we start, its workers on "
        "free ports); default: a free port.",
    )
    add(
        "--student-checkpoint",
        default=None,
        help="A separate, frozen student pool from this checkpoint (an HF directory or a .gguf file); default: with "
        "--student-num-gpus, the teacher's starting checkpoint (--hf-checkpoint), else no separate pool (the "
        "student shares the teacher's).",
    )
    add(
        "--student-num-gpus",
        type=positive_int,
        default=None,
        help="GPUs of a separate, frozen student pool (from --student-checkpoint, default the teacher's starting "
        "weights); local backend: --student-num-gpus / --student-num-gpus-per-engine workers, on CUDA placed "
        "after the teacher's GPUs; default: no separate pool (shared with the teacher).",
    )
    add(
        "--student-num-gpus-per-engine",
        type=positive_int,
        default=None,
        help="GPUs per student engine; default: --rollout-num-gpus-per-engine.",
    )
    add(
        "--student-router-ip",
        default=None,
        help="Address of the student router; default: the teacher's (local backend: --host, the only value it takes; "
        "slime picks it itself).",
    )
    add(
        "--student-router-port",
        type=int,
        default=None,
        help="Local backend: port of the separate student pool's router we start; default: a free port "
        "(slime assigns it itself).",
    )
    add(
        "--external-student-url",
        default=None,
        help="Use an already running SGLang-API server or router (http://HOST:PORT) as the student pool; "
        "nothing is started for the student. Default: none.",
    )
    add(
        "--local-num-workers",
        type=positive_int,
        default=1,
        help="Local backend: embedded teacher workers when --rollout-num-gpus is not given (CPU, or sharing one GPU).",
    )
    add(
        "--local-student-num-workers",
        type=positive_int,
        default=1,
        help=(
            "Local backend: workers of a separate student pool (--student-checkpoint) when --student-num-gpus is not "
            "given."
        ),
    )
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="Local backend: cuda if available, else cpu.")
    add("--host", default="127.0.0.1", help="Local backend: address workers and routers bind to.")
    add(
        "--sglang-mem-fraction-static",
        type=open_fraction,
        default=None,
        help="Fraction of the GPU's total memory each inference worker may hold for weights plus its static KV "
        "cache (SGLang's --mem-fraction-static); local backend: passed to the workers, and a split with the "
        "trainer on the same GPU that cannot fit is refused at start. Default: not set: when local workers share the "
        "trainer's GPU, each gets an equal part of at most 0.3 of it (never more than the trainer's estimate "
        "leaves); otherwise workers keep up to 30%% of the memory free when they start.",
    )
    add(
        "--sglang-chunked-prefill-size",
        type=prefill_chunk,
        default=None,
        help="Tokens per prefill forward in the inference workers (SGLang's --chunked-prefill-size; -1: off). "
        "Default: not set (local workers prefill whole prompts).",
    )
    add(
        "--sglang-context-length",
        type=positive_int,
        default=None,
        help="Local backend (the worker's --static-cache-len): with the paged cache, the page pool holds this "
        "many tokens per running row, and rows of any length share them; with --local-kv-cache static, the "
        "longest request (prompt + new tokens) a slot serves on the CUDA-graph path, longer ones taking the "
        "slower generic path. Default: not set (4096). Sized within the workers' memory share. On "
        "--backend slime this is SGLang's own --context-length.",
    )
    add(
        "--sglang-page-size",
        type=page_size,
        default=None,
        help="Tokens per page of the KV cache (SGLang's --page-size). Local backend: the page size of the embedded "
        "workers' paged cache (--local-kv-cache paged); not set: 16. On --backend slime this is SGLang's own "
        "flag (SGLang's default when not set).",
    )
    add(
        "--local-kv-cache",
        choices=("paged", "static"),
        default="paged",
        help="Local backend on CUDA: the embedded workers' KV cache. paged (default): one pool of pages for all "
        "running requests, as many tokens as --sglang-context-length x the running rows; a row takes pages as "
        "its tokens arrive, so any request the pool holds decodes on the CUDA-graph path and attention reads "
        "only the row's own tokens. static: a slot of --sglang-context-length tokens per running request; "
        "longer requests take the slower generic path (docs/performance.md section 8). The CPU decodes "
        "without either.",
    )
    add("--lr", type=float, default=1e-5)
    add("--weight-decay", type=float, default=0.0)
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.999)
    add("--clip-grad", type=float, default=1.0)
    add("--eps-clip", type=float, default=0.2)
    add("--eps-clip-high", type=float, default=None)
    add("--micro-batch-size", type=positive_int, default=8, help="Sequences per forward pass (gradients accumulate).")
    add(
        "--std-normalize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Divide GRPO advantages by the group's std (--no-std-normalize: Dr.GRPO).",
    )
    add(
        "--compile-layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Local backend on CUDA: torch.compile each decoder layer (H100, 0.5B model: MFU 0.31 -> 0.49; "
        "about 8 s of compile in the first step and once more for new sequence lengths). Default: on for "
        "runs of 4 steps or more, off otherwise (the start line says which).",
    )
    add(
        "--share-prompt-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Local backend: the sequences of one prompt (a GRPO group's samples) are one row in the trainer's "
        "forward and backward, the prompt computed once and each response attending to it and to its own "
        "tokens: the same loss and gradient up to float rounding, for about G times fewer prompt tokens. "
        "Runs where the model's attention is SDPA (transformers' default); --no-share-prompt-forward: one "
        "row per sequence.",
    )
    add(
        "--use-dynamic-batch-size",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Local backend: micro-batches by token count (slime's meaning): sequences packed, shortest first, while "
        "rows x longest row stays within --max-tokens-per-gpu; a longer sequence is a micro-batch of its own; "
        "--micro-batch-size is then unused. The loss is the step's token mean either way. Default: on locally "
        "(a step's memory then has a bound whatever the prompt lengths; slime's own default is off); "
        "--no-use-dynamic-batch-size: --micro-batch-size sequences per forward.",
    )
    add(
        "--max-tokens-per-gpu",
        type=positive_int,
        default=None,
        help="Token budget per micro-batch with --use-dynamic-batch-size (padded tokens of one forward); "
        "with --no-use-dynamic-batch-size the local trainer does not use it (slime also reads it on its own). "
        "Default locally: on CUDA the largest of 16384 / 8192 / 4096 that fits the trainer's share of the GPU "
        "(the start line says which); 8192 on the CPU.",
    )
    add(
        "--recompute-granularity",
        choices=["full", "selective", "none"],
        default=None,
        help="Activation checkpointing, Megatron's flag. Local backend: 'full' checkpoints every decoder layer "
        "(as full / --recompute-method uniform / --recompute-num-layers 1): the backward recomputes each "
        "layer's forward, about one extra forward for the layer activations' memory; 'none' keeps the "
        "activations (on a GPU; local only); 'selective' is slime's only. Default locally: 'full' (kept "
        "activations measured 4.6x the trainer's memory for 7%% of a step, docs/performance.md section 8).",
    )
    add(
        "--max-skipped-steps",
        type=positive_int,
        default=3,
        help="Local backend: a step whose loss or gradient norm is not finite is skipped (weights, optimizer state "
        "unchanged, nothing pushed); this many in a row stop the run, the last checkpoint intact.",
    )
    add(
        "--weight-sync",
        choices=["auto", "disk", "shared-memory", "cuda-ipc"],
        default="auto",
        help="Local backend: how the trained weights reach the teacher workers after each step. disk: safetensors "
        "under the run directory + /update_weights_from_disk; shared-memory: one /dev/shm buffer in the "
        "workers' dtype; cuda-ipc: one CUDA buffer the workers copy from on the same GPU. Default auto: "
        "cuda-ipc when the trainer and every teacher worker are on one and the same GPU, shared-memory for "
        "the run's own workers otherwise, disk when /dev/shm has no room. Checkpoints (--save) are unchanged.",
    )

    add_objective_arguments(groups.group)

    add = groups.group("checkpoints and tracking")
    add("--save", default=None, help="Checkpoint directory.")
    add("--load", default=None, help="Resume from this checkpoint directory.")
    add("--save-interval", type=positive_int, default=None, help="Save every N outer steps (and at the end).")
    add("--run-dir", default=None, help="Where metrics, traces, config and plot go (default runs/<time>).")
    add("--use-wandb", action="store_true")
    add("--wandb-project", default="slime-meta")
    add("--wandb-group", default=None)
    add(
        "--wandb-mode",
        choices=("offline", "online", "disabled"),
        default="offline",
        help="online needs WANDB_API_KEY in the environment.",
    )

    add = groups.group("program")
    add("--backend", choices=("local", "slime"), default="local")
    add("--seed", type=int, default=1234)
    return parser


class _OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags end in one line and exit code 2, not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see python train.py --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="train.py",
        description="Train a teacher LLM to write additional_info, rewarded by a student's holdout grades.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    return add_meta_learning_arguments(parser)


# ----------------------------------------------------------------------------- config


def _pick(cls, namespace: argparse.Namespace, **overrides):
    values = {f.name: getattr(namespace, f.name) for f in fields(cls) if f.name not in overrides}
    return cls(**values, **overrides)


def build_config(namespace: argparse.Namespace, *, default_run_dir: str | None = None) -> MetaConfig:
    """The frozen config from parsed flags, validated; raises UserInputError naming the flag."""
    validate_flags(namespace)
    # Once, before anything reads them: a .gguf checkpoint flag becomes its converted HF directory.
    namespace = resolve_checkpoint_flags(namespace)
    run_dir = namespace.run_dir or default_run_dir or "runs/meta"
    return MetaConfig(
        backend=namespace.backend,
        seed=namespace.seed,
        data=_pick(DataConfig, namespace),
        meta=_pick(MetaLearningConfig, namespace, eval_prompt_data=tuple(namespace.eval_prompt_data or ())),
        sampling=_pick(SamplingConfig, namespace),
        grader=_pick(GraderConfig, namespace),
        pools=_pick(PoolConfig, namespace, **student_pool_defaults(namespace)),
        train=_pick(TrainConfig, namespace),
        objectives=_pick(
            ObjectivesConfig,
            namespace,
            replay_teachers=tuple(namespace.replay_teachers),
            **shared_student_objective_defaults(namespace),
        ),
        checkpoint=_pick(CheckpointConfig, namespace),
        tracking=_pick(TrackingConfig, namespace, run_dir=run_dir),
    )


def parse_config(argv: Sequence[str] | None = None, *, default_run_dir: str | None = None) -> MetaConfig:
    parser = build_parser()
    return build_config(parser.parse_args(argv), default_run_dir=default_run_dir)
