"""Prefill graphs (fast_path/prefill_graphs.py): prompts run at a (rows, length) bucket's shapes, padding rows
and columns included, give what the plain prefill gives, and write nothing a running row reads.

On CPU the buckets run eagerly (`use_graphs=False` with `prefill_graph_tokens`), which checks the
padding and where each row's keys go; with CUDA the same through captured graphs.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_worker_static_decode import (
    full_logprobs,
    greedy_spec,
    hf_greedy,
    needs_cuda,
    no_cudnn_attention,  # noqa: F401 - autouse fixture, as in the worker
    random_prompts,
    submit_all,
    tiny_model,
)

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.fast_path.paged.batch import build_paged_batch
from slime_meta_engine.fast_path.prefill_graphs import prefill_buckets, prefill_graph_tokens_for
from slime_meta_engine.fast_path.static.batch import build_static_batch
from slime_meta_engine.protocol import GenerationSpec, SamplingParams
from slime_meta_engine.rows import GenerationJob
from slime_meta_engine.server import parse_args

SLOTS = 4


def fast_batch(model, kv_cache: str, *, graphs: bool, prefill_graph_tokens: int | None, slots: int = SLOTS):
    if kv_cache == "static":
        return build_static_batch(
            model,
            num_slots=slots,
            requested_capacity=256,
            pad_token_id=0,
            use_graphs=graphs,
            prefill_graph_tokens=prefill_graph_tokens,
        )
    return build_paged_batch(
        model,
        num_rows=slots,
        pool_tokens=1024,
        pad_token_id=0,
        use_graphs=graphs,
        page_size=16 if graphs else 4,
        prefill_graph_tokens=prefill_graph_tokens,
    )


def engine_on(model, batch, slots: int = SLOTS) -> GenerationEngine:
    return GenerationEngine(
        model,
        decode=lambda ids, skip: "".join(f"<{i}>" for i in ids),
        device=model.device,
        eos_token_ids=frozenset(),
        pad_token_id=0,
        max_batch_size=slots,
        static_batch=batch,
        prefill_window_s=0.0,
    )


def test_buckets_double_within_the_token_cap_and_the_capacity() -> None:
    buckets = prefill_buckets(max_rows=8, capacity=1000, max_tokens=1024)
    assert (1, 1000) in buckets and (1, 512) in buckets and (2, 512) in buckets and (8, 128) in buckets
    assert (2, 1000) not in buckets and (16, 64) not in buckets and (8, 256) not in buckets
    assert all(rows * length <= 1024 and length <= 1000 for rows, length in buckets)
    sizes = [rows * length for rows, length in buckets]
    assert sizes == sorted(sizes, reverse=True)  # captured largest first
    assert prefill_buckets(max_rows=3, capacity=40, max_tokens=4096) == [(3, 40), (2, 40), (1, 40)]
    assert prefill_graph_tokens_for(False, None, None) == 0  # CPU: prompts run as before
    assert prefill_graph_tokens_for(True, None, 512) == 512  # never past a chunked prefill's window
    assert prefill_graph_tokens_for(True, 0, None) == 0


def submit_together(engine: GenerationEngine, specs: list[GenerationSpec]) -> list:
    """Queue `specs` at once (one admission, one prefill) and wait for their results."""
    outcomes: dict[str, object] = {}
    done = threading.Semaphore(0)

    def job(spec: GenerationSpec) -> GenerationJob:
        return GenerationJob(spec, on_done=lambda outcome: (outcomes.__setitem__(spec.rid, outcome), done.release()))

    engine.submit_all([job(spec) for spec in specs])
    for _ in specs:
        assert done.acquire(timeout=120)
    return [outcomes[spec.rid] for spec in specs]


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_bucketed_prefill_equals_the_plain_one_with_rows_joining(kv_cache: str) -> None:
    """Prompts together (a padding row and padding columns), alone and joining a running row, and
    a shared `n` prompt: the same greedy tokens and log-probs as without buckets."""
    model = tiny_model("qwen2")
    prompts = random_prompts([6, 70, 3, 20, 150], seed=4)
    outcomes = {}
    for bucketed in (False, True):
        batch = fast_batch(model, kv_cache, graphs=False, prefill_graph_tokens=512 if bucketed else None)
        engine = engine_on(model, batch)
        engine.start()
        try:
            together = submit_together(engine, [greedy_spec(f"a{i}", p, 8) for i, p in enumerate(prompts[:3])])
            long_row: list = []
            thread = threading.Thread(
                target=lambda: long_row.extend(submit_all(engine, [greedy_spec("L", prompts[1], 60)]))
            )
            steps = engine.counters["static_decode_steps"]
            thread.start()
            deadline = time.monotonic() + 60
            while engine.counters["static_decode_steps"] < steps + 5 and time.monotonic() < deadline:
                time.sleep(0.001)
            joined = [submit_all(engine, [greedy_spec(f"j{i}", p, 6)])[0] for i, p in enumerate(prompts[2:])]
            sampling = SamplingParams(max_new_tokens=5, temperature=0.0)
            shared = [GenerationSpec(f"n{j}", tuple(prompts[3]), sampling, True, shared_prefill="k") for j in range(2)]
            samples = submit_together(engine, shared)
            thread.join(60)
        finally:
            engine.stop()
        runs = batch.describe()["prefill_graph_runs"] if bucketed else 0
        outcomes[bucketed] = (together + long_row + joined + samples, runs)
    (plain, _), (bucketed, runs) = outcomes[False], outcomes[True]
    assert runs == 6  # the three together, the long row, three joiners, the shared prompt once
    for a, b in zip(bucketed, plain):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)
    for prompt, result in zip(prompts[:3], bucketed[:3]):
        assert result.output_ids == hf_greedy(model, prompt, 8)


def prefill_jobs(batch, prompts: list[list[int]]) -> torch.Tensor:
    jobs = [GenerationJob(greedy_spec(f"p{i}", p, 4), on_done=lambda outcome: None) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        _, logits_N_V, _ = batch.prefill(jobs)
    return logits_N_V.clone()


def test_static_padding_rows_use_a_free_slot_outside_the_prefill_or_run_eagerly() -> None:
    """Rows 1, 2, 4, 6: three prompts need a padding row; the first three take slots 0-2 and pad
    into slot 5, the next three fill slots 3-5, leaving no slot to pad into (eager). The logits
    and the first rows' keys are those of the plain prefill."""
    model = tiny_model("qwen2")
    bucketed = fast_batch(model, "static", graphs=False, prefill_graph_tokens=512, slots=6)
    plain = fast_batch(model, "static", graphs=False, prefill_graph_tokens=None, slots=6)
    assert bucketed._padding_where([0, 1, 2]) == 5
    first, second = random_prompts([5, 30, 11], seed=7), random_prompts([9, 2, 17], seed=8)
    for prompts in (first, second):
        torch.testing.assert_close(prefill_jobs(bucketed, prompts), prefill_jobs(plain, prompts), atol=1e-5, rtol=0)
    assert bucketed._padding_where([]) is None
    assert bucketed.describe()["prefill_graph_runs"] == 1
    for slot, prompt in enumerate(first + second):
        for cache_of in (
            lambda batch: batch._decoder.cache.keys_L_S_K_T_D,
            lambda b: b._decoder.cache.values_L_S_K_T_D,
        ):
            kept, expected = cache_of(bucketed)[:, slot, :, : len(prompt)], cache_of(plain)[:, slot, :, : len(prompt)]
            torch.testing.assert_close(kept, expected, atol=1e-5, rtol=0)


def test_the_prefill_graph_flag(tiny_checkpoint, monkeypatch) -> None:
    from slime_meta_engine.server import PREFILL_GRAPH_TOKENS_ENV

    monkeypatch.delenv(PREFILL_GRAPH_TOKENS_ENV, raising=False)
    assert parse_args(["--model-path", str(tiny_checkpoint)]).prefill_graph_tokens is None
    assert parse_args(["--model-path", str(tiny_checkpoint), "--prefill-graph-tokens", "0"]).prefill_graph_tokens == 0
    monkeypatch.setenv(PREFILL_GRAPH_TOKENS_ENV, "2048")
    assert parse_args(["--model-path", str(tiny_checkpoint)]).prefill_graph_tokens == 2048
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tiny_checkpoint), "--prefill-graph-tokens", "-5"])


# ----- CUDA: through captured graphs --------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_cuda_prefill_graphs_float32_match_hf(kv_cache: str) -> None:
    model = tiny_model("qwen2", torch.float32, "cuda")
    batch = fast_batch(model, kv_cache, graphs=True, prefill_graph_tokens=None, slots=8)
    info = batch.describe()
    assert info["prefill_graphs"] > 0
    engine = engine_on(model, batch, slots=8)
    engine.start()
    try:
        prompts = random_prompts([6, 70, 3, 33], seed=5)
        results = submit_together(engine, [greedy_spec(f"g{i}", p, 20) for i, p in enumerate(prompts)])
        alone = [submit_all(engine, [greedy_spec(f"s{i}", p, 20)])[0] for i, p in enumerate(prompts)]
    finally:
        engine.stop()
    assert batch.describe()["prefill_graph_runs"] == 1 + len(prompts)
    for prompt, result, single in zip(prompts, results, alone):
        assert result.output_ids == hf_greedy(model, prompt, 20) == single.output_ids
        expected = full_logprobs(model, prompt + result.output_ids)
        wanted = expected[len(prompt) - 1 : -1].gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(result.output_logprobs), wanted, atol=1e-4)


@needs_cuda
def test_cuda_prefill_graph_replay_equals_the_eager_bucket_in_bf16() -> None:
    model = tiny_model("qwen2", torch.bfloat16, "cuda")
    batch = fast_batch(model, "static", graphs=True, prefill_graph_tokens=None, slots=8)
    graphs = batch._prefill_graphs
    prompts = random_prompts([9, 40, 13], seed=6)
    with torch.inference_mode():
        replayed = graphs.run(prompts, [0, 1, 2], padding_where=7).clone()
        graphs.use_graphs = False
        eager = graphs.run(prompts, [0, 1, 2], padding_where=7).clone()
        graphs.use_graphs = True
    assert torch.isfinite(replayed).all()
    torch.testing.assert_close(replayed.float(), eager.float(), atol=2e-2, rtol=0)
