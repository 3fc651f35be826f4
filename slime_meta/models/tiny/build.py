"""Build the tiny tokenizer and model that the embedded demo and the tests run on.

Why build one: no model hub is reachable here, yet the demo needs a real HF checkpoint that the
local backend loads with AutoTokenizer/AutoModelForCausalLM. This module trains, in well under a
minute on 2 CPU cores, a 0.6M-parameter Llama on the synthetic suffix task
(slime_meta/data/tasks/synthetic.py), in both roles of one shared model:
  - student: `S{hint}|{word}=` -> `{word}{hint}.`, so it applies whatever hint it is given, and
    with no hint can only guess the suffix (its behaviour without the teacher is near chance);
  - teacher: reads graded attempts with their expected answers and writes `{hint}.`; the target
    is the family's true suffix only with probability `teacher_correct_fraction` (default 0.5),
    a random suffix otherwise. The prototype found that a teacher pretrained on random hints alone
    ignores its input and RL must build the inference from nothing; one pretrained on correct
    hints alone starts perfect and RL has nothing to show. Half and half makes the correct hint
    the most likely one (greedy decoding finds it: 1.00 after the default build) while sampling at
    temperature 1 gives it only a quarter to a third of the time (0.27-0.33 measured): a
    behaviour that RL can sharpen.

The tokenizer and the model's shape are in `tokenizer.py`, the pretraining loop and decoding in
`training.py`; this module holds the tasks' recipes and formats, the build, its checks, the cache
and the CLI.

Checkpoints are cached by `ensure_tiny_checkpoint`, keyed by the build settings, the data file's
content and BUILD_VERSION; a build goes to a temporary directory renamed into place at the end,
so a killed build never leaves a half checkpoint behind.

Other tasks: `--task bracket` (slime_meta/data/tasks/bracket.py) builds the same model shape on the
bracket task, whose teacher is pretrained on a prompt-reading prior and never on the key; its
pretraining examples come from the task module (`PretrainingSampler`). The cache key of the
default task is unchanged; any other task's key includes the task's name.

CLI: python -m slime_meta.models.tiny [--task NAME] [--out DIR | --cache-dir DIR] [--steps N] [--device cpu|cuda]
(the checkpoint's path is the last line on stdout; progress goes to stderr).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from slime_meta.data.tasks import bracket, synthetic
from slime_meta.models.tiny.tokenizer import new_model, train_char_tokenizer
from slime_meta.models.tiny.training import (
    EMPTY_HINT_FRACTION,
    LEARNING_RATE,
    STUDENT_BATCH,
    STUDENT_ONLY_FRACTION,
    TEACHER_BATCH,
    Log,
    generate,
    pretrain,
)
from slime_meta.types import Grade, GradedAttempt, Problem

BUILD_VERSION = 1  # bump when the build recipe changes, so cached checkpoints are rebuilt
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TASK = "synthetic_suffix"
DEFAULT_DATA = "data/synthetic_suffix.jsonl"
DEFAULT_STEPS = 200


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def resolve_data_path(data_path: str | Path) -> Path:
    """The data file: as given, or relative to the repository when run from elsewhere."""
    path = Path(data_path)
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        return REPO_ROOT / path
    if not path.exists():
        raise FileNotFoundError(f"{data_path}: no such data file (python -m slime_meta.data.tasks.synthetic writes it)")
    return path


def read_rows(data_path: str | Path) -> list[dict[str, str]]:
    lines = resolve_data_path(data_path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# ---------------------------------------------------------------------------- formats


class Formats:
    """Renders training sequences through the task's own templates, so formats cannot drift."""

    def __init__(self, task: str = DEFAULT_TASK) -> None:
        self.student = TASKS[task].generator_template()
        self.teacher = TASKS[task].teacher_template()

    def student_prompt(self, word: str, hint: str) -> str:
        return self.student.build(Problem(uid="", prompt=word, label=""), hint)[0]["content"]

    def teacher_prompt(self, previous_info: str, problems_K: Sequence[tuple[str, str, Sequence[str]]]) -> str:
        """problems_K: (word, expected answer, the student's attempts at it) for each train problem."""
        problems = [Problem(uid="", prompt=word, label=expected) for word, expected, _ in problems_K]
        attempts_K_M = [
            [GradedAttempt(p, a + synthetic.ANSWER_END, Grade(float(a == p.label))) for a in attempts]
            for p, (_, _, attempts) in zip(problems, problems_K)
        ]
        return self.teacher.build(problems, attempts_K_M, previous_info)[0]["content"]


@dataclass(frozen=True)
class TaskRecipe:
    """What the build needs to know of a task; both tasks share the formats' shape and scoring."""

    data_path: str
    generator_template: type
    teacher_template: type
    all_hints: tuple[str, ...]
    answer_tokens: int  # answer, `.` and EOS
    teacher_correct_fraction: float  # the default share of teacher targets that are the true hint
    apply_hint: Callable[[str, str], str]
    # (seed, teacher_correct_fraction, formats) -> an object with .student() and .teacher_batch(n)
    sampler: Callable[[int, float, Formats], Any]


TASKS: dict[str, TaskRecipe] = {
    DEFAULT_TASK: TaskRecipe(
        DEFAULT_DATA,
        synthetic.SyntheticGeneratorTemplate,
        synthetic.SyntheticTeacherTemplate,
        synthetic.ALL_SUFFIXES,
        synthetic.WORD_LENGTH + synthetic.SUFFIX_LENGTH + 2,
        0.5,
        lambda word, hint: word + hint,
        synthetic.PretrainingSampler,
    ),
    bracket.NAME: TaskRecipe(
        "data/bracket.jsonl",
        bracket.BracketGeneratorTemplate,
        bracket.BracketTeacherTemplate,
        bracket.ALL_HINTS,
        bracket.ANSWER_LENGTH + 2,
        0.0,
        bracket.apply_hint,
        bracket.PretrainingSampler,
    ),
}


def tokenizer_corpus(rows: Sequence[dict[str, str]], task: str = DEFAULT_TASK) -> list[str]:
    """Every rendered string of the shipped data: student sequences and one teacher prompt a family."""
    formats = Formats(task)
    texts = [formats.student_prompt(r["prompt"], r["oracle_hint"]) + r["label"] + synthetic.ANSWER_END for r in rows]
    texts += [formats.student_prompt(r["prompt"], "") for r in rows]
    for family in sorted({r["family"] for r in rows}):
        members = [r for r in rows if r["family"] == family][:3]
        texts.append(formats.teacher_prompt("", [(r["prompt"], r["label"], [r["label"]]) for r in members]))
    return texts


# ---------------------------------------------------------------------------- training


# ---------------------------------------------------------------------------- evaluation


def evaluate(
    model, tokenizer, rows: Sequence[dict[str, str]], seed: int, device: str, task: str = DEFAULT_TASK
) -> dict[str, float]:
    """Student accuracy with the correct, no and a random hint; teacher hint accuracy."""
    rng = random.Random(seed + 1)
    recipe = TASKS[task]
    formats = Formats(task)
    metrics: dict[str, float] = {}
    conditions = {
        "correct_hint": [r["oracle_hint"] for r in rows],
        "no_hint": ["" for _ in rows],
        "random_hint": [rng.choice([s for s in recipe.all_hints if s != r["oracle_hint"]]) for r in rows],
    }
    for name, hints in conditions.items():
        prompts = [formats.student_prompt(r["prompt"], hint) for r, hint in zip(rows, hints)]
        outputs = generate(model, tokenizer, prompts, recipe.answer_tokens, device)
        metrics[f"student_exact_{name}"] = sum(
            synthetic.exact_score(o, r["label"]) for o, r in zip(outputs, rows)
        ) / len(rows)
        metrics[f"student_per_char_{name}"] = sum(
            synthetic.per_character_score(o, r["label"]) for o, r in zip(outputs, rows)
        ) / len(rows)

    # The teacher's first inner iteration: 3 train problems of a family, attempts made without a hint.
    teacher_prompts, oracles = [], []
    for family in sorted({r["family"] for r in rows}):
        members = [r for r in rows if r["family"] == family][:3]
        problems_K = [
            (r["prompt"], r["label"], [recipe.apply_hint(r["prompt"], rng.choice(recipe.all_hints))]) for r in members
        ]
        teacher_prompts.append(formats.teacher_prompt("", problems_K))
        oracles.append(members[0]["oracle_hint"])
    parse = recipe.teacher_template().parse_info
    hint_tokens = synthetic.SUFFIX_LENGTH + 2
    greedy = [parse(t) for t in generate(model, tokenizer, teacher_prompts, hint_tokens, device)]
    generator = torch.Generator().manual_seed(seed)
    sampled = [
        parse(t)
        for t in generate(
            model, tokenizer, teacher_prompts * 8, hint_tokens, device, temperature=1.0, generator=generator
        )
    ]
    metrics["teacher_hint_exact_greedy"] = sum(h == o for h, o in zip(greedy, oracles)) / len(oracles)
    metrics["teacher_hint_exact_sampled_t1"] = sum(h == o for h, o in zip(sampled, oracles * 8)) / len(sampled)
    # Per hint letter (position-wise), what the per-character reward sees of the hint.
    metrics["teacher_hint_per_char_sampled_t1"] = sum(
        sum(a == b for a, b in zip(h, o)) / len(o) for h, o in zip(sampled, oracles * 8)
    ) / len(sampled)
    return metrics


# ---------------------------------------------------------------------------- build and cache


def resolve_settings(
    task: str = DEFAULT_TASK, data_path: str | Path | None = None, teacher_correct_fraction: float | None = None
) -> tuple[str | Path, float]:
    """The task's own data file and teacher fraction where the caller gave none."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    recipe = TASKS[task]
    return (
        recipe.data_path if data_path is None else data_path,
        recipe.teacher_correct_fraction if teacher_correct_fraction is None else teacher_correct_fraction,
    )


@dataclass(frozen=True)
class BuildSettings:
    """What one build depends on besides the code (BUILD_VERSION); no data path or teacher fraction:
    the task's own (`resolve_settings`)."""

    data_path: str | Path | None = None
    seed: int = 0
    steps: int = DEFAULT_STEPS
    teacher_correct_fraction: float | None = None
    device: str = "cpu"
    task: str = DEFAULT_TASK


def build_tiny_checkpoint(out_dir: str | Path, *, log: Log = _stderr, **settings: Any) -> Path:
    """Train the tokenizer and the model (`settings`: those of `BuildSettings`), save both (HF format)
    and summary.json into out_dir."""
    import transformers

    build = BuildSettings(**settings)
    task, seed, steps, device = build.task, build.seed, build.steps, build.device
    data_path, teacher_correct_fraction = resolve_settings(task, build.data_path, build.teacher_correct_fraction)

    started = time.perf_counter()
    torch.set_num_threads(min(2, os.cpu_count() or 1))  # this project's machines have 2 cores
    random.seed(seed)
    torch.manual_seed(seed)
    rows = read_rows(data_path)
    tokenizer = train_char_tokenizer(tokenizer_corpus(rows, task))
    model = new_model(tokenizer).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tiny model: {n_params} parameters, vocabulary {len(tokenizer)}, {steps} steps on {device}")
    sampler = TASKS[task].sampler(seed, teacher_correct_fraction, Formats(task))
    final_loss = pretrain(model, tokenizer, sampler, steps, device, log)
    train_seconds = time.perf_counter() - started
    metrics = evaluate(model, tokenizer, rows, seed, device, task)
    log(" ".join(f"{k}={v:.3f}" for k, v in metrics.items()))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.to("cpu").save_pretrained(out, safe_serialization=True)
    summary: dict[str, Any] = {
        "build_version": BUILD_VERSION,
        "settings": {
            "task": task,
            "data_path": str(data_path),
            "seed": seed,
            "steps": steps,
            "teacher_correct_fraction": teacher_correct_fraction,
            "device": device,
            "student_batch": STUDENT_BATCH,
            "teacher_batch": TEACHER_BATCH,
            "empty_hint_fraction": EMPTY_HINT_FRACTION,
            "student_only_fraction": STUDENT_ONLY_FRACTION,
            "learning_rate": LEARNING_RATE,
        },
        "data_sha256": file_sha256(resolve_data_path(data_path)),
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "final_loss": final_loss,
        "train_seconds": round(train_seconds, 2),
        "build_seconds": round(time.perf_counter() - started, 2),
        "metrics": metrics,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return out


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cache_key(**settings: Any) -> str:
    """A name for one build (`settings`: those of `BuildSettings`): the settings, the task, the data's
    content (not its path) and BUILD_VERSION."""
    build = BuildSettings(**settings)
    data_path, teacher_correct_fraction = resolve_settings(build.task, build.data_path, build.teacher_correct_fraction)
    key = {
        "build_version": BUILD_VERSION,
        "data_sha256": file_sha256(resolve_data_path(data_path)),
        "seed": build.seed,
        "steps": build.steps,
        "teacher_correct_fraction": teacher_correct_fraction,
        "device": build.device,
    }
    if build.task != DEFAULT_TASK:  # the default task's key predates tasks: its cached builds stay valid
        key["task"] = build.task
    return "tiny-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def ensure_tiny_checkpoint(cache_dir: str | Path = ".cache/models", log: Log = _stderr, **settings: Any) -> Path:
    """The cached checkpoint for these settings (see build_tiny_checkpoint), built if missing."""
    cache = Path(cache_dir)
    final = cache / cache_key(**settings)
    if (final / "summary.json").exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(cache, final.name)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=cache))
    try:
        build_tiny_checkpoint(staging, log=log, **settings)
        try:
            os.rename(staging, final)  # atomic: the directory appears whole or not at all
        except OSError:
            if not (final / "summary.json").exists():  # not a concurrent build that won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _remove_stale_builds(cache: Path, name: str, older_than_s: float = 3600.0) -> None:
    """Delete leftovers of killed builds (a live build of this size never runs for an hour)."""
    for leftover in cache.glob(f".{name}.building-*"):
        if time.time() - leftover.stat().st_mtime > older_than_s:
            shutil.rmtree(leftover, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m slime_meta.models.tiny",
        description="Build (or find in the cache) the tiny synthetic-task checkpoint.",
    )
    parser.add_argument(
        "--task",
        default=DEFAULT_TASK,
        choices=sorted(TASKS),
        help=f"the task the model is pretrained on (default {DEFAULT_TASK}: the suffix task)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, help="write the checkpoint to this directory (no cache)")
    where.add_argument("--cache-dir", default=".cache/models", help="cache root (default .cache/models)")
    parser.add_argument("--data-path", default=None, help="default: the task's shipped data file")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--teacher-correct-fraction",
        type=float,
        default=None,
        help="share of teacher targets that are the true hint (default: 0.5 suffix task, 0 bracket)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    # Every BuildSettings field is a flag of the same name; --out and --cache-dir only say where.
    settings = {field.name: getattr(args, field.name) for field in fields(BuildSettings)}
    path = (
        build_tiny_checkpoint(args.out, **settings) if args.out else ensure_tiny_checkpoint(args.cache_dir, **settings)
    )
    print(path)
