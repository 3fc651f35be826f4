"""One outer step's hand-offs on the local backend: what a rollout yields to training (`StepBatch`,
made by `produce_batch`), and the training step on it (`train_on_batch`).

The rollout side never touches the trainer: it runs the inner loop, then the solver samples and
replay pairs of the extra loss channels. The pairs' DPO reference log-probs (under the start
weights) are computed on the trainer's thread as the step's first part, cached with the pair
decisions, so with --max-async-level a rollout ahead never shares the model with a training step.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_meta.config.arguments import MetaConfig
from slime_meta.replay.pairs import ReplayPairer, ReplayRequest
from slime_meta.rollout.meta_rollout import MetaLearningRollout, RolloutResult
from slime_meta.types import Episode, PreferencePair, SolverSample


@dataclass(frozen=True)
class StepBatch:
    """What one step's rollout hands to training."""

    episodes: list[Episode]  # the problems drawn for the step
    result: RolloutResult  # the inner loop's teacher samples, metrics and traces
    solver_samples: list[SolverSample]  # the policy's own solutions (distillation, SDPO); [] when off
    pairs: list[PreferencePair]  # replay DPO pairs, their reference log-probs not yet filled
    solver_metrics: dict[str, float]  # the solver and replay counters


def batch_producer(cfg: MetaConfig, rollout: MetaLearningRollout, solver_builder, replayer, tokenizer):
    """The pipeline's `produce(step, episodes)`: the step's rollout and its solver-channel inputs."""

    async def produce(step: int, episodes: list[Episode]) -> StepBatch:
        result = await rollout.run(episodes, step, seed=cfg.seed)
        solver_samples, pairs, metrics = await solver_channel_inputs(solver_builder, replayer, result.chains, tokenizer)
        return StepBatch(episodes, result, solver_samples, pairs, metrics)

    return produce


async def solver_channel_inputs(
    builder, replayer: ReplayPairer | None, chains, tokenizer
) -> tuple[list[SolverSample], list[PreferencePair], dict[str, float]]:
    """The policy's own solutions (distillation, SDPO) and the replay pairs built on them."""
    if builder is None:
        return [], [], {}
    solver_samples, metrics = await builder.build(chains)
    pairs = []
    if replayer is not None:
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
        # Counters since the start of this process (a resume starts them again).
        metrics.update({f"replay/{k}": float(v) for k, v in replayer.stats.as_dict().items()})
    return solver_samples, pairs, metrics


def train_on_batch(trainer, batch: StepBatch, replayer: ReplayPairer | None, step: int) -> dict[str, float]:
    """One training step on the batch (blocking: the trainer's thread). The replay pairs first get
    their DPO reference log-probs under the start weights, from the replayer's cache or computed
    once and cached (a resume never pays twice)."""
    pairs = batch.pairs
    if pairs and replayer is not None:
        pairs = replayer.reference_logps_for(pairs, trainer.with_reference_logps, trainer.reference_id)
    return trainer.train_step(batch.result.samples, batch.solver_samples, pairs, step)
