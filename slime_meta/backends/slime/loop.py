"""The outer loop on a cluster: slime's pieces, our plugins inside them.

Ray places the GPUs (one placement group), slime's rollout manager starts the SGLang engines and
their routers and calls our `generate_rollout` once per step, Megatron trains the teacher with
our loss, and the new weights go to the teacher's engines (never to a frozen student pool).
slime's own train.py is a script; this is the same sequence for the actor-only GRPO case.

--max-async-level 1 follows slime's own pattern for rollouts ahead of training (its
train_async.py): step n+1's rollout is started before step n trains, the trainer's new weights go
to the engines once that rollout is in, so each step trains on a rollout drawn with the weights
of one step before (correct it with --use-tis). It needs training and inference on separate GPUs
(no --colocate); deeper levels are refused at launch.
"""

from __future__ import annotations


def train(args) -> None:
    import ray
    from slime.observability.logging_utils import configure_logger, finish_tracking, init_tracking
    from slime.ray.placement_group import create_placement_groups, create_rollout_manager, create_training_models
    from slime.utils.misc import should_run_periodic_action

    configure_logger()
    placement = create_placement_groups(args)  # GPUs for the trainer and every SGLang model
    init_tracking(args)
    # The rollout manager starts the engines and routers; `num_rollout` may come from it (--num-epoch).
    rollout, rollouts_per_epoch = create_rollout_manager(args, placement["rollout"])
    teacher, _ = create_training_models(args, placement, rollout)

    def wake_rollout_engines() -> None:
        """Colocated: the engines come back (weights, then KV cache) and take the new weights."""
        if args.offload_rollout:
            ray.get(rollout.onload_weights.remote())
        teacher.update_weights()
        if args.offload_rollout:
            ray.get(rollout.onload_kv.remote())

    def evaluate_if_due(rollout_id: int, before_training: bool = False) -> None:
        due = (
            rollout_id == 0 and not args.skip_eval_before_train
            if before_training
            else should_run_periodic_action(rollout_id, args.eval_interval, rollouts_per_epoch)
        )
        if args.eval_interval is not None and due:
            ray.get(rollout.eval.remote(rollout_id))

    wake_rollout_engines()  # the engines start from --hf-checkpoint; the trainer may have resumed
    if args.check_weight_update_equal:
        # slime's own check, as its train.py runs it: the engines' weights were snapshotted and zeroed
        # at start, so this first sync must restore every tensor bit for bit.
        ray.get(rollout.check_weights.remote(action="compare"))
    if args.num_rollout == 0 and args.eval_interval is not None:
        ray.get(rollout.eval.remote(0))  # evaluation only
    if getattr(args, "max_async_level", 0):
        train_one_step_ahead(
            args, ray, rollout, teacher, rollouts_per_epoch, evaluate_if_due, should_run_periodic_action
        )
        ray.get(rollout.dispose.remote())
        finish_tracking(args)
        return
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        evaluate_if_due(rollout_id, before_training=True)
        data = ray.get(rollout.generate.remote(rollout_id))  # our meta-learning rollout
        if args.offload_rollout:
            ray.get(rollout.offload.remote())  # colocated: free the GPUs for training
        ray.get(teacher.async_train(rollout_id, data))
        if should_run_periodic_action(rollout_id, args.save_interval, rollouts_per_epoch, args.num_rollout):
            teacher.save_model(rollout_id, force_sync=rollout_id == args.num_rollout - 1)
            if args.rollout_global_dataset:
                ray.get(rollout.save.remote(rollout_id))  # the data source's cursor
        if not args.offload_train:
            teacher.clear_memory()
        wake_rollout_engines()
        evaluate_if_due(rollout_id)

    ray.get(rollout.dispose.remote())
    finish_tracking(args)


def train_one_step_ahead(args, ray, rollout, teacher, rollouts_per_epoch, evaluate_if_due, periodic) -> None:
    """--max-async-level 1: the next step's rollout runs while this step trains (no colocation)."""
    evaluate_if_due(args.start_rollout_id, before_training=True)
    pending, collected = rollout.generate.remote(args.start_rollout_id), None
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        data = ray.get(pending) if pending is not None else collected
        pending = rollout.generate.remote(rollout_id + 1) if rollout_id + 1 < args.num_rollout else None
        ray.get(teacher.async_train(rollout_id, data))
        if periodic(rollout_id, args.save_interval, rollouts_per_epoch, args.num_rollout):
            teacher.save_model(rollout_id, force_sync=rollout_id == args.num_rollout - 1)
            if args.rollout_global_dataset:
                ray.get(rollout.save.remote(rollout_id))
        if pending is not None:  # collected before the weights change: no update in mid-generation
            collected, pending = ray.get(pending), None
        teacher.update_weights()
        evaluate_if_due(rollout_id)
