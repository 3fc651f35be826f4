"""Qwen3 on the engine's fast path: a per-head RMSNorm of queries and keys before the rotation,
no q/k/v bias, and a head_dim of its own (32 here, where hidden / heads would be 16).

On CPU in float32, for the static and the paged cache, with tied and untied heads: greedy tokens
equal HF `generate`'s and every returned log-prob equals HF's log-softmax of a full forward,
with whole and chunked prefill; a weight update of the q/k norms reaches the fast path. With
CUDA, through captured graphs and the fused Triton kernels (where the q/k norm is the RMSNorm
kernel ahead of the rotation kernels): float32 exact to HF's tokens, bf16 within near-ties.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from test_worker_static_decode import (
    first_divergence_gap,
    full_logprobs,
    greedy_spec,
    hf_greedy,
    needs_cuda,
    random_prompts,
    submit_all,
)

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.fast_path.model_support import model_shape, unsupported_reason
from slime_meta_engine.fast_path.paged.batch import build_paged_batch
from slime_meta_engine.fast_path.static.batch import build_static_batch
from slime_meta_engine.weights import copy_into_model, read_checkpoint

VOCAB = 300
HEAD_DIM = 32
LOGPROB_TOLERANCE = 1e-4
PROMPT_LENGTHS = [5, 12, 3, 9]
NEW_TOKENS = [14, 6, 10, 1]


def tiny_qwen3_checkpoint(directory: Path, *, tie: bool, seed: int = 0) -> Path:
    """A random tiny Qwen3 (GQA, head_dim != hidden / heads) written with `save_pretrained`.

    Every norm weight is drawn away from one, so a q/k norm that were skipped or applied with the
    wrong weight would change the tokens.
    """
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=tie,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.5 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    return directory


def load(directory: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The checkpoint as the worker loads it, generating to full length like ignore_eos."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model


def fast_path_engine(model, kv_cache: str, chunk_tokens: int | None = None, graphs: bool = False):
    if kv_cache == "static":
        batch = build_static_batch(
            model, num_slots=4, requested_capacity=256, pad_token_id=0, use_graphs=graphs, chunk_tokens=chunk_tokens
        )
    else:
        batch = build_paged_batch(
            model,
            num_rows=4,
            pool_tokens=512,
            pad_token_id=0,
            use_graphs=graphs,
            page_size=4,
            chunk_tokens=chunk_tokens,
        )
    engine = GenerationEngine(
        model,
        decode=lambda ids, skip: "".join(f"<{i}>" for i in ids),
        device=model.device,
        eos_token_ids=frozenset(),
        pad_token_id=0,
        max_batch_size=4,
        static_batch=batch,
    )
    assert engine.decode_path == ("cuda_graphs" if graphs else "static_eager")
    assert engine.fast_path_info["kv_cache"] == kv_cache
    return engine


@contextlib.contextmanager
def running(engine: GenerationEngine):
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def generate_greedy(engine: GenerationEngine, prompts: list[list[int]], lengths: list[int]) -> list:
    served_before = engine.counters["static_requests"]
    specs = [greedy_spec(f"q{i}", prompt, n) for i, (prompt, n) in enumerate(zip(prompts, lengths))]
    results = submit_all(engine, specs)
    assert engine.counters["static_requests"] - served_before == len(prompts)  # none on the DynamicCache path
    return results


def assert_equals_hf(model, prompts: list[list[int]], lengths: list[int], results: list) -> None:
    for prompt, length, result in zip(prompts, lengths, results):
        assert result.output_ids == hf_greedy(model, prompt, length)
        expected = full_logprobs(model, prompt + result.output_ids).cpu()
        reference = [float(expected[len(prompt) - 1 + step, token]) for step, token in enumerate(result.output_ids)]
        assert result.output_logprobs == pytest.approx(reference, abs=LOGPROB_TOLERANCE)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def qwen3_directory(request, tmp_path_factory) -> Path:
    return tiny_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3"), tie=request.param)


def test_qwen3_is_supported_with_its_own_head_dim(qwen3_directory: Path) -> None:
    model = load(qwen3_directory)
    assert unsupported_reason(model) is None
    shape = model_shape(model)
    assert shape.head_dim == HEAD_DIM != model.config.hidden_size // model.config.num_attention_heads
    assert model.model.layers[0].self_attn.q_proj.bias is None
    # The saved tensors (q_norm and k_norm included) fit the running model as they are.
    assert set(read_checkpoint(qwen3_directory, model)) <= set(model.state_dict())


@pytest.mark.parametrize("chunk_tokens", [None, 8], ids=["whole", "chunked"])
@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_qwen3_fast_path_equals_hf(qwen3_directory: Path, kv_cache: str, chunk_tokens: int | None) -> None:
    model = load(qwen3_directory)
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    with running(fast_path_engine(model, kv_cache, chunk_tokens)) as engine:
        results = generate_greedy(engine, prompts, NEW_TOKENS)
    assert_equals_hf(model, prompts, NEW_TOKENS, results)


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_qwen3_norm_weight_update_reaches_the_fast_path(qwen3_directory: Path, kv_cache: str) -> None:
    """The decoder reads q_norm/k_norm at call time: new weights copied in place change its
    tokens exactly as they change HF's."""
    model = load(qwen3_directory)
    prompts = random_prompts(PROMPT_LENGTHS[:2], seed=4)
    generator = torch.Generator().manual_seed(9)
    update = {
        name: 1.0 + torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
        if name.endswith(("q_norm.weight", "k_norm.weight"))
    }
    assert len(update) == 2 * model.config.num_hidden_layers
    with running(fast_path_engine(model, kv_cache)) as engine:
        before = generate_greedy(engine, prompts, NEW_TOKENS[:2])
        engine.run_between_batches(lambda: copy_into_model(model, update)).result(timeout=60)
        after = generate_greedy(engine, prompts, NEW_TOKENS[:2])
    assert [result.output_logprobs for result in after] != [result.output_logprobs for result in before]
    assert_equals_hf(model, prompts, NEW_TOKENS[:2], after)


@needs_cuda
@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_qwen3_cuda_graphs_with_fused_kernels_float32_equal_hf(qwen3_directory: Path, kv_cache: str) -> None:
    model = load(qwen3_directory, torch.float32, "cuda")
    engine = fast_path_engine(model, kv_cache, graphs=True)
    assert engine._static._decoder.fused_kernels  # the Triton kernels, q/k norm included
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    lengths = [30, 8, 17, 3]
    with running(engine):
        results = generate_greedy(engine, prompts, lengths)
    assert_equals_hf(model, prompts, lengths, results)


@needs_cuda
@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_qwen3_cuda_graphs_bf16_follow_hf_generate(qwen3_directory: Path, kv_cache: str) -> None:
    """bf16 rounds differently in fused and HF kernels: tokens may part only at near-ties."""
    model = load(qwen3_directory, torch.bfloat16, "cuda")
    prompts = random_prompts([12, 30, 7, 21], seed=6)
    with running(fast_path_engine(model, kv_cache, graphs=True)) as engine:
        results = generate_greedy(engine, prompts, [24] * len(prompts))
    gaps = [first_divergence_gap(model, p, r.output_ids, hf_greedy(model, p, 24)) for p, r in zip(prompts, results)]
    assert max(gaps) < 0.1, gaps
