"""The loss functions against independent float64 references written here from the formulas
(TRL GKD's generalized JSD, slime's PPO clip with dual clip and TIS, TRL's sigmoid DPO), on random
inputs of several shapes: values and gradients."""

from __future__ import annotations

import zlib

import pytest
import torch

from slime_meta.losses.distill import generalized_jsd
from slime_meta.losses.policy import policy_loss
from slime_meta.losses.preference import dpo_loss

SHAPES = [(2, 5, 11), (17, 7), (1, 3, 3)]


def reference_jsd(student, teacher, mask, beta, temperature):
    """float64, per token summed over the vocabulary, mean over unmasked tokens."""
    log_s = torch.log_softmax(student / temperature, dim=-1)
    log_t = torch.log_softmax(teacher / temperature, dim=-1)
    p_s, p_t = log_s.exp(), log_t.exp()
    if beta == 0.0:
        per_token = (p_t * (log_t - log_s)).sum(-1)
    elif beta == 1.0:
        per_token = (p_s * (log_s - log_t)).sum(-1)
    else:
        m = beta * p_t + (1 - beta) * p_s
        log_m = m.log()
        per_token = beta * (p_t * (log_t - log_m)).sum(-1) + (1 - beta) * (p_s * (log_s - log_m)).sum(-1)
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_jsd_value_and_gradient_against_float64_reference(shape, beta, chunk_size):
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, beta)).encode()))
    student = (torch.randn(shape, generator=g) * 2).requires_grad_(True)
    teacher = torch.randn(shape, generator=g) * 2
    mask = (torch.rand(shape[:-1], generator=g) > 0.3).float()
    mask.view(-1)[0] = 1.0
    ours = generalized_jsd(student, teacher, mask, beta=beta, temperature=1.3, chunk_size=chunk_size).loss
    (grad_ours,) = torch.autograd.grad(ours, student)

    student64 = student.detach().double().requires_grad_(True)
    expected = reference_jsd(student64, teacher.double(), mask.double(), beta, 1.3)
    (grad_expected,) = torch.autograd.grad(expected, student64)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad_ours.double(), grad_expected, rtol=1e-4, atol=1e-6)


def test_jsd_top_k_of_the_whole_vocabulary_equals_the_full_jsd():
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    mask = torch.ones(6)
    full = generalized_jsd(student, teacher, mask, beta=0.5).loss
    assert generalized_jsd(student, teacher, mask, beta=0.5, top_k=9).loss.item() == pytest.approx(
        full.item(), rel=1e-6
    )


def reference_ppo(logp, old_logp, adv, mask, eps, eps_high, eps_c, tis_weight):
    ratio = (logp - old_logp).exp()
    loss = torch.maximum(-ratio * adv, -ratio.clamp(1 - eps, 1 + eps_high) * adv)
    if eps_c is not None:
        loss = torch.where(adv < 0, torch.minimum(-eps_c * adv, loss), loss)
    if tis_weight is not None:
        loss = loss * tis_weight
    return (loss * mask).sum() / mask.sum()


@pytest.mark.parametrize("shape", [(3, 6), (8, 2), (1, 9)])
@pytest.mark.parametrize("variant", ["ppo", "asymmetric", "dual", "tis"])
def test_policy_loss_value_and_gradient_against_float64_reference(shape, variant):
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, variant)).encode()))
    logp = (-torch.rand(shape, generator=g) * 2).requires_grad_(True)
    old_logp = logp.detach() + torch.randn(shape, generator=g) * 0.4  # ratios well outside the clip range
    rollout_logp = old_logp + torch.randn(shape, generator=g) * 0.5
    adv = torch.randn(shape[0], generator=g)[:, None].expand(shape).contiguous()
    mask = (torch.rand(shape, generator=g) > 0.2).float()
    mask[0, 0] = 1.0
    eps, eps_high = 0.2, 0.28 if variant == "asymmetric" else 0.2
    eps_c = 3.0 if variant == "dual" else None
    kwargs = dict(eps_clip=eps, eps_clip_high=eps_high, eps_clip_c=eps_c)
    tis_weight = None
    if variant == "tis":
        kwargs.update(rollout_logp=rollout_logp, tis_clip=2.0, tis_clip_low=0.1)
        tis_weight = (old_logp - rollout_logp).exp().clamp(0.1, 2.0).double()
    ours = policy_loss(logp, old_logp, adv, mask, **kwargs).loss
    (grad_ours,) = torch.autograd.grad(ours, logp)
    logp64 = logp.detach().double().requires_grad_(True)
    expected = reference_ppo(logp64, old_logp.double(), adv.double(), mask.double(), eps, eps_high, eps_c, tis_weight)
    (grad_expected,) = torch.autograd.grad(expected, logp64)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(grad_ours.double(), grad_expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("pairs", [1, 5, 32])
def test_dpo_value_and_gradient_against_float64_reference(pairs):
    g = torch.Generator().manual_seed(pairs)
    chosen = (-torch.rand(pairs, generator=g) * 20).requires_grad_(True)
    rejected = (-torch.rand(pairs, generator=g) * 20).requires_grad_(True)
    ref_chosen, ref_rejected = -torch.rand(pairs, generator=g) * 20, -torch.rand(pairs, generator=g) * 20
    out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
    grads = torch.autograd.grad(out.loss, (chosen, rejected))
    c64, r64 = chosen.detach().double().requires_grad_(True), rejected.detach().double().requires_grad_(True)
    delta = (c64 - ref_chosen.double()) - (r64 - ref_rejected.double())
    expected = -torch.nn.functional.logsigmoid(0.1 * delta).mean()
    expected_grads = torch.autograd.grad(expected, (c64, r64))
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for ours, ref in zip(grads, expected_grads):
        assert torch.allclose(ours.double(), ref, rtol=1e-5, atol=1e-8)
    margin = 0.1 * delta.detach()
    assert float(out.reward_accuracy) == pytest.approx((margin > 0).double().mean().item())
