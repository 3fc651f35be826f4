"""The top-k JSD with a tail bucket: its definition, its limit k = V, and the vocabulary split over
real torch.distributed (gloo) processes, each holding one slice of the logits."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slime_meta.losses.distill import divergence_from_logps, generalized_jsd
from slime_meta.losses.topk_distill import ProcessGroupShards, teacher_topk, topk_generalized_jsd

N, V = 12, 96


def _logits(seed: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(N, V, generator=g, dtype=dtype) * 2.0
    teacher = student + torch.randn(N, V, generator=g, dtype=dtype)  # related, as a hinted self is
    return student, teacher


def _full_jsd(student_N_V: torch.Tensor, teacher_N_V: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token generalised JSD over the whole vocabulary, in the inputs' dtype."""
    return divergence_from_logps(torch.log_softmax(student_N_V, -1), torch.log_softmax(teacher_N_V, -1), beta)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
def test_k_equal_to_the_vocabulary_is_the_full_jsd_in_float64(beta: float) -> None:
    student, teacher = _logits(0)
    ids, logps = teacher_topk(teacher.double(), V)
    logps = torch.log_softmax(teacher, -1).gather(-1, ids)  # float64 teacher log-probs
    out = topk_generalized_jsd(student, ids, logps, beta=beta)
    full = _full_jsd(student, teacher, beta)
    torch.testing.assert_close(out.per_token, full, rtol=1e-10, atol=1e-12)
    assert out.per_token.min() > 0


def test_the_gap_to_the_full_jsd_shrinks_as_k_grows_and_never_overshoots() -> None:
    student, teacher = _logits(1)
    full = _full_jsd(student, teacher, 0.5)
    teacher_logps = torch.log_softmax(teacher, -1)
    previous = torch.zeros(N, dtype=torch.float64)
    for k in (1, 4, 16, 48, V):
        ids = teacher_logps.topk(k, -1).indices
        value = topk_generalized_jsd(student, ids, teacher_logps.gather(-1, ids)).per_token
        # Merging outcomes never raises an f-divergence: each finer partition gives at least as much.
        assert torch.all(value <= full + 1e-12) and torch.all(value >= previous - 1e-12)
        previous = value
    torch.testing.assert_close(previous, full, rtol=1e-10, atol=1e-12)


def test_the_tail_bucket_is_the_mass_outside_the_top_k_on_both_sides() -> None:
    student, teacher = _logits(2)
    k = 5
    ids, logps = teacher_topk(teacher, k)
    p_N_V, q_N_V = torch.softmax(student, -1), torch.softmax(teacher, -1)
    outside = torch.ones(N, V, dtype=torch.bool).scatter(-1, ids, False)
    p_buckets = torch.cat([p_N_V.gather(-1, ids), (p_N_V * outside).sum(-1, keepdim=True)], -1)
    q_buckets = torch.cat([q_N_V.gather(-1, ids), (q_N_V * outside).sum(-1, keepdim=True)], -1)
    by_hand = divergence_from_logps(p_buckets.log(), q_buckets.log(), 0.5)
    out = topk_generalized_jsd(student, ids, logps.double(), beta=0.5)
    torch.testing.assert_close(out.per_token, by_hand, rtol=1e-5, atol=1e-7)  # teacher log-probs came as float32


def test_temperature_mask_clip_and_chunks() -> None:
    student, teacher = _logits(3, torch.float32)
    student.requires_grad_(True)
    ids, logps = teacher_topk(teacher, 8, temperature=0.7)
    mask = torch.arange(N) % 3 != 0
    whole = topk_generalized_jsd(student, ids, logps, mask, temperature=0.7, token_clip=0.05)
    (grad_whole,) = torch.autograd.grad(whole.loss, student)
    chunked = topk_generalized_jsd(student, ids, logps, mask, temperature=0.7, token_clip=0.05, chunk_size=3)
    (grad_chunked,) = torch.autograd.grad(chunked.loss, student)
    torch.testing.assert_close(whole.loss, chunked.loss)
    torch.testing.assert_close(grad_whole, grad_chunked)
    assert torch.all(whole.per_token[~mask] == 0) and torch.all(grad_whole[~mask] == 0)
    assert whole.per_token.max() <= 0.05 and 0 < float(whole.metrics["token_clipfrac"]) < 1
    # At the teacher's own distribution the divergence vanishes (same temperature on both sides).
    same = topk_generalized_jsd(teacher, ids, logps, temperature=0.7)
    assert float(same.per_token.abs().max()) < 1e-6


def test_a_gradient_matches_finite_differences() -> None:
    student, teacher = _logits(4)
    ids, logps = teacher_topk(teacher, 6)
    logps = torch.log_softmax(teacher, -1).gather(-1, ids)
    rows = student[:2].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: topk_generalized_jsd(x, ids[:2], logps[:2], beta=0.3).loss, (rows,))


def test_bad_shapes_are_refused() -> None:
    student, teacher = _logits(5)
    ids, logps = teacher_topk(teacher, 4)
    with pytest.raises(ValueError, match="same tokens"):
        topk_generalized_jsd(student[:-1], ids, logps)
    with pytest.raises(ValueError, match="beta"):
        topk_generalized_jsd(student, ids, logps, beta=1.5)


# ----------------------------------------------------------------------------- vocabulary split


def _split_rank(rank: int, world: int, init_file: str, out_dir: str, chunk_size) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        student, teacher = _logits(6, torch.float32)
        ids, logps = teacher_topk(teacher, 10)
        ids[0, 0] = V - 1  # a top id in the last slice: read on another rank than most
        width = V // world
        shard = student[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
        mask = torch.arange(N) != 4
        out = topk_generalized_jsd(
            shard, ids, logps, mask, beta=0.5, token_clip=5.0, chunk_size=chunk_size, shards=ProcessGroupShards()
        )
        out.loss.backward()
        torch.save({"loss": out.loss.detach(), "grad": shard.grad}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,chunk_size", [(2, None), (4, 5)])
def test_a_vocabulary_split_over_ranks_gives_the_unsplit_loss_and_gradient(world: int, chunk_size) -> None:
    student, teacher = _logits(6, torch.float32)
    ids, logps = teacher_topk(teacher, 10)
    ids[0, 0] = V - 1
    whole = student.clone().requires_grad_(True)
    mask = torch.arange(N) != 4
    expected = topk_generalized_jsd(whole, ids, logps, mask, beta=0.5, token_clip=5.0)
    expected.loss.backward()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_split_rank, args=(world, os.path.join(tmp, "init"), tmp, chunk_size), nprocs=world, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    for result in results:
        torch.testing.assert_close(result["loss"], expected.loss.detach())
    torch.testing.assert_close(torch.cat([r["grad"] for r in results], dim=-1), whole.grad)
    assert whole.grad.abs().sum() > 0


def test_the_full_jsd_kernel_and_the_top_k_agree_at_k_equal_to_v_in_float32() -> None:
    student, teacher = _logits(7, torch.float32)
    ids, logps = teacher_topk(teacher, V)
    full = generalized_jsd(student, teacher, None, beta=0.5).per_token
    torch.testing.assert_close(topk_generalized_jsd(student, ids, logps).per_token, full, rtol=1e-4, atol=1e-5)
