"""The worker's memory budget on CUDA: `--mem-fraction-static F` (SGLang's flag and meaning).

F x the GPU's total memory is what the worker may hold for its model weights plus its static KV
cache. What the weights leave of it sizes, once at start-up:
- the static KV cache: `slots` rows (the most requests running at once; more wait in the queue)
  of `cache_len` tokens each (prompt plus new tokens of one row). The cache length asked for
  (--static-cache-len, capped by the model's positions) is kept and the slots shrink to fit (at
  most --max-batch-size); when not even one slot of that length fits, the length is halved until
  one does (down to `MIN_CACHE_LEN`, below which the budget is refused).
- the prefill token budget: at most the tokens the slots hold (SGLang caps its prefill budget by
  its KV pool the same way), so one admission never prefills more than the cache can keep.
The rest of the GPU (1 - F of it, less what others use) is for activations: prefill activations
scale with the tokens of one prefill forward, which --chunked-prefill-size bounds.

Requests the slots cannot serve (longer than `cache_len`, prompt scoring) run on the DynamicCache
path as before; they count against the same running-request cap, but their keys and values live
outside the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1e9
MIN_CACHE_LEN = 128


@dataclass(frozen=True)
class WorkerMemoryPlan:
    fraction: float
    total_bytes: int
    weights_bytes: int
    kv_bytes: int  # the static KV cache: slots x cache_len x row_token_bytes
    slots: int
    cache_len: int
    max_prefill_tokens: int
    pool_tokens: int | None = None  # paged cache: tokens of the one page pool; None: static slots

    def describe(self, chunked_prefill_size: int | None) -> str:
        chunked = f"{chunked_prefill_size} tokens" if chunked_prefill_size else "off"
        if self.pool_tokens is not None:
            layout = f"a pool of {self.pool_tokens} tokens in pages, rows up to {self.cache_len} tokens"
        else:
            layout = f"{self.slots} slots x {self.cache_len} tokens"
        return (
            f"memory budget: --mem-fraction-static {self.fraction:g} of {self.total_bytes / GB:.1f} GB = "
            f"{self.fraction * self.total_bytes / GB:.2f} GB: weights {self.weights_bytes / GB:.2f} GB, "
            f"KV cache {self.kv_bytes / GB:.2f} GB ({layout}), "
            f"max running requests {self.slots}, max prefill tokens {self.max_prefill_tokens}, "
            f"chunked prefill {chunked}"
        )


def plan_worker_memory(
    *,
    fraction: float,
    total_bytes: int,
    weights_bytes: int,
    row_token_bytes: int,
    max_rows: int,
    cache_len: int,
    max_positions: int | None,
    max_prefill_tokens: int,
) -> WorkerMemoryPlan:
    """Slots, cache length and prefill budget that fit `fraction` of `total_bytes` after the weights.

    `row_token_bytes`: keys and values of one token in one row, all layers. Raises ValueError with
    the numbers when not even one slot of `MIN_CACHE_LEN` tokens fits.
    """
    kv_budget = int(fraction * total_bytes) - weights_bytes
    length = min(cache_len, max_positions) if max_positions else cache_len
    slots = min(max_rows, max(kv_budget, 0) // (length * row_token_bytes))
    while slots < 1 and length // 2 >= MIN_CACHE_LEN:
        length //= 2
        slots = min(max_rows, max(kv_budget, 0) // (length * row_token_bytes))
    if slots < 1:
        need = (weights_bytes + MIN_CACHE_LEN * row_token_bytes) / total_bytes
        raise ValueError(
            f"--mem-fraction-static {fraction:g} gives {fraction * total_bytes / GB:.2f} GB of "
            f"{total_bytes / GB:.1f} GB, but the weights take {weights_bytes / GB:.2f} GB and one "
            f"{MIN_CACHE_LEN}-token cache row {MIN_CACHE_LEN * row_token_bytes / GB:.3f} GB: give at least {need:.3f}"
        )
    return WorkerMemoryPlan(
        fraction=fraction,
        total_bytes=total_bytes,
        weights_bytes=weights_bytes,
        kv_bytes=slots * length * row_token_bytes,
        slots=slots,
        cache_len=length,
        max_prefill_tokens=min(max_prefill_tokens, slots * length),
    )


def plan_paged_worker_memory(
    *,
    fraction: float,
    total_bytes: int,
    weights_bytes: int,
    row_token_bytes: int,
    max_rows: int,
    max_positions: int | None,
    max_prefill_tokens: int,
    max_total_tokens: int | None = None,
) -> WorkerMemoryPlan:
    """The paged cache's plan: what the weights leave of `fraction` is one pool of tokens (SGLang's
    and vLLM's sizing), at most `max_total_tokens` (SGLang's --max-total-tokens; None: no cap),
    shared by up to `max_rows` running rows; one row may grow to the model's positions or the whole
    pool. Raises ValueError when the pool holds under `MIN_CACHE_LEN`."""
    kv_budget = int(fraction * total_bytes) - weights_bytes
    pool_tokens = max(kv_budget, 0) // row_token_bytes
    if max_total_tokens is not None and pool_tokens >= MIN_CACHE_LEN:
        pool_tokens = max(min(pool_tokens, max_total_tokens), MIN_CACHE_LEN)
    if pool_tokens < MIN_CACHE_LEN:
        need = (weights_bytes + MIN_CACHE_LEN * row_token_bytes) / total_bytes
        raise ValueError(
            f"--mem-fraction-static {fraction:g} gives {fraction * total_bytes / GB:.2f} GB of "
            f"{total_bytes / GB:.1f} GB, but the weights take {weights_bytes / GB:.2f} GB and a pool of "
            f"{MIN_CACHE_LEN} tokens {MIN_CACHE_LEN * row_token_bytes / GB:.3f} GB: give at least {need:.3f}"
        )
    return WorkerMemoryPlan(
        fraction=fraction,
        total_bytes=total_bytes,
        weights_bytes=weights_bytes,
        kv_bytes=pool_tokens * row_token_bytes,
        slots=max_rows,
        cache_len=min(pool_tokens, max_positions) if max_positions else pool_tokens,
        max_prefill_tokens=min(max_prefill_tokens, pool_tokens),
        pool_tokens=pool_tokens,
    )


def row_token_bytes(model: torch.nn.Module) -> int:
    """Keys and values of one token of one row over all layers, from the model's config."""
    config = model.config.get_text_config()
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * num_kv_heads * head_dim * element


def model_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, each storage once (tied embeddings share theirs)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def plan_for_device(
    fraction: float | None,
    model: torch.nn.Module,
    device: torch.device,
    *,
    max_rows: int,
    cache_len: int,
    max_positions: int | None,
    max_prefill_tokens: int,
    kv_cache: str = "static",
    max_total_tokens: int | None = None,
) -> WorkerMemoryPlan | None:
    """The worker's plan for `--mem-fraction-static`; None without the flag or off CUDA (ignored there).

    `kv_cache` "paged" plans one page pool instead of slots, of at most `max_total_tokens` tokens
    (None: the static cache's `max_rows` x `cache_len`, so a share given for the whole GPU is not
    all reserved for pages that rows of that length never fill). A fraction too small for the
    weights ends the worker with one line naming the flag.
    """
    if fraction is None or device.type != "cuda":
        return None
    sizes = dict(
        fraction=fraction,
        total_bytes=torch.cuda.get_device_properties(device).total_memory,
        weights_bytes=model_bytes(model),
        row_token_bytes=row_token_bytes(model),
        max_rows=max_rows,
        max_positions=max_positions,
        max_prefill_tokens=max_prefill_tokens,
    )
    try:
        if kv_cache == "paged":
            cap = max_total_tokens if max_total_tokens is not None else max_rows * cache_len
            return plan_paged_worker_memory(max_total_tokens=cap, **sizes)
        return plan_worker_memory(cache_len=cache_len, **sizes)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
