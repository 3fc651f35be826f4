"""Eager prefills at rounded shapes (fast_path/slot_batch.py: widths to `EAGER_PREFILL_COLUMNS`, rows up
`eager_rows`): what a GPU worker does so that the token counts its matmuls run stay few, checked on
the CPU against the exact shapes. The padding columns and rows must change nothing a row reads: the
same greedy tokens and log-probs, prompts together and alone, up to the capacity."""

from __future__ import annotations

import pytest
import torch
from test_prefill_graphs import engine_on, submit_together
from test_worker_chunked_prefill import engine_for
from test_worker_static_decode import (
    greedy_spec,
    hf_greedy,
    needs_cuda,
    no_cudnn_attention,  # noqa: F401 - autouse fixture, as in the worker
    random_prompts,
    submit_all,
    tiny_model,
)

from slime_meta_engine.fast_path.paged.batch import build_paged_batch
from slime_meta_engine.fast_path.prefill_graphs import prefill_buckets
from slime_meta_engine.fast_path.slot_batch import EAGER_PREFILL_COLUMNS, ShapeTally, eager_rows
from slime_meta_engine.fast_path.static.batch import build_static_batch
from slime_meta_engine.protocol import GenerationSpec, SamplingParams
from slime_meta_engine.rows import GenerationJob

SLOTS = 8


def eager_batch(
    model, kv_cache: str, width_multiple: int | None, rows_rounded: bool | None = False, slots: int = SLOTS
):
    """A batch with no prefill graphs (every prefill eager), its widths rounded to `width_multiple`
    and (`rows_rounded`) its rows up `eager_rows` (None: the batch's default for its device); the
    decoder's prefill records the (rows, width) it was given."""
    if kv_cache == "static":
        batch = build_static_batch(
            model, num_slots=slots, requested_capacity=200, pad_token_id=0, use_graphs=False, prefill_graph_tokens=0
        )
    else:
        batch = build_paged_batch(
            model,
            num_rows=slots,
            pool_tokens=1024,
            pad_token_id=0,
            use_graphs=False,
            page_size=4,
            prefill_graph_tokens=0,
        )
    if width_multiple is not None:
        batch.eager_width_multiple = width_multiple
    if rows_rounded is not None:
        batch.eager_rows_rounded = rows_rounded
    shapes = []
    plain_prefill = batch._decoder.prefill

    def recording_prefill(input_ids_N_L, *args, **kwargs):
        shapes.append(tuple(input_ids_N_L.shape))
        return plain_prefill(input_ids_N_L, *args, **kwargs)

    batch._decoder.prefill = recording_prefill
    return batch, shapes


def test_the_width_rounds_up_to_the_multiple_and_stops_at_the_capacity():
    model = tiny_model("qwen2")
    batch, _ = eager_batch(model, "static", EAGER_PREFILL_COLUMNS)
    assert batch.capacity == 200
    assert [batch.eager_width(n) for n in (1, 64, 65, 150, 199)] == [64, 64, 128, 192, 200]
    batch.eager_width_multiple = 1
    assert [batch.eager_width(n) for n in (1, 65, 199)] == [1, 65, 199]
    on_cpu, _ = eager_batch(model, "paged", None, None)  # the CPU keeps the plain eager prefill
    assert (on_cpu.eager_width_multiple, on_cpu.eager_rows_rounded) == (1, False)


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_rounded_eager_prefills_give_what_the_exact_ones_give(kv_cache: str) -> None:
    model = tiny_model("qwen2")
    # the last prompt rounds past the static batch's capacity (200) and is cut back to it
    prompts = random_prompts([6, 70, 3, 131, 193], seed=11)
    outcomes, widths_seen = {}, {}
    for multiple in (1, EAGER_PREFILL_COLUMNS):
        batch, shapes = eager_batch(model, kv_cache, multiple)
        engine = engine_on(model, batch, SLOTS)
        engine.start()
        try:
            together = submit_together(engine, [greedy_spec(f"t{i}", p, 7) for i, p in enumerate(prompts[:3])])
            alone = [submit_all(engine, [greedy_spec(f"a{i}", p, 7)])[0] for i, p in enumerate(prompts[3:])]
        finally:
            engine.stop()
        outcomes[multiple], widths_seen[multiple] = together + alone, [width for _, width in shapes]
    assert widths_seen[1] == [70, 131, 193]  # the exact widths: the longest prompt of each prefill
    assert widths_seen[EAGER_PREFILL_COLUMNS] == [128, 192, min(256, batch.capacity)]
    for rounded, exact in zip(outcomes[EAGER_PREFILL_COLUMNS], outcomes[1]):
        assert rounded.output_ids == exact.output_ids
        assert rounded.output_logprobs == pytest.approx(exact.output_logprobs, abs=1e-4)
    for prompt, result in zip(prompts, outcomes[EAGER_PREFILL_COLUMNS]):
        assert result.output_ids == hf_greedy(model, prompt, 7)


def test_the_eager_prefill_columns_flag(tiny_checkpoint, monkeypatch) -> None:
    from slime_meta_engine.server import EAGER_PREFILL_COLUMNS_ENV, parse_args

    monkeypatch.delenv(EAGER_PREFILL_COLUMNS_ENV, raising=False)
    assert parse_args(["--model-path", str(tiny_checkpoint)]).eager_prefill_columns is None  # the default, 64
    flag = ["--model-path", str(tiny_checkpoint), "--eager-prefill-columns"]
    assert parse_args([*flag, "1"]).eager_prefill_columns == 1
    monkeypatch.setenv(EAGER_PREFILL_COLUMNS_ENV, "128")
    assert parse_args(["--model-path", str(tiny_checkpoint)]).eager_prefill_columns == 128
    with pytest.raises(SystemExit):
        parse_args([*flag, "0"])
    monkeypatch.setenv(EAGER_PREFILL_COLUMNS_ENV, "wide")
    with pytest.raises(SystemExit) as exit_info:  # bad input: exit 2 with argparse's line, no traceback
        parse_args(["--model-path", str(tiny_checkpoint)])
    assert exit_info.value.code == 2


def test_the_eager_prefill_rows_flag(tiny_checkpoint, monkeypatch, capsys) -> None:
    from slime_meta_engine.server import EAGER_PREFILL_ROWS_ENV, parse_args

    model_path = ["--model-path", str(tiny_checkpoint)]
    monkeypatch.delenv(EAGER_PREFILL_ROWS_ENV, raising=False)
    assert parse_args(model_path).eager_prefill_rows == "ladder"
    assert parse_args([*model_path, "--eager-prefill-rows", "exact"]).eager_prefill_rows == "exact"
    monkeypatch.setenv(EAGER_PREFILL_ROWS_ENV, "exact")
    assert parse_args(model_path).eager_prefill_rows == "exact"
    monkeypatch.setenv(EAGER_PREFILL_ROWS_ENV, "some")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(model_path)
    assert exit_info.value.code == 2
    assert f"${EAGER_PREFILL_ROWS_ENV} 'some': give one of ladder, exact" in capsys.readouterr().err


def test_the_rows_climb_the_ladder_of_powers_of_two_and_their_halfway_points():
    assert [eager_rows(n) for n in range(1, 18)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]
    assert [eager_rows(n) for n in (24, 25, 33, 48, 49, 64, 65)] == [24, 32, 48, 48, 64, 64, 96]
    assert all(n <= eager_rows(n) <= max(2, 1.5 * n) for n in range(1, 300))  # at most half again


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_padding_rows_change_nothing_the_prompts_get(kv_cache: str) -> None:
    model = tiny_model("qwen2")
    prompts = random_prompts([9, 40, 3, 17, 66], seed=5)  # five prompts in one prefill: six rows
    outcomes, shapes_seen = {}, {}
    for rows_rounded in (False, True):
        batch, shapes = eager_batch(model, kv_cache, EAGER_PREFILL_COLUMNS, rows_rounded)
        engine = engine_on(model, batch, SLOTS)
        engine.start()
        try:
            outcomes[rows_rounded] = submit_together(
                engine, [greedy_spec(f"r{i}", p, 6) for i, p in enumerate(prompts)]
            )
        finally:
            engine.stop()
        shapes_seen[rows_rounded] = shapes
    assert shapes_seen[False] == [(5, 128)]
    assert shapes_seen[True] == [(6, 128)]
    for rounded, exact in zip(outcomes[True], outcomes[False]):
        assert rounded.output_ids == exact.output_ids
        assert rounded.output_logprobs == pytest.approx(exact.output_logprobs, abs=1e-4)
    for prompt, result in zip(prompts, outcomes[True]):
        assert result.output_ids == hf_greedy(model, prompt, 6)


def test_a_static_cache_with_no_free_slot_runs_the_prompts_own_rows() -> None:
    """A padding row of the static cache writes into a free slot; with every slot in the prefill there
    is none, so the prompts run on their own rows (the paged cache always has its scratch page)."""
    model = tiny_model("qwen2")
    batch, _ = eager_batch(model, "static", EAGER_PREFILL_COLUMNS, rows_rounded=True, slots=5)
    jobs = [
        GenerationJob(greedy_spec(f"s{i}", p, 4), on_done=print)
        for i, p in enumerate(random_prompts([5, 9, 2, 7, 3], seed=2))
    ]
    lengths = [len(job.spec.input_ids) for job in jobs]
    input_ids_R_L, lengths_R, where_R = batch._eager_prompt_tensors(jobs, lengths, [0, 1, 2, 3, 4])
    assert tuple(input_ids_R_L.shape) == (5, 64) and where_R.tolist() == [0, 1, 2, 3, 4]
    roomy, _ = eager_batch(model, "static", EAGER_PREFILL_COLUMNS, rows_rounded=True, slots=8)
    input_ids_R_L, lengths_R, where_R = roomy._eager_prompt_tensors(jobs, lengths, [0, 1, 2, 3, 4])
    assert tuple(input_ids_R_L.shape) == (6, 64)
    assert lengths_R.tolist() == [*lengths, 0] and where_R.tolist() == [0, 1, 2, 3, 4, 7]  # the last free slot


def token_counts(rows_of, longest_prompt: int, max_prefill_tokens: int = 16384, max_rows: int = 64) -> set[int]:
    """Every token count (rows x width) an eager prefill of the paged worker's defaults may run, over
    every admission of prompts up to `longest_prompt` tokens that no prefill graph holds."""
    buckets = prefill_buckets(8, 32768, 4096)
    counts = set()
    for prompts in range(1, max_rows + 1):
        held = max((length for rows, length in buckets if rows >= prompts), default=0)
        for longest in range(held + 1, longest_prompt + 1):
            if prompts > 1 and prompts * longest > max_prefill_tokens:
                break  # the engine admits no more prompts of this length at once
            counts.add(rows_of(prompts) * (-(-longest // EAGER_PREFILL_COLUMNS) * EAGER_PREFILL_COLUMNS))
    return counts


def test_the_ladder_leaves_a_worker_few_token_counts_to_meet():
    """What bounds the host memory CUDA's libraries keep per new count (docs/memory.md)."""
    assert len(token_counts(eager_rows, 2048)) == 80 and len(token_counts(eager_rows, 4096)) == 128
    assert len(token_counts(lambda prompts: prompts, 2048)) == 220  # rows exact, widths rounded


@needs_cuda
@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_on_cuda_the_rounded_shapes_are_the_default_and_give_what_exact_ones_give(kv_cache: str) -> None:
    model = tiny_model("qwen2", torch.float32, "cuda")
    default, _ = eager_batch(model, kv_cache, None, None)
    assert (default.eager_width_multiple, default.eager_rows_rounded) == (EAGER_PREFILL_COLUMNS, True)
    prompts = random_prompts([9, 40, 3, 17, 66], seed=5)
    outcomes, shapes_seen = {}, {}
    for rounded in (False, True):
        batch, shapes = eager_batch(model, kv_cache, EAGER_PREFILL_COLUMNS if rounded else 1, rows_rounded=rounded)
        engine = engine_on(model, batch, SLOTS)
        engine.start()
        try:
            outcomes[rounded] = submit_together(engine, [greedy_spec(f"c{i}", p, 8) for i, p in enumerate(prompts)])
        finally:
            engine.stop()
        shapes_seen[rounded] = shapes
    assert shapes_seen == {False: [(5, 66)], True: [(6, 128)]}
    for rounded, exact, prompt in zip(outcomes[True], outcomes[False], prompts):
        assert rounded.output_ids == exact.output_ids == hf_greedy(model, prompt, 8)
        assert rounded.output_logprobs == pytest.approx(exact.output_logprobs, abs=1e-4)


def test_the_dynamic_cache_path_pads_on_the_left_to_the_multiple_and_scores_the_same() -> None:
    """Prompt scoring (and rows beyond the fast path) run through the DynamicCache path, prompts
    left-padded: its rounded widths must give the same prompt log-probs and tokens as exact ones."""
    model = tiny_model("qwen2")
    prompts = random_prompts([37, 5, 70], seed=9)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    outcomes, widths = {}, {}
    for multiple in (1, EAGER_PREFILL_COLUMNS):
        engine = engine_for(model, static=False, chunk=None, prefill_width_multiple=multiple)  # one prefill
        seen = widths.setdefault(multiple, [])
        plain_forward = engine._chunked_forward

        def recording_forward(input_ids_P_T, *args, plain_forward=plain_forward, seen=seen):
            seen.append(tuple(input_ids_P_T.shape))
            return plain_forward(input_ids_P_T, *args)

        engine._chunked_forward = recording_forward
        specs = [
            GenerationSpec(f"s{i}", tuple(p), params, return_logprob=True, logprob_start_len=0)
            for i, p in enumerate(prompts)
        ]
        engine.start()
        try:
            outcomes[multiple] = submit_together(engine, specs)
        finally:
            engine.stop()
    assert widths == {1: [(3, 70)], EAGER_PREFILL_COLUMNS: [(3, 128)]}
    assert engine_for(model, static=False, chunk=None)._prefill_width_multiple == 1  # the CPU's own: exact
    for rounded, exact in zip(outcomes[EAGER_PREFILL_COLUMNS], outcomes[1]):
        assert rounded.output_ids == exact.output_ids
        assert rounded.input_logprobs[0] is None and exact.input_logprobs[0] is None
        assert rounded.input_logprobs[1:] == pytest.approx(exact.input_logprobs[1:], abs=1e-4)
        assert rounded.output_logprobs == pytest.approx(exact.output_logprobs, abs=1e-4)


def test_the_tally_of_eager_prefill_shapes_counts_each_once_and_stops_at_its_limit():
    tally = ShapeTally(limit=3)
    for rows, columns in [(1, 64), (1, 64), (2, 64), (2, 128)]:
        tally.add(rows, columns)
    assert len(tally) == 3
    tally.add(4, 256)  # past the limit: not kept, so a worker on exact shapes holds a bounded set
    assert len(tally) == 3
