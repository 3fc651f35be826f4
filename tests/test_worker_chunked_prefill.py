"""Chunked prefill (`--chunked-prefill-size N`): prompts run in windows of about N tokens.

A chunked prefill must give what a whole-prompt prefill gives: the same greedy tokens and the same
log-probs (to float rounding), on both decode paths (the static cache and the DynamicCache batch),
for prompt scoring too. On CPU in float32; with CUDA through captured graphs in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from test_worker_static_decode import (
    greedy_spec,
    needs_cuda,
    no_cudnn_attention,  # noqa: F401 - autouse fixture, as in the worker
    random_prompts,
    submit_all,
    tiny_model,
)

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.fast_path.static.batch import build_static_batch
from slime_meta_engine.protocol import GenerationSpec, SamplingParams

# Prompts of very different lengths, so windows cut through some prompts' padding and others' ends.
PROMPT_LENGTHS = [37, 5, 61, 18]


def engine_for(model, *, static: bool, chunk: int | None, graphs: bool = False, **engine_kwargs) -> GenerationEngine:
    static_batch = None
    if static:
        static_batch = build_static_batch(
            model, num_slots=8, requested_capacity=256, pad_token_id=0, use_graphs=graphs, chunk_tokens=chunk
        )
    return GenerationEngine(
        model,
        decode=lambda ids, skip: "".join(f"<{i}>" for i in ids),
        device=model.device,
        eos_token_ids=frozenset(),
        pad_token_id=0,
        max_batch_size=8,
        static_batch=static_batch,
        chunked_prefill_size=chunk,
        prefill_window_s=0.05,  # all prompts in one prefill, the case chunking is for
        **engine_kwargs,
    )


def run_batch(engine: GenerationEngine, specs: list[GenerationSpec]) -> list:
    engine.start()
    try:
        return submit_all(engine, specs)
    finally:
        engine.stop()


def greedy_specs(new_tokens: int = 10) -> list[GenerationSpec]:
    return [greedy_spec(f"r{i}", p, new_tokens) for i, p in enumerate(random_prompts(PROMPT_LENGTHS))]


def assert_same_outputs(chunked: list, whole: list, logprob_tolerance: float) -> None:
    for a, b in zip(chunked, whole):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < logprob_tolerance


@pytest.mark.parametrize("chunk", [1, 16, 50])
def test_static_prefill_in_windows_equals_whole_prompts(chunk: int) -> None:
    """The decoder alone: same last-token logits and the same keys in every real cache column."""
    model = tiny_model("qwen2")
    prompts = random_prompts(PROMPT_LENGTHS)
    width = max(PROMPT_LENGTHS)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lengths = torch.tensor(PROMPT_LENGTHS)
    results = []
    for chunk_tokens in (None, chunk):
        static = build_static_batch(model, num_slots=4, requested_capacity=128, pad_token_id=0, use_graphs=False)
        with torch.inference_mode():
            logits = static._decoder.prefill(ids, lengths, torch.arange(4), chunk_tokens)
        results.append((logits, static._decoder.cache))
    (whole_logits, whole_cache), (chunked_logits, chunked_cache) = results
    assert (chunked_logits - whole_logits).abs().max() < 1e-4
    for row, length in enumerate(PROMPT_LENGTHS):
        for tensor in ("keys_L_S_K_T_D", "values_L_S_K_T_D"):
            whole_row = getattr(whole_cache, tensor)[:, row, :, :length]
            chunked_row = getattr(chunked_cache, tensor)[:, row, :, :length]
            assert (whole_row - chunked_row).abs().max() < 1e-4


@pytest.mark.parametrize("static", [True, False], ids=["static_cache", "dynamic_cache"])
def test_engine_chunked_prefill_gives_the_same_greedy_tokens_and_logprobs(static: bool) -> None:
    model = tiny_model("llama")
    whole = run_batch(engine_for(model, static=static, chunk=None), greedy_specs())
    chunked_engine = engine_for(model, static=static, chunk=12)
    chunked = run_batch(chunked_engine, greedy_specs())
    assert chunked_engine.counters["prefill_batches"] == 1  # one admission, run in windows
    assert_same_outputs(chunked, whole, 1e-4)


def test_chunked_scoring_gives_the_same_prompt_logprobs() -> None:
    """Prompt scoring needs logits at every position: the windows' logits are put together."""
    model = tiny_model("qwen2")

    def scoring_specs() -> list[GenerationSpec]:
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        return [
            GenerationSpec(f"s{i}", tuple(p), params, return_logprob=True, logprob_start_len=0)
            for i, p in enumerate(random_prompts(PROMPT_LENGTHS, seed=5))
        ]

    whole = run_batch(engine_for(model, static=False, chunk=None), scoring_specs())
    chunked = run_batch(engine_for(model, static=False, chunk=8), scoring_specs())
    for a, b in zip(chunked, whole):
        assert len(a.input_logprobs) == len(b.input_logprobs) == len(a.spec.input_ids)
        assert a.input_logprobs[0] is None and b.input_logprobs[0] is None
        assert max(abs(x - y) for x, y in zip(a.input_logprobs[1:], b.input_logprobs[1:])) < 1e-4
    assert_same_outputs(chunked, whole, 1e-4)


@needs_cuda
@pytest.mark.parametrize("static", [True, False], ids=["cuda_graphs", "dynamic_cache"])
def test_cuda_chunked_prefill_gives_the_same_greedy_tokens(static: bool) -> None:
    """bf16 on the GPU: windows change kernel shapes, so log-probs agree to bf16 rounding, and the
    greedy tokens of these random-weight prompts (margins far above it) are the same."""
    model = tiny_model("llama", dtype=torch.bfloat16, device="cuda")
    whole = run_batch(engine_for(model, static=static, chunk=None, graphs=static), greedy_specs(16))
    chunked = run_batch(engine_for(model, static=static, chunk=12, graphs=static), greedy_specs(16))
    assert_same_outputs(chunked, whole, 0.1)
