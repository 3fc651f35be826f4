"""The local trainer: the teacher as an HF causal LM, AdamW, one optimizer step per rollout.

It trains on exactly the token ids the engine sampled (prompt ids + output ids), with the
behaviour log-probs the engine returned. Re-tokenising the generated text would drift from what
was sampled and break the ratio. Log-probs are taken under logits / temperature, the
distribution the engine sampled from, so the ratio is 1 on-policy.

The loss channels (policy gradient, SDPO, trace-replay DPO) live in `channels.py`. A step whose
loss or gradient norm is not finite is skipped: no optimizer update, so the weights and AdamW's
moments stay those of the last good step; `max_skipped_steps` such steps in a row stop the run
(`NonFiniteTrainingError`). A step whose loss provably has no gradient (every advantage zero and
no other term that could move the weights, `no_signal.py`) runs no forward at all and is counted
(`train/skipped_no_signal`). fp32 on CPU;
on a GPU fp32 master weights with bf16 autocast, AdamW's fused kernel, and the decoder layers
compiled (`compile_layers`). The model is called in two parts (`SplitModelCall`):
the decoder's last hidden states, then the output projection on the loss rows only. Sequences
whose prompts begin alike share one row, their common prefix computed once (`packing.py`,
`share_prompt_forward`).

The start weights (KL anchor, replay-DPO reference, `reference.py`) are read once per step,
before the policy's passes: the reference log-probs of every sequence first, then the passes
with them. Until the first update the policy *is* the start weights, and its own log-probs serve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch
from transformers import AutoModelForCausalLM

from slime_meta.backends.local.training import gpu_memory
from slime_meta.backends.local.training.batching import CUDA_WIDTH_MULTIPLE, MicroBatching, PolicySequence
from slime_meta.backends.local.training.channels import (
    policy_gradient_pass,
    reference_logp_sums,
    reference_token_logps,
    replay_dpo_pass,
    sdpo_pass,
    sdpo_shaping_sequences,
)
from slime_meta.backends.local.training.model_call import SplitModelCall, compile_decoder_layers
from slime_meta.backends.local.training.no_signal import NoSignalStreak, RolloutSummary, zero_gradient_step
from slime_meta.backends.local.training.reference import StartWeights
from slime_meta.backends.local.training.settings import (
    DistillSettings,
    TrainerSettings,
    release_freed_memory_promptly,
    resolve_device,
)
from slime_meta.backends.local.training.timing import NoTimer, StepTimer
from slime_meta.errors import NonFiniteTrainingError
from slime_meta.losses.advantages import context_distillation_advantages
from slime_meta.losses.combine import ThreeChannelInputs, total_loss
from slime_meta.types import PreferencePair, SolverSample, TeacherSample

logger = logging.getLogger(__name__)


def teacher_sequences(samples: Sequence[TeacherSample], temperature: float) -> list[PolicySequence]:
    return [
        PolicySequence(
            s.prompt_ids, s.response_ids, s.rollout_logprobs, (s.advantage,) * len(s.response_ids), temperature
        )
        for s in samples
        if s.response_ids
    ]


def distillation_sequences(samples: Sequence[SolverSample], d: DistillSettings) -> list[PolicySequence]:
    """The policy's own solutions with context-distillation token advantages (teacher terms detached)."""
    out = []
    for s in samples:
        if not s.response_ids or (s.teacher_logprobs is None and d.teacher_tau != 0.0):
            continue
        # Without a teacher term (solver GRPO alone) no context was scored: its weight is 0.
        teacher_logprobs = s.teacher_logprobs if s.teacher_logprobs is not None else (0.0,) * len(s.response_ids)
        advantages_T = context_distillation_advantages(
            torch.tensor([s.task_advantage]),
            torch.tensor([teacher_logprobs]),
            torch.tensor([s.rollout_logprobs]),
            adv_tau=d.adv_tau,
            teacher_tau=d.teacher_tau,
            student_tau=d.student_tau,
        )[0]
        advantages = tuple(advantages_T.tolist())
        out.append(PolicySequence(s.prompt_ids, s.response_ids, s.rollout_logprobs, advantages, s.temperature))
    return out


class LocalTrainer:
    def __init__(
        self, model_path: str, settings: TrainerSettings, pad_token_id: int = 0, reference_path: str | None = None
    ):
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.pad_token_id = pad_token_id
        if self.device.type == "cuda":
            # cuDNN attention plans per input shape, and every rollout brings new lengths (the
            # workers measured 60-190 ms per new shape on an H100); the flash/efficient kernels don't.
            torch.backends.cuda.enable_cudnn_sdp(False)
        else:
            release_freed_memory_promptly()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.train()
        # Names the reference weights in caches of values computed under them (replay DPO).
        self.reference_id = str(Path(reference_path).resolve()) if reference_path is not None else None
        self.start_weights = None  # frozen start weights: KL anchor and DPO reference
        if reference_path is not None:
            resident = settings.reference_resident
            if resident is None:
                resident = self.device.type == "cuda"
            self.start_weights = StartWeights(reference_path, self.model, self.device, resident)
        # The policy holds the start weights until its first update (a resume loads trained ones).
        self.policy_is_reference = self.reference_id == str(Path(model_path).resolve())
        # One kernel for the whole update on CUDA instead of a loop over tensors; the CPU keeps
        # the default implementation (its numbers are what the CPU tests pin down).
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=settings.lr,
            betas=(settings.adam_beta1, settings.adam_beta2),
            weight_decay=settings.weight_decay,
            **fused,
        )
        self.recomputes_layers = settings.recompute_layers or (settings.recompute_on_cpu and self.device.type == "cpu")
        if self.recomputes_layers:
            # Non-reentrant: works with inputs that need no gradient and inside a compiled layer.
            # transformers 5 renamed the call (the old name warns); 4.x has only the old one.
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.compiled_layers = 0
        if settings.compile_layers and self.device.type == "cuda":
            self.compiled_layers = compile_decoder_layers(self.model)
        self.steps_done = 0  # optimizer steps applied
        self.skipped_nonfinite = 0  # steps skipped for a non-finite loss or gradient norm, in all
        self.skipped_in_a_row = 0
        self.no_signal = NoSignalStreak(settings.no_signal_warn_after)
        # The reference runs through the policy's own modules (its parameters swapped in for the
        # call, or the policy itself before its first update): one user of the model at a time,
        # whichever thread calls.
        self._model_lock = threading.RLock()

    @property
    def reference(self) -> torch.nn.Module | None:
        """The resident reference model, when the start weights are kept as one."""
        return self.start_weights.resident_model if self.start_weights is not None else None

    def _forward(self, model) -> SplitModelCall:
        s = self.settings
        return SplitModelCall(model, self.device.type == "cuda", s.split_head, share_prompts=s.share_prompt_forward)

    @contextlib.contextmanager
    def _reference_call(self) -> Iterator[SplitModelCall]:
        """A `SplitModelCall` of the start weights for the `with` block (the policy itself before its first update)."""
        if self.start_weights is None:
            raise ValueError(
                "replay DPO needs reference log-probs: load the start weights as the trainer's reference_path"
            )
        if self.policy_is_reference:
            yield self._forward(self.model)
            return
        with self.start_weights.loaded() as reference:
            yield self._forward(reference)

    def with_reference_logps(
        self, pairs: Sequence[PreferencePair], reference: SplitModelCall | None = None
    ) -> list[PreferencePair]:
        """The pairs with their DPO reference log-probs: summed over each response, under the frozen
        start weights (`reference_path`). Pairs that carry them already are returned as they are."""
        missing = [
            i for i, p in enumerate(pairs) if p.reference_chosen_logp is None or p.reference_rejected_logp is None
        ]
        out = list(pairs)
        if not missing:
            return out
        if reference is None:
            with self._model_lock, self._reference_call() as reference:
                return self.with_reference_logps(pairs, reference)
        chunk_size = self.settings.loss.jsd_chunk_size
        values = reference_logp_sums(reference, [pairs[i] for i in missing], self._micro_batching(), chunk_size)
        for i, (chosen, rejected) in zip(missing, values):
            out[i] = dataclasses.replace(pairs[i], reference_chosen_logp=chosen, reference_rejected_logp=rejected)
        return out

    def _micro_batching(self) -> MicroBatching:
        """How every pass of this trainer splits its forwards into micro-batches."""
        s = self.settings
        multiple = CUDA_WIDTH_MULTIPLE if self.device.type == "cuda" else 1  # the CPU keeps nothing per shape
        return MicroBatching(s.micro_batch_size, self.pad_token_id, self.device, s.max_tokens_per_gpu, multiple)

    def _with_reference_logprobs(
        self, reference: SplitModelCall, sequences: list[PolicySequence]
    ) -> list[PolicySequence]:
        chunk_size = self.settings.loss.jsd_chunk_size
        values = reference_token_logps(reference, sequences, chunk_size, self._micro_batching())
        return [dataclasses.replace(x, reference_logprobs=v) for x, v in zip(sequences, values)]

    def compute_gradients(
        self,
        teacher_samples: Sequence[TeacherSample],
        solver_samples: Sequence[SolverSample] = (),
        pairs: Sequence[PreferencePair] = (),
    ) -> dict[str, float]:
        """Backpropagate every channel of one step into `.grad` (no optimizer step); the metrics.

        The teacher's infos and the solver's distillation samples are two policy-gradient terms,
        each its own token mean, added with weight 1 (the distillation's weights are its taus):
        turning distillation on leaves the teacher's own gradient as it was. A step whose loss
        provably has no gradient computes nothing (`train/skipped_no_signal` 1, `.grad` untouched).
        """
        with self._model_lock:
            return self._compute_gradients(teacher_samples, solver_samples, pairs, NoTimer())

    def _compute_gradients(
        self,
        teacher_samples: Sequence[TeacherSample],
        solver_samples: Sequence[SolverSample],
        pairs: Sequence[PreferencePair],
        timer: StepTimer | NoTimer,
    ) -> dict[str, float]:
        s = self.settings
        teacher = teacher_sequences(teacher_samples, s.temperature)
        solver = distillation_sequences(solver_samples, s.distill) if s.distill.on else []
        if not teacher and not solver:
            return {"train/skipped_empty_batch": 1.0}
        # With the shaping form, SDPO's term is a policy-gradient pass of its own, like distillation's.
        shaped = sdpo_shaping_sequences(solver_samples, s.loss.sdpo_alpha) if s.loss.sdpo_form == "shaping" else []
        sdpo_samples = [x for x in solver_samples if x.is_error_site and x.hint_prompt_ids and x.response_ids]
        sdpo_jsd = bool(s.loss.sdpo_alpha) and s.loss.sdpo_form == "jsd" and bool(sdpo_samples)
        replay = bool(s.loss.replay_beta) and bool(pairs)
        kl_on = bool(s.loss.kl_loss_coef) and self.start_weights is not None
        sequences = teacher + solver
        counts = {
            "train/tokens": float(sum(len(x.prompt_ids) + len(x.response_ids) for x in sequences)),
            "train/num_sequences": float(len(sequences)),
            "train/response_tokens": float(sum(len(x.response_ids) for x in sequences)),
            "train/advantage_abs_mean": sum(abs(x.advantage) for x in teacher_samples) / max(len(teacher_samples), 1),
            "train/replay_pairs": float(len(pairs)),
        }
        if zero_gradient_step(
            teacher + solver + shaped,
            entropy_coef=s.loss.entropy_coef,
            kl_coef=s.loss.kl_loss_coef if kl_on else 0.0,
            kl_type=s.loss.kl_loss_type,
            policy_is_reference=self.policy_is_reference,
            sdpo_jsd_samples=len(sdpo_samples) if sdpo_jsd else 0,
            replay_pairs=len(pairs) if replay else 0,
        ):
            # Every term is exactly 0 here (PPO terms at zero advantage, k2/k3 at the reference).
            zero = {"train/loss": 0.0, "loss/total": 0.0, "combined_advantage": 0.0}
            return {"train/skipped_no_signal": 1.0, **zero, **counts}
        # Pairs that come with their reference log-probs (cached with them) need no start weights.
        unscored_pairs = replay and any(
            p.reference_chosen_logp is None or p.reference_rejected_logp is None for p in pairs
        )
        if (kl_on and not self.policy_is_reference) or unscored_pairs:
            # The start weights read once for the step: every sequence's anchor log-probs, the pairs' sums.
            with self._reference_call() as reference:
                if kl_on and not self.policy_is_reference:
                    teacher, solver, shaped = (
                        self._with_reference_logprobs(reference, x) if x else x for x in (teacher, solver, shaped)
                    )
                if unscored_pairs:
                    pairs = self.with_reference_logps(pairs, reference)
            timer.mark("reference_forward")
        policy = self._forward(self.model)
        batching = self._micro_batching()
        own_reference = {"reference_is_policy": kl_on and self.policy_is_reference}
        metrics: dict[str, float] = {"train/skipped_no_signal": 0.0}
        pg_loss = 0.0
        if teacher:
            pg = policy_gradient_pass(policy, teacher, s.loss, batching, **own_reference)
            metrics.update({f"train/{k}": v for k, v in pg.items()})
            pg_loss += pg["loss"]
        if solver:
            distill = policy_gradient_pass(policy, solver, s.loss, batching, **own_reference)
            metrics.update({f"train/distill_{k}": v for k, v in distill.items()})
            metrics["train/distill_tokens"] = float(sum(len(x.response_ids) for x in solver))
            pg_loss += distill["loss"]
        channels = ThreeChannelInputs(grpo=torch.tensor(pg_loss))  # with the shaping form, SDPO's term too
        if shaped:  # channel 2 as token advantages: a policy-gradient term of its own, like distillation's
            sdpo = policy_gradient_pass(policy, shaped, s.loss, batching, **own_reference)
            metrics.update({f"train/sdpo_shaping_{k}": v for k, v in sdpo.items()})
            pg_loss += sdpo["loss"]
        if sdpo_jsd:
            sdpo = sdpo_pass(policy, sdpo_samples, s.loss, batching)
            metrics.update({f"train/{k}": v for k, v in sdpo.items()})
            channels.sdpo_jsd = torch.tensor(sdpo["sdpo_jsd"])
        if replay:
            # The reference is the start weights (seed 004), never the weights being trained.
            dpo = replay_dpo_pass(policy, pairs, s.loss, batching)
            metrics.update({f"train/{k}": v for k, v in dpo.items()})
            channels.replay_dpo = torch.tensor(dpo["replay_dpo"])
        combined = total_loss(channels, alpha=s.loss.sdpo_alpha, beta=s.loss.replay_beta)
        metrics.update({k: float(v) for k, v in combined.metrics.items()})
        timer.mark("forward_backward")
        advantages = [a for x in sequences for a in x.advantages]
        metrics["combined_advantage"] = sum(advantages) / len(advantages)
        metrics.update(counts)
        return metrics

    def train_step(
        self,
        teacher_samples: Sequence[TeacherSample],
        solver_samples: Sequence[SolverSample] = (),
        pairs: Sequence[PreferencePair] = (),
        step: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step over a rollout's samples, every channel accumulating into the gradient.

        A non-finite loss or gradient norm skips the update (`train/skipped_nonfinite` 1, weights
        and optimizer state untouched); `max_skipped_steps` of them in a row raise
        `NonFiniteTrainingError`. A step without a training signal skips forward, backward and the
        update (`train/skipped_no_signal` 1); `no_signal_warn_after` in a row log one line saying
        what the rollouts looked like. `step` (the outer step) only names the step in those messages.
        """
        with self._model_lock:
            return self._train_step(teacher_samples, solver_samples, pairs, step)

    def _train_step(
        self,
        teacher_samples: Sequence[TeacherSample],
        solver_samples: Sequence[SolverSample],
        pairs: Sequence[PreferencePair],
        step: int | None,
    ) -> dict[str, float]:
        started = time.perf_counter()
        timer = StepTimer(self.device)
        metrics = self._compute_gradients(teacher_samples, solver_samples, pairs, timer)
        if "train/skipped_empty_batch" in metrics:
            return metrics
        skipped = bool(metrics["train/skipped_no_signal"])
        warning = self.no_signal.record(skipped, step, RolloutSummary.of(teacher_samples, solver_samples))
        if warning:
            logger.warning("%s", warning)
        metrics["train/skipped_no_signal_total"] = float(self.no_signal.total)
        if skipped:  # nothing was computed: the weights, AdamW's moments and the push stay as they were
            elapsed = time.perf_counter() - started
            metrics.update(
                {
                    "train/grad_norm": 0.0,
                    "train/skipped_nonfinite": 0.0,
                    "train/skipped_nonfinite_total": float(self.skipped_nonfinite),
                    "train/step_time": elapsed,
                    "train/tokens_per_s": 0.0,
                }
            )
            metrics.pop("train/tokens")
            return metrics
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.clip_grad).item()
        loss = metrics["loss/total"]
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.steps_done += 1
            self.skipped_in_a_row = 0
            self.policy_is_reference = False
        else:
            self.skipped_nonfinite += 1
            self.skipped_in_a_row += 1
        # Also after a skip: the clip has scaled the gradient by NaN, and none of it may carry over.
        self.optimizer.zero_grad(set_to_none=True)
        timer.mark("optimizer")  # the gradient norm and clip with it
        metrics.update(timer.metrics())
        metrics.update(gpu_memory.step_metrics(self.device))
        elapsed = time.perf_counter() - started
        metrics.update(
            {
                "train/grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
                "train/skipped_nonfinite": 0.0 if finite else 1.0,
                "train/skipped_nonfinite_total": float(self.skipped_nonfinite),
                "train/step_time": elapsed,
                "train/tokens_per_s": metrics.pop("train/tokens") / elapsed,
            }
        )
        if not finite:
            done = self.steps_done + self.skipped_nonfinite - 1
            where = f"step {step}" if step is not None else f"trainer step {done}"
            limit = self.settings.max_skipped_steps
            logger.warning(
                "%s: non-finite loss %s or gradient norm %s: optimizer step skipped, weights unchanged (%d in a row, "
                "the run stops at --max-skipped-steps %d)",
                where,
                loss,
                grad_norm,
                self.skipped_in_a_row,
                limit,
            )
            if self.skipped_in_a_row >= limit:
                raise NonFiniteTrainingError(
                    f"{where}: {self.skipped_in_a_row} steps in a row had a non-finite loss or gradient norm "
                    f"(--max-skipped-steps {limit}); stopped with the weights of the last good step, the last "
                    "checkpoint is intact; lower --lr or --clip-grad, or check the rewards and advantages"
                )
        return metrics

    def save_weights(self, directory: Path) -> Path:
        """Weights for the inference workers (`/update_weights_from_disk` reads this directory)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, safe_serialization=True)
        return directory

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "steps_done": self.steps_done,
            "skipped_nonfinite": self.skipped_nonfinite,
            "skipped_no_signal": self.no_signal.total,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = int(state["steps_done"])
        self.skipped_nonfinite = int(state.get("skipped_nonfinite", 0))  # checkpoints written before it was kept
        self.no_signal.total = int(state.get("skipped_no_signal", 0))
