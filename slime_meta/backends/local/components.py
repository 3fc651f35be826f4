"""Building the pieces of a local run from the config: run dir, pools, roles, grader, trainer.

Kept apart from `run.py` so that the outer loop there reads on one screen.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from slime_meta.backends.local import local_grader, weight_sync
from slime_meta.backends.local.channels import LossSettings

# The run's data and its evaluations live in their own modules; the outer loop reaches them here.
from slime_meta.backends.local.evaluation import baseline_eval, eval_due, evaluate  # noqa: F401
from slime_meta.backends.local.gpu_split import check_shared_gpu, worker_memory_args, workers_on_first_gpu
from slime_meta.backends.local.launcher import PortInUse
from slime_meta.backends.local.run_data import (  # noqa: F401
    Data,
    check_context_fits,
    context_limits,
    describe_plan,
    load_data,
    load_tokenizer,
    rows_that_fit_context,
)
from slime_meta.backends.local.trainer import DistillSettings, LocalTrainer, TrainerSettings
from slime_meta.backends.local.trainer_plan import DEFAULT_TOKENS_PER_GPU, plan_trainer
from slime_meta.backends.local.weight_sync import WeightSync
from slime_meta.config.arguments import MetaConfig
from slime_meta.config.objectives import read_context
from slime_meta.errors import UserInputError
from slime_meta.grading.graders import DEFAULT_GRADER_MODEL, build_grader, choose_grader_kind, grader_line
from slime_meta.prompt_templates import (
    GeneratorPromptTemplate,
    GraderPromptTemplate,
    TeacherPromptTemplate,
    load_template,
)
from slime_meta.rollout.context_budget import context_length_of
from slime_meta.rollout.meta_rollout import InnerLoopSettings, MetaLearningRollout
from slime_meta.rollout.pools import SGLangPool, check_reachable, post_json_sync
from slime_meta.rollout.roles import PromptRenderer, StudentRole, TeacherRole, chat_setting
from slime_meta.rollout.solver_samples import SolverSampleBuilder, SolverSettings
from slime_meta.types import PreferencePair


def prepare_run_dir(cfg: MetaConfig) -> Path:
    run_dir = Path(cfg.tracking.run_dir)
    if (run_dir / "metrics.jsonl").exists() and not cfg.checkpoint.load:
        raise UserInputError(
            f"--run-dir {run_dir}: holds an earlier run's metrics.jsonl; give a new --run-dir, or --load its checkpoints to resume"
        )
    check_context_fits(cfg)  # the last check before anything is written
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "weights").mkdir(exist_ok=True)
    cfg.save(run_dir / "config.json")
    return run_dir


def check_model_dir(path: str | None, flag: str) -> str:
    if not path:
        raise UserInputError(
            f"{flag} is required: a local HF checkpoint directory or a .gguf file (build the small demo model "
            "with: python -m slime_meta.models.tiny; get the real one with: python -m slime_meta.models.real)"
        )
    if not (Path(path) / "config.json").is_file():
        raise UserInputError(
            f"{flag} {path}: not an HF checkpoint directory (no config.json in it); give one, or a .gguf file"
        )
    return path


@dataclass(frozen=True)
class RolePieces:
    """What the roles need besides their pools, built before any process starts (bad input fails fast)."""

    generator_template: GeneratorPromptTemplate
    teacher_template: TeacherPromptTemplate
    grader: object  # None with --grader local until its pool runs (`with_local_grader`)
    grader_template: GraderPromptTemplate | None = None


def build_role_pieces(cfg: MetaConfig) -> RolePieces:
    grader_template = load_template("grader", cfg.meta.grader_template, "--grader-template")
    g = cfg.grader
    if g.grader == "local":  # served by this run: the grader is made once its pool is up
        check_model_dir(local_grader.grader_checkpoint(cfg), "--grader-checkpoint")
        print(local_grader.local_grader_line(cfg), flush=True)
        if cfg.pools.external_student_url:
            external_student_url(cfg)  # an unreachable student server is bad input: refused before the run dir exists
        return RolePieces(
            generator_template=load_template("generator", cfg.meta.generator_template, "--generator-template"),
            teacher_template=load_template("teacher", cfg.meta.teacher_template, "--teacher-template"),
            grader=None,
            grader_template=grader_template,
        )
    grader_kind = choose_grader_kind(
        g.grader, model=g.grader_model, api_key_env=g.grader_api_key_env, base_url=g.grader_base_url
    )
    print(
        grader_line(
            grader_kind,
            model=g.grader_model,
            base_url=g.grader_base_url,
            api_key_env=g.grader_api_key_env,
            metric=g.verifier_metric,
            rubric_key=cfg.data.rubric_key,
        ),
        flush=True,
    )
    if cfg.pools.external_student_url:
        external_student_url(cfg)  # an unreachable student server is bad input: refused before the run dir exists
    if grader_kind == "verifier":
        grader = build_grader("verifier", metric=cfg.grader.verifier_metric)
    else:
        grader = build_grader(
            "openai",
            model=cfg.grader.grader_model or DEFAULT_GRADER_MODEL,
            base_url=cfg.grader.grader_base_url,
            api_key_env=cfg.grader.grader_api_key_env,
            temperature=cfg.grader.grader_temperature,
            max_tokens=cfg.grader.grader_max_tokens,
            concurrency=cfg.grader.grader_concurrency,
            request_timeout=cfg.grader.grader_timeout,
            template=grader_template,
        )
    return RolePieces(
        generator_template=load_template("generator", cfg.meta.generator_template, "--generator-template"),
        teacher_template=load_template("teacher", cfg.meta.teacher_template, "--teacher-template"),
        grader=grader,
    )


def with_local_grader(cfg: MetaConfig, pieces: RolePieces, grader_url: str | None) -> RolePieces:
    """--grader local: the LLM grader over the pool `start_pools` started (other graders: unchanged)."""
    if pieces.grader is not None or grader_url is None:
        return pieces
    model_dir = local_grader.grader_checkpoint(cfg)
    return dataclasses.replace(
        pieces, grader=local_grader.build_local_grader(cfg, pieces.grader_template, grader_url, model_dir)
    )


def build_rollout(
    cfg: MetaConfig, pieces: RolePieces, teacher_pool: SGLangPool, student_pool: SGLangPool, tokenizer
) -> MetaLearningRollout:
    chat = chat_setting(cfg.data.apply_chat_template, pieces.generator_template, pieces.teacher_template)
    renderer = PromptRenderer(tokenizer, chat)
    student_dir = cfg.pools.student_checkpoint or cfg.pools.hf_checkpoint
    # A separate student renders with its own model's tokenizer and chat template (another family's
    # format); the shared student is the teacher's model.
    student_renderer = PromptRenderer(load_tokenizer(student_dir), chat) if cfg.pools.student_checkpoint else renderer
    print(prompt_format_line(renderer, student_renderer), flush=True)
    student = StudentRole(
        pool=student_pool,
        template=pieces.generator_template,
        renderer=student_renderer,
        info_position=cfg.meta.additional_info_position,
        temperature=cfg.sampling.rollout_temperature,
        max_new_tokens=cfg.sampling.rollout_max_response_len,
        context_length=context_length_of(student_dir),
    )
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


@dataclass(frozen=True)
class WorkerLayout:
    num_workers: int
    gpu_ids: tuple[int, ...] | None  # None: every worker sees the machine's devices as they are


def worker_layouts(cfg: MetaConfig) -> tuple[WorkerLayout, WorkerLayout]:
    """Teacher and student workers: from the slime GPU flags on GPUs, else the local counts.

    The local worker runs one engine per GPU, so a pool of G GPUs with E GPUs per engine gets
    G // E workers (E defaults to the teacher's for the student); the student's GPUs follow the
    teacher's. Without GPU flags, workers share whatever device they find (CPU, or one GPU with
    the trainer): --local-num-workers teacher workers, and for a separate student pool given by
    --student-checkpoint alone, --local-student-num-workers. The student layout matters only when
    `cfg.separate_student` (a shared student uses the teacher's workers).
    """
    p = cfg.pools
    if p.rollout_num_gpus > 0:
        teacher_engines = max(1, p.rollout_num_gpus // p.rollout_num_gpus_per_engine)
        teacher = WorkerLayout(teacher_engines, tuple(range(0, p.rollout_num_gpus, p.rollout_num_gpus_per_engine)))
    else:
        teacher = WorkerLayout(p.local_num_workers, None)
    if p.student_num_gpus:
        first = p.rollout_num_gpus
        engines = max(1, p.student_num_gpus // p.student_num_gpus_per_engine)
        student = WorkerLayout(engines, tuple(range(first, first + p.student_num_gpus, p.student_num_gpus_per_engine)))
    else:
        student = WorkerLayout(p.local_student_num_workers, None)
    return teacher, student


def start_pools(cfg: MetaConfig, processes, teacher_model: str, run_dir: Path, external_student_url: str | None):
    """Start the teacher pool, a separate student pool and the --grader local pool when asked:
    (teacher endpoints, student URL, the local grader's OpenAI base URL or None).

    The teacher's router listens on --teacher-port, the student's on --student-router-port (free
    ports without them); the workers behind each router take free ports. A separate student
    starts from --student-checkpoint, which defaults to the teacher's *starting* checkpoint
    (--hf-checkpoint, also when the teacher resumes from trained weights) and stays frozen.
    """
    p, logs, (teacher_layout, student_layout) = cfg.pools, str(run_dir / "logs"), worker_layouts(cfg)
    external_student_url = external_student_url or (p.external_student_url or "").rstrip("/") or None
    student_model = None
    if cfg.separate_student and not external_student_url:
        student_model = check_model_dir(p.student_checkpoint or p.hf_checkpoint, "--student-checkpoint")
    grader_model = (
        check_model_dir(local_grader.grader_checkpoint(cfg), "--grader-checkpoint")
        if cfg.grader.grader == "local"
        else None
    )
    layouts = pool_layouts(cfg, student_model is not None, grader_model is not None)
    # exit 2 before anything starts when they cannot fit; without the flag, the workers' share of the trainer's GPU
    worker_fraction = check_shared_gpu(cfg, teacher_model, layouts)
    worker_args = worker_memory_args(
        worker_fraction, p.sglang_chunked_prefill_size, p.sglang_context_length, p.sglang_page_size, p.local_kv_cache
    )
    teacher = _start_pool(
        processes,
        "teacher",
        teacher_model,
        teacher_layout,
        cfg,
        logs,
        worker_args,
        weights_root=str(run_dir / "weights"),
        router_port=p.teacher_port,
        port_flag="--teacher-port",
    )
    grader_url = (
        local_grader.start_grader_pool(processes, cfg, grader_model, logs, worker_args) if grader_model else None
    )
    if external_student_url:
        return teacher, external_student_url, grader_url
    if student_model is not None:
        student = _start_pool(
            processes,
            "student",
            student_model,
            student_layout,
            cfg,
            logs,
            worker_args,
            weights_root=None,
            router_port=p.student_router_port,
            port_flag="--student-router-port",
        )
        return teacher, student.router_url, grader_url
    return teacher, teacher.router_url, grader_url  # shared pool: the student is the same, evolving model


def pool_layouts(cfg: MetaConfig, student_pool: bool, grader_pool: bool) -> list[tuple[int, tuple[int, ...] | None]]:
    """`(num_workers, gpu_ids)` of each pool the run starts: the teacher's, a separate student's, the local grader's."""
    teacher_layout, student_layout = worker_layouts(cfg)
    layouts = [(teacher_layout.num_workers, teacher_layout.gpu_ids)]
    layouts += [(student_layout.num_workers, student_layout.gpu_ids)] if student_pool else []
    layouts += [(cfg.grader.grader_num_workers, None)] if grader_pool else []  # shares the device
    return layouts


def with_trainer_plan(cfg: MetaConfig, model_dir: str) -> MetaConfig:
    """The run's config with the trainer's memory settings it leaves out chosen (`trainer_plan.py`);
    on a GPU the choice is printed, one line."""
    student_pool = cfg.separate_student and not (cfg.pools.student_router_ip or cfg.pools.external_student_url)
    layouts = pool_layouts(cfg, student_pool, cfg.grader.grader == "local")
    cfg, line = plan_trainer(cfg, model_dir, workers_on_first_gpu(layouts))
    if line:
        print(line, flush=True)
    return cfg


def _start_pool(
    processes,
    name,
    model,
    layout: WorkerLayout,
    cfg: MetaConfig,
    logs: str,
    worker_args: list[str],
    *,
    weights_root,
    router_port,
    port_flag,
):
    try:
        return processes.start_pool(
            name,
            model,
            layout.num_workers,
            device=cfg.pools.device,
            gpu_ids=layout.gpu_ids,
            weights_root=weights_root,
            log_dir=logs,
            router_port=router_port,
            worker_args=worker_args,
        )
    except PortInUse as error:
        raise UserInputError(
            f"{port_flag} {error.port}: cannot listen there on {cfg.pools.host} (in use?); give a free port, "
            "or leave the flag out for a free one"
        ) from None


def make_trainer(cfg: MetaConfig, model_dir: str, tokenizer) -> LocalTrainer:
    t, o = cfg.train, cfg.objectives
    if t.recompute_granularity == "selective":
        raise UserInputError(
            "--recompute-granularity selective: the local trainer checkpoints whole decoder layers "
            "only; use --recompute-granularity full, or leave it out"
        )
    loss = LossSettings(
        eps_clip=t.eps_clip,
        eps_clip_high=t.eps_clip_high,
        eps_clip_c=o.eps_clip_c,
        use_tis=o.use_tis,
        tis_clip=o.tis_clip,
        tis_clip_low=o.tis_clip_low,
        aipo_delta=o.aipo_delta,
        kl_loss_coef=o.kl_loss_coef,
        kl_loss_type=o.kl_loss_type,
        entropy_coef=o.entropy_coef,
        sdpo_alpha=o.sdpo_alpha,
        sdpo_beta=o.sdpo_beta,
        sdpo_temperature=o.sdpo_temperature,
        sdpo_topk=o.sdpo_topk,
        sdpo_topk_tail=o.sdpo_topk_tail,
        sdpo_token_clip=o.sdpo_token_clip,
        sdpo_form=o.sdpo_form,
        replay_beta=o.replay_beta,
        replay_dpo_beta=o.replay_dpo_beta,
    )
    settings = TrainerSettings(
        lr=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        clip_grad=t.clip_grad,
        micro_batch_size=t.micro_batch_size,
        device=cfg.pools.device,
        compile_layers=bool(t.compile_layers),  # None (not chosen: no GPU plan ran) is off
        temperature=cfg.sampling.teacher_temperature,  # log-probs under the distribution sampled from
        loss=loss,
        distill=DistillSettings(o.solver_adv_tau, o.teacher_tau, o.student_tau),
        max_skipped_steps=t.max_skipped_steps,
        max_tokens_per_gpu=(t.max_tokens_per_gpu or DEFAULT_TOKENS_PER_GPU) if t.use_dynamic_batch_size else None,
        recompute_layers=t.recompute_granularity == "full",
        share_prompt_forward=t.share_prompt_forward,
    )
    pad_token_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    # The reference (KL anchor, replay DPO) is the run's starting checkpoint, also after a resume.
    reference = cfg.pools.hf_checkpoint if o.needs_reference else None
    return LocalTrainer(model_dir, settings, pad_token_id=pad_token_id, reference_path=reference)


def make_solver_builder(cfg: MetaConfig, pieces: "RolePieces", teacher_pool: SGLangPool, tokenizer):
    """The solver-role sample producer, when a channel needs the policy's own solutions."""
    o = cfg.objectives
    if not o.needs_solver_samples:
        return None
    source = "fixed" if o.teacher_context else "column" if o.context_key else o.distill_context
    policy_as_student = StudentRole(
        pool=teacher_pool,
        template=pieces.generator_template,
        renderer=PromptRenderer(
            tokenizer, chat_setting(cfg.data.apply_chat_template, pieces.generator_template, pieces.teacher_template)
        ),
        info_position=cfg.meta.additional_info_position,
        temperature=cfg.sampling.rollout_temperature,
        max_new_tokens=cfg.sampling.rollout_max_response_len,
        context_length=context_length_of(cfg.pools.hf_checkpoint),
    )
    settings = SolverSettings(
        attempts_per_problem=cfg.meta.n_samples_per_inner_prompt,
        reuse_chain_attempts=not cfg.separate_student,
        distill_context=source,
        fixed_context=read_context(o.teacher_context),
        context_key=o.context_key,
        distill=o.distillation_on,
        sdpo=o.sdpo_on_any,
        sdpo_hint=o.sdpo_hint,
        sdpo_grade_threshold=o.sdpo_grade_threshold,
        sdpo_on=o.sdpo_on,
        skip_verification=o.skip_verification,
        std_normalize=cfg.train.std_normalize,
        sdpo_shaping=o.sdpo_shaping,
    )
    return SolverSampleBuilder(policy_as_student, pieces.grader, settings)


def make_replayer(cfg: MetaConfig, run_dir: Path):
    """Channel 3's pair maker, its decisions cached in the run dir (a resume never pays twice)."""
    o = cfg.objectives
    if not o.replay_on:
        return None
    from slime_meta.replay.pairs import ReplayPairer, parse_replay_teachers

    return ReplayPairer(
        parse_replay_teachers(o.replay_teachers),
        min_agree=o.replay_min_agree,
        cache_path=run_dir / "replay_pairs.jsonl",
    )


async def solver_channel_inputs(
    builder, replayer, chains, tokenizer, trainer=None
) -> tuple[list, list, dict[str, float]]:
    """The policy's own solutions (distillation, SDPO) and the replay pairs built on them, each pair
    with its DPO reference log-probs under the start weights (the trainer's frozen reference),
    computed once and cached with the pair decisions."""
    if builder is None:
        return [], [], {}
    solver_samples, metrics = await builder.build(chains)
    pairs = []
    if replayer is not None:
        from slime_meta.replay.pairs import ReplayRequest

        labels = {problem.uid: problem.ground_truth for chain in chains for problem in chain.problems}
        requests = [
            ReplayRequest.build(x.prompt_text, x.solution_text, x.problem_uid, labels.get(x.problem_uid))
            for x in solver_samples
        ]
        by_key = {r.key: x for r, x in zip(requests, solver_samples)}
        for pair in await replayer.pairs_for(requests):
            sample = by_key[pair.key]
            # The chosen answer is another model's text: tokenised here, it is DPO's off-policy data by design.
            chosen_ids = tuple(tokenizer(pair.chosen, add_special_tokens=False)["input_ids"])
            if tokenizer.eos_token_id is not None:
                chosen_ids += (tokenizer.eos_token_id,)
            pairs.append(PreferencePair(sample.prompt_ids, chosen_ids, sample.response_ids))
        if pairs and trainer is not None:
            pairs = await asyncio.to_thread(
                replayer.reference_logps_for, pairs, trainer.with_reference_logps, trainer.reference_id
            )
        # Counters since the start of this process (a resume starts them again).
        metrics.update({f"replay/{k}": float(v) for k, v in replayer.stats.as_dict().items()})
    return solver_samples, pairs, metrics


async def close_clients(*clients) -> None:
    """Close the HTTP sessions of pools, grader and replay teachers (those that have any)."""
    for client in clients:
        for method in ("close", "aclose"):
            if client is not None and hasattr(client, method):
                await getattr(client, method)()
                break


def staleness_metrics(samples, rollout_id: int, start_step: int) -> dict[str, float]:
    """How many optimizer steps behind the trained policy the rollout's weights were."""
    versions = []
    for sample in samples:
        try:
            versions.append(int(sample.weight_version))
        except (TypeError, ValueError):  # the weights a worker started with
            versions.append(start_step)
    if not versions:
        return {}
    return {
        "async/max_staleness": float(rollout_id - min(versions)),
        "async/mean_staleness": rollout_id - sum(versions) / len(versions),
    }


def should_save(cfg: MetaConfig, rollout_id: int) -> bool:
    """At every --save-interval steps and after the last step, when --save is given."""
    done = rollout_id + 1
    interval = cfg.checkpoint.save_interval
    return bool(cfg.checkpoint.save) and (done == cfg.meta.num_rollout or bool(interval and done % interval == 0))


def make_pool(cfg: MetaConfig, name: str, url: str, concurrency: int) -> SGLangPool:
    return SGLangPool(
        name=name,
        base_url=url,
        concurrency=concurrency,
        timeout_s=cfg.sampling.request_timeout,
        max_retries=cfg.sampling.request_retries,
    )


def external_student_url(cfg: MetaConfig) -> str | None:
    """The running student server of --external-student-url, checked reachable; None without one."""
    url = cfg.pools.external_student_url
    if url:
        url = url.rstrip("/")
        check_reachable(url, "--external-student-url")
    return url


def push_weights(trainer, worker_urls: list[str], weights_root: Path, version: int, processes=None, sync=None) -> None:
    """Publish the trainer's weights and load them into every teacher worker.

    `sync` (the run's `WeightSync`, see weight_sync.py) picks the transfer; without one, the
    weights go through the disk. The router does not forward weight updates, so each worker is
    called directly (as slime does). With `processes` (the run's LocalProcessGroup) the update goes
    through it: it publishes under its lock and remembers the update, so a worker that is down or
    restarting is skipped and loads the same weights when the supervisor brings it back (never the
    starting checkpoint next to trained workers). Older weight directories are removed once every
    worker has moved on.
    """
    sync = sync if sync is not None else WeightSync("disk", weights_root)
    if processes is not None:
        published = []

        def publish():  # under the group's lock: no restarted worker reads a half-written buffer
            published.append(sync.publish(trainer, version))
            return published[0]

        processes.update_weights("teacher", publish, version)
        update = published[0]
    else:
        update = sync.publish(trainer, version)
        for url in worker_urls:
            reply = post_json_sync(url.rstrip("/") + update.endpoint, {**update.body, "weight_version": str(version)})
            if not reply.get("success"):
                raise RuntimeError(f"weight update of {url} failed: {reply.get('message')}")
    sync.after_push(update)


def make_weight_sync(cfg: MetaConfig, trainer, worker_urls, weights_root: Path, processes) -> WeightSync:
    """The run's weight transfer (--weight-sync), its buffer allocated once; the caller closes it."""
    sync = weight_sync.make_weight_sync(
        cfg.train.weight_sync, trainer, worker_urls, weights_root, processes.weight_buffer_prefix
    )
    print(f"weights reach the teacher workers through {sync.mode} (--weight-sync {cfg.train.weight_sync})", flush=True)
    return sync


def counter_metrics(teacher_pool: SGLangPool, student_pool: SGLangPool, grader) -> dict[str, float]:
    """Per-step counters of the pools (requests, retries, tokens) and of the grader; reset after reading."""
    metrics = {f"pool/teacher_{k}": float(v) for k, v in teacher_pool.stats.snapshot_and_reset().items()}
    metrics.update({f"pool/student_{k}": float(v) for k, v in student_pool.stats.snapshot_and_reset().items()})
    metrics.update(grader_metrics(grader))
    return metrics


def process_metrics(processes) -> dict[str, float]:
    """Worker restarts and router retries of each local pool, counted since the run started."""
    metrics = {}
    for name in processes.pool_names():
        metrics[f"pool/{name}_worker_restarts"] = float(processes.restarts(name))
        metrics[f"pool/{name}_router_retries"] = float(processes.router_retries(name))
    return metrics


def grader_metrics(grader) -> dict[str, float]:
    """The grader's counters (API retries, unparseable replies), reset per step."""
    stats = getattr(grader, "stats", None)
    if stats is None:
        return {}
    values = {f"grader/{k}": float(v) for k, v in vars(stats).items() if isinstance(v, (int, float))}
    for key in vars(stats):
        if isinstance(getattr(stats, key), (int, float)):
            setattr(stats, key, type(getattr(stats, key))(0))
    return values


def write_plot(run_dir: Path) -> Path | None:
    from slime_meta.artifacts.plot import plot_run

    return plot_run(run_dir)
