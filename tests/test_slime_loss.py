"""The loss and advantage plugins on random logits in slime's batch layout (CPU, no Megatron).

The batch is built the way slime's Megatron trainer hands it to a custom loss: sequences packed
into logits [1, T, V] (plus padding), per-sample lists for the rest, and slime's reducer
`sum_of_sample_mean` (per-rollout token means summed over samples). The GRPO channel is checked
against slime's policy loss written out from its formulas; with slime's source importable, also
against slime's own `compute_policy_loss`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from argparse import Namespace

import pytest
import torch

from slime_meta.backends.slime.advantages import meta_advantages
from slime_meta.backends.slime.loss import (
    REPLAY_IS_CHOSEN,
    REPLAY_PAIR_INDEX,
    hold_sdpo_topk,
    meta_loss,
    response_logits,
)
from slime_meta.backends.slime.samples import SOLVER_INDEX_BASE, pack_topk

V = 13


def slime_args(**overrides) -> Namespace:
    values = dict(
        rollout_temperature=0.8,
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=None,
        use_tis=False,
        tis_clip=2.0,
        tis_clip_low=0.0,
        use_rollout_logprobs=False,
        entropy_coef=0.01,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        kl_loss_type="k1",
        aipo_delta=None,
        sdpo_alpha=0.0,
        sdpo_beta=0.5,
        sdpo_temperature=1.0,
        sdpo_token_clip=None,
        replay_beta=0.0,
        replay_dpo_beta=0.1,
        tensor_model_parallel_size=1,
        context_parallel_size=1,
    )
    return Namespace(**{**values, **overrides})


def slime_batch(seed: int = 0, prompt_lengths=(3, 5, 2, 4), response_lengths=(4, 2, 5, 3), pad: int = 3):
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, V, (p + r,), generator=g) for p, r in zip(prompt_lengths, response_lengths)]
    total = sum(p + r for p, r in zip(prompt_lengths, response_lengths))
    logits = torch.randn(1, total + pad, V, generator=g).requires_grad_()
    masks = [torch.ones(r) for r in response_lengths]
    if response_lengths[2] > 1:
        masks[2][1] = 0.0  # a masked-out response token (e.g. a tool output)

    def noise(r):
        return -torch.rand(r, generator=g) * 3

    batch = {
        "unconcat_tokens": tokens,
        "total_lengths": [p + r for p, r in zip(prompt_lengths, response_lengths)],
        "response_lengths": list(response_lengths),
        "loss_masks": masks,
        "advantages": [torch.full((r,), float(a)) for r, a in zip(response_lengths, (1.0, -0.5, 0.7, -1.2))],
        "log_probs": [noise(r) for r in response_lengths],
        "rollout_log_probs": [noise(r) for r in response_lengths],
        "ref_log_probs": [noise(r) for r in response_lengths],
        "rollout_mask_sums": [m.sum() for m in masks],
    }
    return batch, logits


def sum_of_sample_mean(batch):
    """slime's reducer for one rank without context parallelism (cp_utils.get_sum_of_sample_mean)."""

    def reduce(x):
        pieces = x.split(batch["response_lengths"])
        return sum(
            (x_i * m).sum() / torch.clamp_min(d, 1)
            for x_i, m, d in zip(pieces, batch["loss_masks"], batch["rollout_mask_sums"])
        )

    return reduce


def reference_log_probs(batch, logits, temperature):
    """log p and entropy of each response token, from the packed logits (position t predicts t+1)."""
    logps, entropies, end = [], [], 0
    for tokens, total, r in zip(batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"]):
        end += total
        z = logits[0, end - r - 1 : end - 1] / temperature
        logp_all = torch.log_softmax(z, dim=-1)
        logps.append(logp_all.gather(-1, tokens[-r:, None]).squeeze(-1))
        entropies.append(-(logp_all.exp() * logp_all).sum(-1))
    return torch.cat(logps), torch.cat(entropies)


def slime_pg(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None):
    """slime's compute_policy_loss (ppo_utils), from its formulas."""
    ratio = (-ppo_kl).exp()
    pg1, pg2 = -ratio * advantages, -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clipped = torch.maximum(pg1, pg2)
    if eps_clip_c is not None:
        clipped = torch.where(advantages < 0, torch.min(-eps_clip_c * advantages, clipped), clipped)
    return clipped, torch.gt(pg2, pg1).float()


def test_response_rows_follow_the_packing():
    batch, logits = slime_batch()
    rows = response_logits(batch, logits)
    assert [r.shape[0] for r in rows] == batch["response_lengths"]
    assert torch.equal(rows[1], logits[0, 11:13])  # sample 1 ends at 7 + 7: its 2 tokens are scored by rows 11, 12


@pytest.mark.parametrize("eps_clip_c", [None, 3.0])
def test_grpo_channel_is_slimes_policy_loss(eps_clip_c):
    args = slime_args(eps_clip_c=eps_clip_c)
    batch, logits = slime_batch()
    reduce = sum_of_sample_mean(batch)
    loss, metrics = meta_loss(args, batch, logits, reduce)
    (grad,) = torch.autograd.grad(loss, logits)

    logp, entropy = reference_log_probs(batch, logits, args.rollout_temperature)
    old, adv = torch.cat(batch["log_probs"]), torch.cat(batch["advantages"])
    pg, clipfrac = slime_pg(old - logp, adv, args.eps_clip, args.eps_clip_high, eps_clip_c)
    expected = reduce(pg) - args.entropy_coef * reduce(entropy)
    (expected_grad,) = torch.autograd.grad(expected, logits)

    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    torch.testing.assert_close(metrics["pg_clipfrac"], reduce(clipfrac))
    torch.testing.assert_close(metrics["ppo_kl"], reduce(old - logp.detach()))
    assert {"loss", "pg_loss", "entropy_loss", "loss/grpo", "loss/total"} <= set(metrics)
    assert "loss/sdpo_kl" not in metrics and "loss/trace_replay_dpo" not in metrics  # no data: skipped
    assert grad[0, -3:].abs().sum() == 0  # padding rows get no gradient


def test_tis_and_kl_terms_follow_slime():
    args = slime_args(
        use_tis=True, tis_clip=1.5, tis_clip_low=0.5, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"
    )
    batch, logits = slime_batch(seed=1)
    reduce = sum_of_sample_mean(batch)
    loss, metrics = meta_loss(args, batch, logits, reduce)

    logp, entropy = reference_log_probs(batch, logits, args.rollout_temperature)
    old, rollout, ref = (torch.cat(batch[k]) for k in ("log_probs", "rollout_log_probs", "ref_log_probs"))
    pg, _ = slime_pg(old - logp, torch.cat(batch["advantages"]), args.eps_clip, args.eps_clip_high)
    pg = pg * torch.exp(old - rollout).clamp(args.tis_clip_low, args.tis_clip)  # vanilla TIS
    log_ratio = -(logp - ref)
    kl = (log_ratio.exp() - 1 - log_ratio).clamp(-10, 10)  # low_var_kl
    expected = reduce(pg) - args.entropy_coef * reduce(entropy) + args.kl_loss_coef * reduce(kl)
    torch.testing.assert_close(loss, expected)
    assert "kl_loss" in metrics
    torch.testing.assert_close(metrics["tis"], reduce(torch.exp(old - rollout).clamp(0.5, 1.5)))


def test_use_rollout_logprobs_anchors_on_the_engine():
    args = slime_args(use_rollout_logprobs=True, entropy_coef=0.0)
    batch, logits = slime_batch(seed=2)
    reduce = sum_of_sample_mean(batch)
    loss, _ = meta_loss(args, batch, logits, reduce)
    logp, _ = reference_log_probs(batch, logits, args.rollout_temperature)
    pg, _ = slime_pg(torch.cat(batch["rollout_log_probs"]) - logp, torch.cat(batch["advantages"]), 0.2, 0.28)
    torch.testing.assert_close(loss, reduce(pg))


@pytest.mark.parametrize("held", [False, True])
def test_sdpo_channel_is_the_top_k_jsd_with_a_tail_bucket(held: bool):
    args = slime_args(sdpo_alpha=0.5, entropy_coef=0.0)
    batch, logits = slime_batch(seed=3)
    reduce = sum_of_sample_mean(batch)
    g = torch.Generator().manual_seed(4)
    k = 4
    ids = [torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(r)]) for r in batch["response_lengths"]]
    # A teacher's top-k log-probs: normalised over the whole vocabulary, so some mass is left for the tail.
    targets = [
        torch.log_softmax(torch.randn(r, V, generator=g), -1).gather(-1, i)
        for r, i in zip(batch["response_lengths"], ids)
    ]
    sdpo_samples = (0, 2)
    batch["teacher_log_probs"] = [
        torch.as_tensor(pack_topk(ids[i].numpy(), targets[i].numpy())) if i in sdpo_samples else torch.zeros(r)
        for i, r in enumerate(batch["response_lengths"])
    ]
    batch["advantages"] = [
        a if i not in sdpo_samples else torch.zeros_like(a) for i, a in enumerate(batch["advantages"])
    ]
    if held:  # as the trainer-side hook leaves them: 1-D placeholders holding the top-k
        data = {"teacher_log_probs": batch["teacher_log_probs"]}
        hold_sdpo_topk(args, 0, data)
        assert all(t.dim() == 1 for t in data["teacher_log_probs"])
    base, _ = meta_loss(slime_args(entropy_coef=0.0), batch, logits, reduce)
    loss, metrics = meta_loss(args, batch, logits, reduce)
    assert metrics["loss/sdpo_kl"] > 0 and float(metrics["sdpo_samples"]) == len(sdpo_samples)
    torch.testing.assert_close(loss, base + 0.5 * metrics["loss/sdpo_kl"])

    # By hand: beta 0.5 JSD over the k ids plus one bucket for the rest of each side's mass.
    per_token = []
    for i, rows_R_V in enumerate(response_logits(batch, logits)):
        if i not in sdpo_samples:
            per_token.append(torch.zeros(rows_R_V.shape[0]))
            continue
        p = torch.softmax(rows_R_V.detach(), -1).gather(-1, ids[i])
        q = targets[i].exp()
        ps, pt = torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1), torch.cat([q, 1 - q.sum(-1, keepdim=True)], -1)
        m = 0.5 * (ps + pt)
        per_token.append(0.5 * (pt * (pt / m).log()).sum(-1) + 0.5 * (ps * (ps / m).log()).sum(-1))
    torch.testing.assert_close(metrics["loss/sdpo_kl"], reduce(torch.cat(per_token)).detach(), rtol=1e-5, atol=1e-6)
    loss.backward()
    # Only the SDPO answers' rows get the JSD's gradient; the others keep the policy gradient's alone.
    (base_grad,) = torch.autograd.grad(meta_loss(slime_args(entropy_coef=0.0), batch, logits, reduce)[0], logits)
    rows_with = [rows for i, rows in enumerate(response_logits(batch, logits.grad)) if i in sdpo_samples]
    assert all(float(r.abs().sum()) > 0 for r in rows_with)
    assert not torch.allclose(logits.grad, base_grad)


def test_sdpo_channel_refuses_context_parallel():
    args = slime_args(sdpo_alpha=0.5, context_parallel_size=2)
    batch, logits = slime_batch(seed=3)
    batch["teacher_log_probs"] = [torch.zeros(r, 4) for r in batch["response_lengths"]]
    with pytest.raises(NotImplementedError, match="context parallel size 2"):
        from slime_meta.backends.slime.loss import sdpo_channel

        sdpo_channel(args, batch, logits, sum_of_sample_mean(batch))


def test_replay_channel_is_active_with_complete_pairs():
    args = slime_args(replay_beta=0.3, entropy_coef=0.0)
    batch, logits = slime_batch(seed=5)
    reduce = sum_of_sample_mean(batch)
    batch[REPLAY_PAIR_INDEX] = [0, 0, 1, -1]  # pair 1 has one member here: it waits for its partner
    batch[REPLAY_IS_CHOSEN] = [True, False, True, False]
    loss, metrics = meta_loss(args, batch, logits, reduce)
    assert float(metrics["replay_pairs"]) == 1.0

    logp, _ = reference_log_probs(batch, logits, args.rollout_temperature)
    seqs = [(lp * m).sum() for lp, m in zip(logp.split(batch["response_lengths"]), batch["loss_masks"])]
    refs = [(r * m).sum() for r, m in zip(batch["ref_log_probs"], batch["loss_masks"])]
    dpo = -torch.nn.functional.logsigmoid(0.1 * ((seqs[0] - refs[0]) - (seqs[1] - refs[1])))
    torch.testing.assert_close(metrics["loss/trace_replay_dpo"], dpo.detach())
    base, _ = meta_loss(slime_args(entropy_coef=0.0), batch, logits, reduce)
    torch.testing.assert_close(loss, base + 0.3 * dpo)


def test_every_micro_batch_reports_the_same_metric_keys():
    """slime adds the micro-batches' metric values position by position: a micro-batch without SDPO
    answers or replay pairs must report the same keys, in the same order, as one with them."""
    args = slime_args(sdpo_alpha=0.5, replay_beta=0.3, entropy_coef=0.0)
    keys, values = [], []
    for sdpo_rows, pairs in (((0, 2), [0, 0, 1, -1]), ((), [-1, -1, -1, -1])):
        batch, logits = slime_batch(seed=3)
        batch["teacher_log_probs"] = [
            torch.as_tensor(pack_topk(torch.arange(4).repeat(r, 1).numpy(), torch.full((r, 4), -2.0).numpy()))
            if i in sdpo_rows
            else torch.zeros(r)
            for i, r in enumerate(batch["response_lengths"])
        ]
        batch[REPLAY_PAIR_INDEX], batch[REPLAY_IS_CHOSEN] = pairs, [True, False, True, False]
        _, metrics = meta_loss(args, batch, logits, sum_of_sample_mean(batch))
        keys.append(list(metrics))
        values.append(metrics)
    assert keys[0] == keys[1]
    assert {"loss/sdpo_kl", "sdpo_samples", "loss/trace_replay_dpo", "replay_pairs"} <= set(keys[0])
    assert float(values[0]["loss/sdpo_kl"]) > 0 and float(values[0]["replay_pairs"]) == 1.0
    assert float(values[1]["loss/sdpo_kl"]) == 0.0 and float(values[1]["replay_pairs"]) == 0.0
    # A slime that forwards no replay keys (stock slime: replay as samples) reports no replay metric.
    batch, logits = slime_batch(seed=3)
    _, metrics = meta_loss(args, batch, logits, sum_of_sample_mean(batch))
    assert "loss/trace_replay_dpo" not in metrics and "replay_pairs" not in metrics


def test_whole_vocabulary_channels_refuse_tensor_parallel_without_megatron():
    batch, logits = slime_batch()
    with pytest.raises(NotImplementedError, match="tensor and context parallel size 1"):
        meta_loss(slime_args(tensor_model_parallel_size=2), batch, logits, sum_of_sample_mean(batch))


def test_empty_micro_batch_keeps_the_graph():
    batch, logits = slime_batch(response_lengths=(0, 0, 0, 0), prompt_lengths=(3, 2, 2, 2))
    batch["loss_masks"] = [torch.ones(0) for _ in range(4)]
    batch["rollout_mask_sums"] = [torch.tensor(0.0)] * 4
    loss, _ = meta_loss(slime_args(), batch, logits, sum_of_sample_mean(batch))
    loss.backward()
    assert logits.grad is not None and float(loss.detach()) == 0.0


def test_context_distillation_advantages():
    """Solver samples (index from SOLVER_INDEX_BASE) get the shaped advantage, with the engine's
    log-probs as the student term (as on the local backend); infos keep their GRPO advantage."""
    args = Namespace(adv_tau=1.0, teacher_tau=0.5, student_tau=0.25, use_rollout_logprobs=False)
    data = {
        "rewards": [1.0, -2.0, 0.75],
        "kl": [torch.zeros(3), torch.zeros(2), torch.zeros(2)],
        "sample_indices": [SOLVER_INDEX_BASE, SOLVER_INDEX_BASE + 1, 7],
        "teacher_log_probs": [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.1, -0.2]), torch.tensor([-9.0, -9.0])],
        "log_probs": [torch.tensor([-3.0, -3.0, -3.0]), torch.tensor([-4.0, -4.0]), torch.tensor([-1.0, -1.0])],
        "rollout_log_probs": [torch.tensor([-0.5, -0.5, -0.5]), torch.tensor([-1.0, -3.0]), torch.tensor([-1.0, -1.0])],
    }
    meta_advantages(args, data)
    torch.testing.assert_close(
        data["advantages"][0], torch.tensor([1.0 - 0.5 + 0.125, 1.0 - 1.0 + 0.125, 1.0 - 0.25 + 0.125])
    )
    torch.testing.assert_close(data["advantages"][1], torch.tensor([-2.0 - 0.05 + 0.25, -2.0 - 0.1 + 0.75]))
    torch.testing.assert_close(data["advantages"][2], torch.full((2,), 0.75))  # an info: its GRPO advantage
    torch.testing.assert_close(data["returns"][1], data["advantages"][1])

    not_given = dict(data, sample_indices=[SOLVER_INDEX_BASE] * 3)
    meta_advantages(Namespace(adv_tau=None, teacher_tau=0.5, student_tau=0.25), not_given)
    torch.testing.assert_close(not_given["advantages"][0], torch.tensor([-0.5 + 0.125, -1.0 + 0.125, -0.25 + 0.125]))

    plain = {"rewards": [0.5], "kl": [torch.zeros(4)]}  # no solver samples: slime's GRPO returns
    meta_advantages(args, plain)
    torch.testing.assert_close(plain["advantages"][0], torch.full((4,), 0.5))


def test_solver_advantages_are_computed_where_the_actors_log_probs_are():
    """slime's actor holds the teacher log-probs on its GPU and the rollout's on the host: the shaped
    advantage is computed on the first one's device (here `meta` stands in for the GPU)."""
    args = Namespace(adv_tau=1.0, teacher_tau=0.5, student_tau=0.25)
    data = {
        "rewards": [1.0],
        "kl": [torch.zeros(3, device="meta")],
        "sample_indices": [SOLVER_INDEX_BASE],
        "teacher_log_probs": [torch.tensor([-1.0, -2.0, -0.5], device="meta")],
        "rollout_log_probs": [torch.tensor([-0.5, -0.5, -0.5])],
    }
    meta_advantages(args, data)
    assert data["advantages"][0].device.type == "meta" and data["advantages"][0].shape == (3,)


@pytest.fixture
def slime_ppo_utils(monkeypatch):
    """slime.utils.ppo_utils from SLIME_SRC (or an installed slime); slime's modules are dropped afterwards."""
    source = os.environ.get("SLIME_SRC")
    if not source and importlib.util.find_spec("slime") is None:
        pytest.skip("slime's source is not importable: set SLIME_SRC to a THUDM/slime checkout")
    if source:
        monkeypatch.syspath_prepend(source)
    before = set(sys.modules)
    try:
        from slime.utils import ppo_utils
    except ImportError as exc:
        pytest.skip(f"slime.utils.ppo_utils does not import here: {exc}")
    yield ppo_utils
    for name in set(sys.modules) - before:
        if name == "slime" or name.startswith("slime."):
            del sys.modules[name]


def test_grpo_channel_matches_slimes_own_compute_policy_loss(slime_ppo_utils):
    fn = slime_ppo_utils.compute_policy_loss
    compute_policy_loss = getattr(fn, "__wrapped__", fn)  # the function under torch.compile: no compiler on CPU
    args = slime_args(eps_clip_c=3.0, entropy_coef=0.0)
    batch, logits = slime_batch(seed=7)
    reduce = sum_of_sample_mean(batch)
    loss, metrics = meta_loss(args, batch, logits, reduce)
    logp, _ = reference_log_probs(batch, logits, args.rollout_temperature)
    pg, clipfrac = compute_policy_loss(
        torch.cat(batch["log_probs"]) - logp, torch.cat(batch["advantages"]), 0.2, 0.28, eps_clip_c=3.0
    )
    torch.testing.assert_close(loss, reduce(pg))
    torch.testing.assert_close(metrics["pg_clipfrac"], reduce(clipfrac))
