"""A leaner GRPO/PPO train step: a candidate for `slime_meta/backends/local` (not part of the package).

`benchmarks/trainer.py` measures it beside the real `LocalTrainer` to show what closes the
trainer's gap. Same model, same precision recipe (float32 master weights, bf16 autocast), same
loss (the project's `policy_loss`, PPO clip, token mean over the response tokens), the same ids.
What differs:
- the full-vocabulary logits are never materialised: the last hidden states go through the
  output projection a chunk of positions at a time, each chunk turned into log-probs of the
  target tokens in float32 and recomputed in backward (activation checkpointing of the chunk),
  so memory holds one `[chunk, V]` block instead of `[B, T, V]` in bf16 plus several float32
  copies (LocalTrainer's `logits.float() / temperature`, its logsumexp and its entropy);
- no entropy metric over the full vocabulary every step (it costs a float32 softmax);
- no attention mask when no row is padded, so SDPA takes its causal flash kernel;
- AdamW with `fused=True` on CUDA (one kernel for the whole update instead of per-tensor loops).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from slime_meta.losses import policy_loss


def _chunk_logp(hidden_c: torch.Tensor, weight: torch.Tensor, targets_c: torch.Tensor, inv_temp: float) -> torch.Tensor:
    logits = (hidden_c @ weight.t()).float() * inv_temp
    return logits.gather(-1, targets_c[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class FastPolicyStep:
    def __init__(self, model: torch.nn.Module, lr: float = 1e-6, clip_grad: float = 1.0, chunk: int = 4096,
                 temperature: float = 1.0, eps_clip: float = 0.2):  # fmt: skip
        self.model = model
        self.device = next(model.parameters()).device
        self.chunk, self.clip_grad, self.inv_temp, self.eps_clip = chunk, clip_grad, 1.0 / temperature, eps_clip
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **fused)

    def _autocast(self):
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def loss(self, tokens_B_T: torch.Tensor, attention_B_T: torch.Tensor | None, loss_mask_B_T: torch.Tensor,
             rollout_logp_B_T: torch.Tensor, advantages_B: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """PPO-clip token-mean loss; `*_B_T` per target position (shifted by one, length T - 1)."""
        with self._autocast():
            hidden = self.model.model(input_ids=tokens_B_T, attention_mask=attention_B_T).last_hidden_state
            B, T = tokens_B_T.shape
            h = hidden[:, :-1].reshape(B * (T - 1), -1)
            targets = tokens_B_T[:, 1:].reshape(-1)
            weight = self.model.get_output_embeddings().weight
            pieces = [
                checkpoint(_chunk_logp, h[i : i + self.chunk], weight, targets[i : i + self.chunk], self.inv_temp,
                           use_reentrant=False)
                for i in range(0, h.shape[0], self.chunk)
            ]  # fmt: skip
        logp = torch.cat(pieces).reshape(B, T - 1)
        return policy_loss(logp, rollout_logp_B_T, advantages_B, loss_mask_B_T, eps_clip=self.eps_clip).loss

    def step(self, micro_batches: Sequence[tuple]) -> dict[str, float]:
        """One optimizer step over micro-batches (token-mean weighting across them, as LocalTrainer)."""
        total = sum(float(mb[2].sum()) for mb in micro_batches)
        loss_sum = 0.0
        for tokens, attention, mask, rollout_logp, advantages in micro_batches:
            share = float(mask.sum()) / total
            loss = self.loss(tokens, attention, mask, rollout_logp, advantages)
            (loss * share).backward()
            loss_sum += float(loss.detach()) * share
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum, "grad_norm": grad_norm}
