"""One outer step: what a rollout hands to training (`batch`), rollouts ahead of training (`pipeline`), what the
step logs besides the rollout's and the trainer's metrics (`metrics`)."""
