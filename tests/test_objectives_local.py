"""The local trainer's channels: zero weights give plain GRPO bit for bit; each channel moves the
weights alone; distillation log-probs align to the student's tokens on a chat prompt."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.settings import DistillSettings, TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.prompt_templates import GeneratorPromptTemplate
from slime_meta.rollout.pools import SGLangPool
from slime_meta.rollout.roles import PromptRenderer, StudentRole
from slime_meta.rollout.solver_samples import SolverSampleBuilder, SolverSettings
from slime_meta.types import Chain, Grade, PreferencePair, Problem, SolverSample, TeacherSample


def random_ids(generator: torch.Generator, n: int, vocab: int = 60) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.randint(4, vocab, (n,), generator=generator))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    teacher = [
        TeacherSample(
            random_ids(g, 12),
            random_ids(g, 5),
            tuple((-torch.rand(5, generator=g) * 3).tolist()),
            reward=r,
            advantage=a,
            group_index=0,
            sample_index=i,
            inner_iteration=0,
        )
        for i, (r, a) in enumerate([(1.0, 1.0), (0.0, -1.0), (0.5, 0.3)])
    ]
    solver = [
        SolverSample(
            problem_uid=str(i),
            prompt_ids=random_ids(g, 8),
            response_ids=random_ids(g, 4),
            rollout_logprobs=tuple((-torch.rand(4, generator=g) * 3).tolist()),
            temperature=1.0,
            grade=0.0,
            task_advantage=0.5 - i,
            prompt_text="p",
            solution_text="s",
            context_prompt_ids=random_ids(g, 15),
            teacher_logprobs=tuple((-torch.rand(4, generator=g)).tolist()),
            hint_prompt_ids=random_ids(g, 11),
            is_error_site=True,
        )
        for i in range(2)
    ]
    pairs = [PreferencePair(random_ids(g, 8), random_ids(g, 5), random_ids(g, 4)) for _ in range(2)]
    return teacher, solver, pairs


def trained_parameters(checkpoint, settings: TrainerSettings, teacher, solver=(), pairs=(), reference=None):
    torch.manual_seed(0)
    trainer = LocalTrainer(str(checkpoint), settings, reference_path=reference)
    metrics = trainer.train_step(teacher, solver, pairs)
    return [p.detach().clone() for p in trainer.model.parameters()], metrics


def max_change(params_a, params_b) -> float:
    return max((a - b).abs().max().item() for a, b in zip(params_a, params_b))


def test_zero_weights_give_the_plain_grpo_update_bit_for_bit(tiny_checkpoint, batch):
    teacher, solver, pairs = batch
    plain = TrainerSettings(lr=1e-2, device="cpu")
    # Every weight 0 (adv_tau too: given alone it is a solver GRPO term of its own).
    zero = dataclasses.replace(
        plain, loss=LossSettings(sdpo_alpha=0.0, replay_beta=0.0), distill=DistillSettings(0.0, 0.0, 0.0)
    )
    base, base_metrics = trained_parameters(tiny_checkpoint, plain, teacher)
    same, same_metrics = trained_parameters(tiny_checkpoint, zero, teacher, solver, pairs)
    assert all(torch.equal(a, b) for a, b in zip(base, same))
    assert same_metrics["loss/total"] == base_metrics["loss/grpo"] == same_metrics["loss/grpo"]
    assert "loss/sdpo_kl" not in same_metrics and "loss/trace_replay_dpo" not in same_metrics


@pytest.mark.parametrize(
    "channel",
    ["sdpo", "replay", "distill", "kl"],
)
def test_each_channel_alone_changes_the_update(tiny_checkpoint, batch, channel):
    teacher, solver, pairs = batch
    plain = TrainerSettings(lr=1e-2, device="cpu")
    base, _ = trained_parameters(tiny_checkpoint, plain, teacher)
    reference = None
    if channel == "sdpo":
        settings = dataclasses.replace(plain, loss=LossSettings(sdpo_alpha=1.0, sdpo_topk=5, sdpo_topk_tail=False))
    elif channel == "replay":  # the DPO reference is the start weights
        settings, reference = dataclasses.replace(plain, loss=LossSettings(replay_beta=1.0)), str(tiny_checkpoint)
    elif channel == "distill":
        settings = dataclasses.replace(plain, distill=DistillSettings(adv_tau=1.0, teacher_tau=1.0, student_tau=1.0))
    else:
        # A reference unlike the policy: the KL term's gradient is then nonzero at the first step.
        settings, reference = dataclasses.replace(plain, loss=LossSettings(kl_loss_coef=1.0, kl_loss_type="k3")), "ref"
    if reference == "ref":
        reference_dir = tiny_checkpoint.parent / "perturbed-reference"
        if not reference_dir.exists():
            model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            model.save_pretrained(reference_dir)
        reference = str(reference_dir)
    changed, metrics = trained_parameters(tiny_checkpoint, settings, teacher, solver, pairs, reference=reference)
    assert max_change(base, changed) > 1e-7
    expected_key = {
        "sdpo": "loss/sdpo_kl",
        "replay": "loss/trace_replay_dpo",
        "distill": "loss/grpo",
        "kl": "train/kl_ref",
    }[channel]
    assert metrics[expected_key] == metrics[expected_key] and metrics[expected_key] != 0.0


def test_distillation_logprobs_align_to_the_students_tokens_on_a_chat_prompt(tiny_checkpoint, tmp_path):
    """The context prompt is longer than the student's; the pool's scoring call must still give
    log p(response token | context prompt + earlier response tokens), token for token."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    context = "Remember: the suffix is always 'ab'. " * 4  # a long context, prepended to the user turn
    problem = Problem(uid="0", prompt="word", label="wordab", metadata={})

    async def build():
        pool = SGLangPool(name="policy", base_url=endpoints.router_url)
        student = StudentRole(
            pool=pool,
            template=GeneratorPromptTemplate("Q: {problem}"),
            renderer=PromptRenderer(tokenizer, apply_chat_template=True),
            info_position="prefix",
            temperature=1.0,
            max_new_tokens=6,
        )

        class ExactGrader:
            async def grade(self, p, solution):
                return Grade(score=float(solution.strip() == p.ground_truth))

        settings = SolverSettings(
            attempts_per_problem=2,
            reuse_chain_attempts=False,
            distill_context="fixed",
            fixed_context=context,
            context_key=None,
            distill=True,
            sdpo=True,
            sdpo_hint="Use the suffix ab.",
            sdpo_grade_threshold=1.0,
            sdpo_on="errors",
            skip_verification=False,
            std_normalize=True,
            sdpo_shaping=True,
        )
        chain = Chain(prompt_index=0, sample_index=0, problems=[problem])
        samples, metrics = await SolverSampleBuilder(student, ExactGrader(), settings).build([chain])
        await pool.close()
        return samples, metrics

    with LocalProcessGroup() as group:
        endpoints = group.start_pool(
            "policy", str(tiny_checkpoint), 1, device="cpu", weights_root=None, log_dir=str(tmp_path)
        )
        samples, metrics = asyncio.run(build())
    assert len(samples) == 2 and metrics["solver/num_samples"] == 2.0
    for sample in samples:
        assert len(sample.context_prompt_ids) > len(sample.prompt_ids) + 50
        assert tokenizer.decode(sample.context_prompt_ids).count("Remember") == 4
        # The context went into the user turn, before the question, inside the chat template.
        for ids in (sample.context_prompt_ids, sample.prompt_ids):
            assert tokenizer.decode(ids).startswith("user: ") and tokenizer.decode(ids).endswith("Q: word\nassistant: ")
        ids = torch.tensor([sample.context_prompt_ids + sample.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
        start = len(sample.context_prompt_ids) - 1
        expected = [logp[start + i, token].item() for i, token in enumerate(sample.response_ids)]
        assert sample.teacher_logprobs == pytest.approx(expected, abs=1e-4)
        assert sample.hint_prompt_ids is not None and sample.is_error_site == (sample.grade < 1.0)
        # SDPO's shaping form: the error sites' answers scored under the hint prompt, token for token.
        if not sample.is_error_site:
            assert sample.hint_logprobs is None
            continue
        ids = torch.tensor([sample.hint_prompt_ids + sample.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
        start = len(sample.hint_prompt_ids) - 1
        expected = [logp[start + i, token].item() for i, token in enumerate(sample.response_ids)]
        assert sample.hint_logprobs == pytest.approx(expected, abs=1e-4)


def test_a_context_prompt_that_would_not_fit_leaves_its_sample_out(tiny_checkpoint, tmp_path):
    """The answer was sized for the plain prompt; the same answer after the longer context prompt can
    pass the model's context, which SGLang (and the embedded worker) refuse even with max_new_tokens 0:
    the sample is left out and counted, and the step goes on."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    context = "Remember: the suffix is always 'ab'. " * 4
    problem = Problem(uid="0", prompt="word", label="wordab", metadata={})
    renderer = PromptRenderer(tokenizer, apply_chat_template=True)
    template = GeneratorPromptTemplate("Q: {problem}")

    async def build(context_length: int):
        pool = SGLangPool(name="policy", base_url=endpoints.router_url)
        student = StudentRole(
            pool=pool,
            template=template,
            renderer=renderer,
            info_position="prefix",
            temperature=1.0,
            max_new_tokens=6,
            context_length=context_length,
        )
        plain, with_context = len(student.prompt_ids(problem, "")), len(student.prompt_ids(problem, context))
        assert plain + 6 < context_length <= with_context + 1  # the plain request fits, the scoring call not

        class AnyGrader:
            async def grade(self, p, solution):
                return Grade(score=0.0)

        settings = SolverSettings(
            attempts_per_problem=2,
            reuse_chain_attempts=False,
            distill_context="fixed",
            fixed_context=context,
            context_key=None,
            distill=True,
            sdpo=False,
            sdpo_hint=None,
            sdpo_grade_threshold=1.0,
            sdpo_on="errors",
            skip_verification=False,
            std_normalize=True,
        )
        chain = Chain(prompt_index=0, sample_index=0, problems=[problem])
        try:
            return await SolverSampleBuilder(student, AnyGrader(), settings).build([chain])
        finally:
            await pool.close()

    probe = StudentRole(
        pool=None, template=template, renderer=renderer, info_position="prefix", temperature=1.0, max_new_tokens=6
    )
    context_length = len(probe.prompt_ids(problem, context)) + 1  # context prompt + any answer is >= this
    with LocalProcessGroup() as group:
        endpoints = group.start_pool(
            "policy", str(tiny_checkpoint), 1, device="cpu", weights_root=None, log_dir=str(tmp_path)
        )
        samples, metrics = asyncio.run(build(context_length))
    assert samples == [] and metrics["solver/num_samples"] == 0.0
    assert metrics["solver/skipped_for_length"] == 2.0


def gradients(checkpoint, settings: TrainerSettings, teacher, solver=()) -> list[torch.Tensor]:
    torch.manual_seed(0)
    trainer = LocalTrainer(str(checkpoint), settings)
    trainer.compute_gradients(teacher, solver)
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in trainer.model.parameters()]


def test_distillation_leaves_the_teachers_own_gradient_as_it_was(tiny_checkpoint, batch):
    """The teacher's infos and the solver's distillation tokens are two token means: with
    distillation on, the total gradient is the teacher's gradient without it plus the solver's."""
    teacher, solver, _ = batch
    plain = TrainerSettings(lr=1e-2, device="cpu")
    distill = dataclasses.replace(plain, distill=DistillSettings(teacher_tau=1.0, student_tau=0.5))
    teacher_alone = gradients(tiny_checkpoint, plain, teacher)
    solver_alone = gradients(tiny_checkpoint, distill, (), solver)
    both = gradients(tiny_checkpoint, distill, teacher, solver)
    scale = max(g.abs().max().item() for g in teacher_alone)
    assert scale > 1e-4 and max(s.abs().max().item() for s in solver_alone) > 1e-4
    for g_both, g_teacher, g_solver in zip(both, teacher_alone, solver_alone):
        torch.testing.assert_close(g_both - g_solver, g_teacher, atol=1e-6 * scale, rtol=1e-5)


def test_distillation_adds_no_solver_grpo_term_unless_asked(tiny_checkpoint, batch):
    """--adv-tau not given with a separate student: the solver samples' task advantage does not
    reach the gradient (with a shared student it defaults to 1, the term that holds the student role)."""
    from test_arguments import BASE

    from slime_meta.config.arguments import parse_config

    _, solver, _ = batch
    distill = ["--teacher-context", "x", "--teacher-tau", "1"]
    objectives = parse_config(BASE + distill + ["--student-checkpoint", "ckpt"]).objectives
    assert objectives.adv_tau is None and objectives.solver_adv_tau == 0.0
    assert parse_config(BASE + distill).objectives.solver_adv_tau == 1.0
    settings = TrainerSettings(lr=1e-2, device="cpu", distill=DistillSettings(teacher_tau=1.0))
    flipped = [dataclasses.replace(x, task_advantage=-5.0 * x.task_advantage + 3.0) for x in solver]
    for a, b in zip(
        gradients(tiny_checkpoint, settings, (), solver), gradients(tiny_checkpoint, settings, (), flipped)
    ):
        assert torch.equal(a, b)
    asked = dataclasses.replace(settings, distill=DistillSettings(adv_tau=1.0, teacher_tau=1.0))
    changed = zip(gradients(tiny_checkpoint, asked, (), solver), gradients(tiny_checkpoint, asked, (), flipped))
    assert any(not torch.equal(a, b) for a, b in changed)


def test_adv_tau_alone_is_a_solver_grpo_term_without_a_context(tiny_checkpoint, batch):
    """--adv-tau alone (no taus, no context) turns the solver pass on: GRPO on the policy's own
    graded attempts, each token's advantage the attempt's task advantage."""
    from test_arguments import BASE

    from slime_meta.backends.local.training.trainer import distillation_sequences
    from slime_meta.config.arguments import parse_config

    objectives = parse_config(BASE + ["--adv-tau", "1"]).objectives
    assert objectives.needs_solver_samples and not objectives.distillation_on  # no context is scored
    _, solver, _ = batch
    unscored = [dataclasses.replace(x, context_prompt_ids=None, teacher_logprobs=None) for x in solver]
    alone = DistillSettings(adv_tau=objectives.solver_adv_tau)
    assert alone.on
    sequences = distillation_sequences(unscored, alone)
    assert [seq.advantages for seq in sequences] == [(x.task_advantage,) * len(x.response_ids) for x in solver]
    settings = TrainerSettings(lr=1e-2, device="cpu", distill=alone)
    trained, _ = trained_parameters(tiny_checkpoint, settings, (), unscored)
    untouched, _ = trained_parameters(
        tiny_checkpoint, dataclasses.replace(settings, distill=DistillSettings()), (), unscored
    )
    assert max_change(trained, untouched) > 0


def test_adv_tau_not_given_means_zero_on_slime_too():
    """slime distils the same solver samples as the local backend: --adv-tau not given (None) is 0 there."""
    from argparse import Namespace

    from slime_meta.backends.slime.advantages import meta_advantages
    from slime_meta.backends.slime.samples import SOLVER_INDEX_BASE

    def advantages(adv_tau):
        data = {
            "rewards": [1.5],
            "kl": [torch.zeros(2)],
            "teacher_log_probs": [torch.tensor([-1.0, -2.0])],
            "sample_indices": [SOLVER_INDEX_BASE],
            "rollout_log_probs": [torch.zeros(2)],
        }
        meta_advantages(Namespace(adv_tau=adv_tau, teacher_tau=0.5, student_tau=0.0), data)
        return data["advantages"][0]

    torch.testing.assert_close(advantages(None), advantages(0.0))
    torch.testing.assert_close(advantages(None), torch.tensor([-0.5, -1.0]))
