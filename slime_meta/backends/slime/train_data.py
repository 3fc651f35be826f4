"""slime's `--custom-convert-samples-to-train-data-path`: slime's own conversion, channel token means.

    convert_samples_to_train_data(args, samples) -> train_data

The conversion is slime's (`RolloutManager._convert_samples_to_train_data`, rewards through our
post-process plugin); this plugin changes one thing it produces, `rollout_mask_sums`, the
per-sample denominator of slime's loss reducer (checked at slime 624b824):

    reducer(x) = sum_i (x_i * mask_i).sum() / rollout_mask_sums[i]      (per micro-batch)
    step loss  = reducer(loss) summed over the step's micro-batches / G  (G = --global-batch-size
                                                                           rollouts per step)

slime sets rollout_mask_sums[i] to the tokens of sample i's rollout, so the step loss is a mean
over rollouts of per-rollout token means. The local trainer takes one token mean over all the
teacher's info tokens of the step and, beside it, one over the distillation tokens and one over
the SDPO shaping tokens. With rollout_mask_sums[i] = the step's tokens of sample i's kind, and
`meta_loss` multiplying by G, slime's step loss is the local one: the sum of those token means.
Replay samples (two per DPO pair) get the step's pair count instead: DPO's mean over pairs.
Steps are formed as slime forms them (`slime.utils.dp_schedule.build_dp_schedule`): rollouts in
order of first appearance, G per step.
"""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace
from typing import Any, Sequence

from slime_meta.backends.slime.samples import kind_of_index


def _rollout_manager_class():
    """slime's RolloutManager class behind its `@ray.remote` wrapper."""
    from slime.ray import rollout as slime_rollout

    manager = slime_rollout.RolloutManager
    for unwrap in (lambda c: c.__ray_actor_class__, lambda c: c.__ray_metadata__.modified_class):
        try:
            return unwrap(manager)
        except AttributeError:
            continue
    return manager


def slime_train_data(args: Namespace, samples: Sequence[Any]) -> dict[str, Any]:
    """slime's own sample-to-train-data conversion, our reward post-process plugged in as slime does."""
    from slime_meta.backends.slime.rollout import post_process_rewards

    manager = _rollout_manager_class()
    owner = SimpleNamespace(
        args=args, custom_convert_samples_to_train_data_func=None, custom_reward_post_process_func=post_process_rewards
    )
    owner._post_process_rewards = lambda s: manager._post_process_rewards(owner, s)
    return manager._convert_samples_to_train_data(owner, samples)


def channel_token_denominators(
    rollout_ids: Sequence[int],
    sample_indices: Sequence[int],
    loss_masks: Sequence[Sequence[int]],
    global_batch_size: int,
) -> list[float]:
    """Per sample: the tokens of its kind (info, distillation, SDPO shaping) in its training step."""
    order: dict[int, int] = {}
    for rid in rollout_ids:
        order.setdefault(rid, len(order))
    totals: dict[tuple[int, bool], float] = {}
    keys = []
    for rid, index, mask in zip(rollout_ids, sample_indices, loss_masks):
        key = (order[rid] // global_batch_size, kind_of_index(index))
        # Replay: DPO's mean is over pairs (each side's tokens summed), so its denominator counts pairs.
        totals[key] = totals.get(key, 0.0) + (0.5 if key[1] == "replay" else float(sum(mask)))
        keys.append(key)
    return [totals[key] for key in keys]


def convert_samples_to_train_data(args: Namespace, samples: Sequence[Any]) -> dict[str, Any]:
    train_data = slime_train_data(args, samples)
    train_data["rollout_mask_sums"] = channel_token_denominators(
        train_data["rollout_ids"], train_data["sample_indices"], train_data["loss_masks"], int(args.global_batch_size)
    )
    return train_data
