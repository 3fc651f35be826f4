"""Supervised pretraining of the tiny model's two roles, and its decoding for evaluation.

Each step trains the student on `STUDENT_BATCH` sequences and, after the first
`STUDENT_ONLY_FRACTION` of the steps, the teacher on `TEACHER_BATCH`; the loss is on the completion
and EOS only. `generate` decodes greedily or by sampling with a KV cache, for the build's checks.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from slime_meta.data.tasks import synthetic
from slime_meta_engine.cache_names import cache_kwargs, cache_of

STUDENT_BATCH, TEACHER_BATCH = 96, 32  # per step, as in the prototype
EMPTY_HINT_FRACTION = synthetic.PretrainingSampler.empty_hint_fraction  # both tasks' samplers use it
# The first quarter of the steps trains the student alone. Measured here: with both roles from
# step 0, the teacher's longer sequences delayed the student's copying (0 to 0.5 exact after 250
# steps on 2 of 3 seeds); after 50 student-only steps the copy mechanism exists, and the teacher,
# which copies the suffix out of `!{expected};`, picks it up within another 50-100 steps.
STUDENT_ONLY_FRACTION = 0.25
LEARNING_RATE = 2e-3
Log = Callable[[str], None]


def encode_batch(tokenizer, pairs: Sequence[tuple[str, str]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids_B_T and labels_B_T: loss on completion + EOS only, right-padded.

    Right padding needs no attention mask: causal attention never lets a real token see the pads.
    """
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    length = max(len(p) + len(c) + 1 for p, c in zip(prompts, completions))
    input_ids_B_T = torch.full((len(pairs), length), tokenizer.pad_token_id, dtype=torch.long)
    labels_B_T = torch.full((len(pairs), length), -100, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        target = completion + [tokenizer.eos_token_id]
        input_ids_B_T[row, : len(prompt) + len(target)] = torch.tensor(prompt + target)
        labels_B_T[row, len(prompt) : len(prompt) + len(target)] = torch.tensor(target)
    return input_ids_B_T.to(device), labels_B_T.to(device)


def pretrain(model, tokenizer, sampler: Any, steps: int, device: str, log: Log) -> float:
    """Supervised pretraining of both roles; returns the last step's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    student_only_steps = int(steps * STUDENT_ONLY_FRACTION)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        batches = [[sampler.student() for _ in range(STUDENT_BATCH)]]
        if step >= student_only_steps:
            batches.append(sampler.teacher_batch(TEACHER_BATCH))
        loss = torch.zeros((), device=device)
        for pairs in batches:  # each role's mean token loss, summed: equal weight per role
            input_ids_B_T, labels_B_T = encode_batch(tokenizer, pairs, device)
            loss = loss + model(input_ids=input_ids_B_T, labels=labels_B_T).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step + 1}/{steps} loss {loss_value:.4f}")
    model.eval()
    return loss_value


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    device: str,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[str]:
    """Greedy (temperature 0) or sampled completions, decoded up to EOS, with a KV cache.

    Prompts are grouped by length so no batch needs padding.
    """
    by_length: dict[int, list[int]] = {}
    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    for index, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(index)
    texts = [""] * len(prompts)
    for indices in by_length.values():
        input_ids_B_T = torch.tensor([encoded[i] for i in indices], device=device)
        out = model(input_ids=input_ids_B_T, use_cache=True)
        new_tokens = []
        for _ in range(max_new_tokens):
            logits_B_V = out.logits[:, -1, :].float()
            if temperature > 0:
                probs_B_V = torch.softmax(logits_B_V / temperature, dim=-1)
                next_B = torch.multinomial(probs_B_V.cpu(), 1, generator=generator).squeeze(1).to(device)
            else:
                next_B = logits_B_V.argmax(dim=-1)
            new_tokens.append(next_B)
            out = model(input_ids=next_B[:, None], use_cache=True, **cache_kwargs(model, cache_of(out)))
        for row, index in enumerate(indices):
            ids = [int(t[row]) for t in new_tokens]
            if tokenizer.eos_token_id in ids:
                ids = ids[: ids.index(tokenizer.eos_token_id)]
            texts[index] = tokenizer.decode(ids, skip_special_tokens=True)
    return texts
