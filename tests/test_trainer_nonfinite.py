"""A non-finite loss or gradient never reaches the weights: the step is skipped, counted, and too
many in a row stop the run with one line, the last checkpoint intact."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from slime_meta.backends.local.training.settings import TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.errors import NonFiniteTrainingError
from slime_meta.types import TeacherSample


def teacher_batch(seed: int, advantage_of_first: float = 1.0) -> list[TeacherSample]:
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in torch.randint(4, 60, (n,), generator=g))

    return [
        TeacherSample(
            ids(10),
            ids(5),
            tuple((-torch.rand(5, generator=g) * 2).tolist()),
            reward=float(i),
            advantage=advantage_of_first if i == 0 else -0.5,
            group_index=0,
            sample_index=i,
            inner_iteration=0,
        )
        for i in range(3)
    ]


def snapshot(trainer: LocalTrainer) -> tuple[list[torch.Tensor], dict]:
    params = [p.detach().clone() for p in trainer.model.parameters()]
    state = {
        k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
        for k, v in trainer.optimizer.state_dict()["state"].items()
    }
    return params, state


def assert_unchanged(trainer: LocalTrainer, before: tuple[list[torch.Tensor], dict]) -> None:
    params, state = before
    assert all(torch.equal(a, b) for a, b in zip(params, trainer.model.parameters()))
    now = trainer.optimizer.state_dict()["state"]
    assert now.keys() == state.keys()
    for key, entry in state.items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(now[key][name]), torch.as_tensor(value)), (key, name)
    assert all(p.grad is None for p in trainer.model.parameters())  # nothing carried into the next step


@pytest.fixture()
def trainer(tiny_checkpoint):
    torch.manual_seed(0)
    t = LocalTrainer(str(tiny_checkpoint), TrainerSettings(lr=1e-2, device="cpu", max_skipped_steps=3))
    t.train_step(teacher_batch(0))  # a good step first: AdamW has moments that a bad step could spoil
    return t


def test_a_nan_advantage_skips_the_step_and_leaves_weights_and_optimizer_state(trainer):
    before = snapshot(trainer)
    metrics = trainer.train_step(teacher_batch(1, advantage_of_first=float("nan")), step=7)
    assert math.isnan(metrics["loss/total"])
    assert metrics["train/skipped_nonfinite"] == 1.0 and metrics["train/skipped_nonfinite_total"] == 1.0
    assert trainer.steps_done == 1 and trainer.skipped_nonfinite == 1
    assert_unchanged(trainer, before)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    # The next good step trains as usual and resets the count of skips in a row.
    good = trainer.train_step(teacher_batch(2))
    assert good["train/skipped_nonfinite"] == 0.0 and trainer.steps_done == 2 and trainer.skipped_in_a_row == 0
    assert not all(torch.equal(a, b) for a, b in zip(before[0], trainer.model.parameters()))


def test_a_nan_gradient_element_with_a_finite_loss_is_skipped(trainer):
    before = snapshot(trainer)
    # One NaN element in one parameter's gradient: clip + AdamW would spread it to every weight.
    hook = trainer.model.get_input_embeddings().weight.register_hook(
        lambda grad: grad.index_fill(0, torch.tensor([5]), float("nan"))
    )
    metrics = trainer.train_step(teacher_batch(1))
    hook.remove()
    assert math.isfinite(metrics["loss/total"]) and math.isnan(metrics["train/grad_norm"])
    assert metrics["train/skipped_nonfinite"] == 1.0
    assert_unchanged(trainer, before)


def test_max_skipped_steps_in_a_row_stop_with_one_line(trainer, caplog):
    bad = teacher_batch(1, advantage_of_first=float("inf"))
    trainer.train_step(bad, step=4)
    trainer.train_step(teacher_batch(2))  # a good step between: the count starts again
    trainer.train_step(bad, step=6)
    trainer.train_step(bad, step=7)
    with pytest.raises(NonFiniteTrainingError) as error:
        trainer.train_step(bad, step=8)
    message = str(error.value)
    assert "\n" not in message and message.startswith("step 8: 3 steps in a row") and "--max-skipped-steps 3" in message
    assert trainer.skipped_nonfinite == 4 and trainer.steps_done == 2
    assert "step 6: non-finite loss" in caplog.text  # each skip is logged with its step
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_the_skip_count_survives_a_checkpoint(trainer, tiny_checkpoint):
    trainer.train_step(teacher_batch(1, advantage_of_first=float("nan")))
    fresh = LocalTrainer(str(tiny_checkpoint), trainer.settings)
    fresh.load_state_dict(trainer.state_dict())
    assert fresh.skipped_nonfinite == 1 and fresh.steps_done == 1


# --------------------------------------------------------------------------- a whole run

INJECT = textwrap.dedent(
    """
    import sys, torch
    from slime_meta.backends.local.training import trainer as T

    NAN_FROM_CALL = int(sys.argv.pop(1))
    calls = []
    compute = T.LocalTrainer._compute_gradients  # what train_step calls

    def compute_with_a_nan(self, *args, **kwargs):
        metrics = compute(self, *args, **kwargs)
        calls.append(1)
        if len(calls) > NAN_FROM_CALL:  # one NaN element in one gradient: a fault no input can make
            grad = self.model.get_input_embeddings().weight.grad
            grad[5, 0] = float("nan")
        return metrics

    T.LocalTrainer._compute_gradients = compute_with_a_nan
    sys.argv[0] = {train!r}
    sys.path.insert(0, {root!r})
    import train
    sys.exit(train.main())
    """
)


def test_a_run_skips_nan_steps_pushes_nothing_and_stops_with_the_last_checkpoint_intact(tiny_checkpoint, tmp_path):
    from test_train_e2e import ROOT, read_jsonl, synthetic_args

    script = tmp_path / "train_with_nan.py"
    script.write_text(INJECT.format(train=str(ROOT / "train.py"), root=str(ROOT)))
    run_dir = tmp_path / "run"
    args = synthetic_args(
        tiny_checkpoint,
        run_dir,
        "--num-rollout",
        "4",
        "--save",
        str(run_dir / "ckpt"),
        "--save-interval",
        "1",
        "--max-skipped-steps",
        "2",
        "--weight-sync",
        "disk",
        # An entropy bonus gives every step a gradient (a random model's groups may all tie,
        # and a step without a signal computes none for the NaN to land in).
        "--entropy-coef",
        "1e-3",
    )
    result = subprocess.run(
        [sys.executable, str(script), "1", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    # Step 0 trains; steps 1 and 2 get a NaN gradient: skipped, and the second one stops the run.
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 2: 2 steps in a row had a non-finite") and "--max-skipped-steps 2" in last
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert [r["train/skipped_nonfinite"] for r in records] == [0.0, 1.0]
    # Only the good step's weights were pushed to the workers.
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v0000001"]
    # The checkpoints after step 0 and after the skipped step 1 hold the same finite weights; none after step 2.
    ckpt = run_dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (ckpt / "iter_0000003").exists()
    first, second = (load_file(ckpt / f"iter_{i:07d}" / "model" / "model.safetensors") for i in (1, 2))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.isfinite(first[name]).all() and torch.equal(first[name], second[name]), name
    assert records[0]["train/grad_norm"] > 0  # step 0 trained
    start = load_file(tiny_checkpoint / "model.safetensors")
    assert any(not torch.equal(start[n], first[n]) for n in first if n in start)
    assert json.loads((ckpt / "iter_0000002" / "state.json").read_text())["next_rollout_id"] == 2
