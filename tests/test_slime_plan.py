"""The slime backend without slime: flag translation, GPU accounting, --sglang-config, dry runs.

Everything here runs on a laptop: the translation reads our flags, passes slime's through, and
decides GPUs per role from slime's placement rules (facts in slime_meta/backends/slime/plan.py).
The launch scripts themselves run with --dry-run in tests/test_launch_dry_runs.py.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types

import pytest
import yaml
from helpers_slime_plan import BASE, REPO, plan_of, value  # noqa: F401

from slime_meta.backends.slime import cli
from slime_meta.backends.slime.argv import absolute_paths, without
from slime_meta.backends.slime.data import convert
from slime_meta.backends.slime.flags import config_from_slime_args, meta_arguments_skipping
from slime_meta.backends.slime.plan import meta_parser
from slime_meta.errors import UserInputError

# ----------------------------------------------------------------------------- GPU accounting


def test_shared_pool_colocated_on_one_node():
    plan = plan_of("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate")
    lay = plan.layout
    assert (lay.training_gpus, lay.teacher.num_gpus, lay.student, lay.total_gpus, lay.nodes) == (8, 8, None, 8, 1)
    assert lay.sglang_config() is None and plan.sglang_config_path is None
    argv = list(plan.slime_argv)
    assert value(argv, "--rollout-num-gpus") == "8" and "--sglang-config" not in argv and "--colocate" in argv


def test_split_node_generates_a_frozen_student_model():
    plan = plan_of(
        "--actor-num-gpus-per-node",
        "4",
        "--rollout-num-gpus",
        "2",
        "--student-checkpoint",
        "/ckpt/student",
        "--student-num-gpus",
        "2",
        "--student-num-gpus-per-engine",
        "2",
    )
    lay = plan.layout
    assert (lay.training_gpus, lay.rollout_gpus, lay.total_gpus, lay.nodes) == (4, 4, 8, 1)
    # slime asserts --rollout-num-gpus == the sum over the --sglang-config models.
    assert value(plan.slime_argv, "--rollout-num-gpus") == "4"
    config = yaml.safe_load(plan.sglang_config_yaml())
    actor, student = config["sglang"]
    assert actor == {
        "name": "actor",
        "model_path": "/ckpt/teacher",
        "update_weights": True,
        "server_groups": [{"worker_type": "regular", "num_gpus": 2, "num_gpus_per_engine": 1}],
    }
    assert student["name"] == "student" and student["model_path"] == "/ckpt/student"
    assert student["update_weights"] is False
    assert student["server_groups"] == [{"worker_type": "regular", "num_gpus": 2, "num_gpus_per_engine": 2}]
    assert value(plan.slime_argv, "--sglang-config") == str(plan.run_dir / "sglang_config.yaml")


def test_two_nodes_teacher_colocated_student_on_its_own_gpus():
    plan = plan_of(
        "--actor-num-gpus-per-node",
        "8",
        "--colocate",
        "--rollout-num-gpus",
        "8",
        "--rollout-num-gpus-per-engine",
        "2",
        "--student-checkpoint",
        "/ckpt/small",
        "--student-num-gpus",
        "4",
        "--student-num-gpus-per-engine",
        "1",
    )
    lay = plan.layout
    # colocated: one group of max(training, rollout) GPUs, the student's 4 after the teacher's 8
    assert (lay.rollout_gpus, lay.total_gpus, lay.nodes, lay.teacher.engines, lay.student.engines) == (12, 12, 2, 4, 4)
    assert value(plan.slime_argv, "--rollout-num-gpus") == "12"


def test_write_sglang_config(tmp_path):
    plan = plan_of(
        "--actor-num-gpus-per-node",
        "2",
        "--rollout-num-gpus",
        "1",
        "--student-checkpoint",
        "/s",
        "--student-num-gpus",
        "1",
        run_dir=tmp_path,
    )
    path = plan.write_sglang_config()
    assert path == tmp_path / "sglang_config.yaml"
    assert [m["name"] for m in yaml.safe_load(path.read_text())["sglang"]] == ["actor", "student"]


def test_a_global_batch_that_does_not_divide_the_step_and_an_eval_set_inside_the_training_data_are_refused(tmp_path):
    with pytest.raises(UserInputError, match="--global-batch-size 5 does not divide the 12 samples"):
        plan_of("--colocate", "--global-batch-size", "5")
    with pytest.raises(UserInputError, match="--eval-prompt-data same .* are in --prompt-data"):
        plan_of(
            "--colocate",
            "--eval-prompt-data",
            "same",
            str(REPO / "data/math_word_problems.jsonl"),
            "--eval-interval",
            "5",
        )


def test_relative_paths_become_absolute(monkeypatch):
    monkeypatch.chdir(REPO)
    argv = absolute_paths(
        [
            "--prompt-data",
            "data/math_word_problems.jsonl",
            "--hf-checkpoint=/abs",
            "--teacher-template",
            "nope.txt",
            "--teacher-context",
            "@README.md",
            "--teacher-context",
            "README.md",
        ]
    )
    assert argv == [
        "--prompt-data",
        str(REPO / "data/math_word_problems.jsonl"),
        "--hf-checkpoint=/abs",
        "--teacher-template",
        "nope.txt",
        "--teacher-context",
        f"@{REPO / 'README.md'}",
        "--teacher-context",
        "README.md",
    ]


def test_without_removes_both_flag_forms():
    assert without(["--a", "1", "--b=2", "--c", "--d", "4"], {"--a": True, "--b": True, "--c": False}) == ["--d", "4"]


@pytest.mark.parametrize(
    "extra, kept",
    [
        (["--recompute-granularity", "none", "--no-use-dynamic-batch-size"], []),
        (["--recompute-granularity=none"], []),
        (
            ["--recompute-granularity", "full", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192"],
            ["--recompute-granularity", "full", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192"],
        ),
    ],
)
def test_spellings_of_slimes_own_defaults_are_dropped_and_its_settings_kept(extra, kept):
    # slime's parser knows neither --no-use-dynamic-batch-size nor Megatron's granularity 'none'.
    argv = list(plan_of("--colocate", *extra).slime_argv)
    shared = (
        "--recompute-granularity",
        "--recompute-granularity=none",
        "--use-dynamic-batch-size",
        "--no-use-dynamic-batch-size",
        "--max-tokens-per-gpu",
    )
    found = [t for i, t in enumerate(argv) if t in shared or (i and argv[i - 1] in shared[:1] + shared[4:])]
    assert found == kept


def test_config_from_slime_args_reads_our_meaning_back():
    plan = plan_of(
        "--colocate",
        "--rollout-temperature",
        "0.6",
        "--teacher-temperature",
        "0.9",
        "--apply-chat-template",
        "--rollout-batch-size",
        "3",
    )
    ns, _ = meta_parser().parse_known_args(list(plan.slime_argv))
    ns.lr = None  # Megatron's --lr without a value: our default fills it
    cfg = config_from_slime_args(ns)
    assert cfg.sampling.rollout_temperature == 0.6 and cfg.sampling.teacher_temperature == 0.9
    assert cfg.data.apply_chat_template and cfg.meta.rollout_batch_size == 3 and cfg.train.lr == 1e-5
    assert cfg.backend == "slime" and cfg.checkpoint.load is None and not cfg.tracking.use_wandb
    assert cfg.train.std_normalize
    # slime's own --disable-grpo-std-normalization (dest grpo_std_normalization) means Dr.GRPO in our
    # rollout's advantages too, as --no-std-normalize does: one flag, one meaning on both backends.
    ns.grpo_std_normalization = False
    assert not config_from_slime_args(ns).train.std_normalize


def test_our_flags_skip_the_ones_slime_adds_later():
    """slime adds its flags after ours, and its parser refuses a flag defined twice."""
    slime_later = ["--rollout-batch-size", "--prompt-data", "--eps-clip"]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    meta_arguments_skipping(slime_later)(parser)
    for flag in slime_later:  # slime's own definitions go on without a conflict
        parser.add_argument(flag)
    ns = parser.parse_args(["--rollout-batch-size", "7", "--num-inner-iterations", "2", "--student-temperature", "0.5"])
    assert (ns.rollout_batch_size, ns.num_inner_iterations, ns.student_temperature) == ("7", 2, 0.5)


# ----------------------------------------------------------------------------- CLI and dry run


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = cli.main(
        [
            *BASE,
            "--actor-num-gpus-per-node",
            "4",
            "--rollout-num-gpus",
            "2",
            "--student-checkpoint",
            "/ckpt/s",
            "--student-num-gpus",
            "2",
            "--run-dir",
            str(run_dir),
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and not run_dir.exists()
    assert re.search(r"teacher training\s+4", out) and re.search(r"student inference\s+2", out)
    assert "name: student" in out and "update_weights: false" in out
    assert "--custom-loss-function-path slime_meta.backends.slime.loss.meta_loss" in out


def test_missing_slime_is_one_line_naming_both_installs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "slime", None)  # `import slime` fails, as on a laptop
    assert cli.main([*BASE, "--colocate", "--run-dir", "/tmp/slime-meta-test-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --backend slime needs slime")
    assert "slimerl/slime" in err and "git clone https://github.com/THUDM/slime" in err


def test_an_unrelated_slime_package_is_named_as_such(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", types.ModuleType("slime"))  # PyPI's `slime`: no slime.rollout
    assert "is not THUDM/slime" in cli.missing_slime()


def test_help_lists_our_flags(capsys):
    assert cli.main(["--backend", "slime", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--dry-run" in out and "--num-inner-iterations" in out and "slime's" in out


def test_requested_backend_reads_argv_before_any_parser():
    assert cli.requested_backend(["--x", "--backend", "slime"]) == "slime"
    assert cli.requested_backend(["--backend=slime"]) == "slime"
    assert cli.requested_backend(["--lr", "1"]) is None


# ----------------------------------------------------------------------------- data and scripts


def test_convert_moves_rubric_and_columns_into_metadata(tmp_path):
    target = tmp_path / "prompts.jsonl"
    assert convert(REPO / "data/math_word_problems.jsonl", target) > 0
    row = json.loads(target.read_text().splitlines()[0])
    assert set(row) == {"prompt", "label", "metadata"}
    assert row["metadata"]["rubric"].startswith("Full credit") and row["metadata"]["topic"] == "percent"
    assert row["metadata"]["uid"] == "0"


# ------------------------------------------------------------------ the student pool flags of the design document


def test_student_num_gpus_alone_starts_a_frozen_copy_of_the_teacher_with_the_teachers_engine_size():
    plan = plan_of(
        "--colocate", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus-per-engine", "2", "--student-num-gpus", "4"
    )
    student = plan.layout.student
    assert (student.model_path, student.num_gpus, student.gpus_per_engine, student.engines) == (
        "/ckpt/teacher",
        4,
        2,
        2,
    )
    assert plan.layout.sglang_config()["sglang"][1]["update_weights"] is False
    assert plan.config.separate_student
    assert (plan.config.pools.student_checkpoint, plan.config.pools.student_num_gpus_per_engine) == ("/ckpt/teacher", 2)
    assert "frozen /ckpt/teacher" in cli.describe(plan)
    # The rollout manager rebuilds the config from slime's namespace: the same defaults come out.
    slime_args = argparse.Namespace(
        **{**vars(meta_parser().parse_known_args(list(plan.slime_argv))[0]), "rollout_num_gpus_per_engine": 2}
    )
    rebuilt = config_from_slime_args(slime_args).pools
    assert (rebuilt.student_checkpoint, rebuilt.student_num_gpus_per_engine) == ("/ckpt/teacher", 2)


def test_external_student_server_has_its_own_flag_and_no_pool():
    plan = plan_of("--colocate", "--external-student-url", "http://10.0.0.9:30000")
    assert plan.layout.student is None and plan.config.separate_student
    assert "student  external server http://10.0.0.9:30000" in cli.describe(plan)
    with pytest.raises(UserInputError, match="--student-router-port: slime starts the student router"):
        plan_of("--colocate", "--student-num-gpus", "2", "--student-router-port", "30001")
