"""The local trainer built from the run's config: its memory settings on a GPU chosen first
(`with_trainer_plan`, the choice in `plan.py`), then the trainer itself (`make_trainer`)."""

from __future__ import annotations

from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.gpu_split import DEFAULT_TOKENS_PER_GPU, workers_on_first_gpu
from slime_meta.backends.local.training.plan import plan_trainer
from slime_meta.backends.local.training.settings import DistillSettings, TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.backends.local.workers.pools import pool_layouts
from slime_meta.config.arguments import MetaConfig, settings_from
from slime_meta.errors import UserInputError


def with_trainer_plan(cfg: MetaConfig, model_dir: str) -> MetaConfig:
    """The run's config with the trainer's memory settings it leaves out chosen (`plan.py`);
    on a GPU the choice is printed, one line."""
    student_pool = cfg.separate_student and not (cfg.pools.student_router_ip or cfg.pools.external_student_url)
    layouts = pool_layouts(cfg, student_pool, cfg.grader.grader == "local")
    cfg, line = plan_trainer(cfg, model_dir, workers_on_first_gpu(layouts))
    if line:
        print(line, flush=True)
    return cfg


def make_trainer(cfg: MetaConfig, model_dir: str, tokenizer) -> LocalTrainer:
    t, o = cfg.train, cfg.objectives
    if t.recompute_granularity == "selective":
        raise UserInputError(
            "--recompute-granularity selective: the local trainer checkpoints whole decoder layers "
            "only; use --recompute-granularity full, or leave it out"
        )
    settings = settings_from(
        TrainerSettings,
        t,
        device=cfg.pools.device,
        compile_layers=bool(t.compile_layers),  # None (not chosen: no GPU plan ran) is off
        temperature=cfg.sampling.teacher_temperature,  # log-probs under the distribution sampled from
        loss=settings_from(LossSettings, t, o),
        distill=DistillSettings(o.solver_adv_tau, o.teacher_tau, o.student_tau),
        max_tokens_per_gpu=(t.max_tokens_per_gpu or DEFAULT_TOKENS_PER_GPU) if t.use_dynamic_batch_size else None,
        recompute_layers=t.recompute_granularity == "full",
    )
    pad_token_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    # The reference (KL anchor, replay DPO) is the run's starting checkpoint, also after a resume.
    reference = cfg.pools.hf_checkpoint if o.needs_reference else None
    return LocalTrainer(model_dir, settings, pad_token_id=pad_token_id, reference_path=reference)
