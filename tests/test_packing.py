"""Rows that hold one prompt and several responses (`packing.py`): the layout, the mask, and the
loss, gradient and reference log-probs against one row per sequence, on the tiny model and on
the shipped real model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from slime_meta.backends.local.training.batching import MicroBatching, PolicySequence
from slime_meta.backends.local.training.channels import LossSettings, reference_token_logps
from slime_meta.backends.local.training.packing import (
    collate_rows,
    group_rows,
    make_rows,
    pack_micro_batches,
    shared_prompt_mask,
)
from slime_meta.backends.local.training.settings import TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.types import TeacherSample


def sequence(prompt: tuple[int, ...], response: tuple[int, ...], advantage: float = 1.0) -> PolicySequence:
    n = len(response)
    return PolicySequence(prompt, response, (-1.0,) * n, (advantage,) * n, 1.0)


def test_rows_share_a_common_prefix_and_split_at_the_budget():
    a, b = (1, 2, 3, 4), (5, 6)
    seqs = [sequence(a, (7, 8)), sequence(b, (9,)), sequence(a, (10, 11, 12)), sequence(a, (13,))]
    assert [r.members for r in make_rows(seqs, False, 8, None)] == [(0,), (1,), (2,), (3,)]
    shared = make_rows(seqs, True, 8, None)
    assert [(r.prefix_ids, r.members) for r in shared] == [(a, (0, 2, 3)), (b, (1,))]
    assert shared[0].length(seqs) == 4 + 2 + 3 + 1
    # 4 prompt tokens + 2 + 3 would be 9 > 8: the third sequence starts a row of its own (with the prompt again).
    assert [r.members for r in make_rows(seqs, True, 8, 8)] == [(0,), (2, 3), (1,)]
    assert [r.members for r in make_rows(seqs, True, 2, None)] == [(0, 2), (3,), (1,)]
    # Without a token budget a micro-batch holds at most micro_batch_size sequences.
    groups = group_rows(make_rows(seqs, True, 2, None), seqs, 2, None)
    assert [[r.members for r in g] for g in groups] == [[(1,), (3,)], [(0, 2)]]
    # Prompts that begin alike share their common beginning; a short common beginning is not worth
    # the longer branches of the row's other members.
    c, d = (1, 2, 3, 9, 9, 9), (1, 7, 7, 7, 7)
    more = [sequence(a, (7, 8)), sequence(a, (10,)), sequence(c, (11,)), sequence(d, (12,))]
    rows = make_rows(more, True, 8, None)
    assert [(r.prefix_ids, r.members) for r in rows] == [((1, 2, 3), (0, 1, 2)), (d, (3,))]
    assert rows[0].length(more) == 3 + (1 + 2) + (1 + 1) + (3 + 1)
    # With one: rows x longest row within it, and the loss tokens within its 16th.
    for group in group_rows(make_rows(seqs, True, 8, 12), seqs, 8, 12):
        assert len(group) * max(r.length(seqs) for r in group) <= 12 or len(group) == 1
    many = [sequence((i,), (1, 2, 3, 4)) for i in range(10)]  # rows of 5 tokens, 4 of them loss tokens
    groups = group_rows(make_rows(many, True, 8, 64), many, 8, 64)
    assert [len(g) for g in groups] == [1] * 10  # 2 rows would be 10 <= 64 tokens, but 8 > 64 / 16 loss tokens
    groups = group_rows(make_rows(many, True, 8, 160), many, 8, 160)
    assert [len(g) for g in groups] == [2] * 5


def test_the_mask_shows_a_response_its_prompt_and_itself_only():
    #            prompt     response 1  response 2  padding
    branch = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1, -1]])
    mask = shared_prompt_mask(branch)[0, 0]
    expected = torch.zeros(10, 10, dtype=torch.bool)
    for q in range(10):
        for k in range(q + 1):
            bq, bk = int(branch[0, q]), int(branch[0, k])
            expected[q, k] = bk == 0 or bk == bq
    assert torch.equal(mask, expected)
    assert not mask[5:8, 3:5].any()  # response 2 never sees response 1
    assert not mask[:8, 8:].any()  # no real column sees padding
    assert mask.any(dim=1).all()  # no empty row (a NaN softmax)


def test_each_loss_token_is_read_from_the_column_that_predicts_it():
    a = (1, 2, 3)
    seqs = [sequence(a, (7, 8)), sequence((4, 5), (9, 10, 11)), sequence(a, (12, 13, 14)), sequence(a + (6, 6), (15,))]
    for share in (False, True):
        (batch,) = pack_micro_batches(seqs, share, 8, 0)
        flat_tokens = batch.tokens_B_T.flatten()
        flat_positions = batch.positions_B_T.flatten()
        flat_branch = batch.branch_B_T.flatten()
        offset = 0
        for i in batch.members:
            s = seqs[i]
            for t, token in enumerate(s.response_ids):
                source = int(batch.source_N[offset + t])
                assert int(batch.targets_N[offset + t]) == token
                # The predicting column sits one position before the token, in the prompt or the same response.
                assert int(flat_positions[source]) == len(s.prompt_ids) + t - 1
                expected = s.prompt_ids[-1] if t == 0 else s.response_ids[t - 1]
                assert int(flat_tokens[source]) == expected
                if t > 0 and share:
                    assert int(flat_branch[source]) == int(flat_branch[source + 1])
            offset += len(s.response_ids)
        assert offset == len(batch.targets_N)
    shared = pack_micro_batches(seqs, True, 8, 0)[0]
    separate = pack_micro_batches(seqs, False, 8, 0)[0]
    assert int(shared.attention_B_T.sum()) == 3 + 2 + 3 + (2 + 1) + 2 + 3 and shared.shares_prompts
    assert int(separate.attention_B_T.sum()) == 5 + 6 + 5 + 6 and not separate.shares_prompts


def group_samples(prompt_length: int, vocab: int, seed: int) -> list[TeacherSample]:
    """Two GRPO groups (4 and 2 samples) with different prompts and response lengths; in the first,
    two samples' prompts go on past the group's common beginning (as a chain's own attempts do)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group, (size, prompt_len) in enumerate([(4, prompt_length), (2, prompt_length // 2)]):
        common = tuple(torch.randint(4, vocab, (prompt_len,), generator=g).tolist())
        for i in range(size):
            tail = tuple(torch.randint(4, vocab, (i + 2,), generator=g).tolist()) if group == 0 and i >= 2 else ()
            prompt = common + tail
            n = 3 + 2 * i
            out.append(
                TeacherSample(
                    prompt,
                    tuple(torch.randint(4, vocab, (n,), generator=g).tolist()),
                    tuple((-torch.rand(n, generator=g) * 3).tolist()),
                    reward=float(i),
                    advantage=(-1.0) ** i * (1 + i),
                    group_index=group,
                    sample_index=i,
                    inner_iteration=0,
                )
            )
    return out


@pytest.fixture(scope="module")
def moved_reference(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with every weight moved a little: a KL anchor the policy differs from, so
    the KL term and the reference log-probs (computed through the same rows) count in the loss."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("moved-reference")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=g) * 0.02)
    model.save_pretrained(out)
    for path in tiny_checkpoint.iterdir():
        if "token" in path.name or path.name == "special_tokens_map.json":
            shutil.copy(path, out / path.name)
    return out


def compare_shared_and_separate(
    checkpoint, batch, settings: TrainerSettings, pad_id: int, rtol: float, atol: float, reference_path=None
):
    """Loss, metrics and gradient with shared-prompt rows against one row per sequence. With
    `reference_path` (and --kl-loss-coef) the KL term runs: its reference log-probs come through
    the same rows, and it must be non-zero (the reference differs from the policy)."""
    results = []
    for share in (True, False):
        trainer = LocalTrainer(
            str(checkpoint),
            dataclasses.replace(settings, share_prompt_forward=share),
            pad_token_id=pad_id,
            reference_path=None if reference_path is None else str(reference_path),
        )
        assert trainer._forward(trainer.model).shares_prompts == share
        metrics = trainer.compute_gradients(batch)
        results.append(([p.grad.detach().clone() for p in trainer.model.parameters()], metrics))
    (shared_grads, shared), (separate_grads, separate) = results
    kl_runs = reference_path is not None and bool(settings.loss.kl_loss_coef)
    assert (separate["train/kl_ref"] > 0) == kl_runs
    for key in ("train/loss", "train/pg_loss", "train/kl_ref", "train/entropy", "train/logprob_abs_diff"):
        assert shared[key] == pytest.approx(separate[key], rel=rtol, abs=atol), key
    if kl_runs:  # the KL term is part of the loss compared above
        assert separate["train/loss"] != pytest.approx(separate["train/pg_loss"], rel=1e-6, abs=1e-9)
    # Every group's prompt once instead of once per sample.
    assert shared["train/forward_tokens"] < separate["train/forward_tokens"]
    assert separate["train/forward_tokens"] == sum(len(x.prompt_ids) + len(x.response_ids) for x in batch)
    assert sum(g.abs().sum() for g in separate_grads) > 0
    for got, expected in zip(shared_grads, separate_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


def test_shared_prompt_rows_give_the_loss_and_gradient_of_one_row_per_sequence(tiny_checkpoint, moved_reference):
    """The policy-gradient and entropy terms, and the KL term to a reference the policy differs from."""
    settings = TrainerSettings(
        lr=1e-3,
        device="cpu",
        micro_batch_size=8,
        temperature=1.0,
        loss=LossSettings(kl_loss_coef=0.1, entropy_coef=1e-3),
    )
    batch = group_samples(24, 60, seed=0)
    compare_shared_and_separate(tiny_checkpoint, batch, settings, 0, 1e-5, 1e-6, reference_path=moved_reference)
    # Split by a token budget (each row of the 4-sample group over 24 + 24 tokens is cut in two).
    budget = dataclasses.replace(settings, max_tokens_per_gpu=40)
    compare_shared_and_separate(tiny_checkpoint, batch, budget, 0, 1e-5, 1e-6, reference_path=moved_reference)


def test_without_a_reference_the_kl_coefficient_adds_nothing(tiny_checkpoint):
    """--kl-loss-coef with no start weights to anchor to (the trainer has no reference_path): no KL term."""
    settings = TrainerSettings(lr=1e-3, device="cpu", temperature=1.0, loss=LossSettings(kl_loss_coef=0.1))
    compare_shared_and_separate(tiny_checkpoint, group_samples(24, 60, seed=0), settings, 0, 1e-5, 1e-6)


def test_shared_prompt_rows_on_the_real_model(real_checkpoint):
    """SmolLM2-135M (grouped-query attention, tied embeddings, rotary positions): the shared rows
    score each response as a row of its own does, and give the same gradient."""
    tokenizer = AutoTokenizer.from_pretrained(real_checkpoint)
    question = "Write one hint for: how many positive divisors does 360 have?"
    attempts = ["", "", "\nA student answered 12 (grade 0).", "\nA student answered 24 (grade 1)."]
    hints = [
        "Factor 360 into primes first.",
        "Write 360 = 2^3 * 3^2 * 5 and add one to each exponent.",
        "Multiply.",
        "Count the divisors.",
    ]
    batch = []
    for i, (attempt, hint) in enumerate(zip(attempts, hints)):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question + attempt}], add_generation_prompt=True, tokenize=False
        )
        prompt = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids = tuple(tokenizer(hint, add_special_tokens=False)["input_ids"])
        batch.append(
            TeacherSample(
                prompt,
                ids,
                (-2.0,) * len(ids),
                reward=float(i),
                advantage=float(i - 1),
                group_index=0,
                sample_index=i,
                inner_iteration=0,
            )
        )
    # The policy-gradient and entropy terms only (no reference model: a second 135M copy); the
    # reference log-probs through shared rows are compared below, and the KL term on the tiny model.
    settings = TrainerSettings(lr=1e-4, device="cpu", temperature=1.0, loss=LossSettings())
    pad = tokenizer.pad_token_id
    # float32 on the CPU: the two layouts sum in different orders, and how much that moves a gradient
    # element depends on the BLAS's threads (on a 16-core host one element of 576 moved 2.8e-6).
    compare_shared_and_separate(real_checkpoint, batch, settings, pad, rtol=2e-4, atol=1e-5)
    trainer = LocalTrainer(str(real_checkpoint), settings, pad_token_id=pad)
    sequences = [
        PolicySequence(x.prompt_ids, x.response_ids, x.rollout_logprobs, (0.0,) * len(x.response_ids), 1.0)
        for x in batch
    ]
    call = trainer._forward(trainer.model)
    shared = reference_token_logps(call, sequences, 64, MicroBatching(8, pad, trainer.device))
    call.shares_prompts = False
    separate = reference_token_logps(call, sequences, 64, MicroBatching(8, pad, trainer.device))
    for got, expected in zip(shared, separate, strict=True):
        assert len(got) == len(expected) and got == pytest.approx(expected, abs=1e-4)
    assert len(collate_rows(make_rows(sequences, True, 8, None), sequences, pad).targets_N) == sum(map(len, shared))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shared_prompt_rows_on_cuda_with_compiled_layers(tiny_checkpoint, moved_reference):
    """bf16 autocast, the fused loss kernels and compiled decoder layers, where the shared rows
    take SDPA's masked kernel and rows of one sequence its causal one."""
    settings = TrainerSettings(
        lr=1e-3, device="cuda", compile_layers=True, max_tokens_per_gpu=256, loss=LossSettings(kl_loss_coef=0.1)
    )
    batch = group_samples(48, 60, seed=1)
    results = []
    for share in (True, False):
        trainer = LocalTrainer(
            str(tiny_checkpoint),
            dataclasses.replace(settings, share_prompt_forward=share),
            reference_path=str(moved_reference),  # the KL term runs, its reference through the same rows
        )
        metrics = trainer.compute_gradients(batch)
        assert metrics["train/kl_ref"] > 0
        flat = torch.cat([p.grad.detach().float().flatten() for p in trainer.model.parameters()])
        results.append((flat, metrics))
    (shared, shared_metrics), (separate, separate_metrics) = results
    assert shared_metrics["train/forward_tokens"] < separate_metrics["train/forward_tokens"]
    assert shared_metrics["train/loss"] == pytest.approx(separate_metrics["train/loss"], abs=2e-3)
    cosine = torch.nn.functional.cosine_similarity(shared, separate, dim=0).item()
    assert cosine > 0.999 and (shared.norm() / separate.norm()).item() == pytest.approx(1.0, abs=1e-2)


def test_the_additive_mask_gives_what_the_boolean_one_gives(tiny_checkpoint):
    """The form the GPU path hands SDPA (0 / -inf, rows 8-aligned so no layer copies it) masks as the boolean does."""
    from transformers import AutoModelForCausalLM

    from slime_meta.backends.local.training.model_call import additive_mask

    seqs = [sequence((5, 9, 12, 7, 3), (8, 3, 4)), sequence((5, 9, 12, 7, 3, 6), (10, 11)), sequence((4,), (13,))]
    (batch,) = pack_micro_batches(seqs, True, 8, 0)
    visible = shared_prompt_mask(batch.branch_B_T)
    additive = additive_mask(visible, torch.float32)
    assert additive.shape == visible.shape and additive.stride(-2) % 8 == 0
    assert torch.equal(additive == 0, visible) and bool(torch.isneginf(additive[~visible]).all())
    decoder = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint)).eval().model
    with torch.no_grad():
        got = decoder(
            input_ids=batch.tokens_B_T, attention_mask=additive, position_ids=batch.positions_B_T
        ).last_hidden_state
        expected = decoder(
            input_ids=batch.tokens_B_T, attention_mask=visible, position_ids=batch.positions_B_T
        ).last_hidden_state
    real = batch.branch_B_T >= 0
    torch.testing.assert_close(got[real], expected[real])


def reference_varlen(q_N_H_D, k_K_H_D, v_K_H_D, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), scale=None):
    """Variable-length attention one sequence at a time, causal with the diagonal at the bottom right
    (what flash attention computes for `window_size=(-1, 0)`), for the CPU."""
    assert tuple(window_size) == (-1, 0)
    out = []
    for s in range(len(cu_seq_q) - 1):
        q = q_N_H_D[cu_seq_q[s] : cu_seq_q[s + 1]].transpose(0, 1)
        k = k_K_H_D[cu_seq_k[s] : cu_seq_k[s + 1]].transpose(0, 1)
        v = v_K_H_D[cu_seq_k[s] : cu_seq_k[s + 1]].transpose(0, 1)
        n_q, n_k = q.shape[1], k.shape[1]
        assert n_q <= max_q and n_k <= max_k
        visible = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale).transpose(0, 1)
        )
    return torch.cat(out)


def test_varlen_layout_runs_the_prefix_each_branch_and_the_padding_as_sequences():
    from slime_meta.backends.local.training.varlen_attention import varlen_layout

    #                        prefix  b1    b2       pad   | a row of one sequence, padded
    branch = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1], [0, 0, 0, 0, 0, -1, -1, -1, -1]])
    layout = varlen_layout(branch)
    assert layout.cu_seq_q.tolist() == [0, 3, 5, 8, 9, 14, 18]
    keys = [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15, 16, 17]]
    assert layout.key_index.tolist() == [k for run in keys for k in run]
    assert layout.cu_seq_k.diff().tolist() == [len(run) for run in keys]
    assert (layout.max_q, layout.max_k) == (5, 6)


def test_varlen_attention_through_the_model_gives_the_dense_mask_s_values_and_gradients(tiny_checkpoint, monkeypatch):
    """The whole path the GPU takes (the registered attention, the layout through the model's
    keyword arguments, activation checkpointing's recompute), with flash attention's kernel
    replaced by a per-sequence reference: the same hidden states and gradients as the dense mask."""
    from transformers import AutoModelForCausalLM

    from slime_meta.backends.local.training import varlen_attention
    from slime_meta.backends.local.training.model_call import SplitModelCall

    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: reference_varlen)
    seqs = [
        sequence((5, 9, 12, 7, 3), (8, 3, 4)),
        sequence((5, 9, 12, 7, 3, 6, 2), (10, 11)),
        sequence((5, 9, 12, 8), (13, 14)),
        sequence((4, 6), (13,)),
    ]
    (batch,) = pack_micro_batches(seqs, True, 8, 0)
    assert batch.shares_prompts
    results = []
    for varlen in (True, False):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        call = SplitModelCall(model, autocast=False, split_head=True)
        if varlen:
            assert varlen_attention.install(model)
            call.varlen = True
        hidden = call.packed_hidden_states(batch).flatten(0, 1)[batch.source_N]
        (hidden * torch.linspace(-1, 1, hidden.numel()).view_as(hidden)).sum().backward()
        results.append((hidden.detach(), [p.grad.clone() for p in model.parameters()]))
    (got, got_grads), (expected, expected_grads) = results
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-5)


def test_the_varlen_path_builds_no_dense_mask(tiny_checkpoint, monkeypatch):
    """Variable-length attention ignores any mask: transformers must build none for it (a dense
    `[B, 1, T, T]` boolean mask, about 268 MB per 16k-token micro-batch), nor look for packed
    sequences in the position ids (a host sync)."""
    from transformers import AutoModelForCausalLM, masking_utils

    from slime_meta.backends.local.training import varlen_attention
    from slime_meta.backends.local.training.model_call import SplitModelCall

    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: reference_varlen)
    seqs = [sequence((5, 9, 12, 7, 3), (8, 3, 4)), sequence((5, 9, 12, 7, 3, 6, 2), (10, 11)), sequence((4, 6), (13,))]
    (batch,) = pack_micro_batches(seqs, True, 8, 0)
    assert batch.shares_prompts
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    call = SplitModelCall(model, autocast=False, split_head=True)
    assert varlen_attention.install(model)
    call.varlen = True
    built = []

    def recording(name, function):
        def wrapper(*args, **kwargs):
            built.append(name)
            return function(*args, **kwargs)

        return wrapper

    masks = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    name = varlen_attention.ATTENTION_NAME
    monkeypatch.setitem(masks, name, recording("mask", masks[name]))
    search = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", recording("packed search", search))
    hidden = call.packed_hidden_states(batch)
    assert hidden.shape[:2] == batch.tokens_B_T.shape
    assert built == []


def test_rows_are_shared_only_where_every_layer_attends_to_all_earlier_tokens():
    """A sliding window would be dropped by the shared rows' own masks: such models keep one row per sequence."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from slime_meta.backends.local.training.model_call import full_causal

    assert full_causal(LlamaConfig()) and full_causal(Qwen2Config(use_sliding_window=False, sliding_window=4096))
    assert not full_causal(Qwen2Config(use_sliding_window=True, sliding_window=4096))
    assert not full_causal(MistralConfig(sliding_window=4096)) and full_causal(MistralConfig(sliding_window=None))
