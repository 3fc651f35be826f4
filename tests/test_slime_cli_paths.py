"""`train.py --backend slime` names a missing input path in one line before anything starts."""

from __future__ import annotations

import pytest

from slime_meta.backends.slime import cli
from slime_meta.backends.slime.cli import flag_values, main, missing_path


@pytest.fixture
def model_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def test_flag_values_reads_both_spellings_and_multi_value_flags():
    argv = ["--a", "1", "--b=2", "--eval-prompt-data", "name", "/x.jsonl", "--c"]
    assert flag_values(argv, "--a") == ["1"]
    assert flag_values(argv, "--b") == ["2"]
    assert flag_values(argv, "--eval-prompt-data") == ["name", "/x.jsonl"]


def test_every_input_path_is_checked(tmp_path, model_dir):
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    good = ["--hf-checkpoint", str(model_dir), "--ref-load", str(model_dir), "--prompt-data", str(data)]
    assert missing_path(good) is None
    assert "--hf-checkpoint" in missing_path(["--hf-checkpoint", str(tmp_path)])  # a directory without config.json
    assert "--ref-load /nope" in missing_path([*good, "--ref-load", "/nope"])
    assert "--prompt-data" in missing_path([*good[:4], "--prompt-data", str(tmp_path / "missing.jsonl")])
    assert "--eval-prompt-data" in missing_path([*good, "--eval-prompt-data", "name", str(tmp_path / "e.jsonl")])
    # slime's resume pattern: --load is the --save directory, empty until the first save
    assert missing_path([*good, "--load", "/ckpt", "--save", "/ckpt"]) is None
    assert "--load /other" in missing_path([*good, "--load", "/other", "--save", "/ckpt"])


def test_the_launch_stops_with_exit_code_2_and_one_line(tmp_path, model_dir, capsys, monkeypatch):
    monkeypatch.setattr(cli, "missing_slime", lambda: None)  # as on a host with slime installed
    argv = [
        "--use-meta-learning",
        "--hf-checkpoint",
        str(tmp_path / "no-model"),
        "--ref-load",
        str(model_dir),
        "--prompt-data",
        "data/price_lists.jsonl",
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rollout-num-gpus",
        "1",
        "--actor-num-gpus-per-node",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --hf-checkpoint") and "no-model" in err[0]
