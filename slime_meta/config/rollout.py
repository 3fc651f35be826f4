"""Flags and config of the rollout's shape: the meta-learning loop's sizes and templates, the data,
and the teacher's and student's sampling."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime_meta.config.flag_types import AddFlag, non_negative_int, positive_int

ADDITIONAL_INFO_POSITIONS = ("prefix", "suffix", "system")
HOLDOUT_ADVANTAGE_MODES = ("mean-then-normalize", "normalize-then-mean")
TEACHER_HISTORY_MODES = ("all", "last")


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


def add_meta_learning_flags(add: AddFlag) -> None:
    """The outer and inner loop's sizes, the info's placement, templates, evaluation."""
    add(
        "--use-meta-learning",
        action="store_true",
        default=True,
        help="Train a teacher with the meta-learning rollout: this program's only mode, so on whether given or "
        "not; accepted because slime's command lines name their rollout with it.",
    )
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
        "with --group-key split evenly over the teacher prompts. Default: from --inner-loop-train-ratio.",
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
        help="Dataset column of task families: each teacher prompt and its holdout come from one family; "
        "default: none (problems drawn across families).",
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
    add(
        "--trace-sample-rate",
        type=float,
        default=0.1,
        help="Share of chains written in full to traces.jsonl (the teacher's infos, the student's answers, the "
        "grades); at least one chain per step unless 0.",
    )
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
        "without training, logged as eval/NAME/holdout_grade, eval/NAME/holdout_grade_no_info and eval/NAME/gain. "
        "Default: none.",
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


def add_data_flags(add: AddFlag) -> None:
    """The dataset's columns and the draw per outer step (slime's names)."""
    add(
        "--prompt-data",
        default=None,
        help="Required: the problems the teacher learns to write infos for; no data set suits every model, so none "
        "is assumed. A .parquet, .jsonl or .json file (the demo's: data/synthetic_suffix.jsonl).",
    )
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
    add(
        "--num-rollout",
        type=non_negative_int,
        default=3,
        help="Outer steps. 0: evaluation only, as in slime: the evaluations before training (--eval-baseline, "
        "--eval-prompt-data) and no training step; e.g. a trained teacher (its checkpoint's model as --hf-checkpoint) "
        "graded with a student it never trained with (--student-checkpoint).",
    )
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


def add_sampling_flags(add: AddFlag) -> None:
    """Teacher sampling and the inference requests' concurrency, timeouts and retries."""
    add("--teacher-temperature", type=float, default=0.7, help="Sampling temperature of the teacher's infos.")
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
