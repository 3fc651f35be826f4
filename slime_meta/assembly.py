"""The run's pieces built from its config, the same on every backend.

Both backends (`backends/local/`, `backends/slime/`) build their inner loop here: the tokenizer,
the step's batch plan, the prompt templates and the grader (`build_role_pieces`), the pool
clients, the roles and the meta-learning rollout (`build_rollout`), the solver-sample builder and
the replay pair maker of the extra loss channels, the per-step counters of pools and grader, and
the `--eval-baseline` measurement. What differs per backend (processes, GPUs, the trainer, weight
transfer) stays in the backend's own package.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from transformers import AutoTokenizer

from slime_meta.config.arguments import MetaConfig, settings_from
from slime_meta.config.objectives import read_context
from slime_meta.data.batch_split import BatchPlan, batch_plan  # noqa: F401 (batch_plan re-exported)
from slime_meta.grading.graders import (
    DEFAULT_GRADER_MODEL,
    OpenAIGrader,
    build_grader,
    choose_grader_kind,
    grader_line,
)
from slime_meta.prompt_templates import (
    GeneratorPromptTemplate,
    GraderPromptTemplate,
    TeacherPromptTemplate,
    load_template,
)
from slime_meta.replay.pairs import ReplayPairer
from slime_meta.replay.teachers import parse_replay_teachers
from slime_meta.rollout.context_budget import context_length_of
from slime_meta.rollout.meta_rollout import InnerLoopSettings, MetaLearningRollout
from slime_meta.rollout.pools import SGLangPool
from slime_meta.rollout.roles import PromptRenderer, StudentRole, TeacherRole, chat_setting
from slime_meta.rollout.solver_samples import SolverSampleBuilder, SolverSettings


def load_tokenizer(model_dir: str):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    without_word_cache(tokenizer)
    return tokenizer


def without_word_cache(tokenizer) -> bool:
    """Turn off the BPE (or Unigram) model's word cache where the tokenizer has no pre-tokenizer.

    `tokenizers` caches each word it has merged, up to 10,000 words under 256 bytes for each thread
    that encodes, kept for the thread's life (0.23: clearing only orphans them). With a pre-tokenizer
    a word is a word, and the cache soon holds the few thousand a run meets; without one (the demo's
    character-level models) the whole text is the word, so the cache kept every distinct prompt:
    the demo's trainer grew 0.22 MiB a step, about 70 new prompts of 3 KiB each (docs/memory.md,
    "The trainer on the CPU"). A whole prompt seldom comes again, and merging one again is cheap.
    True when the cache was turned off.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if backend is None or backend.pre_tokenizer is not None or not hasattr(model, "_resize_cache"):
        return False
    model._resize_cache(0)  # no new entries: tokenizers >= 0.20 checks the capacity before inserting
    return True


# ----------------------------------------------------------------------------- roles and rollout


@dataclass(frozen=True)
class RolePieces:
    """What the roles need besides their pools, built before any process starts (bad input fails fast)."""

    generator_template: GeneratorPromptTemplate
    teacher_template: TeacherPromptTemplate
    # None with --grader local: the local backend serves that grader and sets it once its pool runs.
    grader: object
    grader_template: GraderPromptTemplate | None = None
    # --apply-chat-template as the templates settle it (None: each model's tokenizer decides), for every role.
    chat: bool | None = None


def build_role_pieces(cfg: MetaConfig) -> RolePieces:
    """The templates and the grader (its choice printed, one line; --grader local: no grader yet)."""
    grader_template = load_template("grader", cfg.meta.grader_template, "--grader-template")
    grader = None if cfg.grader.grader == "local" else _api_or_verifier_grader(cfg, grader_template)
    generator_template = load_template("generator", cfg.meta.generator_template, "--generator-template")
    teacher_template = load_template("teacher", cfg.meta.teacher_template, "--teacher-template")
    chat = chat_setting(cfg.data.apply_chat_template, generator_template, teacher_template)
    return RolePieces(generator_template, teacher_template, grader, grader_template, chat)


def _api_or_verifier_grader(cfg: MetaConfig, template: GraderPromptTemplate):
    g = cfg.grader
    kind = choose_grader_kind(
        g.grader, model=g.grader_model, api_key_env=g.grader_api_key_env, base_url=g.grader_base_url
    )
    line = grader_line(
        kind,
        model=g.grader_model,
        base_url=g.grader_base_url,
        api_key_env=g.grader_api_key_env,
        metric=g.verifier_metric,
        rubric_key=cfg.data.rubric_key,
    )
    print(line, flush=True)
    if kind == "verifier":
        return build_grader("verifier", metric=g.verifier_metric)
    return llm_grader(cfg, template, g.grader_model or DEFAULT_GRADER_MODEL, g.grader_base_url)


def llm_grader(cfg: MetaConfig, template: GraderPromptTemplate, model: str, base_url: str | None) -> OpenAIGrader:
    """An LLM grader over an OpenAI-compatible chat route (a hosted API, a self-hosted server or the
    local backend's own grader pool), with the run's grader key variable, sampling and limits."""
    g = cfg.grader
    return OpenAIGrader(
        model=model,
        base_url=base_url,
        api_key_env=g.grader_api_key_env,
        temperature=g.grader_temperature,
        max_tokens=g.grader_max_tokens,
        concurrency=g.grader_concurrency,
        template=template,
        request_timeout=g.grader_timeout,
    )


def make_pool(cfg: MetaConfig, name: str, url: str, concurrency: int) -> SGLangPool:
    return SGLangPool(
        name=name,
        base_url=url,
        concurrency=concurrency,
        timeout_s=cfg.sampling.request_timeout,
        max_retries=cfg.sampling.request_retries,
    )


def build_rollout(
    cfg: MetaConfig, pieces: RolePieces, teacher_pool: SGLangPool, student_pool: SGLangPool, tokenizer
) -> MetaLearningRollout:
    renderer = PromptRenderer(tokenizer, pieces.chat)
    student_dir = cfg.pools.student_checkpoint or cfg.pools.hf_checkpoint
    # A separate student renders with its own model's tokenizer and chat template (another family's
    # format); the shared student is the teacher's model.
    student_renderer = (
        PromptRenderer(load_tokenizer(student_dir), pieces.chat) if cfg.pools.student_checkpoint else renderer
    )
    print(prompt_format_line(renderer, student_renderer), flush=True)
    student = student_role(cfg, pieces, student_pool, student_renderer, student_dir)
    teacher = TeacherRole(
        pool=teacher_pool,
        template=pieces.teacher_template,
        renderer=renderer,
        temperature=cfg.sampling.teacher_temperature,
        max_new_tokens=cfg.sampling.teacher_max_tokens,
        context_length=context_length_of(cfg.pools.hf_checkpoint),
    )
    settings = InnerLoopSettings(
        num_inner_iterations=cfg.meta.num_inner_iterations,
        n_samples_per_inner_prompt=cfg.meta.n_samples_per_inner_prompt,
        n_samples_per_prompt=cfg.meta.n_samples_per_prompt,
        train_all_inner_steps=cfg.meta.train_all_inner_steps,
        holdout_advantage=cfg.meta.holdout_advantage,
        std_normalize=cfg.train.std_normalize,
        trace_sample_rate=cfg.meta.trace_sample_rate,
        control_samples_per_problem=cfg.meta.n_holdout_samples,
        holdout_samples_per_problem=cfg.meta.n_holdout_samples,
        keep_solver_attempts=cfg.objectives.needs_solver_samples and not cfg.separate_student,
        teacher_history=cfg.meta.teacher_history,
    )
    return MetaLearningRollout(student=student, grader=pieces.grader, teacher=teacher, settings=settings)


def student_role(
    cfg: MetaConfig, pieces: RolePieces, pool: SGLangPool, renderer: PromptRenderer, model_dir: str
) -> StudentRole:
    """The student role over `pool` (the student's, or the teacher's for the policy's own solutions):
    the generator template, the run's student sampling, requests inside `model_dir`'s context."""
    return StudentRole(
        pool=pool,
        template=pieces.generator_template,
        renderer=renderer,
        info_position=cfg.meta.additional_info_position,
        temperature=cfg.sampling.rollout_temperature,
        max_new_tokens=cfg.sampling.rollout_max_response_len,
        context_length=context_length_of(model_dir),
    )


def prompt_format_line(teacher: PromptRenderer, student: PromptRenderer) -> str:
    """One line at start: how each role's prompts are rendered (the default follows each model's tokenizer)."""

    def form(renderer: PromptRenderer) -> str:
        name = getattr(renderer.tokenizer, "name_or_path", "") or "its tokenizer"
        if renderer.apply_chat_template:
            return f"the chat template of {name}"
        if getattr(renderer.tokenizer, "chat_template", None):
            return f"plain text (--no-apply-chat-template; {name} has a chat template)"
        return f"plain text ({name} has no chat template)"

    return f"prompts: teacher in {form(teacher)}; " + (
        "student the same" if student is teacher else f"student in {form(student)}"
    )


# ----------------------------------------------------------------------------- the extra loss channels


def make_solver_builder(cfg: MetaConfig, pieces: RolePieces, teacher_pool: SGLangPool, tokenizer):
    """The solver-role sample producer, when a channel needs the policy's own solutions."""
    o = cfg.objectives
    if not o.needs_solver_samples:
        return None
    source = "fixed" if o.teacher_context else "column" if o.context_key else o.distill_context
    policy_as_student = student_role(
        cfg, pieces, teacher_pool, PromptRenderer(tokenizer, pieces.chat), cfg.pools.hf_checkpoint
    )
    settings = settings_from(
        SolverSettings,
        o,
        cfg.train,
        attempts_per_problem=cfg.meta.n_samples_per_inner_prompt,
        reuse_chain_attempts=not cfg.separate_student,
        distill_context=source,
        fixed_context=read_context(o.teacher_context),
        distill=o.distillation_on,
        sdpo=o.sdpo_on_any,
        sdpo_shaping=o.sdpo_shaping,
    )
    return SolverSampleBuilder(policy_as_student, pieces.grader, settings)


def make_replayer(cfg: MetaConfig, run_dir: Path) -> ReplayPairer | None:
    """Channel 3's pair maker, its decisions cached in the run dir (a resume never pays twice)."""
    o = cfg.objectives
    if not o.replay_on:
        return None
    return ReplayPairer(
        parse_replay_teachers(o.replay_teachers),
        min_agree=o.replay_min_agree,
        cache_path=run_dir / "replay_pairs.jsonl",
    )


# ----------------------------------------------------------------------------- all of it


@dataclass
class LoopParts:
    """What either backend's loop drives, built from one config: the pools' clients, the rollout,
    and the extra channels' producers (None where the channel is off)."""

    teacher_pool: SGLangPool
    student_pool: SGLangPool
    rollout: MetaLearningRollout
    solver_builder: SolverSampleBuilder | None
    replayer: ReplayPairer | None


def build_loop_parts(
    cfg: MetaConfig, pieces: RolePieces, teacher_url: str, student_url: str, tokenizer, run_dir: Path, *, progress: bool
) -> LoopParts:
    """The loop's parts over the routers at `teacher_url` and `student_url` (the same URL for a
    shared pool). Called inside the event loop that will use the pools. `progress`: progress bars."""
    # Two clients even for a shared pool: each role keeps its own bound on requests in flight and its own counters.
    teacher_pool = make_pool(cfg, "teacher", teacher_url, cfg.sampling.teacher_concurrency)
    student_pool = make_pool(cfg, "student", student_url, cfg.sampling.student_concurrency)
    rollout = build_rollout(cfg, pieces, teacher_pool, student_pool, tokenizer)
    rollout.settings = replace(rollout.settings, show_progress=progress)
    solver_builder = make_solver_builder(cfg, pieces, teacher_pool, tokenizer)
    return LoopParts(teacher_pool, student_pool, rollout, solver_builder, make_replayer(cfg, run_dir))
