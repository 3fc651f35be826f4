"""`linear_token_logps`: the output projection folded into row chunks gives the log-probs, the
entropy and the gradients of `token_logps(hidden @ weight.T)`, without the `[N, V]` logits."""

from __future__ import annotations

import pytest
import torch

from slime_meta.losses.linear_head import linear_token_logps
from slime_meta.losses.token_stats import token_logps


def inputs(dtype=torch.float64, rows=11, hidden=6, vocab=37):
    g = torch.Generator().manual_seed(0)
    hidden_N_H = torch.randn(rows, hidden, generator=g, dtype=dtype).requires_grad_(True)
    weight_V_H = torch.randn(vocab, hidden, generator=g, dtype=dtype).requires_grad_(True)
    targets_N = torch.randint(0, vocab, (rows,), generator=g)
    temperature_N = 0.5 + torch.rand(rows, generator=g, dtype=dtype)
    return hidden_N_H, weight_V_H, targets_N, temperature_N


@pytest.mark.parametrize("chunk_size", [1, 4, 11, 64])
def test_values_and_gradients_equal_the_full_logits_path(chunk_size):
    hidden_N_H, weight_V_H, targets_N, temperature_N = inputs()
    upstream_N = torch.linspace(-1.0, 2.0, len(targets_N), dtype=torch.float64)

    full = token_logps(hidden_N_H @ weight_V_H.T, targets_N, temperature_N, chunk_size=None, with_entropy=True)
    (full.logp_N * upstream_N).sum().backward()
    expected_grads = hidden_N_H.grad.clone(), weight_V_H.grad.clone()
    hidden_N_H.grad = weight_V_H.grad = None

    folded = linear_token_logps(hidden_N_H, weight_V_H, targets_N, temperature_N, chunk_size=chunk_size)
    (folded.logp_N * upstream_N).sum().backward()
    torch.testing.assert_close(folded.logp_N, full.logp_N, rtol=0, atol=1e-12)
    torch.testing.assert_close(folded.entropy_N, full.entropy_N, rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden_N_H.grad, expected_grads[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(weight_V_H.grad, expected_grads[1], rtol=0, atol=1e-12)
    assert weight_V_H.grad.abs().sum() > 0 and not folded.entropy_N.requires_grad


def test_float32_scalar_temperature_and_no_entropy():
    hidden_N_H, weight_V_H, targets_N, _ = inputs(torch.float32)
    folded = linear_token_logps(hidden_N_H, weight_V_H, targets_N, 1.3, chunk_size=3, with_entropy=False)
    full = token_logps(hidden_N_H @ weight_V_H.T, targets_N, 1.3, with_entropy=False)
    assert folded.entropy_N is None and folded.logp_N.dtype == torch.float32
    torch.testing.assert_close(folded.logp_N, full.logp_N, rtol=0, atol=1e-5)
    assert (folded.logp_N < 0).all()


def test_only_the_hidden_rows_need_a_gradient_and_no_rows():
    hidden_N_H, weight_V_H, targets_N, temperature_N = inputs()
    frozen_V_H = weight_V_H.detach()
    linear_token_logps(hidden_N_H, frozen_V_H, targets_N, temperature_N, chunk_size=5).logp_N.sum().backward()
    assert hidden_N_H.grad is not None and frozen_V_H.grad is None
    empty = linear_token_logps(hidden_N_H[:0], weight_V_H, targets_N[:0], 1.0)
    assert empty.logp_N.shape == (0,) and empty.entropy_N.shape == (0,)


def test_shapes_and_arguments_are_checked():
    hidden_N_H, weight_V_H, targets_N, temperature_N = inputs()
    with pytest.raises(ValueError, match="hidden"):
        linear_token_logps(hidden_N_H, weight_V_H[:, :3], targets_N, 1.0)
    with pytest.raises(ValueError, match="targets"):
        linear_token_logps(hidden_N_H, weight_V_H, targets_N[:3], 1.0)
    with pytest.raises(ValueError, match="temperature"):
        linear_token_logps(hidden_N_H, weight_V_H, targets_N, temperature_N[:3])
    with pytest.raises(ValueError, match="temperature"):
        linear_token_logps(hidden_N_H, weight_V_H, targets_N, 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_token_logps(hidden_N_H, weight_V_H, targets_N, 1.0, chunk_size=0)
