"""The cluster backend: the same meta-learning run on slime (Ray + Megatron + SGLang).

We write plugins and a thin loop, not a scheduler: Ray places the actors, Megatron trains the
teacher, SGLang engines behind sglang-router serve the pools. Nothing here imports slime, ray,
megatron or sglang at module level; they are imported where a cluster run needs them, so the
flag translation, the dry run and the pure helpers work on any laptop.

  plan.py        flags -> the slime command line, the generated --sglang-config, GPU accounting
  flags.py       our extra flags, and our flag groups as slime's add_custom_arguments
  cli.py         `train.py --backend slime` / `python -m slime_meta.backends.slime`
  loop.py        the outer loop over slime's placement groups, rollout manager and actor
  rollout.py     --rollout-function-path / --custom-reward-post-process-path plugins
  samples.py     problems from slime's data source; TeacherSample -> slime Sample fields
  loss.py        --custom-loss-function-path: GRPO + SDPO JSD + replay DPO on slime's batch
  advantages.py  --custom-advantage-function-path: context distillation
  data.py        a dataset converter: rubric and other columns into slime's `metadata`
"""
