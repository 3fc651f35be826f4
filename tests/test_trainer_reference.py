"""The start weights (KL anchor, DPO reference) read from the checkpoint once per step instead of a
second resident model: the same numbers as a resident reference, exact for any checkpoint layout,
and the policy's own log-probs while it still is the start weights."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from test_trainer_memory import moved_reference
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_meta.backends.local.training.batching import MicroBatching
from slime_meta.backends.local.training.channels import LossSettings, reference_token_logps
from slime_meta.backends.local.training.reference import safetensors_files, start_weights_like
from slime_meta.backends.local.training.settings import TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer, teacher_sequences
from slime_meta.types import TeacherSample

KL = TrainerSettings(
    lr=1e-2,
    device="cpu",
    micro_batch_size=2,
    temperature=1.3,
    loss=LossSettings(kl_loss_coef=1.0, kl_loss_type="k3", use_tis=True),
)


def samples(seed: int = 0, vocab: int = 60) -> list[TeacherSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (prompt, response) in enumerate([(9, 4), (5, 6), (12, 3)]):
        out.append(
            TeacherSample(
                tuple(torch.randint(4, vocab, (prompt,), generator=g).tolist()),
                tuple(torch.randint(4, vocab, (response,), generator=g).tolist()),
                tuple((-torch.rand(response, generator=g) * 3).tolist()),
                reward=float(i),
                advantage=(-1.0) ** i,
                group_index=0,
                sample_index=i,
                inner_iteration=0,
            )
        )
    return out


def gradients(trainer: LocalTrainer, batch) -> tuple[list[torch.Tensor], dict]:
    metrics = trainer.compute_gradients(batch)
    return [p.grad.detach().clone() for p in trainer.model.parameters()], metrics


def test_start_weights_read_per_step_give_what_a_resident_reference_gives(tiny_checkpoint):
    reference = str(moved_reference(Path(tiny_checkpoint)))
    streamed = LocalTrainer(str(tiny_checkpoint), KL, reference_path=reference)
    resident = LocalTrainer(
        str(tiny_checkpoint), dataclasses.replace(KL, reference_resident=True), reference_path=reference
    )
    assert streamed.reference is None and isinstance(resident.reference, torch.nn.Module)
    assert not streamed.policy_is_reference
    got, got_metrics = gradients(streamed, samples())
    expected, expected_metrics = gradients(resident, samples())
    assert got_metrics["train/kl_ref"] == pytest.approx(expected_metrics["train/kl_ref"], rel=1e-6)
    assert got_metrics["train/kl_ref"] > 1e-3  # the moved reference is far enough to matter
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_the_policy_as_its_own_reference_equals_an_explicit_reference_pass(tiny_checkpoint, tmp_path):
    """Before the first update the anchor's log-probs are the policy's own: no reference forward,
    the same gradient as reading the start weights from a copy of the checkpoint."""
    copy = Path(shutil.copytree(tiny_checkpoint, tmp_path / "start-copy"))
    shortcut = LocalTrainer(str(tiny_checkpoint), KL, reference_path=str(tiny_checkpoint))
    explicit = LocalTrainer(str(tiny_checkpoint), KL, reference_path=str(copy))
    assert shortcut.policy_is_reference and not explicit.policy_is_reference
    forwards: list[int] = []
    shortcut.model.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    got, got_metrics = gradients(shortcut, samples())
    expected, expected_metrics = gradients(explicit, samples())
    assert len(forwards) == 2  # the policy's two micro-batches, nothing else
    assert got_metrics["train/kl_ref"] == 0.0 and abs(expected_metrics["train/kl_ref"]) < 1e-7
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_after_an_update_the_anchor_stays_the_start_weights(tiny_checkpoint, tmp_path):
    trainer = LocalTrainer(str(tiny_checkpoint), KL, reference_path=str(tiny_checkpoint))
    trainer.train_step(samples())
    assert not trainer.policy_is_reference and trainer.steps_done == 1
    sequences = teacher_sequences(samples(seed=3), KL.temperature)
    with trainer._reference_call() as reference:
        got = reference_token_logps(reference, sequences, 4, MicroBatching(2, 0, trainer.device))
    start = LocalTrainer(str(tiny_checkpoint), KL)
    expected = reference_token_logps(start._forward(start.model), sequences, None, MicroBatching(8, 0, start.device))
    moved = reference_token_logps(trainer._forward(trainer.model), sequences, None, MicroBatching(8, 0, trainer.device))
    flat = lambda values: [v for row in values for v in row]  # noqa: E731
    assert flat(got) == pytest.approx(flat(expected), abs=1e-5)
    assert max(abs(a - b) for a, b in zip(flat(moved), flat(expected))) > 1e-3  # while the policy has moved


def test_sharded_bf16_checkpoint_reads_back_exactly(tiny_checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    files = safetensors_files(tmp_path / "sharded")
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    policy = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    weights = start_weights_like(policy, tmp_path / "sharded")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    names = dict(expected.named_parameters(remove_duplicate=False))
    assert set(weights) == set(names)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, names[name].detach()), name
    # Tied parameters stay one tensor, as in the policy.
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]


def test_a_checkpoint_that_is_not_safetensors_is_read_by_transformers(tiny_checkpoint, tmp_path):
    (tmp_path / "bin").mkdir()
    shutil.copy(Path(tiny_checkpoint) / "config.json", tmp_path / "bin" / "config.json")
    torch.save(
        AutoModelForCausalLM.from_pretrained(tiny_checkpoint).state_dict(), tmp_path / "bin" / "pytorch_model.bin"
    )
    assert safetensors_files(tmp_path / "bin") == []
    policy = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    weights = start_weights_like(policy, tmp_path / "bin")
    for name, parameter in policy.named_parameters():
        assert torch.equal(weights[name], parameter.detach()), name


@pytest.fixture(scope="module")
def real_model_dir() -> Path:
    helpers = pytest.importorskip("helpers_real", reason="the shipped real model's test helpers")
    return helpers.real_checkpoint_or_skip()


def test_real_model_anchor_log_probs_and_a_step_without_signal(real_model_dir):
    """SmolLM2-135M (tied embeddings, grouped-query attention, chat template): the start weights read
    from its checkpoint score the tokens as a fresh load of it does, after the policy has moved; a
    step whose advantages are all zero then runs nothing."""
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Ana has 3 marbles and gets 5 more. How many?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    answer = tuple(tokenizer("She has 3 + 5 = 8 marbles.\nAnswer: 8", add_special_tokens=False)["input_ids"])
    batch = [
        TeacherSample(
            prompt,
            answer,
            (-1.0,) * len(answer),
            reward=float(i),
            advantage=(-1.0) ** i,
            group_index=0,
            sample_index=i,
            inner_iteration=0,
        )
        for i in range(2)
    ]
    settings = TrainerSettings(lr=1e-4, device="cpu", loss=LossSettings(kl_loss_coef=0.1, kl_loss_type="k3"))
    trainer = LocalTrainer(
        str(real_model_dir), settings, pad_token_id=tokenizer.pad_token_id, reference_path=str(real_model_dir)
    )
    assert trainer.train_step(batch)["train/skipped_no_signal"] == 0.0 and not trainer.policy_is_reference
    sequences = teacher_sequences(batch[:1], 1.0)
    with trainer._reference_call() as reference:
        got = reference_token_logps(reference, sequences, 64, MicroBatching(8, tokenizer.pad_token_id, trainer.device))[
            0
        ]
    start = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(start(torch.tensor([prompt + answer])).logits[0, :-1].double(), dim=-1)
    expected = [logp[len(prompt) - 1 + i, token].item() for i, token in enumerate(answer)]
    assert list(got) == pytest.approx(expected, abs=2e-4)
    forwards: list[int] = []
    trainer.model.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    trainer_at_start = LocalTrainer(
        str(real_model_dir), settings, pad_token_id=tokenizer.pad_token_id, reference_path=str(real_model_dir)
    )
    trainer_at_start.model.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    idle = [dataclasses.replace(x, advantage=0.0, reward=0.0) for x in batch]
    assert trainer_at_start.train_step(idle)["train/skipped_no_signal"] == 1.0 and forwards == []
    assert trainer.train_step(idle)["train/skipped_no_signal"] == 0.0  # moved: the k3 KL pulls it back


def test_a_bf16_checkpoint_s_resident_reference_stays_bf16_and_scores_as_float32_under_autocast(
    tiny_checkpoint, tmp_path
):
    """Half the memory, the same numbers: under bf16 autocast (the trainer's on CUDA) the bf16
    copy computes what float32 copies of the same bf16 values compute, bit for bit."""
    from slime_meta.backends.local.training.reference import StartWeights, half_dtype_of

    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    assert half_dtype_of(bf16_dir) == torch.bfloat16 and half_dtype_of(Path(tiny_checkpoint)) is None
    policy = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    cpu = torch.device("cpu")
    half = StartWeights(str(bf16_dir), policy, cpu, resident=True, keep_half=True)
    full = StartWeights(str(bf16_dir), policy, cpu, resident=True, keep_half=False)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in full.model.parameters()} == {torch.float32}
    # On the CPU, left to itself, it stays float32 (no autocast there).
    assert {p.dtype for p in StartWeights(str(bf16_dir), policy, cpu, resident=True).model.parameters()} == {
        torch.float32
    }
    ids = torch.randint(4, 60, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = half.model(ids).logits
        expected = full.model(ids).logits
        policy_logits = policy(ids).logits
    assert torch.equal(got, expected) and torch.equal(got, policy_logits)
