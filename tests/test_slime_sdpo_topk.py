"""Channel 2 (SDPO's JSD to the hint-conditioned self, the hint's top-k plus a tail bucket), one step
on both backends: the same loss and the same gradient.

Local: `LocalTrainer.compute_gradients` with `sdpo_topk` (the hinted forward's top-k). slime: the
hint's top-k as the pool's scoring call gives it (the same model's log-softmax at temperature 1,
float32), packed into the samples by the rollout's own code, slime's own conversion through our
plugin, slime's tensorisation, our advantage plugin and trainer-side hook, then slime's own
`loss_function` with `loss_type custom_loss` calling our loss plugin, in several micro-batches.
Needs slime's source (`SLIME_SRC`); the stubs are `test_slime_equivalence.py`'s.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types

import pytest
import torch

from slime_meta.backends.local.training.settings import TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.backends.slime.advantages import meta_advantages
from slime_meta.backends.slime.loss import hold_sdpo_topk, slime_log_prob_functions
from slime_meta.backends.slime.rollout import trained_solver_samples
from slime_meta.backends.slime.samples import apply_fields, solver_sample_fields, teacher_sample_fields
from slime_meta.backends.slime.train_data import convert_samples_to_train_data
from slime_meta.losses.topk_distill import teacher_topk
from tests import test_slime_equivalence
from tests.test_slime_equivalence import (
    TEMPERATURE,
    TIS,
    _ImportOnly,
    assert_same,
    make_step,
    slime_args,
)

slime = test_slime_equivalence.slime  # the module-scoped fixture that imports slime, shared with that module

K = 8
ALPHA = 0.5


@pytest.fixture(scope="module")
def slime_loss_function(slime):
    """slime's own `loss_function`, imported for real; the plugin's log-probs keep their one-rank path."""
    name = "slime.backends.megatron_utils.loss"
    blocked = sys.modules.pop(name, None)
    mpu = sys.modules["megatron.core"].mpu
    if isinstance(mpu, types.SimpleNamespace):  # the stub: one rank, no data parallelism
        mpu.get_data_parallel_world_size = lambda with_context_parallel=False: 1
    stubbed = []
    try:
        for _ in range(20):  # third-party packages its package imports but the loss never calls: import-only stubs
            try:
                module = importlib.import_module(name)
                break
            except ModuleNotFoundError as error:
                missing = (error.name or "").split(".")[0]
                if not missing or missing in ("slime", "megatron") or missing in sys.modules:
                    raise
                sys.modules[missing] = _ImportOnly(missing)
                stubbed.append(missing)
    finally:
        sys.modules[name] = blocked  # the plugin's own lookup still finds no slime log-prob kernel
    slime_log_prob_functions.cache_clear()
    yield module.loss_function
    for missing in stubbed:
        sys.modules.pop(missing, None)


def with_hints(solvers, seed: int):
    """The error sites' answers get a hint prompt (a few tokens more than the plain one)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for chain in solvers:
        out.append(
            [
                dataclasses.replace(
                    x,
                    hint_prompt_ids=(
                        *x.prompt_ids[:-1],
                        *torch.randint(4, 60, (3,), generator=g).tolist(),
                        x.prompt_ids[-1],
                    ),
                )
                if x.is_error_site
                else x
                for x in chain
            ]
        )
    return out


def scored(model, solvers):
    """As the rollout has them: each error site's answer with the hint's top-k from the scoring call."""
    out = []
    for chain in solvers:
        new_chain = []
        for x in chain:
            if x.is_error_site:
                tokens = torch.tensor([*x.hint_prompt_ids, *x.response_ids])
                with torch.no_grad():
                    rows = model(input_ids=tokens[None]).logits[0][len(x.hint_prompt_ids) - 1 : len(tokens) - 1]
                ids, logps = teacher_topk(rows, K)
                x = dataclasses.replace(x, hint_topk_ids=ids.int().numpy(), hint_topk_logprobs=logps.float().numpy())
            new_chain.append(x)
        out.append(new_chain)
    return out


def slime_step(slime, loss_function, checkpoint, settings, infos, solvers, micro_batch_size: int = 3):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float64)
    args = slime_args(settings, len(infos))
    args.sdpo_beta, args.sdpo_temperature, args.sdpo_token_clip = settings.loss.sdpo_beta, 1.0, None
    args.loss_type, args.custom_loss_function_path = "custom_loss", "slime_meta.backends.slime.loss.meta_loss"
    args.recompute_loss_function, args.allgather_cp, args.calculate_per_token_loss = False, False, False
    cfg = types.SimpleNamespace(
        objectives=types.SimpleNamespace(distillation_on=False, sdpo_shaping=False, sdpo_alpha=ALPHA, sdpo_form="jsd")
    )
    samples, counts = [], {}
    for chain, (info, chain_solvers) in enumerate(zip(infos, scored(model, solvers))):
        rollout_id = 100 + chain
        samples.append(
            apply_fields(
                slime.Sample(group_index=info.group_index, index=rollout_id),
                teacher_sample_fields(
                    info, prompt="", response="", rollout_id=rollout_id, teacher_log_probs=info.rollout_logprobs
                ),
            )
        )
        for kind, x, packed in trained_solver_samples(cfg, chain_solvers):
            fields = solver_sample_fields(
                x,
                prompt="",
                response="",
                teacher_log_probs=packed,
                index=counts.get(kind, 0),
                rollout_id=rollout_id,
                kind=kind,
            )
            samples.append(apply_fields(slime.Sample(group_index=info.group_index), fields))
            counts[kind] = counts.get(kind, 0) + 1
    assert counts == {"sdpo_jsd": sum(x.is_error_site for c in solvers for x in c)}
    train_data = convert_samples_to_train_data(args, samples)
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
    }
    slime.tensorize(rollout_data)
    assert sum(t.dim() == 2 for t in rollout_data["teacher_log_probs"]) == counts["sdpo_jsd"]
    log_probs = []
    with torch.no_grad():  # the trainer's log-probs before the step, at the rollout temperature
        for tokens, length in zip(rollout_data["tokens"], rollout_data["response_lengths"]):
            rows = model(input_ids=tokens[None]).logits[0][len(tokens) - length - 1 : len(tokens) - 1]
            log_probs.append(
                torch.log_softmax(rows / TEMPERATURE, -1).gather(-1, tokens[len(tokens) - length :, None])[:, 0]
            )
    rollout_data["log_probs"], rollout_data["kl"] = log_probs, [torch.zeros_like(x) for x in log_probs]
    meta_advantages(args, rollout_data)
    hold_sdpo_topk(args, 0, rollout_data)  # slime's --rollout-data-postprocess-path, before its rollout logging
    assert all(t.dim() == 1 for t in rollout_data["teacher_log_probs"])

    order = list(range(len(samples)))
    micro_batches = [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    total = 0.0
    for indices in micro_batches:
        batch = {
            key: [rollout_data[key][i] for i in indices]
            for key in ("loss_masks", "advantages", "log_probs", "rollout_log_probs", "teacher_log_probs")
        }
        batch["unconcat_tokens"] = [rollout_data["tokens"][i] for i in indices]
        batch["total_lengths"] = [len(t) for t in batch["unconcat_tokens"]]
        batch["response_lengths"] = [int(rollout_data["response_lengths"][i]) for i in indices]
        batch["rollout_mask_sums"] = rollout_data["rollout_mask_sums"][indices]
        logits = torch.cat([model(input_ids=t[None]).logits[0] for t in batch["unconcat_tokens"]])[None]
        loss, _, _ = loss_function(args, batch, len(micro_batches), args.global_batch_size, logits)
        step_loss = loss / len(micro_batches)  # Megatron averages the micro-batches' losses
        step_loss.backward()
        total += float(step_loss.detach())
    return total, [p.grad.detach().clone() for p in model.parameters()], train_data


def local_step(checkpoint, settings, infos, solvers):
    torch.manual_seed(0)
    trainer = LocalTrainer(str(checkpoint), settings)
    trainer.model.double()
    metrics = trainer.compute_gradients(infos, [x for chain in solvers for x in chain], [])
    assert metrics["train/sdpo_jsd"] > 0
    return metrics["train/loss"] + ALPHA * metrics["train/sdpo_jsd"], [
        p.grad.detach().clone() for p in trainer.model.parameters()
    ]


def test_sdpo_topk_jsd_gives_the_local_loss_and_gradient(slime, slime_loss_function, tiny_checkpoint):
    infos, solvers = make_step(seed=6)
    solvers = with_hints(solvers, seed=6)
    loss = dataclasses.replace(TIS, sdpo_alpha=ALPHA, sdpo_form="jsd", sdpo_topk=K)
    settings = TrainerSettings(lr=1e-2, device="cpu", temperature=TEMPERATURE, loss=loss, micro_batch_size=2)
    remote = slime_step(slime, slime_loss_function, tiny_checkpoint, settings, infos, solvers)
    local = local_step(tiny_checkpoint, settings, infos, solvers)
    assert_same(local, remote)
    sdpo_tokens = sum(len(x.response_ids) for c in solvers for x in c if x.is_error_site)
    assert float(sdpo_tokens) in set(remote[2]["rollout_mask_sums"])  # the SDPO answers: one token mean
    grpo_alone = local_step_without_sdpo(tiny_checkpoint, settings, infos, solvers)
    assert grpo_alone != pytest.approx(remote[0], rel=1e-4)  # the JSD term is there


def local_step_without_sdpo(checkpoint, settings, infos, solvers) -> float:
    torch.manual_seed(0)
    trainer = LocalTrainer(str(checkpoint), dataclasses.replace(settings, loss=TIS))
    trainer.model.double()
    return trainer.compute_gradients(infos, [x for chain in solvers for x in chain], [])["train/loss"]
