"""The GGUF conversion's recipe details that need no GGUF: the tokenizer's EOS agrees with the model's,
and a conversion cached by an older recipe is redone in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slime_meta.artifacts import model_files
from slime_meta.artifacts.model_files import CONVERSION_VERSION, MARKER, agree_on_eos, ensure_converted, is_converted


def test_the_tokenizer_takes_the_models_eos_where_it_read_another(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model_eos = tokenizer.eos_token_id
    tokenizer.eos_token = "<s>"  # what a GGUF reader got wrong: the BOS as EOS
    assert tokenizer.eos_token_id != model_eos
    agree_on_eos(tokenizer, model_eos)
    assert tokenizer.eos_token_id == model_eos and tokenizer.eos_token == "</s>"
    agree_on_eos(tokenizer, [model_eos, 0])  # a config may list several: the first is the tokenizer's
    assert tokenizer.eos_token_id == model_eos
    agree_on_eos(tokenizer, None)  # a config without one leaves the tokenizer as it is
    assert tokenizer.eos_token_id == model_eos


def test_a_conversion_by_an_older_recipe_is_redone(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in: the conversion below is replaced")
    conversions = []

    def convert(path: Path, out_dir: Path, flag: str = "checkpoint") -> dict:
        conversions.append(path)
        (out_dir / "config.json").write_text("{}")
        return {"model_type": "llama"}

    monkeypatch.setattr(model_files, "convert_gguf", convert)
    monkeypatch.setattr(model_files, "require_gguf_packages", lambda flag, path: None)
    first, seconds = ensure_converted(gguf, root=tmp_path / "cache")
    assert seconds is not None and is_converted(first) and len(conversions) == 1
    assert ensure_converted(gguf, root=tmp_path / "cache") == (first, None)  # reused
    assert len(conversions) == 1

    marker = json.loads((first / MARKER).read_text())
    marker["conversion_version"] = CONVERSION_VERSION - 1
    (first / MARKER).write_text(json.dumps(marker))
    (first / "left-by-the-old-recipe").write_text("x")
    assert not is_converted(first)
    again, seconds = ensure_converted(gguf, root=tmp_path / "cache")
    assert again == first and seconds is not None and len(conversions) == 2
    assert json.loads((again / MARKER).read_text())["conversion_version"] == CONVERSION_VERSION
    assert not (again / "left-by-the-old-recipe").exists()
    assert [p.name for p in again.parent.iterdir()] == [again.name]  # nothing set aside is left


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]"])
def test_a_broken_marker_is_not_a_conversion(tmp_path, text):
    (tmp_path / MARKER).write_text(text)
    assert not is_converted(tmp_path)
