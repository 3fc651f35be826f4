"""Tests for slime_meta.losses: hand-computed values, gradients, and chunked == unchunked."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slime_meta.losses.advantages import context_distillation_advantages, grpo_advantages
from slime_meta.losses.combine import ThreeChannelInputs, total_loss
from slime_meta.losses.distill import generalized_jsd
from slime_meta.losses.policy import kl_penalty, policy_loss
from slime_meta.losses.preference import dpo_loss
from slime_meta.losses.token_stats import entropy_from_logits, sequence_logps


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ----------------------------------------------------------------------------- grpo_advantages


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two groups of 4
    adv = grpo_advantages(rewards, group_size=4, eps=0.0)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]) / torch.tensor([std] * 4 + [1.0] * 4)
    torch.testing.assert_close(adv, expected)


def test_grpo_advantages_eps_and_constant_group():
    adv = grpo_advantages(torch.tensor([3.0, 1.0]), group_size=2, eps=1e-6)
    std = math.sqrt(2.0)  # unbiased std of [3, 1]
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]) / (std + 1e-6))
    assert torch.equal(grpo_advantages(torch.tensor([5.0, 5.0, 5.0]), 3), torch.zeros(3))


def test_grpo_advantages_group_of_one_is_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, -3.0, 7.0]), group_size=1)
    assert torch.equal(adv, torch.zeros(3))
    assert torch.equal(grpo_advantages(torch.tensor([1.0, -3.0]), 1, std_normalize=False), torch.zeros(2))


def test_grpo_advantages_dr_grpo_no_std():
    adv = grpo_advantages(torch.tensor([1, 0, 0, 3]), group_size=2, std_normalize=False)  # ints ok
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -1.5, 1.5]))
    assert adv.dtype == torch.float32


def test_grpo_advantages_validation():
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(4), group_size=0)
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(2, 2), group_size=2)


# ----------------------------------------------------------------------------- policy_loss


def _batch(B=3, T=5):
    logp = (-torch.rand(B, T) * 2).requires_grad_()
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp, mask


def test_policy_loss_on_policy_is_reinforce():
    logp, mask = _batch()
    adv_B = torch.tensor([1.5, -0.5, 2.0])
    out = policy_loss(logp, logp.detach(), adv_B, mask)
    n_tok = mask.sum()
    expected = -(adv_B[:, None] * mask).sum() / n_tok
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, -(adv_B[:, None] * mask) / n_tok)  # REINFORCE gradient
    assert out.metrics["clipfrac"].item() == 0.0
    assert out.metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert out.metrics["approx_kl"].item() == pytest.approx(0.0)
    assert all(not v.requires_grad for v in out.metrics.values())


def test_policy_loss_sample_mean():
    logp, mask = _batch()
    adv = torch.tensor([1.0, 2.0, 4.0])
    out = policy_loss(logp, logp.detach(), adv, mask, loss_aggregation="sample_mean")
    torch.testing.assert_close(out.loss, torch.tensor(-(1.0 + 2.0 + 4.0) / 3))
    with pytest.raises(ValueError):
        policy_loss(logp, logp.detach(), adv, mask, loss_aggregation="seq_sum")
    mask[1] = 0  # a sample with no tokens is left out of the mean, not counted as 0
    out = policy_loss(logp, logp.detach(), adv, mask, loss_aggregation="sample_mean")
    torch.testing.assert_close(out.loss, torch.tensor(-(1.0 + 4.0) / 2))


def test_policy_loss_clip_positive_advantage_no_grad():
    old = torch.log(torch.tensor([[0.2, 0.2]]))
    logp = torch.log(torch.tensor([[0.2 * 1.5, 0.2 * 1.1]])).requires_grad_()  # ratios 1.5 and 1.1
    out = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), eps_clip=0.2)
    out.loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped: ratio > 1 + eps with A > 0
    assert logp.grad[0, 1].item() == pytest.approx(-1.1 / 2)  # inside the range: -ratio * A / N
    torch.testing.assert_close(out.loss, torch.tensor(-(1.2 + 1.1) / 2))
    assert out.metrics["clipfrac"].item() == pytest.approx(0.5)


def test_policy_loss_asymmetric_clip_high():
    old = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.25]])).requires_grad_()
    out = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), eps_clip=0.2, eps_clip_high=0.28)
    torch.testing.assert_close(out.loss, torch.tensor(-1.25))  # 1.25 < 1.28: not clipped
    assert out.metrics["clipfrac"].item() == 0.0


def test_policy_loss_dual_clip_bounds_negative_advantage():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[10.0, 2.0]])).requires_grad_()  # ratios 10 and 2
    adv = torch.tensor([[-1.0, -1.0]])
    plain = policy_loss(logp, old, adv, torch.ones(1, 2))
    torch.testing.assert_close(plain.loss, torch.tensor((10.0 + 2.0) / 2))
    out = policy_loss(logp, old, adv, torch.ones(1, 2), eps_clip_c=3.0)
    torch.testing.assert_close(out.loss, torch.tensor((3.0 + 2.0) / 2))  # min(10, c * |A|) = 3
    out.loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(2.0 / 2)
    assert out.metrics["dual_clipfrac"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, torch.ones(1, 2), eps_clip_c=0.9)


def test_policy_loss_tis_weights_are_clamped_and_detached():
    logp = torch.zeros(1, 3, requires_grad=True)
    old = torch.zeros(1, 3)
    rollout = torch.log(torch.tensor([[0.1, 1.0, 4.0]]))  # weights exp(old - rollout) = 10, 1, 0.25
    out = policy_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 3), rollout_logp=rollout, tis_clip=2.0, tis_clip_low=0.5
    )
    torch.testing.assert_close(out.loss, torch.tensor(-(2.0 + 1.0 + 0.5) / 3))
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -1.0, -0.5]]) / 3)
    assert out.metrics["tis_weight_max"].item() == pytest.approx(2.0)
    assert out.metrics["tis_weight_min"].item() == pytest.approx(0.5)
    assert out.metrics["tis_weight_mean"].item() == pytest.approx(3.5 / 3)
    assert out.metrics["tis_clipfrac"].item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), tis_clip=2.0)  # no rollout_logp


def test_policy_loss_aipo_clips_ratio_to_delta():
    rollout = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[5.0, 1.5]])).requires_grad_()  # pi/mu = 5 and 1.5
    out = policy_loss(logp, logp.detach(), torch.tensor([2.0]), torch.ones(1, 2), rollout_logp=rollout, aipo_delta=2.0)
    torch.testing.assert_close(out.loss, torch.tensor(-(2.0 * 2.0 + 1.5 * 2.0) / 2))
    out.loss.backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-1.5 * 2.0 / 2)
    assert out.metrics["clipfrac"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        policy_loss(logp, logp.detach(), torch.tensor([2.0]), torch.ones(1, 2), aipo_delta=2.0)


def test_policy_loss_ignores_garbage_at_masked_positions():
    logp = torch.tensor([[-1.0, 0.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.0, -200.0, -float("inf")]])
    mask = torch.tensor([[1, 0, 0]])
    out = policy_loss(logp, old, torch.tensor([1.0]), mask, eps_clip_c=3.0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1:].abs().sum().item() == 0.0
    empty = policy_loss(logp, old, torch.tensor([1.0]), torch.zeros(1, 3))
    assert empty.loss.item() == 0.0 and empty.loss.requires_grad


def test_policy_loss_approx_kl_metrics():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(2.0), math.log(0.5)]])
    out = policy_loss(logp, old, torch.tensor([0.0]), torch.ones(1, 2))
    assert out.metrics["approx_kl"].item() == pytest.approx(0.0, abs=1e-6)  # -(ln2 + ln0.5)/2
    k3 = ((2.0 - 1 - math.log(2.0)) + (0.5 - 1 - math.log(0.5))) / 2
    assert out.metrics["approx_kl_k3"].item() == pytest.approx(k3)
    assert out.metrics["ratio_mean"].item() == pytest.approx(1.25)


# ----------------------------------------------------------------------------- kl_penalty


def test_kl_penalty_k1_k3():
    logp = torch.tensor([[-1.0, -2.0, -9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    k1 = kl_penalty(logp, ref, mask, kind="k1")
    torch.testing.assert_close(k1.kl, torch.tensor((0.5 + -1.0) / 2))
    k3 = kl_penalty(logp, ref, mask, kind="k3")
    d = torch.tensor([-0.5, 1.0])
    torch.testing.assert_close(k3.kl, (torch.exp(d) - d - 1).mean())
    assert k3.per_token[0, 2].item() == 0.0
    k3.kl.backward()
    assert logp.grad[0, 2].item() == 0.0
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, mask, kind="k4")


# ----------------------------------------------------------------------------- entropy / sequence_logps


def test_entropy_uniform_and_chunked_matches():
    V = 8
    uniform = torch.zeros(2, 3, V)
    out = entropy_from_logits(uniform, torch.ones(2, 3))
    assert out.entropy.item() == pytest.approx(math.log(V))
    logits = torch.randn(2, 5, 11, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]])
    ref = entropy_from_logits(logits, mask)
    (g_ref,) = torch.autograd.grad(ref.entropy, logits)
    ch = entropy_from_logits(logits, mask, chunk_size=3)
    (g_ch,) = torch.autograd.grad(ch.entropy, logits)
    torch.testing.assert_close(ch.entropy, ref.entropy)
    torch.testing.assert_close(g_ch, g_ref)
    p = torch.softmax(logits, -1)
    manual = (-(p * p.log()).sum(-1))[mask.bool()].mean()
    (g_manual,) = torch.autograd.grad(manual, logits)
    torch.testing.assert_close(ref.entropy, manual)
    torch.testing.assert_close(g_ref, g_manual)


def test_sequence_logps_matches_log_softmax_and_chunked():
    B, T, V = 2, 4, 7
    logits = torch.randn(B, T, V, requires_grad=True)
    tokens = torch.randint(0, V, (B, T))
    tokens[1, 3] = 10_000  # out of range, but masked out: must never be read
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = sequence_logps(logits, tokens, mask, temperature=0.7)
    ls = torch.log_softmax(logits.detach() / 0.7, -1)
    safe = tokens.clamp(max=V - 1)
    expected_tok = ls.gather(-1, safe[..., None]).squeeze(-1) * mask
    torch.testing.assert_close(out.token_logps, expected_tok)
    torch.testing.assert_close(out.seq_logps, expected_tok.sum(1))
    (g,) = torch.autograd.grad(out.seq_logps.sum(), logits)
    ref_tok = torch.log_softmax(logits / 0.7, -1).gather(-1, safe[..., None]).squeeze(-1)
    (g_ref,) = torch.autograd.grad((ref_tok * mask).sum(), logits)
    torch.testing.assert_close(g, g_ref)
    ch = sequence_logps(logits, tokens, mask, temperature=0.7, chunk_size=2)
    (g_ch,) = torch.autograd.grad(ch.seq_logps.sum(), logits)
    torch.testing.assert_close(ch.seq_logps, out.seq_logps)
    torch.testing.assert_close(g_ch, g)
    assert g[1, 2:].abs().sum().item() == 0.0


# ----------------------------------------------------------------------------- generalized_jsd


def _logits(N=6, V=10, scale=2.0):
    return torch.randn(N, V) * scale, torch.randn(N, V) * scale


def test_jsd_beta0_is_forward_kl_via_kl_div():
    s, t = _logits()
    out = generalized_jsd(s, t, None, beta=0.0)
    # F.kl_div(input=log q, target=log p, log_target) = sum p (log p - log q) = KL(teacher || student)
    expected = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), reduction="batchmean", log_target=True)
    torch.testing.assert_close(out.loss, expected)


def test_jsd_beta1_is_reverse_kl():
    s, t = _logits()
    out = generalized_jsd(s, t, None, beta=1.0, temperature=2.0)
    expected = F.kl_div(F.log_softmax(t / 2, -1), F.log_softmax(s / 2, -1), reduction="batchmean", log_target=True)
    torch.testing.assert_close(out.loss, expected)


def test_jsd_half_is_symmetric_and_matches_manual_mixture():
    s, t = _logits()
    a = generalized_jsd(s, t, None, beta=0.5).loss
    b = generalized_jsd(t, s, None, beta=0.5).loss
    torch.testing.assert_close(a, b)
    ps, pt = torch.softmax(s.double(), -1), torch.softmax(t.double(), -1)
    m = 0.3 * pt + 0.7 * ps
    manual = 0.3 * (pt * (pt / m).log()).sum(-1) + 0.7 * (ps * (ps / m).log()).sum(-1)
    torch.testing.assert_close(generalized_jsd(s, t, None, beta=0.3).loss.double(), manual.mean(), rtol=1e-5, atol=1e-6)
    assert 0 < a.item() <= math.log(2)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_zero_when_equal(beta):
    s, _ = _logits()
    assert generalized_jsd(s, s.clone(), None, beta=beta).loss.abs().item() < 1e-6


def test_jsd_gradient_only_to_student_and_masking():
    s, t = _logits(N=8)
    s.requires_grad_()
    t.requires_grad_()
    mask = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1])
    out = generalized_jsd(s.view(2, 4, -1), t.view(2, 4, -1), mask.view(2, 4), beta=0.5)
    out.loss.backward()
    assert t.grad is None
    assert s.grad is not None and s.grad[mask.bool()].abs().sum() > 0
    assert s.grad[~mask.bool()].abs().sum().item() == 0.0
    full = generalized_jsd(s.detach()[mask.bool()], t.detach()[mask.bool()], None, beta=0.5)
    torch.testing.assert_close(out.loss, full.loss)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("top_k", [None, 4])
def test_jsd_chunked_equals_unchunked_fp32(beta, top_k):
    N, V = 13, 37
    s = (torch.randn(N, V) * 3).requires_grad_()
    t = torch.randn(N, V) * 3
    mask = (torch.rand(N) > 0.3).long()
    kw = dict(beta=beta, temperature=1.3, top_k=top_k, token_clip=0.8)
    ref = generalized_jsd(s, t, mask, **kw)
    (g_ref,) = torch.autograd.grad(ref.loss, s)
    ch = generalized_jsd(s, t, mask, chunk_size=4, **kw)
    (g_ch,) = torch.autograd.grad(ch.loss, s)
    torch.testing.assert_close(ch.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ch.per_token, ref.per_token, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_ch, g_ref, rtol=1e-5, atol=1e-7)


def test_jsd_chunked_equals_unchunked_bf16():
    s32, t32 = _logits(N=24, V=50)
    s = s32.to(torch.bfloat16).requires_grad_()
    t = t32.to(torch.bfloat16)
    ref = generalized_jsd(s, t, None, beta=0.5)
    (g_ref,) = torch.autograd.grad(ref.loss, s)
    ch = generalized_jsd(s, t, None, beta=0.5, chunk_size=5)
    (g_ch,) = torch.autograd.grad(ch.loss, s)
    assert ch.loss.dtype == torch.float32 and g_ch.dtype == torch.bfloat16
    torch.testing.assert_close(ch.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_ch.float(), g_ref.float(), rtol=1e-2, atol=1e-5)
    # computed from the bf16 values upcast to fp32, not in bf16:
    fp32 = generalized_jsd(s.detach().float(), t.float(), None, beta=0.5)
    torch.testing.assert_close(ch.loss, fp32.loss, rtol=1e-5, atol=1e-6)


def test_jsd_top_k_renormalises_over_teacher_ids():
    t = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    s = torch.tensor([[1.0, 3.0, 9.0, 9.0]])  # large student mass outside the teacher's top-2
    out = generalized_jsd(s, t, None, beta=0.0, top_k=2)
    pt = torch.softmax(torch.tensor([5.0, 4.0]), -1)
    ps = torch.softmax(torch.tensor([1.0, 3.0]), -1)
    expected = (pt * (pt.log() - ps.log())).sum()
    torch.testing.assert_close(out.loss, expected)
    assert generalized_jsd(s, t, None, beta=0.0, top_k=1).loss.item() == pytest.approx(0.0, abs=1e-7)


def test_jsd_token_clip_caps_each_token():
    s, t = _logits(N=6, scale=4.0)
    raw = generalized_jsd(s, t, None, beta=1.0).per_token
    cap = float(raw.median())
    s.requires_grad_()
    out = generalized_jsd(s, t, None, beta=1.0, token_clip=cap)
    torch.testing.assert_close(out.loss, raw.clamp(max=cap).mean())
    assert out.metrics["token_clipfrac"].item() == pytest.approx((raw > cap).float().mean().item())
    out.loss.backward()
    clipped = raw > cap
    assert clipped.any() and s.grad[clipped].abs().sum().item() == 0.0


def test_jsd_empty_mask_gives_zero():
    s, t = _logits()
    s.requires_grad_()
    out = generalized_jsd(s, t, torch.zeros(6), chunk_size=2)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert s.grad.abs().sum().item() == 0.0


@pytest.mark.filterwarnings("ignore:.*Profiler clears events")
def test_jsd_chunked_never_allocates_full_fp32_logits():
    from torch.profiler import ProfilerActivity, profile

    N, V = 64, 2048
    s = torch.randn(N, V, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randn(N, V, dtype=torch.bfloat16)
    full_fp32 = N * V * 4

    def largest_allocation(chunk_size):
        s.grad = None
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            generalized_jsd(s, t, None, beta=0.5, chunk_size=chunk_size).loss.backward()
        return max(e.self_cpu_memory_usage for e in prof.events())

    assert largest_allocation(None) >= full_fp32  # the check can detect a full [N, V] fp32 tensor
    assert largest_allocation(8) < full_fp32  # only the bf16 gradient (N*V*2) is full-size


# ----------------------------------------------------------------------------- DPO


def test_dpo_zero_delta_is_log2():
    x = torch.tensor([-3.0, -5.0], requires_grad=True)
    out = dpo_loss(x, x.detach() + 1.0, x.detach(), x.detach() + 1.0, beta=0.1)
    torch.testing.assert_close(out.loss, torch.tensor(math.log(2.0)))
    assert out.reward_accuracy.item() == 0.0  # ties are not counted as correct
    assert out.reward_margin.item() == 0.0


def test_dpo_values_and_accuracy():
    chosen = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    rejected = torch.tensor([-2.0, -1.0, -3.0], requires_grad=True)
    ref_c = torch.tensor([-1.5, -1.5, -4.0])
    ref_r = torch.tensor([-1.5, -1.5, -2.0])
    out = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.5)
    delta = torch.tensor([0.5 + 0.5, -0.5 - 0.5, 1.0 + 1.0])
    torch.testing.assert_close(out.loss, -F.logsigmoid(0.5 * delta).mean())
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.25, -0.25, 0.5]))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([-0.25, 0.25, -0.5]))
    assert out.reward_accuracy.item() == pytest.approx(2 / 3)
    assert out.reward_margin.item() == pytest.approx((0.5 - 0.5 + 1.0) / 3)
    assert not out.chosen_rewards.requires_grad
    out.loss.backward()
    assert chosen.grad[0] < 0 and rejected.grad[0] > 0  # descent raises chosen, lowers rejected


# ----------------------------------------------------------------------------- context distillation


def test_context_distillation_advantages_value_and_detach():
    task = torch.tensor([1.0, -1.0], requires_grad=True)
    teacher = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    student = torch.tensor([[-2.0, -1.0], [-0.5, -1.0]], requires_grad=True)
    adv = context_distillation_advantages(task, teacher, student, adv_tau=2.0, teacher_tau=0.5, student_tau=0.25)
    expected = 2.0 * torch.tensor([[1.0, 1.0], [-1.0, -1.0]]) + 0.5 * teacher.detach() - 0.25 * student.detach()
    torch.testing.assert_close(adv, expected)
    assert not adv.requires_grad and adv.grad_fn is None
    per_token_task = context_distillation_advantages(expected, teacher, student, 1.0, 0.0, 0.0)
    torch.testing.assert_close(per_token_task, expected)


# ----------------------------------------------------------------------------- total_loss


def test_total_loss_combination():
    g = torch.tensor(0.5, requires_grad=True)
    j = torch.tensor(2.0, requires_grad=True)
    d = torch.tensor(0.7, requires_grad=True)
    adv = torch.tensor([[1.0, 3.0, 100.0]])
    out = total_loss(
        ThreeChannelInputs(grpo=g, sdpo_jsd=j, replay_dpo=d, advantages=adv, advantages_mask=torch.tensor([[1, 1, 0]])),
        alpha=0.1,
        beta=0.5,
    )
    torch.testing.assert_close(out.loss, torch.tensor(0.5 + 0.1 * 2.0 + 0.5 * 0.7))
    out.loss.backward()
    assert (g.grad.item(), j.grad.item(), d.grad.item()) == pytest.approx((1.0, 0.1, 0.5))
    m = out.metrics
    assert m["loss/grpo"].item() == pytest.approx(0.5)
    assert m["loss/sdpo_kl"].item() == pytest.approx(2.0)
    assert m["loss/trace_replay_dpo"].item() == pytest.approx(0.7)
    assert m["loss/total"].item() == pytest.approx(1.05)
    assert m["combined_advantage"].item() == pytest.approx(2.0)


def test_total_loss_absent_terms_not_logged():
    out = total_loss(ThreeChannelInputs(grpo=torch.tensor(1.5)), alpha=3.0, beta=3.0)
    assert out.loss.item() == pytest.approx(1.5)
    assert set(out.metrics) == {"loss/grpo", "loss/total"}
    only_dpo = total_loss(ThreeChannelInputs(replay_dpo=torch.tensor(2.0)), alpha=1.0, beta=0.25)
    assert only_dpo.loss.item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        total_loss(ThreeChannelInputs(), alpha=1.0, beta=1.0)
    with pytest.raises(ValueError):
        total_loss(ThreeChannelInputs(grpo=torch.ones(2)), alpha=1.0, beta=1.0)


def test_grpo_advantages_constant_group_exact_zero_even_with_rounding():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], dtype=torch.float64)  # mean(0.1*3) != 0.1 in fp
    for std_normalize in (True, False):
        assert torch.equal(
            grpo_advantages(rewards, 3, std_normalize=std_normalize, eps=0.0), torch.zeros(6, dtype=torch.float64)
        )
