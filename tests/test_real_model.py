"""The shipped real model (SmolLM2-135M-Instruct: Llama, 9 query heads over 3 KV heads, tied embeddings,
a ChatML template, EOS `<|im_end|>`) through the embedded inference engine, against Hugging Face in
float32 on CPU; and a `.gguf` checkpoint flag resolved into the config.

The engine is checked on both its decode paths: the DynamicCache path a CPU worker runs, and the
static-cache forward a GPU worker captures in CUDA graphs (eager here). The chat-template prompts go in
together, so rows of different lengths share a batch. Greedy tokens must equal HF `generate`'s, EOS
included where the model ends its answer, and each token's log-prob must lie within 1e-4 of HF's full
forward.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers_real import GREEDY_NEW_TOKENS, LONG_ANSWER_QUESTIONS, SHORT_ANSWER_QUESTION, real_gguf_or_skip
from helpers_worker import embedded_worker, post

from slime_meta.models.real import GGUF_NAME, GGUF_SHA256

REPO_ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = GREEDY_NEW_TOKENS
LOGPROB_TOLERANCE = 1e-4
BASE_FLAGS = ["--use-meta-learning", "--prompt-data", "data/math_word_problems.jsonl"]


@pytest.fixture(scope="module")
def real_tokenizer(real_checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_checkpoint)


@pytest.fixture(scope="module")
def real_model(real_checkpoint: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_checkpoint, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def hf_greedy(real_hf_greedy) -> dict[str, tuple[list[int], list[int]]]:
    """question -> (prompt ids, HF generate's greedy tokens, stopping at the model's own EOS), computed once per
    session (conftest.py) and shared with the paged engine's test."""
    return real_hf_greedy


def full_forward_logprobs(model, prompt: list[int], output_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(output_ids)[:, None])[:, 0]


def test_the_model_is_the_one_described(real_model, real_tokenizer, hf_greedy) -> None:
    config = real_model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (9, 3, True)
    assert real_model.lm_head.weight.data_ptr() == real_model.model.embed_tokens.weight.data_ptr()  # tied
    special = (real_tokenizer.bos_token, real_tokenizer.eos_token, real_tokenizer.eos_token_id)
    assert special == ("<|im_start|>", "<|im_end|>", 2)
    assert real_tokenizer.encode("Hello") == real_tokenizer.encode("Hello", add_special_tokens=False)  # no BOS added
    for question in LONG_ANSWER_QUESTIONS:  # the premise of the parity test: answers longer than 32 tokens
        assert len(hf_greedy[question][1]) == NEW_TOKENS and real_tokenizer.eos_token_id not in hf_greedy[question][1]
    assert hf_greedy[SHORT_ANSWER_QUESTION][1][-1] == real_tokenizer.eos_token_id


@pytest.mark.parametrize("decode_path", ["dynamic_cache", "static_eager"])
def test_engine_matches_hf_greedy_tokens_and_logprobs(decode_path: str, real_model, real_tokenizer, hf_greedy) -> None:
    from slime_meta_engine.engine import GenerationEngine
    from slime_meta_engine.fast_path.static.batch import build_static_batch
    from slime_meta_engine.protocol import GenerationSpec, SamplingParams
    from slime_meta_engine.rows import GenerationJob
    from slime_meta_engine.server import _eos_token_ids

    pad = real_tokenizer.pad_token_id
    static = (
        build_static_batch(real_model, num_slots=8, requested_capacity=256, pad_token_id=pad, use_graphs=False)
        if decode_path == "static_eager"
        else None
    )
    eos_ids = _eos_token_ids(real_tokenizer, real_model)  # what the worker stops on
    assert eos_ids == frozenset({real_tokenizer.eos_token_id})
    engine = GenerationEngine(
        real_model,
        decode=lambda ids, skip: real_tokenizer.decode(list(ids), skip_special_tokens=skip),
        device=torch.device("cpu"),
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        max_batch_size=8,
        static_batch=static,
    )
    outcomes: dict[str, object] = {}
    done = threading.Semaphore(0)

    def on_done(outcome, question: str) -> None:
        outcomes[question] = outcome
        done.release()

    jobs = [
        GenerationJob(
            GenerationSpec(
                f"q{i}", tuple(prompt), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0), return_logprob=True
            ),
            on_done=lambda outcome, question=question: on_done(outcome, question),
        )
        for i, (question, (prompt, _)) in enumerate(hf_greedy.items())
    ]
    engine.start()
    try:
        engine.submit_all(jobs)  # admitted together: one batch of rows of different lengths
        for _ in jobs:
            assert done.acquire(timeout=300)
    finally:
        engine.stop()
    assert engine.decode_path == decode_path
    for question, (prompt, reference) in hf_greedy.items():
        finished = outcomes[question]
        assert not isinstance(finished, BaseException), finished
        assert finished.output_ids == reference, (question, real_tokenizer.decode(finished.output_ids))
        diff = (torch.tensor(finished.output_logprobs) - full_forward_logprobs(real_model, prompt, reference)).abs()
        assert float(diff.max()) < LOGPROB_TOLERANCE, (question, float(diff.max()))
    short = outcomes[SHORT_ANSWER_QUESTION]
    assert short.finish_reason == {"type": "stop", "matched": real_tokenizer.eos_token_id}
    assert short.text == real_tokenizer.decode(short.output_ids[:-1]) and "<|im_end|>" not in short.text
    assert "8" in short.text  # 3 + 5: the real model's answer, not noise
    assert all(outcomes[q].finish_reason["type"] == "length" for q in LONG_ANSWER_QUESTIONS)


def test_worker_serves_chat_completions_as_hf_greedy(
    real_checkpoint: Path, real_tokenizer, hf_greedy, tmp_path
) -> None:
    """The worker process renders the chat template itself and stops at the model's EOS."""
    with embedded_worker(real_checkpoint, tmp_path / "worker.log", "--num-threads", "2") as url:
        for question, finish_reason in ((SHORT_ANSWER_QUESTION, "stop"), (LONG_ANSWER_QUESTIONS[0], "length")):
            body = {"messages": [{"role": "user", "content": question}], "max_tokens": NEW_TOKENS, "temperature": 0}
            status, answer = post(f"{url}/v1/chat/completions", body, timeout_s=120)
            assert status == 200, answer
            choice = answer["choices"][0]
            reference = hf_greedy[question][1]
            assert choice["message"]["content"] == real_tokenizer.decode(reference, skip_special_tokens=True)
            assert choice["finish_reason"] == finish_reason


# ----------------------------------------------------------------------------- a .gguf checkpoint flag


def test_gguf_flag_is_converted_once_and_every_consumer_sees_the_directory(tmp_path, monkeypatch, capsys) -> None:
    from slime_meta.artifacts.model_files import with_converted_checkpoints
    from slime_meta.assembly import load_tokenizer
    from slime_meta.backends.local.inputs import check_model_dir
    from slime_meta.backends.slime.plan import translate
    from slime_meta.config.arguments import parse_config
    from slime_meta.rollout.context_budget import context_length_of

    gguf = real_gguf_or_skip()
    monkeypatch.setenv("SLIME_META_CACHE", str(tmp_path / "cache"))
    directory = tmp_path / "cache" / "checkpoints" / f"{GGUF_NAME.removesuffix('.gguf')}-{GGUF_SHA256[:12]}"
    flags = [*BASE_FLAGS, "--hf-checkpoint", str(gguf), "--student-checkpoint", str(gguf)]

    cfg = with_converted_checkpoints(parse_config(flags))
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines == [
        f"--hf-checkpoint {gguf}: converting it once to the HF checkpoint directory {directory} (later runs reuse it)"
    ]
    assert captured.err == ""  # no progress bars
    assert cfg.pools.hf_checkpoint == cfg.pools.student_checkpoint == str(directory)
    assert check_model_dir(cfg.pools.hf_checkpoint, "--hf-checkpoint") == str(directory)
    assert context_length_of(cfg.pools.hf_checkpoint) == 8192
    assert load_tokenizer(cfg.pools.student_checkpoint).eos_token == "<|im_end|>"
    assert load_tokenizer(cfg.pools.hf_checkpoint).chat_template  # the GGUF's template came along
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config and config["num_key_value_heads"] == 3
    marker = json.loads((directory / "conversion.json").read_text())
    assert marker["sha256"] == GGUF_SHA256 and marker["parameters"] == 134_515_008
    assert [p.name for p in directory.parent.iterdir()] == [directory.name]  # no staging directory left
    converted_at = (directory / "model.safetensors").stat().st_mtime_ns

    again = with_converted_checkpoints(parse_config(flags))  # a later run: the same directory, nothing converted
    assert capsys.readouterr().out.splitlines() == [
        f"--hf-checkpoint {gguf}: using its HF checkpoint directory {directory} (converted earlier)"
    ]
    assert again.pools.hf_checkpoint == str(directory)
    assert (directory / "model.safetensors").stat().st_mtime_ns == converted_at

    # The slime backend hands its own parser the command line: the directory is what it reads there.
    slime_flags = ["--colocate", "--ref-load", str(tmp_path / "ref"), "--run-dir", str(tmp_path / "run")]
    plan = translate([*BASE_FLAGS, "--hf-checkpoint", str(gguf), *slime_flags])
    argv = list(plan.slime_argv)
    assert argv[argv.index("--hf-checkpoint") + 1] == str(directory) and str(gguf) not in argv
    assert plan.layout.teacher.model_path == str(directory)


def test_gguf_flag_errors_are_one_line_with_exit_code_2(tmp_path, monkeypatch, capsys) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    import train

    gguf = real_gguf_or_skip()
    monkeypatch.setenv("SLIME_META_CACHE", str(tmp_path / "cache"))  # nothing converted there yet
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    cases = [
        (tmp_path / "missing.gguf", "no such file; give a .gguf file or a local HF checkpoint directory"),
        (broken, "transformers cannot read it as a GGUF model"),
    ]
    for path, message in cases:
        assert train.main([*BASE_FLAGS, "--hf-checkpoint", str(path)]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and error[0].startswith(f"error: --hf-checkpoint {path}: "), error
        assert message in error[0], error
    # Without the gguf package (hidden from the import system): the pip command to run.
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert train.main([*BASE_FLAGS, "--student-checkpoint", str(gguf)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [
        f"error: --student-checkpoint {gguf}: reading a .gguf file needs the package(s) gguf: "
        "pip install gguf accelerate (or pip install 'slime-meta[real]')"
    ]
    assert not (tmp_path / "cache" / "checkpoints").exists() or not any((tmp_path / "cache" / "checkpoints").iterdir())
