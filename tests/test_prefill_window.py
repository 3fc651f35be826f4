"""The admission window (`--prefill-window-ms`): requests that arrive a few milliseconds apart share
one prefill forward, give what one-at-a-time prefills give, and never hold running rows back.

On CPU in float32, on the three places a prompt can run: the DynamicCache batch, the static cache
and the paged cache (their CUDA-free forms).
"""

from __future__ import annotations

import threading
import time

import pytest
from test_worker_static_decode import (
    greedy_spec,
    no_cudnn_attention,  # noqa: F401 - autouse fixture, as in the worker
    random_prompts,
    submit_all,
    tiny_model,
)

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.fast_path.paged.batch import build_paged_batch
from slime_meta_engine.fast_path.static.batch import build_static_batch
from slime_meta_engine.protocol import GenerationSpec
from slime_meta_engine.rows import GenerationJob
from slime_meta_engine.server import parse_args

PROMPT_LENGTHS = [23, 7, 41, 15]
PATHS = ["dynamic", "static", "paged"]


def make_engine(model, path: str, window_s: float, max_batch_size: int = 8) -> GenerationEngine:
    fast = None
    if path == "static":
        fast = build_static_batch(
            model, num_slots=max_batch_size, requested_capacity=256, pad_token_id=0, use_graphs=False
        )
    elif path == "paged":
        fast = build_paged_batch(
            model, num_rows=max_batch_size, pool_tokens=1024, pad_token_id=0, use_graphs=False, page_size=4
        )
    return GenerationEngine(
        model,
        decode=lambda ids, skip: "".join(f"<{i}>" for i in ids),
        device=model.device,
        eos_token_ids=frozenset(),
        pad_token_id=0,
        max_batch_size=max_batch_size,
        static_batch=fast,
        prefill_window_s=window_s,
    )


def submit_trickling(engine: GenerationEngine, specs: list[GenerationSpec], gap_s: float) -> list:
    """Submit `specs` `gap_s` apart, as independent clients would; returns their results in order."""
    outcomes: dict[str, object] = {}
    done = threading.Semaphore(0)
    for index, spec in enumerate(specs):
        if index:
            time.sleep(gap_s)

        def on_done(outcome, rid=spec.rid) -> None:
            outcomes[rid] = outcome
            done.release()

        engine.submit(GenerationJob(spec, on_done=on_done))
    for _ in specs:
        assert done.acquire(timeout=120)
    return [outcomes[spec.rid] for spec in specs]


def one_at_a_time(model, path: str, specs: list[GenerationSpec]) -> tuple[list, int]:
    """Each request alone (the next one sent once the last is answered): results and prefills run."""
    engine = make_engine(model, path, window_s=0.0)
    engine.start()
    try:
        results = [submit_all(engine, [spec])[0] for spec in specs]
    finally:
        engine.stop()
    return results, engine.counters["prefill_batches"]


@pytest.mark.parametrize("path", PATHS)
def test_requests_arriving_apart_share_one_prefill_with_the_same_results(path: str) -> None:
    model = tiny_model("qwen2")
    specs = [greedy_spec(f"r{i}", prompt, 6) for i, prompt in enumerate(random_prompts(PROMPT_LENGTHS))]
    alone, alone_prefills = one_at_a_time(model, path, specs)
    assert alone_prefills == len(specs)

    engine = make_engine(model, path, window_s=0.5)  # far longer than the gaps, however slow the machine
    engine.start()
    try:
        together = submit_trickling(engine, specs, gap_s=0.004)
    finally:
        engine.stop()
    assert engine.counters["prefill_batches"] == 1
    assert engine.counters["prefill_prompts"] == len(specs)
    for batched, single in zip(together, alone):
        assert batched.output_ids == single.output_ids
        assert batched.output_logprobs == pytest.approx(single.output_logprobs, abs=1e-4)


def test_without_a_window_trickling_requests_prefill_one_by_one() -> None:
    """The case the window is for: arrivals further apart than a loop turn each get a forward."""
    model = tiny_model("qwen2")
    specs = [greedy_spec(f"r{i}", prompt, 2) for i, prompt in enumerate(random_prompts(PROMPT_LENGTHS))]
    engine = make_engine(model, "dynamic", window_s=0.0)
    engine.start()
    try:
        submit_trickling(engine, specs, gap_s=0.1)
    finally:
        engine.stop()
    assert engine.counters["prefill_batches"] == len(specs)


def test_a_full_batch_is_admitted_before_the_window_ends() -> None:
    """Waiting requests that fill every free row have nothing to wait for."""
    model = tiny_model("qwen2")
    specs = [greedy_spec(f"r{i}", prompt, 2) for i, prompt in enumerate(random_prompts(PROMPT_LENGTHS[:2]))]
    engine = make_engine(model, "static", window_s=30.0, max_batch_size=2)
    engine.start()
    try:
        started = time.monotonic()
        submit_all(engine, specs, timeout_s=20)  # fails (timeout) if the 30 s window were waited out
        elapsed_s = time.monotonic() - started
    finally:
        engine.stop()
    assert elapsed_s < 10
    assert engine.counters["prefill_batches"] == 1


@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_running_rows_keep_decoding_while_a_request_waits(path: str) -> None:
    model = tiny_model("qwen2")
    long_prompt, short_prompt = random_prompts([9, 12])
    window_s = 1.0
    engine = make_engine(model, path, window_s=window_s)
    engine.start()
    try:
        results: dict[str, object] = {}
        long_done = threading.Event()
        long_spec = greedy_spec("long", long_prompt, 150)
        engine.submit(GenerationJob(long_spec, on_done=lambda outcome: (results.update(long=outcome), long_done.set())))
        deadline = time.monotonic() + 30
        while engine.counters["decode_steps"] < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        steps_before = engine.counters["decode_steps"]
        short_done = threading.Event()
        short_spec = greedy_spec("short", short_prompt, 2)
        engine.submit(
            GenerationJob(short_spec, on_done=lambda outcome: (results.update(short=outcome), short_done.set()))
        )
        time.sleep(window_s / 2)
        # Half a window later the new request is still waiting, and the long row went on meanwhile.
        assert engine.counters["prefill_batches"] == 1
        assert engine.counters["decode_steps"] > steps_before
        assert short_done.wait(30) and long_done.wait(60)
    finally:
        engine.stop()
    assert engine.counters["prefill_batches"] == 2
    assert len(results["long"].output_ids) == 150


def test_the_window_flag_and_its_environment_default(tiny_checkpoint, monkeypatch) -> None:
    from slime_meta_engine.server import DEFAULT_PREFILL_WINDOW_MS, PREFILL_WINDOW_ENV

    monkeypatch.delenv(PREFILL_WINDOW_ENV, raising=False)
    assert parse_args(["--model-path", str(tiny_checkpoint)]).prefill_window_ms == DEFAULT_PREFILL_WINDOW_MS
    assert parse_args(["--model-path", str(tiny_checkpoint), "--prefill-window-ms", "0"]).prefill_window_ms == 0
    assert parse_args(["--model-path", str(tiny_checkpoint), "--batch-wait-ms", "7"]).prefill_window_ms == 7
    monkeypatch.setenv(PREFILL_WINDOW_ENV, "12.5")
    assert parse_args(["--model-path", str(tiny_checkpoint)]).prefill_window_ms == 12.5
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tiny_checkpoint), "--prefill-window-ms", "-1"])


def test_an_idle_engine_waits_at_most_the_window_for_a_lone_request() -> None:
    model = tiny_model("qwen2")
    (prompt,) = random_prompts([5])
    engine = make_engine(model, "dynamic", window_s=0.3)
    engine.start()
    try:
        submit_all(engine, [greedy_spec("warm", prompt, 1)])  # first forward's one-off costs
        started = time.monotonic()
        submit_all(engine, [greedy_spec("alone", prompt, 1)])
        elapsed_s = time.monotonic() - started
    finally:
        engine.stop()
    assert 0.3 <= elapsed_s < 5.0
    assert engine.counters["idle_s"] >= 0.3  # the window's wait counts as idle time
