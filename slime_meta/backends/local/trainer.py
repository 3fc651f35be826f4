"""The local trainer: the teacher as an HF causal LM, AdamW, one optimizer step per rollout.

It trains on exactly the token ids the engine sampled (prompt ids + output ids), with the
behaviour log-probs the engine returned. Re-tokenising the generated text would drift from what
was sampled and break the ratio. Log-probs are taken under logits / temperature, the
distribution the engine sampled from, so the ratio is 1 on-policy.

The loss channels (policy gradient, SDPO, trace-replay DPO) live in `channels.py`. A step whose
loss or gradient norm is not finite is skipped: no optimizer update, so the weights and AdamW's
moments stay those of the last good step; `max_skipped_steps` such steps in a row stop the run
(`NonFiniteTrainingError`). fp32 on CPU;
on a GPU fp32 master weights with bf16 autocast, AdamW's fused kernel, and the decoder layers
compiled (`compile_layers`). The model is called in two parts (`SplitModelCall`):
the decoder's last hidden states, then the output projection on the loss rows only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM

from slime_meta.backends.local.batching import PolicySequence
from slime_meta.backends.local.channels import (
    LossSettings,
    ModelCall,
    policy_gradient_pass,
    reference_logp_sums,
    replay_dpo_pass,
    sdpo_pass,
    sdpo_shaping_sequences,
)
from slime_meta.losses import (
    ThreeChannelInputs,
    context_distillation_advantages,
    total_loss,
)
from slime_meta.errors import NonFiniteTrainingError
from slime_meta.types import PreferencePair, SolverSample, TeacherSample

logger = logging.getLogger(__name__)

def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass(frozen=True)
class DistillSettings:
    """Context distillation of the policy's own solutions (the solver side of channel 1).

    `adv_tau` weights the solver samples' task advantage (a GRPO term on the solver's tokens): 0
    unless asked, so that turning distillation on adds only the distillation signal. `adv_tau`
    alone (both taus 0) is a solver-role GRPO term of its own: it needs no context's log-probs.
    """

    adv_tau: float = 0.0
    teacher_tau: float = 0.0
    student_tau: float = 0.0

    @property
    def on(self) -> bool:
        return self.adv_tau != 0.0 or self.teacher_tau != 0.0 or self.student_tau != 0.0


@dataclass(frozen=True)
class TrainerSettings:
    lr: float
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    micro_batch_size: int = 8
    temperature: float = 1.0  # the teacher's sampling temperature
    device: str = "auto"
    loss: LossSettings = field(default_factory=LossSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)
    # Output projection on the loss rows only (response tokens), from the decoder's hidden states,
    # for model types whose logits are exactly lm_head(hidden) (SPLIT_HEAD_MODEL_TYPES); others,
    # or False, take the full logits. Same function either way, up to float rounding.
    split_head: bool = True
    # torch.compile of each decoder layer (CUDA only; identical layers share one compiled graph).
    # Fuses the elementwise work between the matmuls (RMSNorm, rotary, SiLU, residual adds, the
    # autocast casts). Measured on an H100, Qwen2.5-0.5B shape, 8 x 2,048 tokens: MFU 0.31 -> 0.50,
    # peak memory 38 -> 29 GB, about 8 s of compile in the first step (benchmarks/trainer.py).
    # New sequence lengths recompile once into a dynamic-shape graph. Ignored on CPU. Off unless
    # asked (--compile-layers): the compile is a cost a short or small-model run does not earn back.
    compile_layers: bool = False
    # Steps in a row with a non-finite loss or gradient norm (each skipped) before the run stops.
    max_skipped_steps: int = 3
    # Dynamic batch size: micro-batches packed by padded tokens (rows x longest row) up to this
    # many, `micro_batch_size` then unused; None: `micro_batch_size` sequences each. The loss is
    # the same either way (each micro-batch weighted by its share of the step's tokens).
    max_tokens_per_gpu: int | None = None
    # Activation checkpointing of every decoder layer (slime's --recompute-granularity full): the
    # backward recomputes each layer's forward instead of keeping its activations.
    recompute_layers: bool = False


# Causal LMs whose forward is `lm_head(decoder(...).last_hidden_state)` with nothing in between.
SPLIT_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class SplitModelCall:
    """One HF causal LM called as decoder, then output projection on chosen rows (`ModelCall`).

    Under bf16 autocast on CUDA. When the model cannot be split, `hidden_states` returns the full
    logits and `logits` is the identity, so the channels work unchanged.
    """

    def __init__(self, model: torch.nn.Module, autocast: bool, split_head: bool):
        self.model = model
        self.autocast = autocast
        self.split = split_head and getattr(model.config, "model_type", None) in SPLIT_HEAD_MODEL_TYPES
        self.decoder = getattr(model, model.base_model_prefix) if self.split else None
        self.head = model.get_output_embeddings() if self.split else None

    def _autocast(self):
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.autocast)

    def hidden_states(self, tokens_B_T: torch.Tensor, attention_B_T: torch.Tensor) -> torch.Tensor:
        # No KV cache: training never reads it, building it copies every layer's keys and values,
        # and its per-layer state would make a compiled layer recompile once per layer.
        with self._autocast():
            if self.split:
                return self.decoder(input_ids=tokens_B_T, attention_mask=attention_B_T, use_cache=False).last_hidden_state
            return self.model(input_ids=tokens_B_T, attention_mask=attention_B_T, use_cache=False).logits

    def logits(self, hidden_N_H: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return hidden_N_H
        with self._autocast():
            return self.head(hidden_N_H)


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """`torch.compile` each decoder layer in place; returns how many (0 where none are found)."""
    layers = getattr(getattr(model, model.base_model_prefix, None), "layers", None)
    if layers is None:
        return 0
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


def teacher_sequences(samples: Sequence[TeacherSample], temperature: float) -> list[PolicySequence]:
    return [
        PolicySequence(s.prompt_ids, s.response_ids, s.rollout_logprobs, (s.advantage,) * len(s.response_ids), temperature)
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
            torch.tensor([s.task_advantage]), torch.tensor([teacher_logprobs]), torch.tensor([s.rollout_logprobs]),
            adv_tau=d.adv_tau, teacher_tau=d.teacher_tau, student_tau=d.student_tau,
        )[0]  # fmt: skip
        out.append(PolicySequence(s.prompt_ids, s.response_ids, s.rollout_logprobs, tuple(advantages_T.tolist()), s.temperature))
    return out


class LocalTrainer:
    def __init__(self, model_path: str, settings: TrainerSettings, pad_token_id: int = 0, reference_path: str | None = None):
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.pad_token_id = pad_token_id
        if self.device.type == "cuda":
            # cuDNN attention plans per input shape, and every rollout brings new lengths (the
            # workers measured 60-190 ms per new shape on an H100); the flash/efficient kernels don't.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.train()
        self.reference = None
        # Names the reference weights in caches of values computed under them (replay DPO).
        self.reference_id = str(Path(reference_path).resolve()) if reference_path is not None else None
        if reference_path is not None:  # frozen start weights: KL anchor and DPO reference
            self.reference = AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32).to(self.device)
            self.reference.eval().requires_grad_(False)
        # One kernel for the whole update on CUDA instead of a loop over tensors; the CPU keeps
        # the default implementation (its numbers are what the CPU tests pin down).
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2),
            weight_decay=settings.weight_decay, **fused,
        )  # fmt: skip
        if settings.recompute_layers:
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

    def _forward(self, model) -> ModelCall:
        return SplitModelCall(model, autocast=self.device.type == "cuda", split_head=self.settings.split_head)

    def with_reference_logps(self, pairs: Sequence[PreferencePair]) -> list[PreferencePair]:
        """The pairs with their DPO reference log-probs: summed over each response, under the frozen
        start weights (`reference_path`). Pairs that carry them already are returned as they are."""
        missing = [i for i, p in enumerate(pairs) if p.reference_chosen_logp is None or p.reference_rejected_logp is None]
        out = list(pairs)
        if not missing:
            return out
        if self.reference is None:
            raise ValueError("replay DPO needs reference log-probs: load the start weights as the trainer's reference_path")
        values = reference_logp_sums(
            self._forward(self.reference), [pairs[i] for i in missing], self.settings.micro_batch_size,
            self.pad_token_id, self.device, self.settings.loss.jsd_chunk_size, self.settings.max_tokens_per_gpu,
        )  # fmt: skip
        for i, (chosen, rejected) in zip(missing, values):
            out[i] = dataclasses.replace(pairs[i], reference_chosen_logp=chosen, reference_rejected_logp=rejected)
        return out

    def compute_gradients(
        self,
        teacher_samples: Sequence[TeacherSample],
        solver_samples: Sequence[SolverSample] = (),
        pairs: Sequence[PreferencePair] = (),
    ) -> dict[str, float]:
        """Backpropagate every channel of one step into `.grad` (no optimizer step); the metrics.

        The teacher's infos and the solver's distillation samples are two policy-gradient terms,
        each its own token mean, added with weight 1 (the distillation's weights are its taus):
        turning distillation on leaves the teacher's own gradient as it was.
        """
        s = self.settings
        teacher = teacher_sequences(teacher_samples, s.temperature)
        solver = distillation_sequences(solver_samples, s.distill) if s.distill.on else []
        if not teacher and not solver:
            return {"train/skipped_empty_batch": 1.0}
        policy, reference = self._forward(self.model), self._forward(self.reference) if self.reference else None
        # Every pass's trailing arguments: how its forwards are split into micro-batches.
        batching = (s.micro_batch_size, self.pad_token_id, self.device, s.max_tokens_per_gpu)
        metrics: dict[str, float] = {}
        pg_loss = 0.0
        if teacher:
            pg = policy_gradient_pass(policy, reference, teacher, s.loss, *batching)
            metrics.update({f"train/{k}": v for k, v in pg.items()})
            pg_loss += pg["loss"]
        if solver:
            distill = policy_gradient_pass(policy, reference, solver, s.loss, *batching)
            metrics.update({f"train/distill_{k}": v for k, v in distill.items()})
            metrics["train/distill_tokens"] = float(sum(len(x.response_ids) for x in solver))
            pg_loss += distill["loss"]
        channels = ThreeChannelInputs(grpo=torch.tensor(pg_loss))  # with the shaping form, SDPO's term too
        shaped = sdpo_shaping_sequences(solver_samples, s.loss.sdpo_alpha) if s.loss.sdpo_form == "shaping" else []
        if shaped:  # channel 2 as token advantages: a policy-gradient term of its own, like distillation's
            sdpo = policy_gradient_pass(policy, reference, shaped, s.loss, *batching)
            metrics.update({f"train/sdpo_shaping_{k}": v for k, v in sdpo.items()})
            pg_loss += sdpo["loss"]
        sdpo_samples = [x for x in solver_samples if x.is_error_site and x.hint_prompt_ids and x.response_ids]
        if s.loss.sdpo_alpha and s.loss.sdpo_form == "jsd" and sdpo_samples:
            sdpo = sdpo_pass(policy, sdpo_samples, s.loss, *batching)
            metrics.update({f"train/{k}": v for k, v in sdpo.items()})
            channels.sdpo_jsd = torch.tensor(sdpo["sdpo_jsd"])
        if s.loss.replay_beta and pairs:
            # The reference is the start weights (seed 004), never the weights being trained.
            dpo = replay_dpo_pass(policy, self.with_reference_logps(pairs), s.loss, *batching)
            metrics.update({f"train/{k}": v for k, v in dpo.items()})
            channels.replay_dpo = torch.tensor(dpo["replay_dpo"])
        combined = total_loss(channels, alpha=s.loss.sdpo_alpha, beta=s.loss.replay_beta)
        metrics.update({k: float(v) for k, v in combined.metrics.items()})
        sequences = teacher + solver
        metrics["combined_advantage"] = sum(sum(x.advantages) for x in sequences) / sum(len(x.advantages) for x in sequences)
        metrics.update(
            {
                "train/tokens": float(sum(len(x.prompt_ids) + len(x.response_ids) for x in sequences)),
                "train/num_sequences": float(len(sequences)),
                "train/response_tokens": float(sum(len(x.response_ids) for x in sequences)),
                "train/advantage_abs_mean": sum(abs(x.advantage) for x in teacher_samples) / max(len(teacher_samples), 1),
                "train/replay_pairs": float(len(pairs)),
            }
        )
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
        `NonFiniteTrainingError`. `step` (the outer step) only names the step in that message.
        """
        started = time.perf_counter()
        metrics = self.compute_gradients(teacher_samples, solver_samples, pairs)
        if "train/skipped_empty_batch" in metrics:
            return metrics
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.clip_grad).item()
        loss = metrics["loss/total"]
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.steps_done += 1
            self.skipped_in_a_row = 0
        else:
            self.skipped_nonfinite += 1
            self.skipped_in_a_row += 1
        # Also after a skip: the clip has scaled the gradient by NaN, and none of it may carry over.
        self.optimizer.zero_grad(set_to_none=True)
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
            where = f"step {step}" if step is not None else f"trainer step {self.steps_done + self.skipped_nonfinite - 1}"
            limit = self.settings.max_skipped_steps
            logger.warning(
                "%s: non-finite loss %s or gradient norm %s: optimizer step skipped, weights unchanged (%d in a row, "
                "the run stops at --max-skipped-steps %d)", where, loss, grad_norm, self.skipped_in_a_row, limit,
            )  # fmt: skip
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
        return {"optimizer": self.optimizer.state_dict(), "steps_done": self.steps_done, "skipped_nonfinite": self.skipped_nonfinite}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = int(state["steps_done"])
        self.skipped_nonfinite = int(state.get("skipped_nonfinite", 0))  # checkpoints written before it was kept
