"""A paged prefill that fails returns every page its rows took or reserved.

Pages are taken for a row before its prompt runs; if the forward raises, the rows never start,
so nothing else would give those pages back. Left in use, they shrink the pool for good: a later
request that the empty pool could hold passes `can_serve` but never fits the gate, and the queue,
admitted in order, stalls behind it.
"""

from __future__ import annotations

import pytest
import torch
from test_worker_static_decode import greedy_spec, hf_greedy, random_prompts, submit_all, tiny_model

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.fast_path.paged.batch import build_paged_batch
from slime_meta_engine.protocol import GenerationSpec, SamplingParams
from slime_meta_engine.rows import GenerationJob

PAGE = 4
POOL_TOKENS = 64  # 16 usable pages of 4 tokens


class PrefillFailure(RuntimeError):
    pass


def fail_next_prefills(paged, failures: int = 1) -> list[int]:
    """Make the paged decoder's next `failures` prefill forwards raise; returns the call count."""
    decoder = paged._decoder
    real_prefill = decoder.prefill
    calls = [0]

    def prefill(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= failures:
            raise PrefillFailure("prefill forward failed")
        return real_prefill(*args, **kwargs)

    decoder.prefill = prefill
    return calls


def assert_pool_empty(paged) -> None:
    pool = paged.pool
    assert len(paged) == 0 and paged.free_slots() == paged._decoder.num_rows
    assert pool.in_use == 0 and pool.reserved == 0 and pool.available == pool.usable_pages


def jobs_for(specs: list[GenerationSpec]) -> list[GenerationJob]:
    return [GenerationJob(spec, on_done=lambda outcome: None) for spec in specs]


@pytest.fixture
def model():
    return tiny_model("qwen2")


@pytest.fixture
def paged(model):
    return build_paged_batch(
        model, num_rows=4, pool_tokens=POOL_TOKENS, pad_token_id=0, use_graphs=False, page_size=PAGE
    )


def test_a_failed_prefill_returns_taken_and_reserved_pages(paged) -> None:
    """Two prompts (20 and 9 tokens) and two samples sharing the first: full pages shared, a
    partial page copied, all reserved ahead; the forward raises and the pool is whole again."""
    first, second = random_prompts([20, 9], seed=11)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    specs = [
        GenerationSpec("a0", tuple(first), sampling, True, shared_prefill="a"),
        GenerationSpec("a1", tuple(first), sampling, True, shared_prefill="a"),
        greedy_spec("b", second, 8),
    ]
    assert paged.pool.usable_pages == 16
    calls = fail_next_prefills(paged)
    with torch.inference_mode(), pytest.raises(PrefillFailure):
        paged.prefill(jobs_for(specs))
    assert calls[0] == 1
    assert_pool_empty(paged)
    # The same jobs then run, with every page of the pool to draw from.
    with torch.inference_mode():
        rows, logits_N_V, prompts_run = paged.prefill(jobs_for(specs))
    assert len(rows) == 3 and prompts_run == 2 and logits_N_V.shape[0] == 3
    assert paged.pool.in_use > 0
    paged.release(rows)
    assert_pool_empty(paged)


def test_a_prefill_refused_for_pages_leaves_the_pool_as_it_was(paged) -> None:
    """Jobs that need more pages than the pool has (the gate normally keeps them out): the
    reservation fails part-way and what the first rows reserved is given back."""
    prompts = random_prompts([20, 20, 20], seed=12)
    specs = [greedy_spec(f"r{i}", prompt, 8) for i, prompt in enumerate(prompts)]  # 7 pages each
    with torch.inference_mode(), pytest.raises(RuntimeError, match="reserving"):
        paged.prefill(jobs_for(specs))
    assert_pool_empty(paged)


def test_after_a_failed_prefill_a_request_needing_most_of_the_pool_is_served(model, paged) -> None:
    engine = GenerationEngine(
        model,
        decode=lambda ids, skip: "".join(f"<{i}>" for i in ids),
        device=model.device,
        eos_token_ids=frozenset(),
        pad_token_id=0,
        max_batch_size=4,
        static_batch=paged,
    )
    small_prompt, large_prompt, behind_prompt = random_prompts([20, 40, 6], seed=13)
    fail_next_prefills(paged)
    engine.start()
    try:
        (failed,) = submit_all(engine, [greedy_spec("small", small_prompt, 8)], timeout_s=60)  # 7 pages
        assert isinstance(failed, PrefillFailure)
        assert_pool_empty(paged)
        large = greedy_spec("large", large_prompt, 20)  # 60 tokens: 15 of the 16 pages
        behind = greedy_spec("behind", behind_prompt, 5)  # queued after it
        assert paged.can_serve(large)
        large_result, behind_result = submit_all(engine, [large, behind], timeout_s=60)
    finally:
        engine.stop()
    assert engine.counters["static_requests"] == 2  # both on the paged path
    assert large_result.output_ids == hf_greedy(model, large_prompt, 20)
    assert behind_result.output_ids == hf_greedy(model, behind_prompt, 5)
    assert_pool_empty(paged)
