"""The embedded worker over real HTTP, checked against an independent Hugging Face forward pass.

One worker process serves the whole module (starting one costs seconds). The weight-update
test puts the original weights back before it ends, so test order does not matter.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from helpers_tiny import full_logprobs
from helpers_worker import embedded_worker, get, post

# The same checks can run against a GPU worker (the reference stays on the CPU, in float32).
WORKER_DEVICE = os.environ.get("SLIME_META_TEST_WORKER_DEVICE", "cpu")


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights-root")


@pytest.fixture(scope="module")
def worker_url(tiny_checkpoint: Path, weights_root: Path, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("worker-log") / "worker.log"
    flags = ("--weights-root", str(weights_root))
    with embedded_worker(tiny_checkpoint, log_path, *flags, device=WORKER_DEVICE) as url:
        yield url


def greedy(url: str, ids: list[int], max_new_tokens: int) -> list[int]:
    status, body = post(
        f"{url}/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}},
    )
    assert status == 200, body
    return body["output_ids"]


def test_health_and_info_endpoints(worker_url: str, tiny_checkpoint: Path) -> None:
    assert get(f"{worker_url}/health")[0] == 200
    assert get(f"{worker_url}/health_generate")[0] == 200
    for path in ("/get_model_info", "/model_info"):
        status, raw = get(worker_url + path)
        info = json.loads(raw)
        assert status == 200 and info["model_path"] == str(tiny_checkpoint) and info["is_generation"] is True
        assert {"tokenizer_path", "preferred_sampling_params", "weight_version"} <= set(info)
    status, raw = get(f"{worker_url}/get_server_info")
    assert status == 200 and {"max_batch_size", "device", "dtype", "num_generate_requests"} <= set(json.loads(raw))
    assert get(f"{worker_url}/flush_cache")[0] == 200


def test_generate_single_and_batched(worker_url: str, tokenizer) -> None:
    sampling = {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True}
    status, single = post(f"{worker_url}/generate", {"text": "hello", "sampling_params": sampling})
    assert status == 200
    assert len(single["output_ids"]) == 7
    assert single["text"] == tokenizer.decode(single["output_ids"], skip_special_tokens=True)
    meta = single["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 7 and meta["cached_tokens"] == 0
    assert {"id", "weight_version", "e2e_latency"} <= set(meta)

    status, batch = post(
        f"{worker_url}/generate", {"text": ["hello", "a", "longer prompt"], "sampling_params": sampling}
    )
    assert status == 200 and isinstance(batch, list) and len(batch) == 3
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [5, 1, 13]
    assert batch[0]["output_ids"] == single["output_ids"]

    ids = [tokenizer.encode(t) for t in ("xy", "hello world")]
    status, by_ids = post(
        f"{worker_url}/generate",
        {"input_ids": ids, "sampling_params": [sampling, {**sampling, "max_new_tokens": 3}], "rid": ["a", "b"]},
    )
    assert status == 200
    assert [len(r["output_ids"]) for r in by_ids] == [7, 3]
    assert [r["meta_info"]["id"] for r in by_ids] == ["a", "b"]


def assert_same_generation(got: dict, expected: dict) -> None:
    """Same tokens, and log-probs equal to float noise: a position or padding mistake that leaves
    greedy tokens unchanged (the tiny model leans on the previous token) still shows up here."""
    assert got["output_ids"] == expected["output_ids"]
    got_logprobs = [entry[0] for entry in got["meta_info"]["output_token_logprobs"]]
    expected_logprobs = [entry[0] for entry in expected["meta_info"]["output_token_logprobs"]]
    assert got_logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_greedy_under_concurrency_equals_alone(worker_url: str, tokenizer, reference_model) -> None:
    prompts = [tokenizer.encode("p" + "abcdefghij"[: i % 10] + str(i) * (i % 4)) for i in range(20)]
    bodies = [
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 3 + (i * 7) % 13, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        }
        for i, ids in enumerate(prompts)
    ]
    alone = [post(f"{worker_url}/generate", body)[1] for body in bodies]
    assert post(f"{worker_url}/generate", bodies[0])[1]["output_ids"] == alone[0]["output_ids"]  # deterministic

    async def all_at_once() -> list[dict]:
        async with aiohttp.ClientSession() as session:

            async def one(body: dict) -> dict:
                async with session.post(f"{worker_url}/generate", json=body) as response:
                    assert response.status == 200
                    return await response.json()

            return await asyncio.gather(*(one(body) for body in bodies))

    for together, by_itself in zip(asyncio.run(all_at_once()), alone):
        assert_same_generation(together, by_itself)
    # And greedy decoding matches an independent cache-free reference, token by token.
    for ids, result in list(zip(prompts, alone))[:3]:
        expected = full_logprobs(reference_model, ids + result["output_ids"])
        for step, (logprob, token, _) in enumerate(result["meta_info"]["output_token_logprobs"]):
            assert int(expected[len(ids) - 1 + step].argmax()) == token
            assert logprob == pytest.approx(float(expected[len(ids) - 1 + step, token]), abs=1e-4)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.7, "top_p": 0.9, "top_k": 20}, {"temperature": 0.0}, {"temperature": 1.3}]
)
def test_output_logprobs_match_reference(worker_url: str, tokenizer, reference_model, sampling) -> None:
    ids = tokenizer.encode("logprob check")
    status, body = post(
        f"{worker_url}/generate",
        {
            "input_ids": ids,
            "sampling_params": {**sampling, "max_new_tokens": 12, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 3,
        },
    )
    assert status == 200
    meta = body["meta_info"]
    assert meta["input_token_logprobs"] == []  # logprob_start_len=-1: output tokens only
    temperature = sampling["temperature"] if sampling["temperature"] > 1e-6 else 1.0
    expected = full_logprobs(reference_model, ids + body["output_ids"], temperature)
    for step, (logprob, token_id, text) in enumerate(meta["output_token_logprobs"]):
        assert token_id == body["output_ids"][step] and text is None
        assert logprob == pytest.approx(float(expected[len(ids) - 1 + step, token_id]), abs=1e-4)
        top = meta["output_top_logprobs"][step]
        assert len(top) == 3 and top[0][0] >= top[1][0] >= top[2][0]


def test_scoring_call_equals_full_forward(worker_url: str, tokenizer, reference_model) -> None:
    prompts = [tokenizer.encode(text) for text in ("score me please", "a", "two words")]
    status, results = post(
        f"{worker_url}/generate",
        {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        },
    )
    assert status == 200
    for ids, result in zip(prompts, results):
        meta = result["meta_info"]
        assert result["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["output_token_logprobs"] == []
        entries = meta["input_token_logprobs"]
        assert len(entries) == len(ids) and entries[0] == [None, ids[0], None]
        assert meta["input_top_logprobs"][0] is None
        expected = full_logprobs(reference_model, ids)
        for position in range(1, len(ids)):
            assert entries[position][1] == ids[position]
            assert entries[position][0] == pytest.approx(float(expected[position - 1, ids[position]]), abs=1e-4)
            top_ids = [entry[1] for entry in meta["input_top_logprobs"][position]]
            assert top_ids == expected[position - 1].topk(2).indices.tolist()

    # A later start skips the first positions.
    status, partial = post(
        f"{worker_url}/generate",
        {
            "input_ids": prompts[0],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 3,
        },
    )
    assert [entry[1] for entry in partial["meta_info"]["input_token_logprobs"]] == prompts[0][3:]


def test_stop_strings_stop_tokens_and_lengths(worker_url: str, tokenizer) -> None:
    ids = tokenizer.encode("stop test")
    reference = greedy(worker_url, ids, 24)
    reference_text = tokenizer.decode(reference, skip_special_tokens=True)
    assert len(reference_text) == 24, "the tiny model happened to emit special tokens; pick another prompt"
    stop = reference_text[5:7]
    first = reference_text.find(stop)
    base = {"input_ids": ids}
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}

    _, trimmed = post(f"{worker_url}/generate", {**base, "sampling_params": {**sampling, "stop": [stop, "\x00never"]}})
    assert trimmed["text"] == reference_text[:first]
    assert trimmed["output_ids"] == reference[: first + len(stop)]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    _, untrimmed = post(
        f"{worker_url}/generate", {**base, "sampling_params": {**sampling, "stop": stop, "no_stop_trim": True}}
    )
    assert untrimmed["text"] == reference_text[: first + len(stop)]

    stop_token = reference[4]
    _, by_token = post(
        f"{worker_url}/generate", {**base, "sampling_params": {**sampling, "stop_token_ids": [stop_token]}}
    )
    cut = reference.index(stop_token)
    assert by_token["output_ids"] == reference[: cut + 1]  # the stop token is kept in output_ids ...
    assert by_token["text"] == tokenizer.decode(reference[:cut])  # ... but not in the text
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}

    _, short = post(f"{worker_url}/generate", {**base, "sampling_params": {**sampling, "max_new_tokens": 2}})
    assert short["output_ids"] == reference[:2] and short["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 2,
    }


def test_truncated_sampling_with_one_candidate_is_greedy(worker_url: str, tokenizer) -> None:
    ids = tokenizer.encode("top k")
    expected = greedy(worker_url, ids, 10)
    for cut in ({"top_k": 1}, {"top_p": 1e-6}):
        status, body = post(
            f"{worker_url}/generate",
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, **cut},
            },
        )
        assert status == 200 and body["output_ids"] == expected


@pytest.mark.parametrize(
    "body",
    [
        {"text": "a", "input_ids": [1]},
        {},
        {"text": "a", "sampling_params": {"max_new_tokens": 300}},  # beyond 256 positions
        {"text": "a", "sampling_params": {"n": 0}},
        {"text": "a", "sampling_params": {"n": 2.5}},
        {"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]},
        {"text": "a", "sampling_params": {"temperature": -1}},
        {"input_ids": [100000]},
        {"input_ids": []},
        {"text": "a", "return_hidden_states": True},
    ],
)
def test_bad_requests_get_400(worker_url: str, body: dict) -> None:
    status, reply = post(f"{worker_url}/generate", body)
    assert status == 400 and isinstance(reply["error"]["message"], str)


def test_malformed_json_gets_400(worker_url: str) -> None:
    status, reply = post(f"{worker_url}/generate", None, raw=b"{not json")
    assert status == 400 and "JSON" in reply["error"]["message"]


def test_router_style_defaults_are_accepted(worker_url: str) -> None:
    # sglang-router re-serialises requests with these fields at their defaults.
    body = {
        "text": "a",
        "model": None,
        "stream": False,
        "return_hidden_states": False,
        "log_metrics": True,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "sampling_params": {"max_new_tokens": 1},
    }
    assert post(f"{worker_url}/generate", body)[0] == 200


@pytest.fixture(scope="module")
def checkpoints_in_root(tiny_checkpoint: Path, weights_root: Path) -> dict[str, Path]:
    """A perturbed copy of the tiny model and a copy of the original, both inside the weights root."""
    from transformers import AutoModelForCausalLM

    perturbed = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    perturbed.save_pretrained(weights_root / "perturbed")
    shutil.copytree(tiny_checkpoint, weights_root / "original")
    return {"perturbed": weights_root / "perturbed", "original": weights_root / "original"}


def update_weights(url: str, model_path: Path | str, **extra: Any) -> tuple[int, Any]:
    return post(f"{url}/update_weights_from_disk", {"model_path": str(model_path), **extra})


def test_update_weights_from_disk(
    worker_url: str, tiny_checkpoint: Path, weights_root: Path, checkpoints_in_root: dict[str, Path], tokenizer
) -> None:
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode("update me")
    before = greedy(worker_url, ids, 16)
    status, reply = update_weights(worker_url, checkpoints_in_root["perturbed"], weight_version="7")
    assert status == 200 and reply["success"] is True and reply["num_paused_requests"] == 0
    status, body = post(
        f"{worker_url}/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert body["output_ids"] != before
    assert body["meta_info"]["weight_version"] == "7"
    assert json.loads(get(f"{worker_url}/get_model_info")[1])["weight_version"] == "7"
    perturbed = AutoModelForCausalLM.from_pretrained(checkpoints_in_root["perturbed"]).eval()
    expected = full_logprobs(perturbed, ids + body["output_ids"])
    for step, (logprob, token_id, _) in enumerate(body["meta_info"]["output_token_logprobs"]):
        assert logprob == pytest.approx(float(expected[len(ids) - 1 + step, token_id]), abs=1e-4)

    # Outside the weights root, directly or through a symlink: refused, weights unchanged.
    (weights_root / "escape").symlink_to(tiny_checkpoint, target_is_directory=True)
    for outside in (tiny_checkpoint, weights_root / "escape", weights_root / ".." / tiny_checkpoint.name):
        status, reply = update_weights(worker_url, outside)
        assert status == 400 and reply["success"] is False, outside
    status, reply = update_weights(worker_url, weights_root / "missing")
    assert status == 400 and reply["success"] is False
    assert greedy(worker_url, ids, 16) == body["output_ids"]

    status, reply = update_weights(worker_url, checkpoints_in_root["original"])
    assert status == 200 and reply["success"] is True
    assert greedy(worker_url, ids, 16) == before


def test_weight_swap_waits_for_running_generations(
    worker_url: str, checkpoints_in_root: dict[str, Path], tokenizer
) -> None:
    """A swap requested mid-generation lands between batches: running requests finish on the old weights."""
    prompts = [tokenizer.encode(f"long generation {i}") for i in range(8)]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 230, "temperature": 0, "ignore_eos": True}}
    status, reference = post(f"{worker_url}/generate", body)
    assert status == 200

    async def generate_while_swapping() -> tuple[list[dict], dict]:
        async with aiohttp.ClientSession() as session:
            generation = asyncio.create_task(session.post(f"{worker_url}/generate", json=body))
            for _ in range(500):  # wait until the batch is running, then ask for the swap
                async with session.get(f"{worker_url}/get_server_info") as response:
                    if (await response.json())["running_requests"] > 0:
                        break
            update = {"model_path": str(checkpoints_in_root["perturbed"]), "weight_version": "swapped"}
            async with session.post(f"{worker_url}/update_weights_from_disk", json=update) as response:
                swap_reply = await response.json()
            async with await generation as response:
                return await response.json(), swap_reply

    during, swap_reply = asyncio.run(generate_while_swapping())
    try:
        assert swap_reply["success"] is True
        assert [r["output_ids"] for r in during] == [r["output_ids"] for r in reference]
        assert {r["meta_info"]["weight_version"] for r in during} == {reference[0]["meta_info"]["weight_version"]}
        assert greedy(worker_url, prompts[0], 20) != reference[0]["output_ids"][:20]
    finally:
        assert update_weights(worker_url, checkpoints_in_root["original"])[1]["success"] is True


def test_openai_compatible_endpoints(worker_url: str) -> None:
    status, chat = post(
        f"{worker_url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    assert status == 200 and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] <= 4
    status, completion = post(f"{worker_url}/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert status == 200 and completion["choices"][0]["finish_reason"] in ("stop", "length")


async def until_running(session, worker_url: str, polls: int = 500) -> None:
    """Poll the worker until a generation is running (or the polls run out)."""
    for _ in range(polls):
        async with session.get(f"{worker_url}/get_server_info") as response:
            if (await response.json())["running_requests"] > 0:
                return


def test_abort_all_requests(worker_url: str, tokenizer) -> None:
    body = {
        "input_ids": [tokenizer.encode(f"to abort {i}") for i in range(4)],
        "sampling_params": {"max_new_tokens": 230, "temperature": 0, "ignore_eos": True},
    }

    async def generate_then_abort() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            generation = asyncio.create_task(session.post(f"{worker_url}/generate", json=body))
            await until_running(session, worker_url)
            async with session.post(f"{worker_url}/abort_request", json={"abort_all": True}) as response:
                assert response.status == 200
            async with await generation as response:
                return await response.json()

    results = asyncio.run(generate_then_abort())
    assert all(result["meta_info"]["finish_reason"]["type"] == "abort" for result in results)
    assert all(len(result["output_ids"]) < 230 for result in results)
    assert len(greedy(worker_url, body["input_ids"][0], 3)) == 3  # still serving


def test_a_client_that_goes_away_frees_its_rows(worker_url: str, tokenizer) -> None:
    """A router that times out and retries elsewhere, or a stopped trainer, leaves no generation running."""
    rows, max_new_tokens = 8, 230
    body = {
        "input_ids": [tokenizer.encode(f"nobody waits {i}") for i in range(rows)],
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }

    def server_info() -> dict:
        return json.loads(get(f"{worker_url}/get_server_info")[1])

    tokens_before = server_info()["engine"]["tokens_generated"]

    async def generate_then_hang_up() -> None:
        async with aiohttp.ClientSession() as session:
            generation = asyncio.create_task(session.post(f"{worker_url}/generate", json=body))
            await until_running(session, worker_url)
            generation.cancel()  # the connection closes with the session, no reply read

    asyncio.run(generate_then_hang_up())
    deadline = time.monotonic() + 30
    while server_info()["running_requests"] > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    info = server_info()
    assert info["running_requests"] == 0
    # Ended early, not run to the last token for nobody.
    assert info["engine"]["tokens_generated"] - tokens_before < rows * max_new_tokens
    assert len(greedy(worker_url, body["input_ids"][0], 3)) == 3  # still serving


def test_engine_time_counters_split_a_step_into_prefill_decode_and_idle(worker_url: str) -> None:
    from slime_meta.backends.local.workers.engine_time import WorkerTimeMeter

    meter = WorkerTimeMeter({"teacher": [worker_url]})
    time.sleep(0.3)
    quiet = meter.metrics()
    assert quiet["worker/teacher_idle_time"] >= 0.2  # nothing to do: the thread waited
    assert quiet["worker/teacher_prefill_time"] == 0.0 and quiet["worker/teacher_busy_share"] < 0.05

    greedy(worker_url, list(range(3, 40)), max_new_tokens=24)
    busy = meter.metrics()
    assert busy["worker/teacher_prefill_time"] > 0.0
    # 24 tokens: one from the prefill's logits, 23 from decode steps on one of the two paths.
    assert busy["worker/teacher_fast_decode_time"] + busy["worker/teacher_dynamic_decode_time"] > 0.0
    assert 0.0 < busy["worker/teacher_busy_share"] <= 1.0
    assert busy["worker/teacher_tokens_generated"] == 24 and busy["worker/teacher_decode_steps"] == 23
    assert busy["worker/teacher_prefill_batches"] == 1
    assert busy["worker/teacher_eager_prefill_shapes"] >= 1  # a level: the shapes met so far
    assert "worker/teacher_gpu_allocated_mib" not in busy  # the allocator's figures come from a GPU only
    # A worker that does not answer is left out, not counted as idle.
    assert WorkerTimeMeter({"teacher": ["http://127.0.0.1:9"]}).metrics() == {}


def test_a_worker_counts_the_distinct_eager_prefill_shapes_it_has_run(worker_url: str) -> None:
    """On a GPU each new prefill shape can keep host memory for good; the count tells a run's growth
    from shapes met (it stops when they stop) from memory kept."""

    def shapes() -> int:
        return json.loads(get(f"{worker_url}/get_server_info")[1])["engine"]["eager_prefill_shapes"]

    before = shapes()
    greedy(worker_url, list(range(3, 80)), max_new_tokens=2)  # 77 tokens, a length no other test sends
    assert shapes() == before + 1
    greedy(worker_url, list(range(4, 81)), max_new_tokens=2)  # another prompt of the same shape
    assert shapes() == before + 1
    status, body = post(
        f"{worker_url}/generate",
        {
            "input_ids": [list(range(3, 80)), list(range(5, 82))],  # two rows of 77: a new shape
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        },
    )
    assert status == 200, body
    assert shapes() == before + 2
