"""How stale a rollout's weights were, as the local run logs it (async/max_staleness)."""

from types import SimpleNamespace

from slime_meta.backends.local.step.metrics import staleness_metrics


def samples(*versions):
    return [SimpleNamespace(weight_version=v) for v in versions]


def test_a_sample_counts_the_steps_between_its_weights_and_the_trained_policy():
    metrics = staleness_metrics(samples("3", "4", "4"), rollout_id=4, start_step=0)
    assert metrics["async/max_staleness"] == 1.0
    assert abs(metrics["async/mean_staleness"] - 1 / 3) < 1e-12


def test_a_worker_s_start_weights_are_the_start_step_s():
    metrics = staleness_metrics(samples("default", None), rollout_id=7, start_step=6)
    assert metrics["async/max_staleness"] == 1.0


def test_a_skipped_step_pushed_nothing_so_the_weights_before_it_are_not_older():
    # Step 1 was skipped: weights 1 were also weights 2, so a sample on them at step 2 is fresh...
    assert staleness_metrics(samples("1"), rollout_id=2, start_step=0, unchanged_steps={1})["async/max_staleness"] == 0
    # ...and at step 3 (step 2 trained) one step behind; without the skip it would read two.
    assert staleness_metrics(samples("1"), rollout_id=3, start_step=0, unchanged_steps={1})["async/max_staleness"] == 1
    assert staleness_metrics(samples("1"), rollout_id=3, start_step=0)["async/max_staleness"] == 2
    # Skipped steps before a worker's start weights count the same way.
    metrics = staleness_metrics(samples("default"), rollout_id=2, start_step=0, unchanged_steps={0})
    assert metrics["async/max_staleness"] == 1


def test_no_samples_log_nothing():
    assert staleness_metrics([], rollout_id=3, start_step=0) == {}
