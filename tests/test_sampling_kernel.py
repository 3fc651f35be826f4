"""sampling.py's token choice in Triton kernels against torch's: the same greedy tokens, the same log-probs,
and samples drawn from the same distribution.

Checks (each on the CPU under Triton's interpreter, in a child process, and compiled on CUDA):
- greedy rows pick torch's argmax, ties included (equal maxima within a block and across blocks:
  the first wins), with log_softmax's log-prob;
- sampled rows at temperatures 1, 0.5 and 1.7 report log_softmax(logits / T) at the token they
  picked, within 1e-5;
- the frequencies of 5,120 samples (2,560 interpreted) of one row (vocabulary of 5,000 over two
  blocks, most mass on tokens in both) against softmax(logits / T): each strong token within 4.5 standard errors, and
  the total variation over the strong tokens and the rest under 0.03 (x sqrt 2 interpreted);
- a dominant token (p about 0.98) sampled at its probability within 4.5 standard errors: the rare
  rest keeps its mass;
- a seed gives the same tokens again; another seed other tokens;
- the engine with the kernel on: every sampled token's log-prob is a full forward's, within 1e-4.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch
from helpers_interpreter import run_interpreted

from slime_meta_engine.protocol import SamplingParams
from slime_meta_engine.sampling import RowSampling, choose_next_tokens, kernel_can_choose

HAS_CUDA = torch.cuda.is_available()
TRITON_MISSING = importlib.util.find_spec("triton") is None
needs_triton = pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed (e.g. PYTHONPATH=/tmp/triton_site)")
needs_cuda_and_triton = pytest.mark.skipif(not HAS_CUDA or TRITON_MISSING, reason="needs CUDA and triton")
VOCAB = 5000  # two of the kernel's 4,096-column blocks
SAMPLES = {"cuda": 5120, "cpu": 2560}  # the interpreter is slow


def row_sampling(params: list[SamplingParams], device) -> RowSampling:
    return RowSampling.from_params(params, [0] * len(params), VOCAB, device)


def peaked_logits(generator: torch.Generator) -> torch.Tensor:
    """Noise plus five strong tokens, three in the first block and two in the second."""
    logits_V = torch.randn(VOCAB, generator=generator)
    for token, value in ((7, 6.0), (1000, 5.5), (4095, 5.0), (4096, 5.2), (4999, 6.3)):
        logits_V[token] = value
    return logits_V


def check_cases(device: str) -> dict:
    """Every check's figures, computed on `device` (the tests assert on them)."""
    generator = torch.Generator().manual_seed(0)
    out: dict = {}

    # Greedy, with ties: row 0 equal maxima inside a block, row 1 across blocks, row 2 none.
    logits_B_V = torch.randn(3, VOCAB, generator=generator)
    logits_B_V[0, [300, 301, 2000]] = 9.0
    logits_B_V[1, [4500, 12, 4097]] = 9.0
    logits_B_V = logits_B_V.to(device=device, dtype=torch.bfloat16)
    greedy = row_sampling([SamplingParams(max_new_tokens=1, temperature=0.0)] * 3, device)
    assert kernel_can_choose(logits_B_V, greedy)
    choice = choose_next_tokens(logits_B_V, greedy, None, kernel_seed=123)
    expected = torch.log_softmax(logits_B_V.float(), dim=-1)
    out["greedy_tokens"] = choice.token_ids.tolist()
    out["greedy_expected"] = logits_B_V.float().argmax(-1).tolist()
    out["greedy_logprob_error"] = float(
        (choice.logprobs - expected.gather(1, choice.token_ids[:, None])[:, 0]).abs().max()
    )

    # Sampled rows at three temperatures, and a greedy row among them.
    temperatures = (1.0, 0.5, 1.7, 0.0)
    logits_B_V = torch.randn(4, VOCAB, generator=generator).mul(3).to(device)
    params = [SamplingParams(max_new_tokens=1, temperature=t) for t in temperatures]
    mixed = row_sampling(params, device)
    choice = choose_next_tokens(logits_B_V, mixed, None, kernel_seed=7)
    scaled = logits_B_V / mixed.temperatures[:, None]
    expected = torch.log_softmax(scaled, dim=-1).gather(1, choice.token_ids[:, None])[:, 0]
    out["mixed_logprob_error"] = float((choice.logprobs - expected).abs().max())
    out["mixed_greedy_row"] = [int(choice.token_ids[3]), int(logits_B_V[3].argmax())]

    # The distribution: 256 copies of one row, 20 seeds.
    for temperature in (1.0, 0.5):
        logits_V = peaked_logits(generator).to(device)
        copies = 256
        batch = row_sampling([SamplingParams(max_new_tokens=1, temperature=temperature)] * copies, device)
        logits_B_V = logits_V.expand(copies, VOCAB)
        counts = torch.zeros(VOCAB, dtype=torch.float64)
        samples = SAMPLES[device]
        for seed in range(samples // copies):
            picked = choose_next_tokens(logits_B_V, batch, None, kernel_seed=1000 + seed).token_ids.cpu()
            counts += torch.bincount(picked, minlength=VOCAB).double()
        probs = torch.softmax(logits_V.double().cpu() / temperature, dim=-1)
        frequencies = counts / samples
        strong = probs > 0.01
        errors = (frequencies[strong] - probs[strong]).abs() / (probs[strong] * (1 - probs[strong]) / samples).sqrt()
        out[f"distribution_T{temperature}"] = {
            "samples": samples,
            "strong_tokens": int(strong.sum()),
            "max_standard_errors": float(errors.max()),
            # Over the strong tokens and one bucket for all the rest (5,000 rare tokens' own
            # frequencies from 5,120 samples say little each).
            "total_variation": float(
                0.5
                * (
                    (frequencies[strong] - probs[strong]).abs().sum()
                    + (frequencies[~strong].sum() - probs[~strong].sum()).abs()
                )
            ),
        }

    # A dominant token, as a trained model's next token often is (p about 0.98): the rest must keep
    # its mass. A sampler that thinned the tail would score answers above the policy's own rate
    # while reporting the policy's log-probs, a bias no importance ratio sees.
    logits_V = torch.randn(VOCAB, generator=generator)
    logits_V[4321] = 13.0
    copies, samples = 256, SAMPLES[device]
    batch = row_sampling([SamplingParams(max_new_tokens=1, temperature=1.0)] * copies, device)
    hits = 0
    for seed in range(samples // copies):
        picked = choose_next_tokens(logits_V.to(device).expand(copies, VOCAB), batch, None, kernel_seed=3000 + seed)
        hits += int((picked.token_ids == 4321).sum())
    probability = float(torch.softmax(logits_V.double(), dim=-1)[4321])
    frequency = hits / samples
    standard_error = math.sqrt(probability * (1 - probability) / samples)
    out["dominant_token"] = {
        "samples": samples,
        "probability": probability,
        "frequency": frequency,
        "standard_errors": (frequency - probability) / standard_error,
    }

    # Seeds.
    logits_B_V = torch.randn(64, VOCAB, generator=generator).to(device)
    batch = row_sampling([SamplingParams(max_new_tokens=1, temperature=1.0)] * 64, device)
    first = choose_next_tokens(logits_B_V, batch, None, kernel_seed=5).token_ids.tolist()
    again = choose_next_tokens(logits_B_V, batch, None, kernel_seed=5).token_ids.tolist()
    other = choose_next_tokens(logits_B_V, batch, None, kernel_seed=6).token_ids.tolist()
    out["same_seed_same_tokens"] = first == again
    out["other_seed_rows_differing"] = sum(a != b for a, b in zip(first, other))
    out["engine"] = engine_check(device)
    return out


def engine_check(device: str) -> dict:
    """Sampled requests through the engine with the kernel on: log-probs against a full forward."""
    from test_worker_static_decode import full_logprobs, random_prompts, submit_all, tiny_model

    from slime_meta_engine import sampling
    from slime_meta_engine.engine import GenerationEngine
    from slime_meta_engine.protocol import GenerationSpec

    used = {"calls": 0}
    original = sampling._choose_with_kernel

    def counted(*args, **kwargs):
        used["calls"] += 1
        return original(*args, **kwargs)

    sampling._choose_with_kernel = counted
    model = tiny_model("qwen2", device=device)
    engine = GenerationEngine(
        model,
        decode=lambda ids, skip: "",
        device=model.device,
        eos_token_ids=frozenset(),
        pad_token_id=0,
        max_batch_size=4,
        sampling_kernel_on=True,
    )
    prompts = random_prompts([5, 11, 3, 8, 20], seed=3)
    specs = [
        GenerationSpec(f"s{i}", tuple(p), SamplingParams(max_new_tokens=9, temperature=t, ignore_eos=True), True)
        for i, (p, t) in enumerate(zip(prompts, (1.0, 0.7, 1.3, 1.0, 0.0)))
    ]
    engine.start()
    try:
        results = submit_all(engine, specs)
    finally:
        engine.stop()
        sampling._choose_with_kernel = original
    worst = 0.0
    for spec, result in zip(specs, results):
        temperature = spec.sampling.temperature or 1.0
        expected = full_logprobs(model, list(spec.input_ids) + list(result.output_ids), temperature)
        for step, (token, logprob) in enumerate(zip(result.output_ids, result.output_logprobs)):
            worst = max(worst, abs(logprob - float(expected[len(spec.input_ids) - 1 + step, token])))
    return {"kernel_calls": used["calls"], "tokens": sum(len(r.output_ids) for r in results), "max_error": worst}


def _interpreted_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    print(json.dumps(check_cases("cpu")))


def assert_cases(out: dict) -> None:
    assert out["greedy_tokens"] == out["greedy_expected"] == [300, 12, out["greedy_expected"][2]]
    assert out["greedy_logprob_error"] < 1e-5
    assert out["mixed_logprob_error"] < 1e-5
    assert out["mixed_greedy_row"][0] == out["mixed_greedy_row"][1]
    for temperature in (1.0, 0.5):
        figures = out[f"distribution_T{temperature}"]
        assert figures["strong_tokens"] >= 4, figures
        assert figures["max_standard_errors"] < 4.5, figures
        assert figures["total_variation"] < 0.03 * math.sqrt(5120 / figures["samples"]), figures
    dominant = out["dominant_token"]
    assert 0.95 < dominant["probability"] < 0.995 and abs(dominant["standard_errors"]) < 4.5, dominant
    assert out["same_seed_same_tokens"] and out["other_seed_rows_differing"] > 32
    engine = out["engine"]
    assert engine["tokens"] == 45 and engine["kernel_calls"] >= 9 and engine["max_error"] < 1e-4, engine


@needs_triton
def test_kernel_choice_matches_torch_interpreted() -> None:
    assert_cases(run_interpreted(__file__))


@pytest.mark.gpu
@needs_cuda_and_triton
def test_kernel_choice_matches_torch_on_cuda() -> None:
    assert_cases(check_cases("cuda"))


def test_cuts_and_top_logprobs_stay_with_torch() -> None:
    """No triton needed: which batches the kernel may serve."""
    logits_B_V = torch.randn(2, VOCAB)
    plain = row_sampling([SamplingParams(max_new_tokens=1, temperature=1.0)] * 2, "cpu")
    cut = row_sampling([SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.9)] * 2, "cpu")
    tops = RowSampling.from_params([SamplingParams(max_new_tokens=1, temperature=1.0)] * 2, [0, 3], VOCAB, "cpu")
    assert not kernel_can_choose(logits_B_V, cut) and not kernel_can_choose(logits_B_V, tops)
    if os.environ.get("TRITON_INTERPRET") != "1":  # the CPU without the interpreter: torch's ops
        assert not kernel_can_choose(logits_B_V, plain)
        generator = torch.Generator().manual_seed(0)
        choice = choose_next_tokens(logits_B_V, plain, generator, kernel_seed=1)
        expected = torch.log_softmax(logits_B_V, -1).gather(1, choice.token_ids[:, None])[:, 0]
        assert torch.allclose(choice.logprobs, expected) and math.isfinite(float(choice.logprobs.sum()))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _interpreted_main()
