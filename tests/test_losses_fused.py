"""The fused (Triton) paths of the vocabulary-wide losses: dispatch, fallback, and the kernels
against the torch code.

Dispatch and fallback run everywhere. The kernel comparisons need Triton and a device to run it:
a CUDA GPU, or the CPU through Triton's interpreter (`TRITON_INTERPRET=1 pytest ...`, slow but
exact in what it checks); otherwise they are skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

from slime_meta.losses import fused
from slime_meta.losses.distill import generalized_jsd, token_logps_and_jsd
from slime_meta.losses.token_stats import entropy_from_logits, sequence_logps, token_logps


def _kernel_device() -> str | None:
    if fused.kernels() is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


KERNEL_DEVICE = _kernel_device()
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs Triton on a CUDA GPU (or TRITON_INTERPRET=1)")


def logits_pair(n: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(n, vocab, generator=g) * 2.0
    teacher = student + torch.randn(n, vocab, generator=g)
    return student.to(device=device, dtype=dtype), teacher.to(device=device, dtype=dtype)


def grad_of(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.detach().clone().requires_grad_(True)
    value = fn(leaf)
    value.backward()
    return value.detach(), leaf.grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- dispatch, everywhere


def test_cpu_tensors_take_the_torch_code_exactly():
    student, teacher = logits_pair(6, 50, torch.float32, "cpu")
    mask = torch.tensor([1, 0, 1, 1, 0, 1])
    tokens = torch.randint(0, 50, (2, 3))
    assert not fused.use_fused("auto", True, student)
    auto = generalized_jsd(student, teacher, mask, beta=0.3, chunk_size=2)
    forced = generalized_jsd(student, teacher, mask, beta=0.3, chunk_size=2, backend="torch")
    assert torch.equal(auto.loss, forced.loss)
    logits_B_T_V = student.view(2, 3, 50)
    assert torch.equal(
        sequence_logps(logits_B_T_V, tokens, None).token_logps,
        sequence_logps(logits_B_T_V, tokens, None, backend="torch").token_logps,
    )


def test_backend_argument_is_checked():
    student, teacher = logits_pair(4, 20, torch.float32, "cpu")
    with pytest.raises(ValueError, match="backend"):
        generalized_jsd(student, teacher, None, backend="cuda")
    with pytest.raises(ValueError, match="top_k"):
        generalized_jsd(student, teacher, None, top_k=3, backend="triton")


def test_without_triton_auto_falls_back_and_triton_is_refused(monkeypatch):
    monkeypatch.setattr(fused, "kernels", lambda: None)
    student, teacher = logits_pair(4, 20, torch.float32, "cpu")
    assert not fused.kernels_usable(student)
    assert generalized_jsd(student, teacher, None).loss.isfinite()
    with pytest.raises(RuntimeError, match="Triton"):
        generalized_jsd(student, teacher, None, backend="triton")


def test_float64_never_takes_the_kernels():
    student, teacher = logits_pair(4, 20, torch.float64, "cpu")
    assert not fused.kernels_usable(student, teacher)
    assert not fused.use_fused("auto", True, student.cuda() if torch.cuda.is_available() else student)
    assert torch.equal(
        generalized_jsd(student, teacher, None).loss, generalized_jsd(student, teacher, None, backend="torch").loss
    )


def test_token_logps_torch_path_matches_log_softmax_with_per_row_temperature():
    student, _ = logits_pair(7, 40, torch.float64, "cpu")
    targets = torch.randint(0, 40, (7,))
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.3, 1.0], dtype=torch.float64)
    out = token_logps(student, targets, temperature, chunk_size=3, backend="torch")
    logp_ref = torch.log_softmax(student / temperature[:, None], dim=-1)
    assert torch.allclose(out.logp_N, logp_ref.gather(1, targets[:, None]).squeeze(1))
    assert torch.allclose(out.entropy_N, -(logp_ref.exp() * logp_ref).sum(-1))
    assert not out.entropy_N.requires_grad
    scalar = token_logps(student, targets, 0.5, backend="torch").logp_N
    assert torch.allclose(scalar, torch.log_softmax(student / 0.5, -1).gather(1, targets[:, None]).squeeze(1))


def test_combined_torch_path_equals_the_two_calls():
    student, teacher = logits_pair(6, 30, torch.float32, "cpu")
    s_B_T_V, t_B_T_V = student.view(2, 3, 30), teacher.view(2, 3, 30)
    tokens, mask = torch.randint(0, 30, (2, 3)), torch.tensor([[1, 1, 0], [0, 1, 1]])
    logps, jsd = token_logps_and_jsd(s_B_T_V, t_B_T_V, tokens, mask, beta=0.4, temperature=0.8, token_clip=0.5)
    assert torch.equal(logps.token_logps, sequence_logps(s_B_T_V, tokens, mask, 0.8).token_logps)
    assert torch.equal(jsd.loss, generalized_jsd(s_B_T_V, t_B_T_V, mask, 0.4, 0.8, token_clip=0.5).loss)


# ----------------------------------------------------------------------------- kernels vs torch

SHAPES = [(37, 1000), (19, 5000), (8, 4096)]  # vocab below, above and at one 4096 block


@needs_kernels
@pytest.mark.parametrize("n,vocab", SHAPES)
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_jsd_kernel_matches_torch(n, vocab, beta, temperature):
    student, teacher = logits_pair(n, vocab, torch.float32, KERNEL_DEVICE, seed=n + vocab)
    mask = (torch.arange(n) % 3 != 1).to(KERNEL_DEVICE)  # masked rows in between

    def loss(backend):
        return lambda s: generalized_jsd(s, teacher, mask, beta=beta, temperature=temperature, backend=backend).loss

    v_fused, g_fused = grad_of(loss("triton"), student)
    v_torch, g_torch = grad_of(loss("torch"), student)
    assert abs(float(v_fused - v_torch)) <= 1e-5 * max(1.0, abs(float(v_torch)))
    assert rel_err(g_fused, g_torch) < 1e-4
    assert torch.all(g_fused[~mask] == 0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_jsd_kernel_low_precision_and_token_clip(dtype):
    student, teacher = logits_pair(24, 3000, dtype, KERNEL_DEVICE, seed=3)

    def loss(backend):
        return lambda s: (
            generalized_jsd(s, teacher, None, beta=0.5, temperature=1.3, token_clip=0.05, backend=backend).loss
        )

    v_fused, g_fused = grad_of(loss("triton"), student)
    v_torch, g_torch = grad_of(loss("torch"), student)
    assert g_fused.dtype == dtype and torch.isfinite(g_fused).all()
    assert abs(float(v_fused - v_torch)) <= 1e-5 * max(1.0, abs(float(v_torch)))
    assert rel_err(g_fused, g_torch) < 1e-2  # both rounded to the gradient's dtype


@needs_kernels
@pytest.mark.parametrize("n,vocab", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_sequence_logps_kernel_matches_torch(n, vocab, temperature):
    student, _ = logits_pair(n, vocab, torch.float32, KERNEL_DEVICE, seed=vocab)
    logits_B_T_V = student.view(1, n, vocab)
    tokens = torch.randint(0, vocab, (1, n)).to(KERNEL_DEVICE)
    mask = (torch.arange(n) % 4 != 0).view(1, n).to(KERNEL_DEVICE)
    weights = torch.randn(1, n).to(KERNEL_DEVICE)  # a non-uniform upstream gradient

    def loss(backend):
        return lambda s: (sequence_logps(s, tokens, mask, temperature, backend=backend).token_logps * weights).sum()

    v_fused, g_fused = grad_of(loss("triton"), logits_B_T_V)
    v_torch, g_torch = grad_of(loss("torch"), logits_B_T_V)
    assert abs(float(v_fused - v_torch)) <= 1e-5 * max(1.0, abs(float(v_torch)))
    assert rel_err(g_fused, g_torch) < 1e-5
    assert torch.all(g_fused[~mask] == 0)


@needs_kernels
def test_token_logps_and_entropy_kernel_per_row_temperature():
    student, _ = logits_pair(33, 2500, torch.bfloat16, KERNEL_DEVICE, seed=5)
    targets = torch.randint(0, 2500, (33,)).to(KERNEL_DEVICE)
    temperature = (0.5 + torch.rand(33)).to(KERNEL_DEVICE)
    fused_out = token_logps(student, targets, temperature, backend="triton")
    torch_out = token_logps(student, targets, temperature, backend="torch")
    assert rel_err(fused_out.logp_N, torch_out.logp_N) < 1e-5
    assert rel_err(fused_out.entropy_N, torch_out.entropy_N) < 1e-5
    with torch.no_grad():
        ent = entropy_from_logits(student, None, temperature=0.9, backend="triton").per_token
    assert rel_err(ent, entropy_from_logits(student, None, temperature=0.9, backend="torch").per_token) < 1e-5


@needs_kernels
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_combined_kernel_one_gradient_for_both(beta):
    n_b, n_t, vocab = 2, 9, 4500
    student, teacher = logits_pair(n_b * n_t, vocab, torch.float32, KERNEL_DEVICE, seed=11)
    s_B_T_V, t_B_T_V = student.view(n_b, n_t, vocab), teacher.view(n_b, n_t, vocab)
    tokens = torch.randint(0, vocab, (n_b, n_t)).to(KERNEL_DEVICE)
    mask = (torch.rand(n_b, n_t) > 0.3).to(KERNEL_DEVICE)

    def loss(backend):
        def run(s):
            logps, jsd = token_logps_and_jsd(s, t_B_T_V, tokens, mask, beta=beta, temperature=0.9, backend=backend)
            return 0.7 * jsd.loss - (logps.seq_logps * torch.tensor([0.2, -0.5], device=s.device)).sum()

        return run

    v_fused, g_fused = grad_of(loss("triton"), s_B_T_V)
    v_torch, g_torch = grad_of(loss("torch"), s_B_T_V)
    assert abs(float(v_fused - v_torch)) <= 1e-5 * max(1.0, abs(float(v_torch)))
    assert rel_err(g_fused, g_torch) < 1e-4


@needs_kernels
@pytest.mark.skipif(not torch.cuda.is_available(), reason="full vocabulary: GPU only")
def test_kernels_at_full_vocabulary_bf16():
    student, teacher = logits_pair(64, 151936, torch.bfloat16, "cuda", seed=7)
    v_fused, g_fused = grad_of(lambda s: generalized_jsd(s, teacher, None, beta=0.5, backend="triton").loss, student)
    v_torch, g_torch = grad_of(lambda s: generalized_jsd(s, teacher, None, beta=0.5, backend="torch").loss, student)
    assert abs(float(v_fused - v_torch)) <= 1e-5 * abs(float(v_torch))
    assert rel_err(g_fused, g_torch) < 1e-2
