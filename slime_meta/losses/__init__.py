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

# The names slime_meta.backends imports from the package; everything else is imported from the
# module that defines it (advantages, combine, distill, linear_head, policy, preference,
# token_stats, topk_distill, fused).
from slime_meta.losses.advantages import context_distillation_advantages
from slime_meta.losses.combine import ThreeChannelInputs, total_loss
from slime_meta.losses.distill import generalized_jsd
from slime_meta.losses.linear_head import linear_token_logps
from slime_meta.losses.policy import kl_penalty, policy_loss
from slime_meta.losses.preference import dpo_loss
from slime_meta.losses.token_stats import entropy_from_logits, sequence_logps, token_logps
from slime_meta.losses.topk_distill import ProcessGroupShards, teacher_topk, topk_generalized_jsd

__all__ = [
    "ProcessGroupShards",
    "ThreeChannelInputs",
    "context_distillation_advantages",
    "dpo_loss",
    "entropy_from_logits",
    "generalized_jsd",
    "kl_penalty",
    "linear_token_logps",
    "policy_loss",
    "sequence_logps",
    "teacher_topk",
    "token_logps",
    "topk_generalized_jsd",
    "total_loss",
]
