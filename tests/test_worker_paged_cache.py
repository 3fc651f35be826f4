"""The worker's paged KV cache: one pool of pages for every running row (fast_path/paged/*.py).

On CPU (float32, eager) the paged forward must give HF's greedy tokens and its log-probs within
1e-4, as the static forward does, for the tiny Qwen2/Llama models and the real SmolLM2-135M, with
small pages so that rows cross many page boundaries. Then what pages add: rows longer than a
static slot would be, `n = k` samples sharing their prompt's pages (counted), pages returned on
finish, cancel and abort, a pool too small for all requests at once (they wait, all are
answered), and the pool sized from `--mem-fraction-static`. With CUDA: the same through graphs.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_worker_static_decode import full_logprobs, greedy_spec, hf_greedy, random_prompts, submit_all, tiny_model

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.fast_path.memory_budget import MIN_CACHE_LEN, plan_paged_worker_memory
from slime_meta_engine.fast_path.paged.batch import build_paged_batch
from slime_meta_engine.fast_path.paged.cache import PagePool
from slime_meta_engine.protocol import GenerationSpec, SamplingParams
from slime_meta_engine.rows import GenerationJob

HAS_CUDA = torch.cuda.is_available()
PAGE = 4  # small pages: every row crosses many page boundaries


def paged_engine(model, *, pool_tokens: int = 1024, rows: int = 8, graphs: bool = False, page_size: int = PAGE):
    paged = build_paged_batch(
        model, num_rows=rows, pool_tokens=pool_tokens, pad_token_id=0, use_graphs=graphs, page_size=page_size
    )
    engine = GenerationEngine(
        model,
        decode=lambda ids, skip: "".join(f"<{i}>" for i in ids),
        device=model.device,
        eos_token_ids=frozenset(),
        pad_token_id=0,
        max_batch_size=rows,
        static_batch=paged,
    )
    return engine, paged


def assert_pool_empty(paged) -> None:
    assert len(paged) == 0
    assert paged.pool.in_use == 0 and paged.pool.reserved == 0 and paged.pool.available == paged.pool.usable_pages


def check_greedy(model, prompt, length, result) -> None:
    assert result.output_ids == hf_greedy(model, prompt, length)
    expected = full_logprobs(model, prompt + result.output_ids)
    for step, (token, logprob) in enumerate(zip(result.output_ids, result.output_logprobs)):
        assert logprob == pytest.approx(float(expected[len(prompt) - 1 + step, token]), abs=1e-4)


# ----- the page pool alone -------------------------------------------------------------------


def test_pool_reserves_takes_shares_and_returns_pages() -> None:
    pool = PagePool(5)  # page 0 is scratch: 4 usable
    assert pool.usable_pages == 4 and pool.available == 4
    pool.reserve(3)
    assert pool.available == 1
    with pytest.raises(RuntimeError):
        pool.reserve(2)
    first, second = pool.take_reserved(), pool.take_reserved()
    assert 0 not in (first, second) and pool.in_use == 2 and pool.reserved == 1
    pool.share(first)
    pool.release([first, second])
    assert pool.in_use == 1 and pool.refcount(first) == 1  # still held by its sharer
    pool.release([first])
    pool.unreserve(1)
    assert pool.in_use == 0 and pool.available == 4 and pool.peak_in_use == 2


# ----- the generation loop on the paged forward (eager on CPU) ----------------------------------


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_paged_engine_greedy_equals_hf_with_rows_joining_and_leaving(kind: str) -> None:
    model = tiny_model(kind)
    engine, paged = paged_engine(model)
    assert engine.decode_path == "static_eager" and engine.fast_path_info["kv_cache"] == "paged"
    engine.start()
    try:
        prompts = random_prompts([6, 11, 3, 8, 5, 17], seed=2)
        lengths = [20, 4, 12, 1, 9, 30]
        results = submit_all(engine, [greedy_spec(f"g{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths))])
        assert engine.counters["static_requests"] == len(prompts)
        for prompt, length, result in zip(prompts, lengths, results):
            check_greedy(model, prompt, length, result)
        assert_pool_empty(paged)
        # A long row mid-way, then joiners in the pages the first rows freed: same tokens as alone.
        alone = submit_all(engine, [greedy_spec("long", prompts[0], 60)])[0]
        holder: list = []
        thread = threading.Thread(
            target=lambda: holder.extend(submit_all(engine, [greedy_spec("long", prompts[0], 60)]))
        )
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
        assert_pool_empty(paged)
    finally:
        engine.stop()


def test_rows_longer_than_a_static_slot_stay_on_the_paged_path() -> None:
    """A 200-token prompt plus 50 new tokens: a static cache of 128-token slots sends it to the
    DynamicCache path; the paged pool (256 tokens here) serves it with the short rows beside it."""
    model = tiny_model("qwen2")
    engine, paged = paged_engine(model, pool_tokens=320)
    long_prompt, short_prompt = random_prompts([200, 9], seed=5)
    engine.start()
    try:
        results = submit_all(engine, [greedy_spec("long", long_prompt, 50), greedy_spec("short", short_prompt, 20)])
    finally:
        engine.stop()
    assert engine.counters["static_requests"] == 2 and paged.capacity == 256  # the model's 256 positions
    check_greedy(model, long_prompt, 50, results[0])
    check_greedy(model, short_prompt, 20, results[1])
    assert paged.pool.peak_in_use >= (200 + 49) // PAGE
    assert_pool_empty(paged)


def test_n_samples_share_their_prompt_pages_and_decode_as_if_alone() -> None:
    """4 samples of a 13-token prompt with pages of 4: the 3 full prompt pages are held once (4
    references each), the last partial page is copied per sample; each sample's log-probs are
    those of a full forward of its own sequence."""
    model = tiny_model("llama")
    engine, paged = paged_engine(model)
    shared = random_prompts([13], seed=4)[0]
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    specs = [GenerationSpec(f"n{j}", tuple(shared), sampling, True, shared_prefill="group") for j in range(4)]
    with torch.inference_mode():
        rows, logits, prompts_run = paged.prefill([GenerationJob(spec, on_done=lambda outcome: None) for spec in specs])
    assert prompts_run == 1 and len(rows) == 4
    owner_pages = paged._pages_by_slot[0]
    assert paged.pool.in_use == 3 + 4  # three shared full pages, one partial page per sample
    for slot in range(4):
        assert paged._pages_by_slot[slot][:3] == owner_pages[:3]
        assert all(paged.pool.refcount(page) == 4 for page in owner_pages[:3])
    assert len({paged._pages_by_slot[slot][3] for slot in range(4)}) == 4
    # Reserved: 6 pages per sample for 23 tokens, less the 3 shared ones for the three sharers.
    assert paged.pool.reserved + paged.pool.in_use == 6 + 3 * 3
    paged.release(rows)
    assert_pool_empty(paged)

    engine.start()
    try:
        results = submit_all(engine, specs)
    finally:
        engine.stop()
    assert engine.counters["shared_prefill_rows"] == 3 and engine.counters["prefill_prompts"] == 1
    for result in results:
        expected = full_logprobs(model, shared + result.output_ids)
        for step, (token, logprob) in enumerate(zip(result.output_ids, result.output_logprobs)):
            assert logprob == pytest.approx(float(expected[len(shared) - 1 + step, token]), abs=1e-4)
    assert len({tuple(result.output_ids) for result in results}) > 1  # sampled apart, not copies
    assert_pool_empty(paged)


def test_a_pool_too_small_for_every_request_makes_them_wait_and_answers_all() -> None:
    """16 pages of 4 tokens; each request may need 8 (14 + 18 tokens), so at most two run at once."""
    model = tiny_model("qwen2")
    engine, paged = paged_engine(model, pool_tokens=64)
    prompts = random_prompts([14] * 7, seed=6)
    engine.start()
    try:
        results = submit_all(engine, [greedy_spec(f"w{i}", p, 18) for i, p in enumerate(prompts)])
    finally:
        engine.stop()
    assert engine.counters["static_requests"] == len(prompts)  # none sent to the DynamicCache path
    assert engine.counters["prefill_batches"] >= 4  # admitted in turns as pages came back
    assert paged.pool.peak_in_use <= paged.pool.usable_pages == 16
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(model, prompt, 18)
    # A request larger than the whole pool runs on the DynamicCache path instead of waiting forever.
    big = random_prompts([60], seed=7)[0]
    assert not paged.can_serve(greedy_spec("big", big, 10))
    assert_pool_empty(paged)


def test_cancel_and_abort_return_every_page() -> None:
    model = tiny_model("qwen2")
    engine, paged = paged_engine(model)
    engine.start()
    try:
        prompts = random_prompts([10, 7, 12], seed=8)
        outcomes: dict[str, object] = {}
        done = threading.Semaphore(0)
        jobs = [
            GenerationJob(
                greedy_spec(f"c{i}", p, 200), on_done=lambda o, i=i: (outcomes.__setitem__(i, o), done.release())
            )
            for i, p in enumerate(prompts)
        ]
        engine.submit_all(jobs)
        deadline = time.monotonic() + 60
        while engine.counters["static_decode_steps"] < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert paged.pool.in_use > 0
        jobs[0].cancelled = True
        assert done.acquire(timeout=60)
        assert outcomes[0].finish_reason["type"] == "abort"
        engine.abort_all()
        for _ in jobs[1:]:
            assert done.acquire(timeout=60)
        assert all(outcome.finish_reason["type"] == "abort" for outcome in outcomes.values())
        deadline = time.monotonic() + 10
        while paged.pool.in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert_pool_empty(paged)
        # The freed pages serve new requests correctly.
        check_greedy(model, prompts[1], 9, submit_all(engine, [greedy_spec("after", prompts[1], 9)])[0])
    finally:
        engine.stop()


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])],
)
def test_the_synthetic_tasks_model_shape_samples_with_exact_log_probs_under_load(device: str) -> None:
    """The shape of the synthetic tasks' models (head size 24: the gather path, 4 layers, RoPE base
    100, tied head) with 16-token pages: 106 sampled requests of 8-69-token prompts, groups of 1, 2
    and 4 samples sharing their prompt's pages, rows ending at EOS and new ones joining, 8 rows at
    a time. Every sampled token's log-prob is that of a full forward of its own sequence. On CUDA
    (float32) the decode steps replay captured graphs, as the efficacy benchmark's workers do."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from slime_meta.models.tiny.tokenizer import MODEL_SHAPE

    config = LlamaConfig(**MODEL_SHAPE, vocab_size=100, initializer_range=0.2, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device).eval().requires_grad_(False)
    graphs = device == "cuda"
    paged = build_paged_batch(model, num_rows=8, pool_tokens=4096, pad_token_id=0, use_graphs=graphs, page_size=16)
    assert paged._decoder.attention == "gather" and paged._decoder.shape.head_dim == 24
    assert paged.describe()["graphs"] > 0 if graphs else True
    engine = GenerationEngine(
        model,
        decode=lambda ids, skip: "",
        device=model.device,
        eos_token_ids=frozenset({2}),
        pad_token_id=0,
        max_batch_size=8,
        static_batch=paged,
    )
    generator = torch.Generator().manual_seed(0)
    specs = []
    for i in range(48):
        prompt = tuple(
            torch.randint(3, 100, (int(torch.randint(8, 70, (1,), generator=generator)),), generator=generator).tolist()
        )
        samples = (1, 2, 4)[i % 3]
        sampling = SamplingParams(max_new_tokens=5 + (7 * i) % 35, temperature=1.0)
        specs += [
            GenerationSpec(f"r{i}_{j}", prompt, sampling, True, shared_prefill=f"g{i}" if samples > 1 else None)
            for j in range(samples)
        ]
    engine.start()
    try:
        results = submit_all(engine, specs)
    finally:
        engine.stop()
    assert engine.counters["static_requests"] == len(specs) and engine.counters["shared_prefill_rows"] > 0
    assert any(r.output_ids and r.output_ids[-1] == 2 for r in results)  # some rows stopped at EOS
    for spec, result in zip(specs, results):
        expected = full_logprobs(model, list(spec.input_ids) + list(result.output_ids))
        for step, (token, logprob) in enumerate(zip(result.output_ids, result.output_logprobs)):
            assert logprob == pytest.approx(float(expected[len(spec.input_ids) - 1 + step, token]), abs=1e-4)
    assert_pool_empty(paged)


@pytest.mark.parametrize("chunk", [None, 5])
def test_paged_prefill_whole_or_in_windows_equals_hf(chunk) -> None:
    model = tiny_model("llama")
    paged = build_paged_batch(
        model, num_rows=4, pool_tokens=512, pad_token_id=0, use_graphs=False, page_size=8, chunk_tokens=chunk
    )
    prompts = random_prompts([21, 6, 33], seed=9)
    jobs = [GenerationJob(greedy_spec(f"p{i}", p, 4), on_done=lambda outcome: None) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        rows, logits_N_V, _ = paged.prefill(jobs)
        for prompt, logits_V in zip(prompts, logits_N_V):
            reference_V = model(torch.tensor([prompt])).logits[0, -1]
            assert float((reference_V - logits_V).abs().max()) < 1e-4
    paged.release(rows)
    assert_pool_empty(paged)


def test_the_pool_is_sized_from_mem_fraction_static() -> None:
    gb = 10**9
    plan = plan_paged_worker_memory(
        fraction=0.3,
        total_bytes=80 * gb,
        weights_bytes=1 * gb,
        row_token_bytes=12_288,
        max_rows=64,
        max_positions=32768,
        max_prefill_tokens=16384,
    )
    assert plan.pool_tokens == (24 * gb - 1 * gb) // 12_288
    assert plan.kv_bytes == plan.pool_tokens * 12_288 <= 23 * gb
    assert plan.slots == 64 and plan.cache_len == 32768 and plan.max_prefill_tokens == 16384
    assert "pool of" in plan.describe(None)
    small = plan_paged_worker_memory(
        fraction=0.02,
        total_bytes=80 * gb,
        weights_bytes=1 * gb,
        row_token_bytes=122_880,
        max_rows=64,
        max_positions=32768,
        max_prefill_tokens=16384,
    )
    assert small.pool_tokens == (int(0.02 * 80 * gb) - gb) // 122_880 == 4882
    assert small.max_prefill_tokens == small.pool_tokens
    assert small.cache_len == small.pool_tokens  # a row may grow to the whole pool, not past it
    with pytest.raises(ValueError, match="mem-fraction-static"):
        plan_paged_worker_memory(
            fraction=0.01,
            total_bytes=80 * gb,
            weights_bytes=1 * gb,
            row_token_bytes=12_288,
            max_rows=64,
            max_positions=32768,
            max_prefill_tokens=16384,
        )
    # A cap (SGLang's --max-total-tokens) bounds the pool below what the share allows, never below
    # the smallest usable pool, and a cap above the share changes nothing.
    capped = plan_paged_worker_memory(
        fraction=0.3,
        total_bytes=80 * gb,
        weights_bytes=1 * gb,
        row_token_bytes=12_288,
        max_rows=64,
        max_positions=32768,
        max_prefill_tokens=16384,
        max_total_tokens=64 * 4096,
    )
    assert capped.pool_tokens == 64 * 4096 and capped.kv_bytes == 64 * 4096 * 12_288
    assert capped.cache_len == 32768  # one row may still grow to the model's positions within the pool
    tiny_cap = plan_paged_worker_memory(
        fraction=0.3,
        total_bytes=80 * gb,
        weights_bytes=1 * gb,
        row_token_bytes=12_288,
        max_rows=64,
        max_positions=32768,
        max_prefill_tokens=16384,
        max_total_tokens=1,
    )
    assert tiny_cap.pool_tokens == MIN_CACHE_LEN
    loose = plan_paged_worker_memory(
        fraction=0.3,
        total_bytes=80 * gb,
        weights_bytes=1 * gb,
        row_token_bytes=12_288,
        max_rows=64,
        max_positions=32768,
        max_prefill_tokens=16384,
        max_total_tokens=10**9,
    )
    assert loose.pool_tokens == plan.pool_tokens


# ----- the real model --------------------------------------------------------------------------


def test_real_model_paged_engine_matches_hf(real_checkpoint, real_hf_greedy) -> None:
    """SmolLM2-135M (GQA 9 over 3, tied head) on the paged path: greedy tokens of HF `generate`
    (conftest.py's, computed once per session), EOS included, log-probs within 1e-4 of a full forward,
    prompts of different lengths together."""
    from helpers_real import GREEDY_NEW_TOKENS, SHORT_ANSWER_QUESTION
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(real_checkpoint, dtype=torch.float32).eval()
    model.requires_grad_(False)
    paged = build_paged_batch(
        model, num_rows=8, pool_tokens=1024, pad_token_id=tokenizer.pad_token_id, use_graphs=False, page_size=16
    )
    engine = GenerationEngine(
        model,
        decode=lambda ids, skip: tokenizer.decode(list(ids), skip_special_tokens=skip),
        device=torch.device("cpu"),
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
        pad_token_id=tokenizer.pad_token_id,
        max_batch_size=8,
        static_batch=paged,
    )
    assert list(real_hf_greedy)[-1] == SHORT_ANSWER_QUESTION  # the one answer that ends with EOS comes last
    prompts = [prompt for prompt, _ in real_hf_greedy.values()]
    references = [reference for _, reference in real_hf_greedy.values()]
    specs = [
        GenerationSpec(
            f"q{i}", tuple(p), SamplingParams(max_new_tokens=GREEDY_NEW_TOKENS, temperature=0.0), return_logprob=True
        )
        for i, p in enumerate(prompts)
    ]
    engine.start()
    try:
        results = submit_all(engine, specs, timeout_s=300)
    finally:
        engine.stop()
    assert engine.counters["static_requests"] == len(specs)
    for prompt, reference, result in zip(prompts, references, results):
        assert result.output_ids == reference
        expected = full_logprobs(model, prompt + result.output_ids)
        for step, (token, logprob) in enumerate(zip(result.output_ids, result.output_logprobs)):
            assert logprob == pytest.approx(float(expected[len(prompt) - 1 + step, token]), abs=1e-4)
    assert results[-1].finish_reason == {"type": "stop", "matched": tokenizer.eos_token_id}
    assert_pool_empty(paged)


# ----- CUDA: the same through captured graphs ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_cuda_graph_paged_engine_float32_is_exact(kind: str) -> None:
    model = tiny_model(kind, device="cuda")
    engine, paged = paged_engine(model, graphs=True, page_size=16)
    assert engine.decode_path == "cuda_graphs" and paged.describe()["graphs"] > 0
    engine.start()
    try:
        prompts = random_prompts([6, 40, 3, 90, 17], seed=10)
        results = submit_all(engine, [greedy_spec(f"g{i}", p, 30) for i, p in enumerate(prompts)])
        shared = GenerationSpec
        specs = [
            shared(
                f"n{j}",
                tuple(prompts[1]),
                SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True),
                True,
                shared_prefill="k",
            )
            for j in range(3)
        ]
        sampled = submit_all(engine, specs)
    finally:
        engine.stop()
    for prompt, result in zip(prompts, results):
        check_greedy(model, prompt, 30, result)
    for result in sampled:
        expected = full_logprobs(model, prompts[1] + result.output_ids)
        for step, (token, logprob) in enumerate(zip(result.output_ids, result.output_logprobs)):
            assert logprob == pytest.approx(float(expected[len(prompts[1]) - 1 + step, token]), abs=1e-4)
    assert_pool_empty(paged)


def test_kv_cache_flags_are_parsed_and_checked(tiny_checkpoint) -> None:
    from slime_meta_engine.server import parse_args

    base = ["--model-path", str(tiny_checkpoint)]
    args = parse_args(base + ["--kv-cache", "paged", "--page-size", "32"])
    assert (args.kv_cache, args.page_size) == ("paged", 32)
    assert parse_args(base).kv_cache == "paged"  # the default
    assert parse_args(base + ["--kv-cache", "static"]).kv_cache == "static"
    for bad in (["--kv-cache", "ring"], ["--page-size", "12"], ["--page-size", "256"]):
        with pytest.raises(SystemExit) as error:
            parse_args(base + bad)
        assert error.value.code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_worker_sizes_its_page_pool_from_the_budget(tiny_checkpoint, tmp_path) -> None:
    from test_worker_memory_budget import generate, server_info, start_worker

    process, url = start_worker(
        tiny_checkpoint, "cuda", ["--kv-cache", "paged", "--mem-fraction-static", "0.02"], tmp_path / "worker.log"
    )
    try:
        fast_path = server_info(url)["engine"]["fast_path"]
        assert fast_path["kv_cache"] == "paged" and fast_path["graphs"] > 0
        total = torch.cuda.get_device_properties(0).total_memory
        assert fast_path["pages"] * fast_path["page_size"] <= 0.02 * total
        # No --max-total-tokens: at most what the static cache would hold (64 rows x 4,096 tokens).
        assert fast_path["pages"] * fast_path["page_size"] <= 64 * 4096
        results = generate(url, [[5, 6, 7], list(range(10, 50))], 24)
        assert [len(result["output_ids"]) for result in results] == [24, 24]
        info = server_info(url)["engine"]
        assert info["static_requests"] >= 2 and info["fast_path"]["pages_in_use"] == 0
    finally:
        process.terminate()
        process.wait(30)
