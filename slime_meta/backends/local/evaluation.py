"""Evaluations without training on the fixed eval sets (--eval-prompt-data); --eval-baseline, which
the slime backend runs too, is `rollout.baseline.baseline_eval`."""

from __future__ import annotations

from slime_meta.config.arguments import MetaConfig
from slime_meta.rollout.meta_rollout import MetaLearningRollout


def eval_due(cfg: MetaConfig, done: int) -> bool:
    """After `done` training steps: every --eval-interval steps, and after the last one."""
    interval = cfg.meta.eval_interval
    return done == cfg.meta.num_rollout or bool(interval and done % interval == 0)


async def evaluate(cfg: MetaConfig, rollout: MetaLearningRollout, eval_sets: dict, step: int) -> dict[str, float]:
    """The meta-learning rollout on each fixed eval set, without training: does the teacher help there?"""
    metrics = {}
    for name, episodes in eval_sets.items():
        result = await rollout.run(episodes, step, seed=cfg.seed)
        with_info = result.metrics["meta_learning/avg_holdout_grade"]
        no_info = result.metrics["meta_learning/holdout_grade_no_info"]
        metrics.update(
            {
                f"eval/{name}/holdout_grade": with_info,
                f"eval/{name}/holdout_grade_no_info": no_info,
                f"eval/{name}/gain": with_info - no_info,
            }
        )
    return metrics
