"""The local trainer: the teacher as an HF causal LM, AdamW, GRPO with PPO clipping.

It trains on exactly the token ids the engine sampled (prompt ids + output ids), with the
behaviour log-probs the engine returned as the PPO "old" log-probs. Re-tokenising the generated
text would drift from what was sampled and break the ratio. Log-probs are taken under
logits / temperature, the distribution the engine sampled from, so the ratio is 1 on-policy.

fp32 on CPU; on a GPU fp32 master weights with bf16 autocast.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM

from slime_meta.losses import policy_loss
from slime_meta.types import TeacherSample


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass(frozen=True)
class TrainerSettings:
    lr: float
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    micro_batch_size: int = 8
    temperature: float = 1.0  # the teacher's sampling temperature
    device: str = "auto"


@dataclass
class MicroBatch:
    tokens_B_T: torch.Tensor
    attention_mask_B_T: torch.Tensor
    loss_mask_B_T: torch.Tensor  # 1 where the target token (position t+1) was sampled by the teacher
    rollout_logp_B_T: torch.Tensor
    advantages_B: torch.Tensor


def make_micro_batches(samples: Sequence[TeacherSample], micro_batch_size: int, pad_id: int) -> list[MicroBatch]:
    """Right-padded micro-batches; positions are the targets' (shifted by one)."""
    # Similar lengths together waste less padding.
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].response_ids))
    batches = []
    for start in range(0, len(order), micro_batch_size):
        chunk = [samples[i] for i in order[start : start + micro_batch_size]]
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in chunk)
        tokens = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), length), dtype=torch.long)
        loss_mask = torch.zeros((len(chunk), length - 1), dtype=torch.float32)
        rollout_logp = torch.zeros((len(chunk), length - 1), dtype=torch.float32)
        for row, sample in enumerate(chunk):
            ids = list(sample.prompt_ids) + list(sample.response_ids)
            tokens[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            first = len(sample.prompt_ids) - 1  # logits at t predict token t+1
            loss_mask[row, first : first + len(sample.response_ids)] = 1.0
            rollout_logp[row, first : first + len(sample.response_ids)] = torch.tensor(sample.rollout_logprobs)
        advantages = torch.tensor([s.advantage for s in chunk], dtype=torch.float32)
        batches.append(MicroBatch(tokens, attention, loss_mask, rollout_logp, advantages))
    return batches


class LocalTrainer:
    def __init__(self, model_path: str, settings: TrainerSettings, pad_token_id: int = 0):
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.pad_token_id = pad_token_id
        if self.device.type == "cuda":
            # cuDNN attention plans per input shape, and every rollout brings new lengths (the
            # workers measured 60-190 ms per new shape on an H100); the flash/efficient kernels don't.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=settings.lr,
            betas=(settings.adam_beta1, settings.adam_beta2),
            weight_decay=settings.weight_decay,
        )
        self.steps_done = 0

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return torch.autocast(device_type="cpu", enabled=False)

    def train_step(self, samples: Sequence[TeacherSample]) -> dict[str, float]:
        """One optimizer step over all samples of a rollout (gradient accumulation over micro-batches)."""
        started = time.perf_counter()
        samples = [s for s in samples if s.response_ids]
        total_tokens = sum(len(s.response_ids) for s in samples)
        if total_tokens == 0:
            return {"train/skipped_empty_batch": 1.0}
        sums = {"loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "entropy": 0.0, "logprob_abs_diff": 0.0}
        for batch in make_micro_batches(samples, self.settings.micro_batch_size, self.pad_token_id):
            batch = MicroBatch(*(t.to(self.device) for t in vars(batch).values()))
            with self._autocast():
                logits_B_T_V = self.model(input_ids=batch.tokens_B_T, attention_mask=batch.attention_mask_B_T).logits
            logits_B_T_V = logits_B_T_V[:, :-1].float() / max(self.settings.temperature, 1e-6)
            log_z_B_T = torch.logsumexp(logits_B_T_V, dim=-1)
            logp_B_T = logits_B_T_V.gather(-1, batch.tokens_B_T[:, 1:, None]).squeeze(-1) - log_z_B_T
            out = policy_loss(
                logp_B_T,
                batch.rollout_logp_B_T,
                batch.advantages_B,
                batch.loss_mask_B_T,
                eps_clip=self.settings.eps_clip,
                eps_clip_high=self.settings.eps_clip_high,
            )
            # policy_loss is a token mean over this micro-batch; weight it to a mean over the step.
            share = batch.loss_mask_B_T.sum().item() / total_tokens
            (out.loss * share).backward()
            with torch.no_grad():
                mask = batch.loss_mask_B_T
                probs = torch.softmax(logits_B_T_V, dim=-1)
                entropy_B_T = log_z_B_T - (probs * logits_B_T_V).sum(-1)
                sums["entropy"] += ((entropy_B_T * mask).sum() / total_tokens).item()
                sums["logprob_abs_diff"] += (((logp_B_T - batch.rollout_logp_B_T).abs() * mask).sum() / total_tokens).item()
            sums["loss"] += out.loss.item() * share
            sums["clipfrac"] += float(out.metrics.get("clipfrac", 0.0)) * share
            sums["approx_kl"] += float(out.metrics.get("approx_kl", 0.0)) * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.clip_grad).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        elapsed = time.perf_counter() - started
        metrics = {f"train/{k}": v for k, v in sums.items()}
        metrics.update(
            {
                "train/grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
                "train/step_time": elapsed,
                "train/tokens_per_s": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples) / elapsed,
                "train/num_sequences": float(len(samples)),
                "train/response_tokens": float(total_tokens),
                "train/advantage_abs_mean": sum(abs(s.advantage) for s in samples) / len(samples),
            }
        )
        return metrics

    def save_weights(self, directory: Path) -> Path:
        """Weights for the inference workers (`/update_weights_from_disk` reads this directory)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, safe_serialization=True)
        return directory

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps_done": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = int(state["steps_done"])
