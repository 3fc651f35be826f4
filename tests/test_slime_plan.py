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
