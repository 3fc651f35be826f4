"""Eager prefills at rounded widths (fast_path/slot_batch.py, `EAGER_PREFILL_COLUMNS`): what a GPU worker
does so that the shapes its matmuls run stay few, checked on the CPU against the exact widths. The
padding columns must change nothing a row reads: the same greedy tokens and log-probs, prompts
together and alone, up to the capacity."""

from __future__ import annotations

import pytest
from test_prefill_graphs import engine_on, submit_together
from test_worker_static_decode import (
    greedy_spec,
    hf_greedy,
    no_cudnn_attention,  # noqa: F401 - autouse fixture, as in the worker
    random_prompts,
    submit_all,
    tiny_model,
)

from slime_meta_engine.fast_path.paged.batch import build_paged_batch
from slime_meta_engine.fast_path.slot_batch import EAGER_PREFILL_COLUMNS
from slime_meta_engine.fast_path.static.batch import build_static_batch

SLOTS = 4


def eager_batch(model, kv_cache: str, width_multiple: int):
    """A batch with no prefill graphs (every prefill eager), its widths rounded to `width_multiple`;
    the decoder's prefill records the widths it was given."""
    if kv_cache == "static":
        batch = build_static_batch(
            model, num_slots=SLOTS, requested_capacity=200, pad_token_id=0, use_graphs=False, prefill_graph_tokens=0
        )
    else:
        batch = build_paged_batch(
            model,
            num_rows=SLOTS,
            pool_tokens=1024,
            pad_token_id=0,
            use_graphs=False,
            page_size=4,
            prefill_graph_tokens=0,
        )
    batch.eager_width_multiple = width_multiple
    widths = []
    plain_prefill = batch._decoder.prefill

    def recording_prefill(input_ids_N_L, *args, **kwargs):
        widths.append(input_ids_N_L.shape[1])
        return plain_prefill(input_ids_N_L, *args, **kwargs)

    batch._decoder.prefill = recording_prefill
    return batch, widths


def test_the_width_rounds_up_to_the_multiple_and_stops_at_the_capacity():
    model = tiny_model("qwen2")
    batch, _ = eager_batch(model, "static", EAGER_PREFILL_COLUMNS)
    assert batch.capacity == 200
    assert [batch.eager_width(n) for n in (1, 64, 65, 150, 199)] == [64, 64, 128, 192, 200]
    batch.eager_width_multiple = 1
    assert [batch.eager_width(n) for n in (1, 65, 199)] == [1, 65, 199]


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_rounded_eager_prefills_give_what_the_exact_ones_give(kv_cache: str) -> None:
    model = tiny_model("qwen2")
    # the last prompt rounds past the static batch's capacity (200) and is cut back to it
    prompts = random_prompts([6, 70, 3, 131, 193], seed=11)
    outcomes, widths_seen = {}, {}
    for multiple in (1, EAGER_PREFILL_COLUMNS):
        batch, widths = eager_batch(model, kv_cache, multiple)
        engine = engine_on(model, batch)
        engine.start()
        try:
            together = submit_together(engine, [greedy_spec(f"t{i}", p, 7) for i, p in enumerate(prompts[:3])])
            alone = [submit_all(engine, [greedy_spec(f"a{i}", p, 7)])[0] for i, p in enumerate(prompts[3:])]
        finally:
            engine.stop()
        outcomes[multiple], widths_seen[multiple] = together + alone, widths
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
