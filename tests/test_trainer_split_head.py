"""LocalTrainer's split model call (decoder hidden states, output projection on the loss rows
only) computes the same step as full logits, every channel on; the fused-AdamW and compile
settings leave the CPU step as it was."""

from __future__ import annotations

import dataclasses

import torch

from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.model_call import SplitModelCall
from slime_meta.backends.local.training.settings import DistillSettings, TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.types import PreferencePair, SolverSample, TeacherSample


def ids(g: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.randint(4, 60, (n,), generator=g))


def make_batch():
    g = torch.Generator().manual_seed(3)
    teacher = [
        TeacherSample(
            ids(g, 9 + i),
            ids(g, 4 + i),
            tuple((-torch.rand(4 + i, generator=g) * 3).tolist()),
            reward=float(i % 2),
            advantage=(-1.0) ** i,
            group_index=0,
            sample_index=i,
            inner_iteration=0,
        )
        for i in range(3)
    ]
    solver = [
        SolverSample(
            problem_uid=str(i),
            prompt_ids=ids(g, 7 + i),
            response_ids=ids(g, 3 + i),
            rollout_logprobs=tuple((-torch.rand(3 + i, generator=g) * 3).tolist()),
            temperature=0.8,
            grade=0.0,
            task_advantage=0.5 - i,
            prompt_text="p",
            solution_text="s",
            context_prompt_ids=ids(g, 12),
            teacher_logprobs=tuple((-torch.rand(3 + i, generator=g)).tolist()),
            hint_prompt_ids=ids(g, 10 + i),
            is_error_site=True,
        )
        for i in range(2)
    ]
    pairs = [PreferencePair(ids(g, 6), ids(g, 5), ids(g, 3)) for _ in range(2)]
    return teacher, solver, pairs


def step(checkpoint, settings: TrainerSettings):
    torch.manual_seed(0)
    trainer = LocalTrainer(str(checkpoint), settings, reference_path=str(checkpoint))
    teacher, solver, pairs = make_batch()
    metrics = trainer.train_step(teacher, solver, pairs)
    return [p.detach().clone() for p in trainer.model.parameters()], metrics, trainer


def test_split_head_equals_full_logits_with_every_channel(tiny_checkpoint):
    loss = LossSettings(
        sdpo_alpha=0.5, sdpo_beta=0.3, replay_beta=0.7, kl_loss_coef=0.1, kl_loss_type="k3", use_tis=True
    )
    settings = TrainerSettings(
        lr=1e-2, device="cpu", micro_batch_size=2, temperature=1.2, loss=loss, distill=DistillSettings(1.0, 0.5, 0.5)
    )
    split, m_split, trainer = step(tiny_checkpoint, settings)
    assert isinstance(trainer._forward(trainer.model), SplitModelCall) and trainer._forward(trainer.model).split
    full, m_full, _ = step(tiny_checkpoint, dataclasses.replace(settings, split_head=False))
    for key in (
        "loss/total",
        "loss/grpo",
        "loss/sdpo_kl",
        "loss/trace_replay_dpo",
        "train/entropy",
        "train/kl_ref",
        "train/grad_norm",
        "train/logprob_abs_diff",
    ):
        assert abs(m_split[key] - m_full[key]) <= 1e-5 * max(1.0, abs(m_full[key])), key
    assert max((a - b).abs().max().item() for a, b in zip(split, full)) < 1e-5


def test_entropy_bonus_and_compile_setting_on_cpu(tiny_checkpoint):
    base = TrainerSettings(lr=1e-2, device="cpu", loss=LossSettings(entropy_coef=0.01))
    params, metrics, trainer = step(tiny_checkpoint, dataclasses.replace(base, compile_layers=True))
    assert trainer.compiled_layers == 0  # CPU: never compiled
    assert metrics["train/entropy"] > 0 and metrics["train/grad_norm"] == metrics["train/grad_norm"]
    same, _, _ = step(tiny_checkpoint, dataclasses.replace(base, compile_layers=False))
    assert all(torch.equal(a, b) for a, b in zip(params, same))


def test_right_padded_rows_run_without_a_padding_mask(tiny_checkpoint):
    """The split call drops the mask of right-padded rows (causal attention alone then gives every
    real position what the masked forward gives) and keeps any other mask."""
    from transformers import AutoModelForCausalLM

    from slime_meta.backends.local.training.model_call import is_right_padded

    right = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert is_right_padded(right) and is_right_padded(torch.ones(2, 3, dtype=torch.long))
    assert not is_right_padded(torch.tensor([[0, 1, 1], [1, 1, 1]])) and not is_right_padded(torch.tensor([[1, 0, 1]]))

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint)).eval()
    call = SplitModelCall(model, autocast=False, split_head=True)
    tokens = torch.tensor([[5, 9, 12, 7], [8, 3, 0, 0]])
    with torch.no_grad():
        ours = call.hidden_states(tokens, right)
        masked = call.decoder(input_ids=tokens, attention_mask=right, use_cache=False).last_hidden_state
        left = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
        left_tokens = torch.tensor([[5, 9, 12, 7], [0, 0, 8, 3]])
        kept = call.hidden_states(left_tokens, left)
        expected_left = call.decoder(input_ids=left_tokens, attention_mask=left, use_cache=False).last_hidden_state
    real = right.bool()
    torch.testing.assert_close(ours[real], masked[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept, expected_left)  # left padding: the mask is passed as given
