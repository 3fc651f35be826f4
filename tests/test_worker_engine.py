"""The embedded worker's generation loop in-process, without HTTP: EOS handling and joining
requests into a running batch, checked token for token and log-prob for log-prob."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.protocol import FinishedGeneration, GenerationSpec, SamplingParams
from slime_meta_engine.rows import GenerationJob


def make_engine(model, tokenizer, eos_token_ids: frozenset[int], **options) -> GenerationEngine:
    return GenerationEngine(
        model,
        decode=lambda ids, skip: tokenizer.decode(list(ids), skip_special_tokens=skip),
        device=torch.device("cpu"),
        eos_token_ids=eos_token_ids,
        pad_token_id=tokenizer.pad_token_id,
        **options,
    )


def wait_for(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def run_in_engine(engine: GenerationEngine, spec: GenerationSpec) -> FinishedGeneration:
    outcomes: list = []
    finished = threading.Event()
    engine.submit(GenerationJob(spec, on_done=lambda outcome: (outcomes.append(outcome), finished.set())))
    assert finished.wait(60)
    if isinstance(outcomes[0], BaseException):
        raise outcomes[0]
    return outcomes[0]


def test_eos_ends_generation_and_is_kept_in_ids_not_text(reference_model, tokenizer) -> None:
    ids = tuple(tokenizer.encode("eos test"))
    free_run = make_engine(reference_model, tokenizer, frozenset())
    free_run.start()
    try:
        unconstrained = run_in_engine(
            free_run, GenerationSpec("a", ids, SamplingParams(max_new_tokens=12, temperature=0))
        ).output_ids
    finally:
        free_run.stop()
    eos = unconstrained[5]  # pretend this token is EOS (the random model rarely emits the real one)
    cut = unconstrained.index(eos)

    engine = make_engine(reference_model, tokenizer, frozenset({eos}))
    engine.start()
    try:
        stopped = run_in_engine(engine, GenerationSpec("b", ids, SamplingParams(max_new_tokens=12, temperature=0)))
        assert stopped.output_ids == unconstrained[: cut + 1]
        assert stopped.finish_reason == {"type": "stop", "matched": eos}
        assert stopped.text == tokenizer.decode(unconstrained[:cut])
        ignoring = run_in_engine(
            engine, GenerationSpec("c", ids, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
        )
        assert ignoring.output_ids == unconstrained
    finally:
        engine.stop()


def test_eos_ids_come_from_tokenizer_and_generation_config(reference_model, tokenizer) -> None:
    from slime_meta_engine.server import _eos_token_ids

    original = reference_model.generation_config.eos_token_id
    reference_model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]
    try:
        assert _eos_token_ids(tokenizer, reference_model) == frozenset({tokenizer.eos_token_id, 7})
    finally:
        reference_model.generation_config.eos_token_id = original


def test_requests_joining_a_running_batch_match_running_alone(reference_model, tokenizer) -> None:
    """Continuous batching: rows joined mid-generation (cache re-padded) and rows leaving early
    (cache trimmed) must not change anyone's tokens or log-probs."""
    engine = make_engine(reference_model, tokenizer, frozenset(), prefill_window_s=0.0)
    long_spec = GenerationSpec(
        "long",
        tuple(tokenizer.encode("a long one")),
        SamplingParams(max_new_tokens=200, temperature=0),
        return_logprob=True,
    )
    joiners = [
        GenerationSpec(
            f"j{i}",
            tuple(tokenizer.encode("j" * (1 + 3 * i))),
            SamplingParams(max_new_tokens=5 + 7 * i, temperature=0),
            return_logprob=True,
        )
        for i in range(5)
    ]
    engine.start()
    try:
        alone = {spec.rid: run_in_engine(engine, spec) for spec in [long_spec, *joiners]}
        results: dict[str, FinishedGeneration] = {}
        finished = threading.Semaphore(0)

        def submit(spec: GenerationSpec) -> None:
            def on_done(outcome) -> None:
                results[spec.rid] = outcome
                finished.release()

            engine.submit(GenerationJob(spec, on_done=on_done))

        assert engine.running_rows == 0  # the gauge drops before a result is handed out
        steps_before = engine.counters["decode_steps"]
        submit(long_spec)
        assert wait_for(lambda: engine.counters["decode_steps"] >= steps_before + 10)  # long is mid-way
        for spec in joiners:
            submit(spec)
        for _ in range(len(joiners) + 1):
            assert finished.acquire(timeout=60)
        assert engine.counters["decode_steps"] - steps_before < 200  # the joiners rode along
    finally:
        engine.stop()
    for rid, result in results.items():
        assert result.output_ids == alone[rid].output_ids, rid
        assert result.output_logprobs == pytest.approx(alone[rid].output_logprobs, abs=1e-4), rid
