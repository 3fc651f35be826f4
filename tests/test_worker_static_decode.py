"""The worker's fast decode path: its own Llama/Qwen2 forward over a static, slot-indexed KV cache.

On CPU (float32, no graphs) the forward must give HF's tokens exactly and its logits to rounding,
and the generation loop must keep every feature (joins, stops, aborts, weight swaps, the fallback
to the DynamicCache path) when it runs on it. With CUDA the same checks run through captured graphs,
plus bf16 checks against HF `generate` and a full forward.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.fast_path.decode_graphs import length_buckets, row_buckets, smallest_bucket
from slime_meta_engine.fast_path.model_support import unsupported_reason
from slime_meta_engine.fast_path.static.batch import build_fast_path, build_static_batch
from slime_meta_engine.fast_path.static.cache import fit_capacity
from slime_meta_engine.protocol import GenerationSpec, SamplingParams
from slime_meta_engine.rows import GenerationJob
from slime_meta_engine.weights import copy_into_model

HAS_CUDA = torch.cuda.is_available()


def needs_cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(test))


VOCAB = 300
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(autouse=True)
def no_cudnn_attention():
    """As in the worker: cuDNN's attention plans anew for every KV length, which makes HF decoding slow."""
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(previous)


def tiny_model(kind: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A random tiny Qwen2 (q/k/v biases, tied head) or Llama (llama3 rope, biases, untied head), GQA."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=2,
    )
    if kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True)
    else:
        config = LlamaConfig(
            **common, tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    model.generation_config.eos_token_id = None  # HF generate runs the full length, like ignore_eos
    return model


def random_prompts(lengths, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def full_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1).cpu()


def make_engine(model, *, graphs: bool, eos: frozenset[int] = frozenset(), **options) -> GenerationEngine:
    static = build_static_batch(model, num_slots=8, requested_capacity=256, pad_token_id=0, use_graphs=graphs)
    return GenerationEngine(
        model,
        decode=lambda ids, skip: "".join(f"<{i}>" for i in ids),
        device=model.device,
        eos_token_ids=eos,
        pad_token_id=0,
        max_batch_size=8,
        static_batch=static,
        **options,
    )


def submit_all(engine: GenerationEngine, specs: list[GenerationSpec], timeout_s: float = 120) -> list:
    outcomes: dict[str, object] = {}
    done = threading.Semaphore(0)
    for spec in specs:

        def on_done(outcome, rid=spec.rid) -> None:
            outcomes[rid] = outcome
            done.release()

        engine.submit(GenerationJob(spec, on_done=on_done))
    for _ in specs:
        assert done.acquire(timeout=timeout_s)
    return [outcomes[spec.rid] for spec in specs]


def greedy_spec(rid: str, prompt: list[int], new_tokens: int, **sampling) -> GenerationSpec:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return GenerationSpec(rid, tuple(prompt), params, return_logprob=True)


# ----- the forward alone ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_forward_equals_hf_tokens_and_logits(kind: str) -> None:
    model = tiny_model(kind)
    static = build_static_batch(model, num_slots=4, requested_capacity=256, pad_token_id=0, use_graphs=False)
    decoder, graphs = static._decoder, static._graphs
    prompts = random_prompts([5, 9, 7])
    sequences = [list(p) for p in prompts]
    worst = 0.0
    with torch.inference_mode():
        width = max(map(len, prompts))
        logits = decoder.prefill(
            torch.tensor([p + [0] * (width - len(p)) for p in prompts]),
            torch.tensor([len(p) for p in prompts]),
            torch.tensor([0, 2, 3]),  # any free slots, not necessarily the first
        )
        slots = [0, 2, 3]
        for step in range(12):
            for row, sequence in enumerate(sequences):
                reference = model(torch.tensor([sequence])).logits[0, -1]
                worst = max(worst, float((reference - logits[row]).abs().max()))
                sequence.append(int(logits[row].argmax()))
            tokens = [0] * 4
            positions = [0] * 4
            for slot, sequence in zip(slots, sequences):
                tokens[slot], positions[slot] = sequence[-1], len(sequence) - 1
            logits = graphs.step(tokens, positions)[slots]
    assert worst < 1e-4
    for prompt, sequence in zip(prompts, sequences):
        assert sequence[len(prompt) :] == hf_greedy(model, prompt, 12)


def test_unsupported_models_are_reported_and_fall_back() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    assert "gpt2" in unsupported_reason(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4)))
    dynamic = LlamaForCausalLM(
        LlamaConfig(**small, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    )
    assert "rotary" in unsupported_reason(dynamic)
    sliding = Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert "sliding" in unsupported_reason(sliding)
    assert unsupported_reason(tiny_model("qwen2")) is None and unsupported_reason(tiny_model("llama")) is None
    cpu = torch.device("cpu")
    assert build_fast_path("auto", tiny_model("qwen2"), cpu, 4, 256, 0) is None
    assert build_fast_path("off", tiny_model("qwen2"), cpu, 4, 256, 0) is None
    with pytest.raises(SystemExit):
        build_fast_path("on", tiny_model("qwen2"), cpu, 4, 256, 0)


def test_buckets_and_capacity() -> None:
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 64] and row_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert length_buckets(4096) == [128, 256, 512, 1024, 2048, 4096] and length_buckets(100) == [100]
    assert smallest_bucket([1, 2, 4], 3) == 4
    assert fit_capacity(4096, 256, column_bytes=10, free_bytes=None) == 256
    assert fit_capacity(4096, None, column_bytes=1000, free_bytes=10_000_000) == 2048  # 30% of free memory
    assert fit_capacity(4096, None, column_bytes=10**9, free_bytes=10**9) == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_projections_are_views_of_the_model_weights(kind: str) -> None:
    """q/k/v and gate/up run as one product each; the model's own parameters become views of the
    fused tensors, so an in-place weight update reaches both and the state dict is unchanged."""
    model = tiny_model(kind)
    names_before = list(model.state_dict())
    build_static_batch(model, num_slots=2, requested_capacity=64, pad_token_id=0, use_graphs=False)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv_weight, qkv_bias = attention.__dict__["_fused_qkv"]
    assert attention.q_proj.weight.data_ptr() == qkv_weight.data_ptr()
    assert (qkv_bias is None) == (attention.q_proj.bias is None)
    if qkv_bias is not None:
        assert attention.v_proj.bias.data_ptr() == qkv_bias.data_ptr() + qkv_bias.element_size() * (
            attention.q_proj.bias.numel() + attention.k_proj.bias.numel()
        )
    gate_up_weight, _ = mlp.__dict__["_fused_gate_up"]
    assert list(model.state_dict()) == names_before
    update = {
        name: torch.full_like(t, 0.5) for name, t in model.state_dict().items() if name.endswith("up_proj.weight")
    }
    copy_into_model(model, update)
    assert bool((gate_up_weight[mlp.gate_proj.weight.shape[0] :] == 0.5).all())
    # A second fast path over the same model reuses the fused tensors instead of copying again.
    build_static_batch(model, num_slots=2, requested_capacity=64, pad_token_id=0, use_graphs=False)
    assert attention.__dict__["_fused_qkv"][0] is qkv_weight


# ----- the generation loop on the fast path (eager on CPU) --------------------------------------


@pytest.fixture(scope="module")
def qwen2_engine():
    model = tiny_model("qwen2")
    engine = make_engine(model, graphs=False)
    engine.start()
    yield model, engine
    engine.stop()


def test_engine_greedy_with_rows_joining_and_leaving(qwen2_engine) -> None:
    model, engine = qwen2_engine
    assert engine.decode_path == "static_eager"
    prompts = random_prompts([6, 11, 3, 8, 5], seed=2)
    lengths = [20, 4, 12, 1, 9]
    before = engine.counters["static_requests"]
    results = submit_all(engine, [greedy_spec(f"g{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths))])
    assert engine.counters["static_requests"] - before == len(prompts)
    for prompt, length, result in zip(prompts, lengths, results):
        assert result.output_ids == hf_greedy(model, prompt, length)
        expected = full_logprobs(model, prompt + result.output_ids)
        for step, (token, logprob) in enumerate(zip(result.output_ids, result.output_logprobs)):
            assert logprob == pytest.approx(float(expected[len(prompt) - 1 + step, token]), abs=1e-4)

    # A long row mid-way, then joiners: same tokens as alone.
    long_spec = greedy_spec("long", prompts[0], 120)
    alone = submit_all(engine, [long_spec])[0]
    holder: list = []
    thread = threading.Thread(target=lambda: holder.extend(submit_all(engine, [long_spec])))
    steps = engine.counters["static_decode_steps"]
    thread.start()
    deadline = time.monotonic() + 60
    while engine.counters["static_decode_steps"] < steps + 10 and time.monotonic() < deadline:
        time.sleep(0.001)
    joined = submit_all(engine, [greedy_spec(f"j{i}", p, 7) for i, p in enumerate(prompts[1:])])
    thread.join(60)
    assert holder[0].output_ids == alone.output_ids
    assert holder[0].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
    for prompt, result in zip(prompts[1:], joined):
        assert result.output_ids == hf_greedy(model, prompt, 7)


def test_engine_n_samples_share_one_prefill_into_their_slots(qwen2_engine) -> None:
    """The k samples of one `n = k` request: one prompt prefill, its keys and values copied into the
    other samples' slots; each row then decodes as if it had prefilled its own slot."""
    model, engine = qwen2_engine
    shared, other = random_prompts([5, 12], seed=4)
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    specs = [GenerationSpec(f"n{j}", tuple(shared), sampling, True, shared_prefill="group") for j in range(4)]
    specs.append(GenerationSpec("other", tuple(other), sampling, True))
    before = dict(engine.counters)
    jobs_done: dict[str, object] = {}
    done = threading.Semaphore(0)
    engine.submit_all(
        [GenerationJob(s, on_done=lambda o, rid=s.rid: (jobs_done.__setitem__(rid, o), done.release())) for s in specs]
    )
    for _ in specs:
        assert done.acquire(timeout=120)
    results = [jobs_done[s.rid] for s in specs]
    assert engine.counters["static_requests"] - before["static_requests"] == 5
    assert engine.counters["prefill_prompts"] - before["prefill_prompts"] == 2
    assert engine.counters["shared_prefill_rows"] - before["shared_prefill_rows"] == 3
    for spec, result in zip(specs, results):
        expected = full_logprobs(model, list(spec.input_ids) + result.output_ids)
        got = torch.tensor(result.output_logprobs)
        wanted = expected[len(spec.input_ids) - 1 : -1].gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
        assert torch.allclose(got, wanted, atol=1e-4), spec.rid
    assert len({tuple(r.output_ids) for r in results[:4]}) > 1

    greedy = [greedy_spec(f"gr{j}", shared, 9) for j in range(3)]
    greedy = [GenerationSpec(g.rid, g.input_ids, g.sampling, True, shared_prefill="greedy") for g in greedy]
    for result in submit_all(engine, greedy):
        assert result.output_ids == hf_greedy(model, shared, 9)


@pytest.mark.parametrize("sampling", [dict(temperature=0.7), dict(temperature=1.0, top_p=0.8, top_k=20)])
def test_engine_sampled_logprobs_match_full_forward(qwen2_engine, sampling) -> None:
    model, engine = qwen2_engine
    prompts = random_prompts([4, 9, 6], seed=3)
    specs = [
        GenerationSpec(f"s{i}", tuple(p), SamplingParams(max_new_tokens=16, ignore_eos=True, **sampling), True)
        for i, p in enumerate(prompts)
    ]
    for prompt, result in zip(prompts, submit_all(engine, specs)):
        assert len(result.output_ids) == 16
        expected = full_logprobs(model, prompt + result.output_ids, sampling["temperature"])
        got = torch.tensor(result.output_logprobs)
        wanted = expected[len(prompt) - 1 : -1].gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
        assert torch.allclose(got, wanted, atol=1e-4)


def test_engine_stops_lengths_and_fallbacks(qwen2_engine) -> None:
    model, engine = qwen2_engine
    prompt = random_prompts([7], seed=4)[0]
    free_run = hf_greedy(model, prompt, 12)
    stop_token = free_run[5]
    cut = free_run.index(stop_token)
    stopped = submit_all(engine, [greedy_spec("stop-id", prompt, 12, stop_token_ids=frozenset({stop_token}))])[0]
    assert stopped.output_ids == free_run[: cut + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_token}
    word = f"<{free_run[3]}>"
    by_text = submit_all(engine, [greedy_spec("stop-str", prompt, 12, stop=(word,))])[0]
    assert by_text.finish_reason["type"] == "stop" and by_text.output_ids == free_run[: free_run.index(free_run[3]) + 1]
    assert submit_all(engine, [greedy_spec("len", prompt, 3)])[0].finish_reason == {"type": "length", "length": 3}

    # Scoring calls and requests longer than the static cache take the DynamicCache path.
    before = dict(engine.counters)
    scoring = GenerationSpec("score", tuple(prompt), SamplingParams(max_new_tokens=4, temperature=0.0), True, 0)
    too_long = greedy_spec("long", prompt, 256)  # 7 + 256 > 256 columns
    scored, long_result = submit_all(engine, [scoring, too_long])
    assert engine.counters["static_requests"] == before["static_requests"]
    assert scored.output_ids == free_run[:4] and long_result.output_ids[:12] == free_run
    expected = full_logprobs(model, prompt)
    assert scored.input_logprobs[1:] == pytest.approx(
        [float(expected[i - 1, prompt[i]]) for i in range(1, len(prompt))], abs=1e-4
    )


def test_engine_abort_and_weight_swap_between_batches(qwen2_engine) -> None:
    model, engine = qwen2_engine
    prompt = random_prompts([5], seed=5)[0]
    holder: list = []
    thread = threading.Thread(target=lambda: holder.extend(submit_all(engine, [greedy_spec("abort-me", prompt, 200)])))
    thread.start()
    deadline = time.monotonic() + 60
    while engine.running_rows == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    engine.abort_all("test abort")
    thread.join(60)
    assert holder[0].finish_reason == {"type": "abort", "message": "test abort"}
    assert len(holder[0].output_ids) < 200

    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    torch.manual_seed(7)
    perturbed = {name: tensor + 0.3 * torch.randn_like(tensor) for name, tensor in original.items()}
    before = submit_all(engine, [greedy_spec("before", prompt, 10)])[0].output_ids
    engine.run_between_batches(lambda: copy_into_model(model, perturbed)).result(30)
    try:
        after = submit_all(engine, [greedy_spec("after", prompt, 10)])[0].output_ids
        assert after != before and after == hf_greedy(model, prompt, 10)
    finally:
        engine.run_between_batches(lambda: copy_into_model(model, original)).result(30)
    assert submit_all(engine, [greedy_spec("again", prompt, 10)])[0].output_ids == before


# ----- CUDA graphs ------------------------------------------------------------------------------


def first_divergence_gap(model, prompt: list[int], ours: list[int], reference: list[int]) -> float:
    """0 when equal; else how far our token's logit lies below the reference's at the first
    difference, under the model's own full forward of the shared prefix, in units of that
    position's logit standard deviation (a bf16 near-tie is far below 0.1; a wrong forward is not)."""
    for step, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + reference[:step]], device=model.device)).logits[0, -1].float()
            return float((logits[b] - logits[a]) / logits.std())
    return 0.0


@needs_cuda
def test_graph_replay_equals_eager_decode() -> None:
    model = tiny_model("qwen2", torch.bfloat16, "cuda")
    static = build_static_batch(model, num_slots=8, requested_capacity=256, pad_token_id=0, use_graphs=True)
    graphs = static._graphs
    assert graphs.num_graphs == len(row_buckets(8)) * len(length_buckets(256))
    prompts = random_prompts([9, 4, 13], seed=6)
    with torch.inference_mode():
        width = max(map(len, prompts))
        static._decoder.prefill(
            torch.tensor([p + [0] * (width - len(p)) for p in prompts], device="cuda"),
            torch.tensor([len(p) for p in prompts], device="cuda"),
            torch.tensor([0, 1, 2], device="cuda"),
        )
        tokens, positions = [5, 6, 7], [len(p) for p in prompts]
        replayed = graphs.step(tokens, positions).clone()
        graphs.use_graphs = False
        eager = graphs.step(tokens, positions).clone()
        graphs.use_graphs = True
    assert torch.isfinite(replayed).all()
    torch.testing.assert_close(replayed.float(), eager.float(), atol=2e-2, rtol=0)


@needs_cuda
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_cuda_graph_engine_float32_is_exact_and_follows_weight_updates(kind: str) -> None:
    model = tiny_model(kind, torch.float32, "cuda")
    engine = make_engine(model, graphs=True)
    assert engine.decode_path == "cuda_graphs"
    engine.start()
    try:
        prompts = random_prompts([6, 11, 3, 8], seed=8)
        lengths = [30, 4, 12, 9]
        results = submit_all(engine, [greedy_spec(f"g{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths))])
        for prompt, length, result in zip(prompts, lengths, results):
            assert result.output_ids == hf_greedy(model, prompt, length)
            expected = full_logprobs(model, prompt + result.output_ids)
            wanted = expected[len(prompt) - 1 : -1].gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(result.output_logprobs), wanted, atol=1e-4)
        original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        torch.manual_seed(9)
        perturbed = {name: tensor + 0.3 * torch.randn_like(tensor) for name, tensor in original.items()}
        engine.run_between_batches(lambda: copy_into_model(model, perturbed)).result(30)
        after = submit_all(engine, [greedy_spec("after", prompts[0], 30)])[0].output_ids
        assert after != results[0].output_ids and after == hf_greedy(model, prompts[0], 30)
        assert engine.counters["static_requests"] == 5
    finally:
        engine.stop()


@needs_cuda
def test_cuda_graph_engine_bf16_against_hf_generate_and_full_forward() -> None:
    model = tiny_model("qwen2", torch.bfloat16, "cuda")
    engine = make_engine(model, graphs=True)
    engine.start()
    try:
        prompts = random_prompts([12, 30, 7, 21, 16, 9], seed=10)
        greedy = submit_all(engine, [greedy_spec(f"g{i}", p, 24) for i, p in enumerate(prompts)])
        gaps = [first_divergence_gap(model, p, r.output_ids, hf_greedy(model, p, 24)) for p, r in zip(prompts, greedy)]
        assert max(gaps) < 0.1, gaps
        sampled = submit_all(
            engine,
            [
                GenerationSpec(f"s{i}", tuple(p), SamplingParams(max_new_tokens=24, ignore_eos=True), True)
                for i, p in enumerate(prompts)
            ],
        )
        diffs = []
        for prompt, result in zip(prompts, sampled):
            expected = full_logprobs(model, prompt + result.output_ids)
            wanted = expected[len(prompt) - 1 : -1].gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
            diffs.append((torch.tensor(result.output_logprobs) - wanted).abs())
        diffs = torch.cat(diffs)
        assert float(diffs.mean()) < 1e-2 and float(diffs.max()) < 0.1, (float(diffs.mean()), float(diffs.max()))
    finally:
        engine.stop()
