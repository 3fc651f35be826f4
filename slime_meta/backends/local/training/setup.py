"""The local trainer built from the run's config: its memory settings on a GPU chosen first
(`with_trainer_plan`, the choice in `plan.py`), then the trainer itself (`make_trainer`)."""

from __future__ import annotations

from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.gpu_split import DEFAULT_TOKENS_PER_GPU, workers_on_first_gpu
from slime_meta.backends.local.training.plan import plan_trainer
from slime_meta.backends.local.training.settings import DistillSettings, TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.backends.local.workers.pools import pool_layouts
from slime_meta.config.arguments import MetaConfig
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
