"""Flags and config of the grader: the built-in verifier or an LLM grader."""

from __future__ import annotations

from dataclasses import dataclass

from slime_meta.config.flag_types import AddFlag, positive_int, positive_seconds

GRADER_KINDS = ("auto", "verifier", "openai", "local")
VERIFIER_METRICS = ("exact", "normalized", "numeric", "char")


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


def add_grader_flags(add: AddFlag) -> None:
    """Which grader, and an LLM grader's model, endpoint and limits."""
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
        "--grader-base-url",
        default=None,
        help="A self-hosted OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1; default: the OpenAI API.",
    )
    add("--grader-api-key-env", default="OPENAI_API_KEY", help="Name of the environment variable holding the API key.")
    add("--grader-temperature", type=float, default=0.0, help="Sampling temperature of the LLM grader's replies.")
    add(
        "--grader-max-tokens",
        type=positive_int,
        default=512,
        help="Most tokens of one LLM grader reply (room for its GRADE line and explanation).",
    )
    add("--grader-concurrency", type=positive_int, default=32, help="LLM grader requests in flight at once.")
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
