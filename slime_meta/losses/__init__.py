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
