"""One step, two backends: the same samples give the same loss and the same gradient.

Local: `LocalTrainer.compute_gradients` (the infos' token mean plus, with distillation, the solver
samples' own token mean). slime: the samples as slime `Sample`s (our sample conversion), slime's
own `RolloutManager._convert_samples_to_train_data` through our conversion plugin, slime's
`tensorize_rollout_data_for_training`, our advantage plugin, then our loss plugin on slime's
batch layout (sequences packed into one `[1, T, V]` logits row, per-sample lists) with slime's
own reducer `get_sum_of_sample_mean`, in several micro-batches, and the step loss formed as
slime's `loss_function` and Megatron form it (each micro-batch's loss x num_microbatches /
global_batch_size, averaged over micro-batches). The tiny Llama runs in float64; the tolerance
is float32's (see `assert_same`).

Needs slime's source (`SLIME_SRC`); what its modules import but cannot run here (ray, sglang,
wandb, Megatron's parallel state) is stubbed for the import only: no stubbed code is called on
the compared path except `mpu.get_context_parallel_world_size()` (1: one rank, no CP). The loss
plugin's log-probs take its one-rank path (slime's own kernel needs Megatron's parallel groups).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import types
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.settings import DistillSettings, TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.backends.slime.advantages import meta_advantages
from slime_meta.backends.slime.loss import meta_loss
from slime_meta.backends.slime.replay_samples import replay_samples
from slime_meta.backends.slime.rollout import trained_solver_samples
from slime_meta.backends.slime.samples import (
    apply_fields,
    replay_sample_fields,
    solver_sample_fields,
    teacher_sample_fields,
)
from slime_meta.backends.slime.train_data import convert_samples_to_train_data
from slime_meta.types import PreferencePair, SolverSample, TeacherSample

SLIME_SRC = os.environ.get("SLIME_SRC")
if not SLIME_SRC and importlib.util.find_spec("slime") is None:
    pytest.skip("slime's source is not importable: set SLIME_SRC to a THUDM/slime checkout", allow_module_level=True)

TEMPERATURE = 0.7  # teacher and student alike: slime's trainer scores every sample at one temperature
VOCAB_LOW, VOCAB_HIGH = 4, 60  # ordinary character ids of the tiny tokenizer
IMPORT_ONLY = (
    "ray",
    "ray.util",
    "ray.util.scheduling_strategies",
    "sglang",
    "sglang.srt",
    "sglang.srt.constants",
    "sglang.srt.server_args",
    "sglang.srt.utils",
    "requests",
    "urllib3",
    "urllib3.exceptions",
    "wandb",
    "httpx",
)


class _ImportOnly(types.ModuleType):
    """A module slime imports at the top of a file whose code we do not run here."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None})


@pytest.fixture(scope="module")
def slime():
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    if SLIME_SRC:
        sys.path[:0] = [SLIME_SRC]
    stubs = {}
    for name in IMPORT_ONLY:
        try:
            missing = importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            missing = True
        if missing:
            stubs[name] = _ImportOnly(name)
    if "ray" in stubs:  # RolloutManager is a @ray.remote class: keep the class itself
        stubs["ray"].remote = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda c: c)
    if importlib.util.find_spec("megatron") is None:  # the reducer asks for the context-parallel size only
        mpu = types.SimpleNamespace(get_context_parallel_world_size=lambda: 1, get_context_parallel_rank=lambda: 0)
        stubs["megatron"] = types.ModuleType("megatron")
        stubs["megatron.core"] = types.ModuleType("megatron.core")
        stubs["megatron.core"].mpu = mpu
    sys.modules.update(stubs)
    try:
        from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
        from slime.observability.rollout_data_utils import tensorize_rollout_data_for_training
        from slime.ray.rollout import RolloutManager  # noqa: F401  (the conversion the plugin calls)
        from slime.utils.types import Sample

        # slime's log-prob kernel runs on Megatron's tensor-parallel groups: the loss plugin takes
        # its one-rank path here (the GRPO channel is checked against slime's formulas in test_slime_loss).
        sys.modules["slime.backends.megatron_utils.loss"] = None
        yield types.SimpleNamespace(
            Sample=Sample, reducer=get_sum_of_sample_mean, tensorize=tensorize_rollout_data_for_training
        )
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name in stubs or name.split(".")[0] in ("slime", "megatron"):
                del sys.modules[name]


def _f32(values) -> tuple[float, ...]:
    """Values as slime stores them (float32 tensors), so both sides read the same numbers."""
    return tuple(torch.tensor(values, dtype=torch.float32).double().tolist())


def make_step(seed: int = 0):
    """4 chains (2 teacher prompts x 2 infos), each with 0-2 solver samples of its problems."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return tuple(torch.randint(VOCAB_LOW, VOCAB_HIGH, (n,), generator=g).tolist())

    def logps(n):
        return _f32((-torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.05).tolist())

    infos, solvers = [], []
    for chain, (prompt_len, response_len, advantage, num_solver) in enumerate(
        [(5, 4, 1.0, 2), (5, 6, -1.0, 1), (7, 3, 0.5, 0), (7, 5, -0.5, 2)]
    ):
        infos.append(
            TeacherSample(
                prompt_ids=(1, *ids(prompt_len)),
                response_ids=ids(response_len),
                rollout_logprobs=logps(response_len),
                reward=0.5 + advantage / 4,
                advantage=advantage,
                group_index=chain // 2,
                sample_index=chain % 2,
                inner_iteration=0,
            )
        )
        chain_solvers = []
        for n in range(num_solver):
            length = 3 + (chain + n) % 4
            chain_solvers.append(
                SolverSample(
                    problem_uid=f"p{chain}",
                    prompt_ids=(1, *ids(6)),
                    response_ids=ids(length),
                    rollout_logprobs=logps(length),
                    temperature=TEMPERATURE,
                    grade=float(n % 2),
                    task_advantage=(1.0 if n % 2 else -1.0) * (chain + 1) / 4,
                    prompt_text="",
                    solution_text="",
                    teacher_logprobs=logps(length),
                    is_error_site=n % 2 == 0,
                    hint_logprobs=logps(length) if n % 2 == 0 else None,
                )
            )
        solvers.append(chain_solvers)
    return infos, solvers


def local_step(checkpoint: Path, settings: TrainerSettings, infos, solvers, pairs=()):
    torch.manual_seed(0)
    trainer = LocalTrainer(str(checkpoint), settings)
    trainer.model.double()
    metrics = trainer.compute_gradients(infos, [x for chain in solvers for x in chain], [p for c in pairs for p in c])
    loss = metrics["train/loss"] + metrics.get("train/distill_loss", 0.0) + metrics.get("train/sdpo_shaping_loss", 0.0)
    return loss, [p.grad.detach().clone() for p in trainer.model.parameters()]


def slime_args(settings: TrainerSettings, num_rollouts: int) -> Namespace:
    s, d = settings.loss, settings.distill
    return Namespace(
        rollout_temperature=TEMPERATURE,
        rollout_top_p=1.0,
        eps_clip=s.eps_clip,
        eps_clip_high=s.eps_clip_high,
        eps_clip_c=s.eps_clip_c,
        use_tis=s.use_tis,
        tis_clip=s.tis_clip,
        tis_clip_low=s.tis_clip_low,
        aipo_delta=s.aipo_delta,
        use_rollout_logprobs=False,
        entropy_coef=0.0,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        kl_loss_type="k1",
        sdpo_alpha=s.sdpo_alpha,
        sdpo_form=s.sdpo_form,
        replay_beta=0.0,
        adv_tau=d.adv_tau,
        teacher_tau=d.teacher_tau,
        student_tau=d.student_tau,
        tensor_model_parallel_size=1,
        context_parallel_size=1,
        global_batch_size=num_rollouts,
        custom_convert_samples_to_train_data_path="slime_meta.backends.slime.train_data.convert_samples_to_train_data",
    )


def slime_samples(slime, infos, solvers, distill: DistillSettings, sdpo_shaping: bool):
    """As the rollout plugin builds them: its own choice of trained solver samples and their scores."""
    objectives = types.SimpleNamespace(
        distillation_on=distill.teacher_tau != 0.0 or distill.student_tau != 0.0,
        solver_grpo_on=distill.adv_tau != 0.0,
        sdpo_shaping=sdpo_shaping,
    )
    cfg = types.SimpleNamespace(objectives=objectives)
    with_solver = distill.on or sdpo_shaping
    out, counts = [], {}
    for chain, (info, chain_solvers) in enumerate(zip(infos, solvers)):
        rollout_id = 100 + chain
        base = slime.Sample(group_index=info.group_index, index=rollout_id)
        out.append(
            apply_fields(
                base,
                teacher_sample_fields(
                    info,
                    prompt="",
                    response="",
                    rollout_id=rollout_id,
                    teacher_log_probs=info.rollout_logprobs if with_solver else None,
                ),
            )
        )
        for kind, x, scores in trained_solver_samples(cfg, chain_solvers):
            fields = solver_sample_fields(
                x,
                prompt="",
                response="",
                teacher_log_probs=scores,
                index=counts.get(kind, 0),
                rollout_id=rollout_id,
                kind=kind,
            )
            out.append(apply_fields(slime.Sample(group_index=info.group_index), fields))
            counts[kind] = counts.get(kind, 0) + 1
    return out


def slime_step(
    slime,
    checkpoint: Path,
    settings: TrainerSettings,
    infos,
    solvers,
    micro_batch_size: int = 3,
    slimes_own_denominators: bool = False,
    pairs=(),
    temperature: float = TEMPERATURE,
):
    from transformers import AutoModelForCausalLM

    shaping = bool(settings.loss.sdpo_alpha) and settings.loss.sdpo_form == "shaping"
    with_solver = settings.distill.on or shaping or bool(pairs)
    args = slime_args(settings, len(infos))
    args.rollout_temperature = temperature
    samples = slime_samples(slime, infos, solvers, settings.distill, shaping)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float64)
    if pairs:  # as the rollout makes them: the policy's log-probs (temperature 1) of both sides, then w

        def policy_logps(prompt, response):
            with torch.no_grad():
                tokens = torch.tensor([*prompt, *response])
                rows = model(input_ids=tokens[None]).logits[0][len(prompt) - 1 : len(tokens) - 1]
                return torch.log_softmax(rows, -1).gather(-1, tokens[len(prompt) :, None])[:, 0].tolist()

        count = 0
        for chain, chain_pairs in enumerate(pairs):
            scored = [
                (policy_logps(p.prompt_ids, p.chosen_ids), policy_logps(p.prompt_ids, p.rejected_ids))
                for p in chain_pairs
            ]
            for x in replay_samples(chain_pairs, scored, settings.loss.replay_beta, settings.loss.replay_dpo_beta):
                fields = replay_sample_fields(x, index=count, rollout_id=100 + chain)
                samples.append(apply_fields(slime.Sample(group_index=infos[chain].group_index), fields))
                count += 1
        for sample in samples:  # slime forwards teacher_log_probs only when every sample has them
            sample.teacher_log_probs = sample.teacher_log_probs or sample.rollout_log_probs
    train_data = convert_samples_to_train_data(args, samples)
    if slimes_own_denominators:  # as without the conversion plugin: each rollout's tokens
        train_data["rollout_mask_sums"] = _per_rollout(train_data["rollout_ids"], train_data["loss_masks"])
        args.custom_convert_samples_to_train_data_path = None
    rollout_data = {
        key: train_data[key]
        for key in (
            "tokens",
            "response_lengths",
            "rewards",
            "loss_masks",
            "sample_indices",
            "rollout_ids",
            "rollout_mask_sums",
            "rollout_log_probs",
            "teacher_log_probs",
        )
        if key in train_data
    }
    slime.tensorize(rollout_data)

    def response_logits(tokens, response_length):
        logits = model(input_ids=tokens[None].long()).logits[0]
        return logits, logits[len(tokens) - response_length - 1 : len(tokens) - 1]

    with torch.no_grad():  # slime's log_probs: the trainer's own, before the step, at the rollout temperature
        log_probs = []
        for tokens, length in zip(rollout_data["tokens"], rollout_data["response_lengths"]):
            _, rows = response_logits(tokens, length)
            scaled = torch.log_softmax(rows / temperature, dim=-1)
            log_probs.append(scaled.gather(-1, tokens[len(tokens) - length :].long()[:, None])[:, 0])
    rollout_data["log_probs"] = log_probs
    rollout_data["kl"] = [torch.zeros_like(x) for x in log_probs]
    if with_solver:
        meta_advantages(args, rollout_data)
    else:  # slime's grpo estimator with kl 0: every token gets its sample's reward
        rollout_data["advantages"] = [
            torch.full_like(k, float(r)) for k, r in zip(rollout_data["kl"], rollout_data["rewards"])
        ]

    order = list(range(len(samples)))
    micro_batches = [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    total = 0.0
    for indices in micro_batches:
        batch = {
            key: [rollout_data[key][i] for i in indices]
            for key in ("loss_masks", "advantages", "log_probs", "rollout_log_probs", "response_lengths")
        }
        batch["unconcat_tokens"] = [rollout_data["tokens"][i] for i in indices]
        batch["total_lengths"] = [len(t) for t in batch["unconcat_tokens"]]
        batch["rollout_mask_sums"] = rollout_data["rollout_mask_sums"][indices]
        batch["response_lengths"] = [int(x) for x in batch["response_lengths"]]
        logits = torch.cat(
            [response_logits(t, r)[0] for t, r in zip(batch["unconcat_tokens"], batch["response_lengths"])]
        )[None]
        reducer = slime.reducer(
            batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], batch["rollout_mask_sums"], False
        )
        loss, _ = meta_loss(args, batch, logits, reducer)
        # slime's loss_function: x num_microbatches / global_batch_size; Megatron: / num_microbatches.
        step_loss = loss * len(micro_batches) / args.global_batch_size / len(micro_batches)
        step_loss.backward()
        total += float(step_loss.detach())
    return total, [p.grad.detach().clone() for p in model.parameters()], train_data


def assert_same(local, remote, same_loss: bool = True):
    (local_loss, local_grads), (slime_loss, slime_grads) = local, remote[:2]
    # The model runs in float64 on both sides; the per-token terms are float32 on slime's side
    # (slime hands log-probs and advantages over as float32, and the plugin works in it), hence
    # agreement to float32 rounding, not to float64's.
    if same_loss:
        assert slime_loss == pytest.approx(local_loss, rel=1e-6, abs=1e-7)  # terms of either sign: float32 eps
    for a, b in zip(local_grads, slime_grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    assert any(float(g.abs().max()) > 0 for g in local_grads)


TIS = LossSettings(eps_clip=0.2, eps_clip_high=0.28, use_tis=True, tis_clip=1.5, tis_clip_low=0.2)


def test_grpo_with_tis_gives_the_local_loss_and_gradient(slime, tiny_checkpoint):
    infos, solvers = make_step()
    settings = TrainerSettings(lr=1e-2, device="cpu", temperature=TEMPERATURE, loss=TIS, micro_batch_size=2)
    assert_same(
        local_step(tiny_checkpoint, settings, infos, solvers),
        slime_step(slime, tiny_checkpoint, settings, infos, solvers),
    )


@pytest.mark.parametrize("adv_tau", [0.0, 0.5])
def test_context_distillation_gives_the_local_loss_and_gradient(slime, tiny_checkpoint, adv_tau):
    infos, solvers = make_step(seed=1)
    settings = TrainerSettings(
        lr=1e-2,
        device="cpu",
        temperature=TEMPERATURE,
        loss=TIS,
        micro_batch_size=2,
        distill=DistillSettings(adv_tau=adv_tau, teacher_tau=0.5, student_tau=0.25),
    )
    remote = slime_step(slime, tiny_checkpoint, settings, infos, solvers)
    assert_same(local_step(tiny_checkpoint, settings, infos, solvers), remote)
    # slime's own denominators (a token mean per rollout) would mix the infos with the solver samples.
    train_data = remote[2]
    assert sorted(set(train_data["rollout_mask_sums"])) == sorted(
        {float(sum(len(x.response_ids) for x in infos)), float(sum(len(x.response_ids) for c in solvers for x in c))}
    )


def test_solver_grpo_alone_gives_the_local_loss_and_gradient(slime, tiny_checkpoint):
    """--adv-tau alone: the policy's graded attempts, no context scored (the builder leaves their
    context log-probs out), trained with adv_tau x their GRPO task advantage on both backends."""
    infos, solvers = make_step(seed=2)
    solvers = [[dataclasses.replace(x, teacher_logprobs=None) for x in chain] for chain in solvers]
    settings = TrainerSettings(
        lr=1e-2,
        device="cpu",
        temperature=TEMPERATURE,
        loss=TIS,
        micro_batch_size=2,
        distill=DistillSettings(adv_tau=0.5),
    )
    remote = slime_step(slime, tiny_checkpoint, settings, infos, solvers)
    assert_same(local_step(tiny_checkpoint, settings, infos, solvers), remote)
    solver_tokens = float(sum(len(x.response_ids) for c in solvers for x in c))
    assert solver_tokens in set(remote[2]["rollout_mask_sums"])  # the solver samples trained, in their own mean


def test_sdpo_shaping_gives_the_local_loss_and_gradient(slime, tiny_checkpoint):
    """Channel 2 in its shaping form: alpha * (log p_hint - log p) on the error sites, both backends."""
    infos, solvers = make_step(seed=3)
    loss = dataclasses.replace(TIS, sdpo_alpha=0.5, sdpo_form="shaping")
    settings = TrainerSettings(lr=1e-2, device="cpu", temperature=TEMPERATURE, loss=loss, micro_batch_size=2)
    remote = slime_step(slime, tiny_checkpoint, settings, infos, solvers)
    assert_same(local_step(tiny_checkpoint, settings, infos, solvers), remote)
    solver_tokens = sum(len(x.response_ids) for c in solvers for x in c if x.is_error_site)
    assert float(solver_tokens) in set(remote[2]["rollout_mask_sums"])  # only the error sites are trained
    grpo_alone = local_step(tiny_checkpoint, dataclasses.replace(settings, loss=TIS), infos, solvers)
    assert grpo_alone[0] != pytest.approx(remote[0], rel=1e-4)  # the shaping term is there


def test_all_channels_slime_runs_give_the_local_loss_and_gradient(slime, tiny_checkpoint):
    """Distillation and the SDPO shaping form together: an answer in both is two slime samples."""
    infos, solvers = make_step(seed=4)
    loss = dataclasses.replace(TIS, sdpo_alpha=0.5, sdpo_form="shaping")
    settings = TrainerSettings(
        lr=1e-2,
        device="cpu",
        temperature=TEMPERATURE,
        loss=loss,
        micro_batch_size=2,
        distill=DistillSettings(adv_tau=0.5, teacher_tau=0.5, student_tau=0.25),
    )
    remote = slime_step(slime, tiny_checkpoint, settings, infos, solvers)
    assert_same(local_step(tiny_checkpoint, settings, infos, solvers), remote)
    assert len(set(remote[2]["rollout_mask_sums"])) == 3  # infos, distillation, SDPO: three token means


def test_replay_dpo_gives_the_local_gradient(slime, tiny_checkpoint):
    """Channel 3 as two samples per pair with advantages +-replay_beta * w: DPO's gradient (the loss
    value is the surrogate's, so only the gradient is compared). Temperature 1, as DPO's."""
    infos, solvers = make_step(seed=5)
    g = torch.Generator().manual_seed(5)

    def ids(n):
        return tuple(torch.randint(VOCAB_LOW, VOCAB_HIGH, (n,), generator=g).tolist())

    pairs = [
        [
            PreferencePair(
                (1, *ids(5)),
                ids(4 + c % 3),
                ids(3 + c % 2),
                reference_chosen_logp=-30.0 - c,
                reference_rejected_logp=-25.0 + c,
            )
        ]
        * (1 + c % 2)
        for c in range(4)
    ]
    loss = dataclasses.replace(TIS, replay_beta=0.5, replay_dpo_beta=0.1)
    settings = TrainerSettings(lr=1e-2, device="cpu", temperature=1.0, loss=loss, micro_batch_size=2)
    remote = slime_step(slime, tiny_checkpoint, settings, infos, [[] for _ in infos], pairs=pairs, temperature=1.0)
    local = local_step(tiny_checkpoint, settings, infos, [[] for _ in infos], pairs)
    assert_same(local, remote, same_loss=False)
    grpo_alone = local_step(tiny_checkpoint, dataclasses.replace(settings, loss=TIS), infos, [[] for _ in infos])
    assert not torch.allclose(grpo_alone[1][0], local[1][0], rtol=1e-3)  # the replay term is in the gradient


def test_slimes_own_denominators_would_differ(slime, tiny_checkpoint):
    """The conversion plugin is what makes the two equal: without it, slime's per-rollout means differ."""
    infos, solvers = make_step(seed=2)
    settings = TrainerSettings(
        lr=1e-2,
        device="cpu",
        temperature=TEMPERATURE,
        loss=TIS,
        micro_batch_size=2,
        distill=DistillSettings(teacher_tau=0.5, student_tau=0.25),
    )
    local_loss, _ = local_step(tiny_checkpoint, settings, infos, solvers)
    slime_loss, _, _ = slime_step(slime, tiny_checkpoint, settings, infos, solvers, slimes_own_denominators=True)
    assert slime_loss != pytest.approx(local_loss, rel=1e-3)


def _per_rollout(rollout_ids, masks):
    totals = {}
    for rid, mask in zip(rollout_ids, masks):
        totals[rid] = totals.get(rid, 0.0) + float(sum(mask))
    return [totals[rid] for rid in rollout_ids]
