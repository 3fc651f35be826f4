"""On a GPU the trainer pads each micro-batch's rows to a multiple of 64 columns
(`batching.CUDA_WIDTH_MULTIPLE`), so its matmuls meet few token counts (each new one keeps host memory
in CUDA's libraries: docs/reliability.md). The padding must change nothing a step computes. Checked on
the CPU, which runs exact widths, by giving the trainer the multiple: every channel at once, the same
loss terms and the same update, and every forward of the step at a padded width."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_objectives_local import batch  # noqa: F401 - the module's fixture: teacher, solver and pair samples

from slime_meta.backends.local.training.batching import CUDA_WIDTH_MULTIPLE
from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.settings import DistillSettings, TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer

EVERY_CHANNEL = TrainerSettings(
    lr=1e-2,
    device="cpu",
    loss=LossSettings(sdpo_alpha=1.0, replay_beta=1.0, kl_loss_coef=1.0, kl_loss_type="k3"),
    distill=DistillSettings(adv_tau=1.0, teacher_tau=1.0, student_tau=1.0),
)


def one_step(checkpoint, samples, width_multiple: int | None):
    """A step of every channel; the widths of the model's forwards. `width_multiple` None: the trainer's own."""
    teacher, solver, pairs = samples
    torch.manual_seed(0)
    trainer = LocalTrainer(str(checkpoint), EVERY_CHANNEL, reference_path=str(checkpoint))
    if width_multiple is not None:
        own = trainer._micro_batching
        trainer._micro_batching = lambda: dataclasses.replace(own(), width_multiple=width_multiple)
    widths: list[int] = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        widths.append(ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1])

    trainer.model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)  # split head or not
    metrics = trainer.train_step(teacher, solver, pairs)
    return [p.detach().clone() for p in trainer.model.parameters()], metrics, widths


def test_padded_widths_give_the_same_step_as_exact_ones(tiny_checkpoint, batch):  # noqa: F811
    exact, exact_metrics, exact_widths = one_step(tiny_checkpoint, batch, None)  # the CPU: exact widths
    padded, padded_metrics, padded_widths = one_step(tiny_checkpoint, batch, CUDA_WIDTH_MULTIPLE)
    assert any(width % CUDA_WIDTH_MULTIPLE for width in exact_widths)
    assert padded_widths and all(width % CUDA_WIDTH_MULTIPLE == 0 for width in padded_widths)
    assert len(padded_widths) == len(exact_widths)  # the same forwards, each wider
    for name in ("loss/total", "loss/grpo", "loss/sdpo_kl", "loss/trace_replay_dpo", "train/kl_ref"):
        assert padded_metrics[name] == pytest.approx(exact_metrics[name], rel=1e-4, abs=1e-6), name
    for a, b in zip(padded, exact, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
