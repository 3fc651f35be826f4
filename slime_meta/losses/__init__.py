"""Pure-torch loss functions over per-token tensors.

Used by the local torch trainer and by slime's Megatron trainer through its custom-loss hook.
Conventions shared by every function:

* Losses are minimised. A positive advantage raises the probability of its tokens.
* Shape suffixes: `_B_T` per token (batch, time), `_B_T_V` per vocabulary entry, `_N` flat.
* Masks are non-zero (or True) on tokens that count (response tokens); values at masked-out
  positions are ignored. A reduction over an empty mask gives 0, not NaN.
* Computation is float32 (float64 stays float64) whatever the input dtype; bf16 logits are
  upcast chunk by chunk when `chunk_size` is given. On CUDA the vocabulary-wide functions run
  fused Triton kernels when Triton imports (`fused.py`; `backend=` chooses), else this code.
* Reference, old-policy, rollout and teacher quantities are detached; metrics are detached
  scalar tensors (no host sync is forced by this module beyond mask indexing).
* Logits at position t score the token at position t: callers do the causal shift.
"""

from .advantages import context_distillation_advantages, grpo_advantages
from .combine import ThreeChannelInputs, TotalLossOutput, total_loss
from .distill import JSDOutput, generalized_jsd, token_logps_and_jsd
from .linear_head import linear_token_logps
from .policy import KLPenaltyOutput, PolicyLossOutput, kl_penalty, policy_loss
from .preference import DPOOutput, dpo_loss
from .token_stats import (
    EntropyOutput,
    SequenceLogpsOutput,
    TokenLogpsOutput,
    entropy_from_logits,
    sequence_logps,
    token_logps,
)
from .topk_distill import ProcessGroupShards, VocabShards, teacher_topk, topk_generalized_jsd

__all__ = [
    "DPOOutput",
    "EntropyOutput",
    "JSDOutput",
    "KLPenaltyOutput",
    "PolicyLossOutput",
    "ProcessGroupShards",
    "SequenceLogpsOutput",
    "ThreeChannelInputs",
    "TokenLogpsOutput",
    "TotalLossOutput",
    "VocabShards",
    "context_distillation_advantages",
    "dpo_loss",
    "entropy_from_logits",
    "generalized_jsd",
    "grpo_advantages",
    "kl_penalty",
    "linear_token_logps",
    "policy_loss",
    "sequence_logps",
    "token_logps",
    "teacher_topk",
    "token_logps_and_jsd",
    "topk_generalized_jsd",
    "total_loss",
]
