"""The worker's memory budget (`--mem-fraction-static`) and its start-up flags.

The sizing is a pure function, checked with made-up GPU sizes; a real worker process checks the
flags end to end: on CPU the budget is accepted and ignored, on CUDA the log line and the served
request cap come from it.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers_worker import embedded_worker

from slime_meta_engine.fast_path.memory_budget import (
    MIN_CACHE_LEN,
    model_bytes,
    plan_for_device,
    plan_worker_memory,
    row_token_bytes,
)
from slime_meta_engine.server import parse_args

GB = 10**9
# A 0.5B Qwen2 shape in bf16: 24 layers x 2 kv heads x 64 dims x keys and values x 2 bytes.
QWEN_05B_ROW_TOKEN_BYTES = 24 * 2 * 64 * 2 * 2


def plan(**overrides):
    settings = dict(
        fraction=0.3,
        total_bytes=80 * GB,
        weights_bytes=1 * GB,
        row_token_bytes=QWEN_05B_ROW_TOKEN_BYTES,
        max_rows=64,
        cache_len=4096,
        max_positions=32768,
        max_prefill_tokens=16384,
    )
    settings.update(overrides)
    return plan_worker_memory(**settings), settings


@pytest.mark.parametrize("fraction", [0.02, 0.05, 0.3])
def test_slots_fill_what_the_weights_leave_of_the_fraction(fraction: float) -> None:
    sized, s = plan(fraction=fraction)
    budget = fraction * s["total_bytes"]
    slot_bytes = sized.cache_len * s["row_token_bytes"]
    assert sized.cache_len == s["cache_len"]  # the asked length is kept while one slot fits
    assert s["weights_bytes"] + sized.kv_bytes <= budget
    assert sized.kv_bytes == sized.slots * slot_bytes
    # Either every row asked for has a slot, or one more slot would not fit.
    assert sized.slots == s["max_rows"] or s["weights_bytes"] + sized.kv_bytes + slot_bytes > budget
    assert sized.max_prefill_tokens == min(s["max_prefill_tokens"], sized.slots * sized.cache_len)


def test_a_small_budget_means_fewer_slots_and_a_smaller_prefill_budget() -> None:
    small, _ = plan(fraction=0.0135)  # about 80 MB of KV: one 4096-token slot is 50 MB
    large, _ = plan(fraction=0.3)
    assert small.slots == 1 and large.slots == 64
    assert small.max_prefill_tokens == 4096 < large.max_prefill_tokens


def test_the_cache_length_halves_when_not_one_slot_fits() -> None:
    tight, s = plan(fraction=0.0127)  # 16 MB of KV after the weights: not one 4096-token slot (50 MB)
    assert tight.slots >= 1 and MIN_CACHE_LEN <= tight.cache_len < s["cache_len"]
    assert tight.cache_len * 2 * s["row_token_bytes"] > tight.fraction * s["total_bytes"] - s["weights_bytes"]


def test_the_model_positions_cap_the_cache_length() -> None:
    sized, _ = plan(cache_len=8192, max_positions=2048)
    assert sized.cache_len == 2048


def test_a_fraction_below_the_weights_is_refused_with_the_minimum() -> None:
    with pytest.raises(ValueError, match=r"--mem-fraction-static 0.01 .* give at least 0\.01"):
        plan(fraction=0.01)  # 0.8 GB for 1 GB of weights


def test_sizes_come_from_the_loaded_model(tiny_checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert row_token_bytes(model) == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    distinct = {p.data_ptr(): p.numel() * 4 for p in [*model.parameters(), *model.buffers()]}
    assert model_bytes(model) == sum(distinct.values())
    # Off CUDA the flag is accepted and ignored.
    kwargs = dict(max_rows=8, cache_len=256, max_positions=None, max_prefill_tokens=1024)
    assert plan_for_device(0.3, model, torch.device("cpu"), **kwargs) is None


def test_flags_are_parsed_and_checked(tiny_checkpoint: Path) -> None:
    base = ["--model-path", str(tiny_checkpoint)]
    args = parse_args(base + ["--mem-fraction-static", "0.4", "--chunked-prefill-size", "512"])
    assert args.mem_fraction_static == 0.4 and args.chunked_prefill_size == 512
    assert parse_args(base + ["--chunked-prefill-size", "-1"]).chunked_prefill_size is None  # SGLang's "off"
    defaults = parse_args(base)
    assert defaults.mem_fraction_static is None and defaults.chunked_prefill_size is None
    for bad in (["--mem-fraction-static", "1.5"], ["--mem-fraction-static", "0"], ["--chunked-prefill-size", "0"]):
        with pytest.raises(SystemExit) as error:
            parse_args(base + bad)
        assert error.value.code == 2


def generate(url: str, input_ids: list[list[int]], new_tokens: int) -> list[dict]:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    request = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def server_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as response:
        return json.loads(response.read())


def test_cpu_worker_accepts_the_budget_and_chunks_its_prefill(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Real process, real HTTP: a budget on CPU changes nothing; a chunked prefill answers as a whole one."""
    prompts = [[5 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate([40, 9, 70])]
    answers = []
    for name, extra in (("whole", []), ("chunked", ["--mem-fraction-static", "0.2", "--chunked-prefill-size", "16"])):
        with embedded_worker(tiny_checkpoint, tmp_path / f"{name}.log", *extra, startup_timeout_s=180) as url:
            answers.append(generate(url, prompts, 8))
            assert server_info(url)["max_batch_size"] == 64  # no budget applied on CPU
    for whole, chunked in zip(*answers):
        assert chunked["output_ids"] == whole["output_ids"]
        whole_lp = [entry[0] for entry in whole["meta_info"]["output_token_logprobs"]]
        chunked_lp = [entry[0] for entry in chunked["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(whole_lp, chunked_lp)) < 1e-4
    assert "memory budget" not in (tmp_path / "chunked.log").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_worker_sizes_its_cache_from_the_budget(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The static cache (`--kv-cache static`; the default is paged, whose pages the paged tests size):
    the log line states the sizing, the slot count caps running requests, and more requests than
    slots queue and are all answered."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16)  # the worker's dtype on CUDA
    total = torch.cuda.get_device_properties(0).total_memory
    cache_len = model.config.max_position_embeddings  # 256
    # Room for the weights and 5.5 rows of the full length: 5 slots.
    fraction = (model_bytes(model) + 5.5 * cache_len * row_token_bytes(model)) / total
    extra = ["--kv-cache", "static", "--mem-fraction-static", repr(fraction), "--static-cache-len", "4096"]
    extra += ["--chunked-prefill-size", "64"]
    log_path = tmp_path / "budget.log"
    with embedded_worker(tiny_checkpoint, log_path, *extra, device="cuda", dtype=None, startup_timeout_s=180) as url:
        info = server_info(url)
        slots = info["engine"]["fast_path"]["slots"]
        assert info["max_batch_size"] == slots == 5 and info["engine"]["fast_path"]["capacity"] == cache_len
        prompts = [[5 + (i + j) % 90 for j in range(30 + i)] for i in range(3 * slots)]
        answers = generate(url, prompts, 5)
        assert all(len(answer["output_ids"]) == 5 for answer in answers)
    log = log_path.read_text()
    assert f"memory budget: --mem-fraction-static {fraction:g}" in log and f"{slots} slots x" in log
