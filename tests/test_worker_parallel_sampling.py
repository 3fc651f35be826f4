"""SGLang's parallel sampling (`sampling_params.n`): k completions of one prompt from one request.

Checked in-process (the generation loop prefills the prompt once and its k rows decode like k
separate requests would) and over real HTTP through the real sglang-router (which forwards `n`
inside sampling_params; the answer is a list of k result objects, as SGLang sends it).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_tiny import full_logprobs

from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.protocol import GenerationSpec, SamplingParams
from slime_meta_engine.rows import GenerationJob


def assert_logprobs_match(model, prompt: list[int], output_ids: list[int], logprobs: list[float]) -> None:
    expected = full_logprobs(model, prompt + output_ids)
    for step, (token, logprob) in enumerate(zip(output_ids, logprobs)):
        assert logprob == pytest.approx(float(expected[len(prompt) - 1 + step, token]), abs=1e-4), step


def run_together(engine: GenerationEngine, specs: list[GenerationSpec]) -> list:
    outcomes: dict[str, Any] = {}
    done = threading.Semaphore(0)

    def on_done(outcome, rid) -> None:
        outcomes[rid] = outcome
        done.release()

    engine.submit_all(
        [GenerationJob(spec, on_done=lambda outcome, rid=spec.rid: on_done(outcome, rid)) for spec in specs]
    )
    for _ in specs:
        assert done.acquire(timeout=120)
    return [outcomes[spec.rid] for spec in specs]


def test_samples_of_one_prompt_share_one_prefill_and_decode_as_if_alone(reference_model, tokenizer) -> None:
    engine = GenerationEngine(
        reference_model,
        decode=lambda ids, skip: tokenizer.decode(list(ids), skip_special_tokens=skip),
        device=torch.device("cpu"),
        eos_token_ids=frozenset(),
        pad_token_id=tokenizer.pad_token_id,
    )
    engine.start()
    try:
        shared = tokenizer.encode("a shared prompt")
        other = tokenizer.encode("a longer prompt beside it, so the shared rows are left-padded")
        sampled = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)
        specs = [GenerationSpec(f"s{j}", tuple(shared), sampled, True, shared_prefill="g") for j in range(4)]
        specs.append(GenerationSpec("o", tuple(other), sampled, True))
        before = dict(engine.counters)
        results = run_together(engine, specs)
        assert engine.counters["prefill_prompts"] - before["prefill_prompts"] == 2  # not 5
        assert engine.counters["shared_prefill_rows"] - before["shared_prefill_rows"] == 3
        for spec, result in zip(specs, results):
            assert len(result.output_ids) == 10
            # Each row's log-probs against a fresh full forward: its copied cache is its prompt's.
            assert_logprobs_match(reference_model, list(spec.input_ids), result.output_ids, result.output_logprobs)
        assert len({tuple(r.output_ids) for r in results[:4]}) > 1  # independent samples, not copies

        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        alone = run_together(engine, [GenerationSpec("alone", tuple(shared), greedy, True)])[0]
        group = run_together(
            engine, [GenerationSpec(f"g{j}", tuple(shared), greedy, True, shared_prefill="k") for j in range(3)]
        )
        assert all(r.output_ids == alone.output_ids for r in group)
    finally:
        engine.stop()


# ----- over HTTP, through the real router -----------------------------------------------------


def post(url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def server_info(worker_url: str) -> dict:
    with urllib.request.urlopen(f"{worker_url}/get_server_info", timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def pool(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("n-pool")
    with LocalProcessGroup(startup_timeout_s=120) as group:
        yield group.start_pool("student", str(tiny_checkpoint), 1, device="cpu", weights_root=None, log_dir=str(logs))


def test_router_forwards_n_and_returns_a_list_of_n_results(pool, tokenizer, reference_model) -> None:
    worker = pool.worker_urls[0]
    ids = tokenizer.encode("parallel sampling")
    before = server_info(worker)
    status, reply = post(
        f"{pool.router_url}/generate",
        {
            "input_ids": ids,
            "sampling_params": {"n": 4, "max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert status == 200, reply
    assert isinstance(reply, list) and len(reply) == 4
    for result in reply:
        meta = result["meta_info"]
        assert len(result["output_ids"]) == 8 and meta["completion_tokens"] == 8 and meta["prompt_tokens"] == len(ids)
        assert [entry[1] for entry in meta["output_token_logprobs"]] == result["output_ids"]
        assert_logprobs_match(reference_model, ids, result["output_ids"], [e[0] for e in meta["output_token_logprobs"]])
    assert len({r["meta_info"]["id"] for r in reply}) == 4
    after = server_info(worker)
    assert after["num_generate_requests"] - before["num_generate_requests"] == 1
    assert after["engine"]["prefill_prompts"] - before["engine"]["prefill_prompts"] == 1
    assert after["engine"]["shared_prefill_rows"] - before["engine"]["shared_prefill_rows"] == 3

    status, single = post(
        f"{pool.router_url}/generate", {"input_ids": ids, "sampling_params": {"n": 1, "max_new_tokens": 2}}
    )
    assert status == 200 and isinstance(single, dict) and len(single["output_ids"]) == 2
    status, _ = post(f"{worker}/generate", {"input_ids": ids, "sampling_params": {"n": 0}})
    assert status == 400


def test_batched_prompts_with_n_come_back_prompt_major(pool, tokenizer) -> None:
    short, long = tokenizer.encode("ab"), tokenizer.encode("a longer one")
    status, reply = post(
        f"{pool.worker_urls[0]}/generate",
        {
            "input_ids": [short, long],
            "sampling_params": {"n": 2, "max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert status == 200, reply
    assert [r["meta_info"]["prompt_tokens"] for r in reply] == [len(short), len(short), len(long), len(long)]
    # Scoring rows of a shared prompt: the same prompt log-probs in each.
    assert reply[0]["meta_info"]["input_token_logprobs"] == reply[1]["meta_info"]["input_token_logprobs"]
    assert reply[2]["meta_info"]["input_token_logprobs"] == reply[3]["meta_info"]["input_token_logprobs"]


def test_student_sends_the_m_attempts_of_a_problem_as_one_request(pool, tiny_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    from slime_meta.prompt_templates import GeneratorPromptTemplate
    from slime_meta.rollout.pools import SGLangPool
    from slime_meta.rollout.roles import PromptRenderer, StudentRole
    from slime_meta.types import Problem

    renderer = PromptRenderer(AutoTokenizer.from_pretrained(tiny_checkpoint), apply_chat_template=False)
    problem = Problem(uid="p0", prompt="What is 2 + 3?", label="5")
    worker = pool.worker_urls[0]

    async def solve() -> tuple[list, SGLangPool]:
        client = SGLangPool(name="student", base_url=pool.router_url)
        student = StudentRole(
            pool=client,
            template=GeneratorPromptTemplate(),
            renderer=renderer,
            info_position="prefix",
            temperature=1.0,
            max_new_tokens=6,
            context_length=256,
        )
        try:
            _, completions = await student.solve_n(problem, "Add.", 5, with_tokens=True)
        finally:
            await client.close()
        return completions, client

    before = server_info(worker)["num_generate_requests"]
    completions, client = asyncio.run(solve())
    assert len(completions) == 5 and all(len(c.output_ids) == len(c.output_logprobs) > 0 for c in completions)
    assert client.stats.requests == 1 and server_info(worker)["num_generate_requests"] - before == 1
