"""The slime backend's flag translation: our flags to slime's meaning (trainer defaults, KL,
plugins, temperatures, the chat template, distillation, the batch), and bad flags refused in one
line. tests/test_slime_plan.py checks the GPU accounting, --sglang-config and the CLI."""

from __future__ import annotations

import re

import pytest
from helpers_slime_plan import BASE, plan_of, value  # noqa: F401

from slime_meta.backends.slime.flags import config_from_slime_args
from slime_meta.backends.slime.plan import PLUGINS, meta_parser, translate
from slime_meta.errors import UserInputError


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
        (
            ["--colocate", "--num-rollout", "0", "--eval-baseline"],
            "--num-rollout 0 (evaluation only) runs on the local",
        ),
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
