"""The tiny model builder: an exact character tokenizer, a loadable HF checkpoint, the cache.

Builds run for real on CPU with a handful of steps on a small data file (2 words a family), so
each takes a few seconds; the full build's accuracy is measured by the CLI, not here.
"""

from __future__ import annotations

import contextlib
import io
import json
import string
from pathlib import Path

import pytest
import torch

from slime_meta.data.tasks import synthetic
from slime_meta.models.tiny import build as tiny
from slime_meta.models.tiny import tokenizer as tiny_tokenizer
from slime_meta.types import Grade, GradedAttempt, Problem

FEW_STEPS = 4


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    return synthetic.write_jsonl(synthetic.generate_rows(seed=0, words_per_family=2), path)


@pytest.fixture(scope="session")
def tokenizer(small_data):
    return tiny_tokenizer.train_char_tokenizer(tiny.tokenizer_corpus(tiny.read_rows(small_data)))


@pytest.fixture(scope="session")
def checkpoint(small_data, tmp_path_factory) -> Path:
    """One real build through the CLI entry point; its last stdout line is the path."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        tiny.main(["--out", str(out), "--steps", str(FEW_STEPS), "--data-path", str(small_data)])
    assert stdout.getvalue().strip().splitlines()[-1] == str(out)
    return out


def sample_prompts() -> list[str]:
    problem = Problem(uid="a", prompt="kqpd", label="kqpddf")
    teacher = synthetic.SyntheticTeacherTemplate().build(
        [problem], [[GradedAttempt(problem, "kqpdab.", Grade(0.0))]], "ab"
    )[0]["content"]
    return ["Sdf|kqpd=kqpddf.", "S|kqpd=", teacher + "df."]


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_one_token_per_character_for_the_formats(tokenizer):
    for text in sample_prompts():
        ids = tokenizer.encode(text)
        assert len(ids) == len(text)  # fixed lengths: no merges, no BOS
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize(
    "text",
    [
        string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", ""),
        "What is 12 + 7 * (3 - 1)?  Answer: x = 26.\n\tDone!",
        "  leading and trailing spaces  ",
        "unicode: héllo × π ≈ 3.14 — 😀",
    ],
)
def test_tokenizer_round_trips_any_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert tokenizer.unk_token_id not in ids  # byte fallback instead of <unk>
    assert tokenizer.bos_token_id not in ids and tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_are_set(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}) == 4
    assert tokenizer.decode([tokenizer.encode("ab")[0], tokenizer.eos_token_id], skip_special_tokens=True) == "a"


# ---------------------------------------------------------------------------- checkpoint


def test_checkpoint_loads_with_auto_classes(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded_tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert (checkpoint / "model.safetensors").exists()
    assert model.config.hidden_size == 96 and model.config.num_hidden_layers == 4
    assert model.config.vocab_size == len(loaded_tokenizer)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 0.7e6
    assert model.generation_config.eos_token_id == loaded_tokenizer.eos_token_id
    for text in sample_prompts():
        assert loaded_tokenizer.decode(loaded_tokenizer.encode(text), skip_special_tokens=True) == text

    inputs = loaded_tokenizer(["Sdf|kqpd="], return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert output.shape[0] == 1 and inputs["input_ids"].shape[1] < output.shape[1] <= inputs["input_ids"].shape[1] + 3


def test_summary_records_settings_and_metrics(checkpoint, small_data):
    summary = json.loads((checkpoint / "summary.json").read_text())
    assert summary["settings"]["steps"] == FEW_STEPS
    assert summary["settings"]["teacher_correct_fraction"] == 0.5
    assert summary["data_sha256"] == tiny.file_sha256(small_data)
    for key in (
        "student_exact_correct_hint",
        "student_per_char_no_hint",
        "student_exact_random_hint",
        "teacher_hint_exact_greedy",
    ):
        assert 0.0 <= summary["metrics"][key] <= 1.0


def test_build_is_deterministic_for_a_seed(small_data, tmp_path):
    from safetensors.torch import load_file

    first = tiny.build_tiny_checkpoint(tmp_path / "a", data_path=small_data, steps=2, log=lambda _: None)
    second = tiny.build_tiny_checkpoint(tmp_path / "b", data_path=small_data, steps=2, log=lambda _: None)
    weights_a, weights_b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------------------- cache


def test_cache_key_follows_settings_data_and_version(small_data, tmp_path, monkeypatch):
    base = dict(data_path=small_data, seed=0, steps=10, teacher_correct_fraction=0.5, device="cpu")
    key = tiny.cache_key(**base)
    assert tiny.cache_key(**base) == key
    for change in ({"seed": 1}, {"steps": 11}, {"teacher_correct_fraction": 0.6}, {"device": "cuda"}):
        assert tiny.cache_key(**{**base, **change}) != key, change

    same_content = tmp_path / "copy.jsonl"
    same_content.write_bytes(small_data.read_bytes())
    assert tiny.cache_key(**{**base, "data_path": same_content}) == key  # content, not path
    edited = tmp_path / "edited.jsonl"
    edited.write_text(small_data.read_text().replace("f00", "f99", 1))
    assert tiny.cache_key(**{**base, "data_path": edited}) != key

    monkeypatch.setattr(tiny, "BUILD_VERSION", tiny.BUILD_VERSION + 1)
    assert tiny.cache_key(**base) != key


def test_ensure_builds_once_then_hits_the_cache(small_data, tmp_path, monkeypatch):
    quiet = lambda _: None  # noqa: E731
    first = tiny.ensure_tiny_checkpoint(tmp_path, data_path=small_data, steps=2, log=quiet)
    assert (first / "summary.json").exists() and first.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left

    def must_not_build(*args, **kwargs):
        raise AssertionError("a cached checkpoint was rebuilt")

    monkeypatch.setattr(tiny, "build_tiny_checkpoint", must_not_build)
    assert tiny.ensure_tiny_checkpoint(tmp_path, data_path=small_data, steps=2, log=quiet) == first


def test_a_failed_build_leaves_nothing_behind(small_data, tmp_path, monkeypatch):
    def half_build(out_dir, **kwargs):
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tiny, "build_tiny_checkpoint", half_build)
    with pytest.raises(RuntimeError):
        tiny.ensure_tiny_checkpoint(tmp_path, data_path=small_data, steps=2)
    assert list(tmp_path.iterdir()) == []
