"""The slime backend without slime: flag translation, GPU accounting, --sglang-config, dry runs.

Everything here runs on a laptop: the translation reads our flags, passes slime's through, and
decides GPUs per role from slime's placement rules (facts in slime_meta/backends/slime/plan.py).
The launch scripts are run for real with --dry-run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from slime_meta.backends.slime import cli
from slime_meta.backends.slime.argv import absolute_paths, without
from slime_meta.backends.slime.data import convert
from slime_meta.backends.slime.flags import config_from_slime_args, meta_arguments_skipping
from slime_meta.backends.slime.plan import PLUGINS, meta_parser, translate
from slime_meta.errors import UserInputError

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "--use-meta-learning",
    "--prompt-data",
    "data/math_word_problems.jsonl",
    "--hf-checkpoint",
    "/ckpt/teacher",
    "--ref-load",
    "/ckpt/teacher_torch_dist",
]


def value(argv, flag):
    """The last value given to `flag` in `argv` (what argparse keeps)."""
    values = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == flag]
    return values[-1] if values else None


def plan_of(*extra, run_dir=None, **kwargs):
    return translate([*BASE, *extra, "--run-dir", str(run_dir or "/tmp/slime-meta-test-run")], **kwargs)


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


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--actor-num-gpus-per-node", "4"], "--rollout-num-gpus is required without --colocate"),
        (
            ["--colocate", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
            "not a multiple of --rollout-num-gpus-per-engine",
        ),
        (["--colocate", "--student-checkpoint", "/s"], "--student-num-gpus None"),
        (
            ["--colocate", "--student-num-gpus", "2", "--sglang-config", "x.yaml"],
            "--sglang-config and --student-num-gpus",
        ),
        (
            ["--colocate", "--student-checkpoint", "/s", "--student-num-gpus", "2", "--sglang-config", "x.yaml"],
            "give one",
        ),
        (["--colocate", "--rollout-function-path", "my.rollout"], "--rollout-function-path is set by --backend slime"),
        (["--colocate", "--loss-type", "policy_loss"], "--loss-type policy_loss"),
        (["--colocate", "--advantage-estimator", "ppo"], "--advantage-estimator ppo"),
        (["--colocate", "--group-key", "topic"], "--heldout-ipb"),  # per family: the holdout must divide evenly
        (
            ["--colocate", "--sdpo-alpha", "0.1", "--sdpo-topk", "8", "--no-sdpo-topk-tail"],
            "keeps the hint's mass outside",
        ),
        (["--colocate", "--sdpo-alpha", "0.1", "--sdpo-temperature", "0.5"], "give --sdpo-temperature 1"),
        (["--colocate", "--sdpo-alpha", "0.1", "--context-parallel-size", "2"], "give --context-parallel-size 1"),
        (["--colocate", "--sdpo-alpha", "0.1"], "--rollout-temperature 1.0 with solver samples"),
        (
            ["--colocate", "--replay-beta", "0.1", "--replay-teachers", "a@http://x", "b@http://y"],
            "a frozen pool of the start weights",
        ),
        (
            ["--student-num-gpus", "2", "--replay-beta", "0.1", "--replay-teachers", "a@http://x", "b@http://y"],
            "--replay-beta with --teacher-temperature 0.7",
        ),
        (
            ["--colocate", "--sdpo-alpha", "0.1", "--sdpo-form", "shaping"],
            "--rollout-temperature 1.0 with solver samples",
        ),
        (
            ["--colocate", "--distill-context", "additional_info", "--teacher-tau", "1"],
            "--rollout-temperature 1.0 with solver samples",
        ),
        (["--colocate", "--custom-convert-samples-to-train-data-path", "my.convert"], "is set by --backend slime"),
        (["--colocate", "--rollout-batch-size", "0"], "must be >= 1"),
        (["--colocate", "--max-async-level", "1"], "--max-async-level 1"),
        (["--max-async-level", "2"], "--max-async-level 2: slime's pattern"),
        (["--colocate", "--calculate-per-token-loss"], "--calculate-per-token-loss: the conversion plugin"),
        (["--colocate", "--adv-tau", "1"], "--rollout-temperature 1.0 with solver samples (--adv-tau"),
        (
            ["--colocate", "--student-router-ip", "10.0.0.2"],
            "--student-router-ip: slime starts the student router",
        ),
        (["--colocate", "--local-num-workers", "2"], "--local-num-workers: a flag of the local backend"),
        (["--colocate", "--weight-sync", "disk"], "--weight-sync: a flag of the local backend"),
        (["--colocate", "--device", "cpu"], "--device: a flag of the local backend"),
        (["--colocate", "--no-share-prompt-forward"], "--no-share-prompt-forward: a flag of the local backend"),
    ],
)
def test_bad_flags_fail_in_one_line_naming_the_flag(extra, message):
    with pytest.raises(UserInputError, match=re.escape(message)):
        plan_of(*extra)


# ----------------------------------------------------------------------------- translation


def test_our_trainer_defaults_go_to_slime_where_its_own_differ():
    # Not given: slime (1e-6) and Megatron (weight decay 0.01) would train with other settings than the
    # same command on one machine; the plan passes ours. Given: the user's value, once.
    argv = list(plan_of("--colocate").slime_argv)
    assert (value(argv, "--lr"), value(argv, "--weight-decay"), value(argv, "--rollout-max-response-len")) == (
        "1e-05",
        "0.0",
        "256",
    )
    given = list(plan_of("--colocate", "--lr", "2e-6").slime_argv)
    assert value(given, "--lr") == "2e-6" and given.count("--lr") == 1


def test_kl_acts_on_slime_with_the_switch_the_reference_and_our_estimator():
    # Shared student (the default): the anti-drift KL term is on, as on one machine, and slime is told
    # --use-kl-loss (without it slime builds no reference model and its loss skips the term).
    argv = list(plan_of("--colocate").slime_argv)
    assert "--use-kl-loss" in argv and value(argv, "--kl-loss-coef") == "0.1" and value(argv, "--kl-loss-type") == "k3"
    given = list(plan_of("--colocate", "--kl-loss-coef", "0.05", "--kl-loss-type", "k2").slime_argv)
    assert (value(given, "--kl-loss-coef"), value(given, "--kl-loss-type")) == ("0.05", "k2")
    assert given.count("--kl-loss-coef") == 1 and given.count("--use-kl-loss") == 1  # ours replaced, not repeated
    # A frozen student pool: no default KL, nothing passed.
    frozen = list(plan_of("--colocate", "--student-num-gpus", "2").slime_argv)
    assert "--use-kl-loss" not in frozen and "--kl-loss-coef" not in frozen


def test_kl_without_a_reference_or_with_zero_weight_is_refused_in_one_line():
    argv = [*BASE[: BASE.index("--ref-load")], "--colocate", "--run-dir", "/tmp/slime-meta-test-run"]
    with pytest.raises(UserInputError, match=re.escape("(the default where the student shares the weights)")) as e:
        translate(argv)
    assert "--ref-load DIR" in str(e.value) and "or --kl-loss-coef 0" in str(e.value)
    assert "--use-kl-loss" not in translate([*argv, "--kl-loss-coef", "0"]).slime_argv
    with pytest.raises(UserInputError, match=re.escape("--use-kl-loss with --kl-loss-coef 0")):
        plan_of("--colocate", "--use-kl-loss", "--kl-loss-coef", "0")


def test_plugins_and_shared_flags_are_set_for_slime():
    argv = list(plan_of("--colocate", "--tensor-model-parallel-size", "2", "--lr", "1e-6").slime_argv)
    assert value(argv, "--rollout-function-path") == PLUGINS["--rollout-function-path"]
    assert value(argv, "--custom-reward-post-process-path") == PLUGINS["--custom-reward-post-process-path"]
    assert value(argv, "--loss-type") == "custom_loss"
    assert value(argv, "--custom-loss-function-path") == PLUGINS["--custom-loss-function-path"]
    assert "--custom-advantage-function-path" not in argv  # no distillation asked for: slime's own GRPO path
    assert value(argv, "--tensor-model-parallel-size") == "2" and value(argv, "--lr") == "1e-6"  # passed through
    # Our defaults where slime's differ (slime: --input-key input, --label-key None, 1 sample per prompt).
    assert (value(argv, "--input-key"), value(argv, "--label-key"), value(argv, "--n-samples-per-prompt")) == (
        "prompt",
        "label",
        "4",
    )
    assert value(argv, "--actor-num-gpus-per-node") == "8"  # slime's default, written out
    assert value(argv, "--num-steps-per-rollout") == "1"  # one optimizer step per outer step
    assert "--backend" not in argv and "--dry-run" not in argv
    assert value(argv, "--run-dir") == "/tmp/slime-meta-test-run"


def test_temperatures_and_chat_template_move_to_their_meaning_on_slime():
    argv = list(
        plan_of(
            "--colocate", "--rollout-temperature", "0.6", "--teacher-temperature", "0.9", "--apply-chat-template"
        ).slime_argv
    )
    # slime divides the trained model's logits by --rollout-temperature: the teacher's.
    assert argv.count("--rollout-temperature") == 1 and value(argv, "--rollout-temperature") == "0.9"
    assert value(argv, "--student-temperature") == "0.6"
    assert "--apply-chat-template" not in argv and "--meta-apply-chat-template=on" in argv


def test_chat_template_is_per_model_by_default_and_can_be_turned_off_on_slime():
    default_argv = list(plan_of("--colocate").slime_argv)
    assert not any(token.startswith("--meta-apply-chat-template") for token in default_argv)
    off_argv = list(plan_of("--colocate", "--no-apply-chat-template").slime_argv)
    assert "--meta-apply-chat-template=off" in off_argv and "--no-apply-chat-template" not in off_argv
    for argv, expected in ((default_argv, None), (off_argv, False)):
        ns, _ = meta_parser().parse_known_args(argv)
        ns.lr = None
        assert config_from_slime_args(ns).data.apply_chat_template is expected


def test_distillation_adds_the_advantage_plugin_and_teacher_port_the_router_port():
    argv = list(
        plan_of(
            "--colocate",
            "--teacher-context",
            "Be brief.",
            "--teacher-tau",
            "1",
            "--teacher-port",
            "30000",
            "--rollout-temperature",
            "0.7",
        ).slime_argv
    )
    assert value(argv, "--custom-advantage-function-path") == PLUGINS["--custom-advantage-function-path"]
    assert value(argv, "--sglang-router-port") == "30000"


def test_adv_tau_alone_runs_the_solver_grpo_term_on_slime():
    """--adv-tau alone: the solver samples and their per-kind advantages, as the local solver pass."""
    argv = list(plan_of("--colocate", "--adv-tau", "1", "--rollout-temperature", "0.7").slime_argv)
    assert value(argv, "--custom-advantage-function-path") == PLUGINS["--custom-advantage-function-path"]
    assert value(argv, "--adv-tau") == "1"


def test_slimes_router_port_flag_names_the_teacher_port_once():
    """--sglang-router-port is slime's name for --teacher-port: given either way, slime gets it once."""
    argv = list(plan_of("--colocate", "--sglang-router-port", "30001").slime_argv)
    assert argv.count("--sglang-router-port") == 1 and value(argv, "--sglang-router-port") == "30001"


@pytest.mark.parametrize("context", [["--distill-context", "additional_info"], ["--teacher-context", "Be brief."]])
def test_distillation_of_solver_samples_runs_on_slime(context):
    """The solver samples and the per-channel token means travel through slime's stock plugin flags."""
    argv = list(
        plan_of(
            "--colocate",
            *context,
            "--teacher-tau",
            "0.5",
            "--skip-verification",
            "--rollout-temperature",
            "0.7",
            "--teacher-temperature",
            "0.7",
        ).slime_argv
    )
    assert value(argv, "--custom-advantage-function-path") == "slime_meta.backends.slime.advantages.meta_advantages"
    assert value(argv, "--custom-convert-samples-to-train-data-path") == (
        "slime_meta.backends.slime.train_data.convert_samples_to_train_data"
    )
    shaping = list(
        plan_of(
            "--colocate",
            "--sdpo-alpha",
            "0.5",
            "--sdpo-form",
            "shaping",
            "--rollout-temperature",
            "0.7",
            "--teacher-temperature",
            "0.7",
        ).slime_argv
    )
    assert value(shaping, "--custom-advantage-function-path") == value(argv, "--custom-advantage-function-path")
    replay = list(
        plan_of(
            "--rollout-num-gpus",
            "2",
            "--student-num-gpus",
            "2",
            "--replay-beta",
            "0.1",
            "--replay-teachers",
            "a@http://x",
            "b@http://y",
            "--teacher-temperature",
            "1",
            "--rollout-temperature",
            "1",
        ).slime_argv
    )
    assert value(replay, "--custom-advantage-function-path") == value(argv, "--custom-advantage-function-path")
    plain = list(plan_of("--colocate").slime_argv)  # GRPO alone: the token-mean conversion, no advantage plugin
    assert "--custom-advantage-function-path" not in plain
    assert value(plain, "--custom-convert-samples-to-train-data-path") == value(
        argv, "--custom-convert-samples-to-train-data-path"
    )


def test_num_rollout_and_batch_steps_defer_to_slime_flags():
    # 5 problems = 4 train + 1 holdout: 4 teacher prompts x 4 infos = 16 samples per step.
    argv = list(
        plan_of(
            "--colocate",
            "--num-epoch",
            "2",
            "--global-batch-size",
            "16",
            "--rollout-batch-size",
            "5",
            "--heldout-ipb",
            "1",
        ).slime_argv
    )
    assert "--num-rollout" not in argv and "--num-steps-per-rollout" not in argv


@pytest.mark.parametrize(
    "flags, groups, global_batch",
    [
        # The design document's example: 32 problems, 75% train -> 24 teacher prompts x 4 infos.
        (["--rollout-batch-size", "32", "--inner-loop-train-ratio", "0.75"], 24, 24 * 4),
        # train problems / k x G: 8 / 2 x 8.
        (
            [
                "--rollout-batch-size",
                "10",
                "--heldout-ipb",
                "2",
                "--n-problems-per-prompt",
                "2",
                "--n-samples-per-prompt",
                "8",
            ],
            4,
            32,
        ),
    ],
)
def test_slimes_rollout_batch_is_our_teacher_prompts_and_one_optimizer_step(flags, groups, global_batch):
    plan = plan_of("--colocate", *flags)
    argv = list(plan.slime_argv)
    assert value(argv, "--rollout-batch-size") == str(groups)  # slime's meaning: prompts, each a group of n samples
    assert value(argv, "--meta-rollout-batch-size") == value(flags, "--rollout-batch-size")  # ours: problems drawn
    assert value(argv, "--global-batch-size") == str(global_batch) and value(argv, "--num-steps-per-rollout") == "1"
    ns, _ = meta_parser().parse_known_args(argv)
    ns.lr = None
    cfg = config_from_slime_args(ns)  # what the rollout manager rebuilds: our meaning again
    assert cfg.meta.rollout_batch_size == int(value(flags, "--rollout-batch-size"))
    assert f"{groups} teacher prompts (GRPO groups)" in cli_dry_run_text(flags)


def cli_dry_run_text(flags) -> str:
    from slime_meta.backends.slime.dry_run import describe

    return describe(plan_of("--colocate", *flags))


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


SCRIPTS = {
    "launch_1node_2gpu.sh": {"training": 1, "teacher": 1, "student": None, "rollout": 1, "total": 2, "nodes": 1},
    "launch_1node_8gpu_shared.sh": {"training": 8, "teacher": 8, "student": None, "rollout": 8, "total": 8, "nodes": 1},
    "launch_1node_8gpu_split.sh": {"training": 4, "teacher": 2, "student": 2, "rollout": 4, "total": 8, "nodes": 1},
    "launch_1node_4gpu_split.sh": {"training": 2, "teacher": 1, "student": 1, "rollout": 2, "total": 4, "nodes": 1},
    "launch_2node_teacher8_student4.sh": {
        "training": 8,
        "teacher": 8,
        "student": 4,
        "rollout": 12,
        "total": 12,
        "nodes": 2,
    },
}


def run_script(name: str, tmp_path: Path, *flags: str, **env) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "PYTHON": sys.executable,
        "RUN_DIR": str(tmp_path / "run"),
        "SLIME_DIR": os.environ.get("SLIME_SRC", str(tmp_path / "no-slime")),
        **env,
    }
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")]))
    command = ["bash", str(REPO / "scripts" / name), "--dry-run", *flags]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_launch_script_dry_run(name, tmp_path):
    expected = SCRIPTS[name]
    result = run_script(name, tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(rf"GPUs: {expected['total']} in the Ray placement group, {expected['nodes']} node", out)
    assert re.search(rf"teacher training\s+{expected['training']}\b", out)
    assert re.search(rf"teacher inference\s+{expected['teacher']}\b", out)
    if expected["student"]:
        assert re.search(rf"student inference\s+{expected['student']}\b", out) and "name: student" in out
    else:
        assert "student inference" not in out and "shared pool" in out
    assert re.search(rf"--rollout-num-gpus {expected['rollout']} \\", out)
    assert "--loss-type custom_loss" in out and "--use-meta-learning" in out
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    if expected["student"] is None:  # the shared student carries both anti-drift terms, as locally
        assert "--use-kl-loss \\" in out and "--kl-loss-coef 0.1 \\" in out and "--adv-tau 1 \\" in out
        assert "--custom-advantage-function-path" in out


def slime_arguments(out: str) -> list[str]:
    """The slime argument block of a dry run, as one token list."""
    block = out.split("\nslime arguments\n", 1)[1]
    return [token for line in block.splitlines() for token in line.strip().rstrip("\\").split()]


def sglang_config(out: str) -> dict:
    """The --sglang-config a dry run prints (the YAML under its heading, up to the blank line)."""
    block = out.split("(written when the run starts)\n", 1)[1].split("\n\n", 1)[0]
    return yaml.safe_load(block)


def pools(config: dict) -> list[tuple]:
    return [
        (model["name"], model["model_path"], model["update_weights"], *model["server_groups"][0].values())
        for model in config["sglang"]
    ]


def test_four_gpu_split_dry_run_plans_actor_tp2_one_teacher_and_one_student_engine(tmp_path):
    result = run_script("launch_1node_4gpu_split.sh", tmp_path)
    assert result.returncode == 0, result.stderr
    out, argv = result.stdout, slime_arguments(result.stdout)
    assert "[topology] GPU(s) 0-1 Megatron, tensor parallel 2 x data parallel 1; GPU(s) 2 SGLang 'actor'" in out
    assert "GPU(s) 3 SGLang 'student', 1 engine(s) x 1 GPU, own router" in out
    assert (value(argv, "--actor-num-nodes"), value(argv, "--actor-num-gpus-per-node")) == ("1", "2")
    assert value(argv, "--tensor-model-parallel-size") == "2" and "--sequence-parallel" in argv
    assert value(argv, "--make-vocab-size-divisible-by") == "64"  # 128 x TP 2: the vocabulary stays unpadded
    # slime's --rollout-num-gpus is the sum over both models; each model one engine of one GPU.
    assert (value(argv, "--rollout-num-gpus"), value(argv, "--rollout-num-gpus-per-engine")) == ("2", "1")
    assert value(argv, "--student-num-gpus") == "1" and "--student-checkpoint" not in argv
    assert "--colocate" not in argv and value(argv, "--max-async-level") == "1"
    assert value(argv, "--sglang-config") == str(tmp_path / "run/sglang_config.yaml")
    checkpoint = "/root/Qwen2.5-Coder-0.5B-Instruct"
    assert pools(sglang_config(out)) == [
        ("actor", checkpoint, True, "regular", 1, 1),
        ("student", checkpoint, False, "regular", 1, 1),
    ]
    assert "router of model 'student' (args.sglang_model_routers['student'])" in out
    assert "SGLang model 'actor': 1 engine(s) x 1 GPU" in out and "SGLang model 'student': 1 engine(s) x 1 GPU" in out
    # The two-GPU run's task settings (benchmarks/run_slime_2gpu.sh), so the runs compare.
    for flag, expected in {
        "--meta-rollout-batch-size": "24",
        "--heldout-ipb": "16",
        "--n-problems-per-prompt": "2",
        "--n-samples-per-prompt": "8",
        "--n-samples-per-inner-prompt": "2",
        "--n-holdout-samples": "2",
        "--lr": "3e-6",
        "--adam-beta2": "0.999",
        "--grader": "verifier",
        "--eval-interval": "10",
    }.items():
        assert value(argv, flag) == expected, flag
    assert "data/price_lists_eval.jsonl" in out and out.startswith("[topology]")


def test_four_gpu_split_data_parallel_and_local_layers(tmp_path):
    dp = run_script("launch_1node_4gpu_split.sh", tmp_path, TP="1")
    assert dp.returncode == 0, dp.stderr
    argv = slime_arguments(dp.stdout)
    assert "tensor parallel 1 x data parallel 2" in dp.stdout and value(argv, "--actor-num-gpus-per-node") == "2"
    assert value(argv, "--tensor-model-parallel-size") == "1" and "--sequence-parallel" not in argv
    assert value(argv, "--make-vocab-size-divisible-by") == "128"
    # Megatron's local layers have no sequence-parallel norm: TP 2 without --sequence-parallel there.
    local = run_script("launch_1node_4gpu_split.sh", tmp_path, TRANSFORMER_IMPL="local")
    assert local.returncode == 0, local.stderr
    argv = slime_arguments(local.stdout)
    assert value(argv, "--tensor-model-parallel-size") == "2" and "--sequence-parallel" not in argv
    assert value(argv, "--transformer-impl") == "local"
    bad = run_script("launch_1node_4gpu_split.sh", tmp_path, TP="3")
    assert bad.returncode == 2 and "tensor parallel 3 does not divide the 2 training GPUs" in bad.stderr


# The split scripts' pools and parallel layout as they were before the three shared one code path
# (scripts/_launch.sh: split_pool_args, tensor_parallel_args, launch_split).
SPLIT_LAYOUTS = {
    "launch_1node_8gpu_split.sh": {
        "topology": "[topology] GPU(s) 0-3 Megatron, tensor parallel 2 x data parallel 2; GPU(s) 4-5 SGLang 'actor', "
        "2 engine(s) x 1 GPU; GPU(s) 6-7 SGLang 'student', 2 engine(s) x 1 GPU, own router, frozen /root/Qwen3-4B; "
        "Ray: 8 GPUs on the head, 8 in the placement group",
        "flags": ["--rollout-num-gpus-per-engine", "1", "--student-num-gpus", "2"],
        "placement": ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"],
        "pools": [
            ("actor", "/root/Qwen3-4B", True, "regular", 2, 1),
            ("student", "/root/Qwen3-4B", False, "regular", 2, 1),
        ],
    },
    "launch_2node_teacher8_student4.sh": {
        "topology": "[topology] GPU(s) 0-7 Megatron, tensor parallel 2 x data parallel 4; GPU(s) 0-7 SGLang 'actor', "
        "4 engine(s) x 2 GPU (colocated: offloaded while Megatron trains); node 1's GPUs 0-3 SGLang 'student', "
        "4 engine(s) x 1 GPU, own router, frozen /root/Qwen3-1.7B; Ray: 8 GPUs on the head, 12 in the placement group",
        "flags": [
            *("--rollout-num-gpus-per-engine", "2", "--student-checkpoint", "/root/Qwen3-1.7B"),
            *("--student-num-gpus", "4", "--student-num-gpus-per-engine", "1"),
        ],
        "placement": ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "12"],
        "pools": [
            ("actor", "/root/Qwen3-4B", True, "regular", 8, 2),
            ("student", "/root/Qwen3-1.7B", False, "regular", 4, 1),
        ],
    },
}


@pytest.mark.parametrize("name", sorted(SPLIT_LAYOUTS))
def test_split_scripts_keep_their_pools_on_the_shared_code_path(name, tmp_path):
    expected = SPLIT_LAYOUTS[name]
    result = run_script(name, tmp_path)
    assert result.returncode == 0, result.stderr
    out, argv = result.stdout, slime_arguments(result.stdout)
    assert out.splitlines()[0] == expected["topology"]
    joined_argv = " ".join(argv)
    assert " ".join(expected["flags"]) in joined_argv and " ".join(expected["placement"]) in joined_argv
    assert ("--colocate" in argv) == (name == "launch_2node_teacher8_student4.sh")
    assert value(argv, "--tensor-model-parallel-size") == "2" and "--sequence-parallel" in argv
    assert pools(sglang_config(out)) == expected["pools"]
    assert not (tmp_path / "run").exists()


def final_flags(out: str) -> dict[str, str]:
    """The slime arguments of a dry run, each flag's last value (what the parser keeps; "" for a switch)."""
    block = out.split("\nslime arguments\n", 1)[1].splitlines()
    tokens = [t for line in block if line.startswith("  ") for t in line.strip().rstrip("\\").split()]
    flags, flag = {}, None
    for token in tokens:
        if token.startswith("--"):
            flag = token
            flags[flag] = ""
        else:
            flags[flag] = f"{flags[flag]} {token}".strip()
    return flags


def run_benchmark(script: str, mode: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """A benchmark script's launch with --dry-run: the plan it would run, on a stand-in model directory."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-06, "tie_word_embeddings": False}))
    environment = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "MODEL_DIR": str(model),
        "SLIME_DIR": os.environ.get("SLIME_SRC", str(tmp_path / "no-slime")),
    }
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")]))
    command = ["bash", str(REPO / "benchmarks" / script), mode, "--dry-run"]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=180, check=False)


# What the four-GPU benchmark may run differently from the two-GPU one: the topology, its run directory,
# the resume (--load, --save-interval), and the shared student's anti-drift terms (the student is frozen).
FOUR_GPU_DIFFERENCES = {
    *("--actor-num-gpus-per-node", "--num-gpus-per-node", "--rollout-num-gpus", "--student-num-gpus"),
    *("--sglang-config", "--tensor-model-parallel-size", "--sequence-parallel", "--make-vocab-size-divisible-by"),
    *("--run-dir", "--prompt-data", "--save", "--load", "--save-interval"),
    *("--adv-tau", "--use-kl-loss", "--kl-loss-coef", "--kl-loss-type", "--custom-advantage-function-path"),
}


def test_four_gpu_benchmark_runs_the_two_gpu_benchmarks_settings(tmp_path):
    two = run_benchmark("run_slime_2gpu.sh", "slime", tmp_path)
    four = run_benchmark("run_slime_4gpu.sh", "slime", tmp_path)
    assert two.returncode == 0 and four.returncode == 0, two.stderr + four.stderr
    a, b = final_flags(two.stdout), final_flags(four.stdout)
    differing = {flag for flag in a.keys() | b.keys() if a.get(flag) != b.get(flag)}
    assert differing <= FOUR_GPU_DIFFERENCES, differing - FOUR_GPU_DIFFERENCES
    assert (b["--seed"], b["--num-rollout"], b["--meta-rollout-batch-size"], b["--lr"]) == ("31", "50", "24", "3e-6")
    assert b["--tensor-model-parallel-size"] == "2" and b["--load"] == b["--save"]
    dp2 = final_flags(run_benchmark("run_slime_4gpu.sh", "dp2", tmp_path).stdout)
    assert (dp2["--tensor-model-parallel-size"], dp2["--actor-num-gpus-per-node"]) == ("1", "2")
    assert "--sequence-parallel" not in dp2 and dp2["--run-dir"].endswith("slime_4gpu_dp2_seed31")
    assert not (tmp_path / "out" / "slime_4gpu_seed31").exists()  # a dry run writes no run directory


def test_launch_script_grader_switch_keeps_the_key_off_the_command_line(tmp_path):
    secret = "sk-test-0123456789abcdef"
    result = run_script(
        "launch_1node_8gpu_split.sh", tmp_path, GRADER="openai", OPENAI_API_KEY=secret, GRADER_MODEL="gpt-4o"
    )
    assert result.returncode == 0, result.stderr
    assert "--grader openai" in result.stdout and "key from $OPENAI_API_KEY: set" in result.stdout
    assert secret not in result.stdout + result.stderr

    hosted = run_script(
        "launch_1node_8gpu_shared.sh", tmp_path, GRADER="self-hosted", GRADER_BASE_URL="http://10.0.0.5:8000/v1"
    )
    assert hosted.returncode == 0, hosted.stderr
    assert "--grader-base-url http://10.0.0.5:8000/v1" in hosted.stdout

    environment = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    command = ["bash", str(REPO / "scripts/launch_2node_teacher8_student4.sh"), "--dry-run"]
    environment.update(GRADER="openai", PYTHON=sys.executable)
    missing = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode != 0 and "OPENAI_API_KEY" in missing.stderr


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


ALL_CHANNELS = (
    "--teacher-context",
    "Be brief.",
    "--teacher-tau",
    "0.5",
    "--student-tau",
    "0.5",
    "--sdpo-alpha",
    "0.5",
    "--use-tis",
    "--rollout-temperature",
    "0.7",
    "--teacher-temperature",
    "0.7",
    "--skip-verification",
    "--eval-baseline",
)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_launch_script_dry_run_with_every_channel_slime_runs(name, tmp_path):
    """Distillation, SDPO (its default JSD form, the hint's top-k), TIS: the dry run prints each plugin
    path and the channel flags."""
    channels = ALL_CHANNELS
    if name == "launch_1node_4gpu_split.sh":  # it has its context source already: --context-key oracle_hint
        channels = tuple(without(ALL_CHANNELS, {"--teacher-context": True}))
    result = run_script(name, tmp_path, *channels)
    assert result.returncode == 0, result.stderr
    for flag, path in PLUGINS.items():
        assert re.search(rf"{re.escape(flag)} {re.escape(path)}\b", result.stdout), flag
    for flag in ("--teacher-tau 0.5", "--sdpo-alpha 0.5", "--sdpo-topk 100", "--use-tis", "--eval-baseline"):
        assert flag in result.stdout
    shaping = run_script(name, tmp_path, *channels, "--sdpo-form", "shaping")
    assert shaping.returncode == 0, shaping.stderr
    assert "--sdpo-form shaping" in shaping.stdout and "--rollout-data-postprocess-path" not in shaping.stdout


def test_split_script_dry_run_with_all_three_channels_and_replay(tmp_path):
    """Every channel at once, replay included: it needs the frozen start-weights student pool (the
    split script's --student-num-gpus) and temperature 1 for DPO's log-probs."""
    replay = ("--replay-beta", "0.1", "--replay-teachers", "a@http://127.0.0.1:1/v1", "b@http://127.0.0.1:2/v1")
    at_one = [value if value != "0.7" else "1" for value in ALL_CHANNELS]
    result = run_script("launch_1node_8gpu_split.sh", tmp_path, *at_one, *replay)
    assert result.returncode == 0, result.stderr
    for flag, path in PLUGINS.items():
        assert re.search(rf"{re.escape(flag)} {re.escape(path)}\b", result.stdout), flag
    for flag in (
        "--teacher-tau 0.5",
        "--sdpo-topk 100",
        "--replay-beta 0.1",
        "--replay-teachers a@http://127.0.0.1:1/v1",
    ):
        assert flag in result.stdout
    refused = run_script("launch_1node_8gpu_shared.sh", tmp_path, *replay)  # no frozen pool of the start weights
    assert refused.returncode == 2 and "a frozen pool of the start weights" in refused.stderr
