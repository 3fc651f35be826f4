"""On a GPU the trainer pads each micro-batch's rows to a multiple of 64 columns
(`batching.CUDA_WIDTH_MULTIPLE`), so its matmuls meet few token counts (each new one keeps host memory
in CUDA's libraries: docs/memory.md). The padding must change nothing a step computes. Checked on
the CPU, which runs exact widths, by giving the trainer the multiple: every channel at once, the same
loss terms and the same update, and every forward of the step at a padded width."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_objectives_local import batch  # noqa: F401 - the module's fixture: teacher, solver and pair samples

from slime_meta.backends.local.training.batching import (
    CUDA_WIDTH_MULTIPLE,
    PolicySequence,
    budget_chunks,
    padded_width,
)
from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.packing import group_rows, make_rows
from slime_meta.backends.local.training.settings import DistillSettings, TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer

EVERY_CHANNEL = TrainerSettings(
    lr=1e-2,
    device="cpu",
    loss=LossSettings(sdpo_alpha=1.0, replay_beta=1.0, kl_loss_coef=1.0, kl_loss_type="k3"),
    distill=DistillSettings(adv_tau=1.0, teacher_tau=1.0, student_tau=1.0),
)


def one_step(checkpoint, samples, width_multiple: int | None, device: str = "cpu"):
    """A step of every channel; the widths of the model's forwards. `width_multiple` None: the trainer's own."""
    teacher, solver, pairs = samples
    torch.manual_seed(0)
    settings = dataclasses.replace(EVERY_CHANNEL, device=device)
    trainer = LocalTrainer(str(checkpoint), settings, reference_path=str(checkpoint))
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_trainer_pads_by_default_and_computes_the_same_losses(tiny_checkpoint, batch):  # noqa: F811
    padded, padded_metrics, padded_widths = one_step(tiny_checkpoint, batch, None, "cuda")  # the GPU's own: 64
    exact, exact_metrics, exact_widths = one_step(tiny_checkpoint, batch, 1, "cuda")
    assert padded_widths and all(width % CUDA_WIDTH_MULTIPLE == 0 for width in padded_widths)
    assert any(width % CUDA_WIDTH_MULTIPLE for width in exact_widths)
    # bf16 autocast: kernels picked per shape round differently (the update itself is checked on the CPU)
    for name in ("loss/total", "loss/grpo", "loss/sdpo_kl", "loss/trace_replay_dpo"):
        assert padded_metrics[name] == pytest.approx(exact_metrics[name], rel=2e-2, abs=1e-4), name


def test_the_token_budget_counts_the_padded_width():
    """A micro-batch of rows x padded width stays within --max-tokens-per-gpu, as the exact one did:
    seven rows of 65 tokens fit 512 tokens at exact widths (455), and four at 128 columns."""
    lengths = [65] * 7 + [130, 200]
    sequences = [PolicySequence(tuple(range(3, 3 + n - 2)), (1, 2), (-0.1, -0.1), (1.0, 1.0), 1.0) for n in lengths]
    rows = make_rows(sequences, False, 8, None)
    sizes = {}
    for multiple in (1, CUDA_WIDTH_MULTIPLE):
        groups = group_rows(rows, sequences, 16, 512, multiple)
        chunks = budget_chunks(list(range(len(lengths))), lengths, 16, 512, multiple)
        for group in groups:
            assert len(group) * padded_width(max(row.length(sequences) for row in group), multiple) <= 512
        for chunk in chunks:
            assert len(chunk) * padded_width(max(lengths[i] for i in chunk), multiple) <= 512
        sizes[multiple] = ([len(g) for g in groups], [len(c) for c in chunks])
    assert sizes[1] == ([7, 2], [7, 2])
    assert sizes[CUDA_WIDTH_MULTIPLE] == ([4, 3, 2], [4, 3, 2])
