"""The default KL estimator pulls: its expected gradient on on-policy samples is not zero.

The KL term is a loss on tokens sampled from the policy, so its expected gradient is
sum_y p(y) * d/dtheta k(log p(y), log r(y)) with the sampling weights p(y) held fixed. For a
categorical policy that sum is exact over the vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from test_arguments import BASE

from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.config.arguments import parse_config
from slime_meta.losses.policy import kl_penalty

V = 7


def expected_kl_gradient(kind: str, logits_V: torch.Tensor, ref_logits_V: torch.Tensor) -> torch.Tensor:
    theta_V = logits_V.clone().requires_grad_(True)
    logp_V = torch.log_softmax(theta_V, dim=-1)
    ref_logp_V = torch.log_softmax(ref_logits_V, dim=-1)
    per_token_V = kl_penalty(logp_V[None], ref_logp_V[None], torch.ones(1, V), kind=kind).per_token[0]
    (logp_V.detach().exp() * per_token_V).sum().backward()  # sampling weights p(y) fixed
    return theta_V.grad


def true_kl(logits_V: torch.Tensor, ref_logits_V: torch.Tensor) -> float:
    logp, ref = torch.log_softmax(logits_V, -1), torch.log_softmax(ref_logits_V, -1)
    return float((logp.exp() * (logp - ref)).sum())


@pytest.fixture()
def policy_and_reference():
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, generator=g, dtype=torch.float64), torch.randn(V, generator=g, dtype=torch.float64)


def test_k1_as_a_loss_has_zero_expected_gradient(policy_and_reference):
    logits, ref = policy_and_reference
    assert true_kl(logits, ref) > 0.1
    assert expected_kl_gradient("k1", logits, ref).abs().max().item() < 1e-6  # kl_penalty computes in float32


def test_the_default_estimator_pulls_the_policy_towards_the_reference(policy_and_reference):
    logits, ref = policy_and_reference
    default = parse_config(BASE).objectives.kl_loss_type
    assert default == LossSettings().kl_loss_type == "k3"
    grad = expected_kl_gradient(default, logits, ref)
    assert grad.abs().max().item() > 1e-2
    # k3's expected gradient is that of KL(ref || policy): a step along it brings the policy closer.
    theta = logits.clone().requires_grad_(True)
    ref_p = torch.softmax(ref, -1)
    (ref_p * (ref_p.log() - torch.log_softmax(theta, -1))).sum().backward()
    torch.testing.assert_close(grad, theta.grad, atol=1e-6, rtol=1e-5)
    assert true_kl(logits - 0.1 * grad, ref) < true_kl(logits, ref)
