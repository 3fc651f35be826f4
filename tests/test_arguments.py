"""Flags: the documented defaults, the frozen config, slime compatibility, one-line errors."""

import argparse
import dataclasses
import json

import pytest

from slime_meta.config.arguments import add_meta_learning_arguments, build_parser, parse_config
from slime_meta.errors import UserInputError

BASE = ["--use-meta-learning", "--prompt-data", "data/math_word_problems.jsonl"]


def test_defaults_match_the_documented_ones():
    cfg = parse_config(BASE)
    assert cfg.meta.num_inner_iterations == 3
    assert cfg.meta.n_samples_per_inner_prompt == 4
    assert cfg.meta.inner_loop_train_ratio == 0.75
    assert cfg.meta.n_problems_per_prompt == 1
    assert cfg.meta.holdout_advantage == "mean-then-normalize"
    assert cfg.meta.additional_info_position == "prefix"
    assert cfg.data.rubric_key == "rubric"
    assert cfg.grader.grader_temperature == 0.0
    assert cfg.sampling.teacher_temperature == 0.7
    assert cfg.grader.grader_model is None  # not named: an LLM grader would use gpt-4
    assert cfg.grader.grader_concurrency == 32
    assert cfg.backend == "local"
    # --rollout-batch-size counts problems: the default 4 = 3 train + 1 holdout; one attempt per holdout problem.
    assert cfg.meta.rollout_batch_size == 4 and cfg.meta.n_holdout_samples == 1
    assert cfg.meta.eval_prompt_data == () and cfg.meta.eval_interval is None and cfg.meta.eval_num_batches == 1


def test_config_is_frozen_and_saved_without_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-canary-123")
    cfg = parse_config(BASE + ["--grader-model", "m", "--seed", "7"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]
    cfg.save(tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text()
    saved = json.loads(text)
    assert saved["seed"] == 7 and saved["grader"]["grader_model"] == "m"
    assert saved["grader"]["grader_api_key_env"] == "OPENAI_API_KEY"
    assert "sk-canary-123" not in text


def test_slimes_router_port_name_sets_the_teacher_port():
    assert parse_config(BASE + ["--sglang-router-port", "30123"]).pools.teacher_port == 30123
    assert parse_config(BASE).pools.teacher_port is None


def test_flags_slime_already_defines_are_skipped():
    # slime's parse_args(add_custom_arguments=fn) hands us a parser that has --lr and --prompt-data.
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--prompt-data", nargs="+")
    add_meta_learning_arguments(parser)
    ns = parser.parse_args(["--prompt-data", "a", "b", "--num-inner-iterations", "2"])
    assert ns.lr == 0.5 and ns.prompt_data == ["a", "b"] and ns.num_inner_iterations == 2


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--inner-loop-train-ratio", "1.0"], "--inner-loop-train-ratio"),
        (["--inner-loop-train-ratio", "0"], "--inner-loop-train-ratio"),
        (["--student-router-ip", "10.0.0.9"], "--student-router-ip"),
        (["--student-router-port", "30000"], "--student-router-port"),
        (["--external-student-url", "http://h:1", "--student-num-gpus", "1"], "--external-student-url"),
        (["--save-interval", "2"], "--save"),
        (["--save", "ck", "--save-retain-interval", "4"], "--save-retain-interval 4"),
        (["--save", "ck", "--save-interval", "3", "--save-retain-interval", "4"], "multiple of --save-interval (3)"),
        (["--load", "/nonexistent/ckpt"], "--load"),
        (["--lr", "-1"], "--lr"),
        (["--teacher-temperature", "-0.1"], "--teacher-temperature"),
        (["--teacher-tau", "0.5"], "--teacher-tau"),
        (["--teacher-tau", "0.5", "--teacher-context", "x", "--context-key", "c"], "one context source"),
        (["--aipo-delta", "8", "--use-tis"], "--aipo-delta"),
        (["--eps-clip-c", "0.5"], "--eps-clip-c"),
        (["--replay-beta", "0.1", "--replay-teachers", "a@http://x"], "--replay-min-agree"),
        (["--sdpo-beta", "1.5"], "--sdpo-beta"),
        (["--sdpo-top-k", "8"], "give --sdpo-topk 8 --no-sdpo-topk-tail"),
        (["--no-sdpo-topk-tail"], "give --sdpo-topk K"),
        (["--sdpo-topk", "0"], "--sdpo-topk 0: must be >= 1"),
        (["--rollout-batch-size", "2"], "nearest --rollout-batch-size that works: 3 (2 train + 1 holdout)"),
        (["--rollout-batch-size", "8", "--n-problems-per-prompt", "4"], "--n-problems-per-prompt 4"),
        (["--rollout-batch-size", "4", "--heldout-ipb", "4"], "--heldout-ipb 4"),
        (["--group-key", "topic", "--rollout-batch-size", "10", "--heldout-ipb", "3"], "split evenly"),
        (["--eval-prompt-data", "held"], "NAME PATH pairs"),
        (["--eval-prompt-data", "held", "/nonexistent/held.jsonl"], "--eval-prompt-data held /nonexistent/held.jsonl"),
        (["--eval-interval", "2"], "--eval-interval needs --eval-prompt-data"),
        (["--num-rollout", "0"], "--num-rollout 0 evaluates only"),
    ],
)
def test_bad_flag_values_name_the_flag(extra, flag):
    with pytest.raises(UserInputError) as info:
        parse_config(BASE + extra)
    assert flag in str(info.value) and "\n" not in str(info.value)


def test_objective_defaults_leave_plain_grpo_with_a_separate_student():
    for student in (["--student-checkpoint", "ckpt"], ["--student-num-gpus", "1"]):
        o = parse_config(BASE + student).objectives
        assert not (o.distillation_on or o.sdpo_on_any or o.replay_on or o.needs_solver_samples or o.needs_reference)
        assert o.adv_tau is None and o.kl_loss_coef == 0.0
    assert o.kl_loss_type == "k3" and o.replay_min_agree == 2 and o.sdpo_grade_threshold == 1.0


def test_the_shared_student_kl_default_holds_on_slime_and_the_solver_term_stays_local():
    o = parse_config(BASE + ["--backend", "slime"]).objectives  # slime: the same KL default, one meaning
    assert (o.kl_loss_coef, o.kl_loss_type, o.adv_tau) == (0.1, "k3", None)


def test_slimes_kl_switch_is_accepted_and_refused_without_a_weight():
    assert parse_config(BASE + ["--use-kl-loss"]).objectives.kl_loss_coef == 0.1
    with pytest.raises(UserInputError, match="--use-kl-loss with --kl-loss-coef 0"):
        parse_config(BASE + ["--student-num-gpus", "1", "--use-kl-loss"])


def test_shared_student_defaults_hold_the_student_role_and_can_be_turned_off():
    o = parse_config(BASE).objectives  # local backend, no separate student: the student is the trained model
    assert (o.adv_tau, o.kl_loss_coef, o.kl_loss_type) == (1.0, 0.1, "k3")
    assert o.solver_grpo_on and o.needs_solver_samples and o.needs_reference and not o.distillation_on
    off = parse_config(BASE + ["--adv-tau", "0", "--kl-loss-coef", "0"]).objectives
    assert not (off.solver_grpo_on or off.needs_solver_samples or off.needs_reference)
    given = parse_config(BASE + ["--adv-tau", "0.5", "--kl-loss-coef", "0.02"]).objectives
    assert (given.adv_tau, given.kl_loss_coef) == (0.5, 0.02)


def test_slimes_spelling_of_dr_grpo_means_no_std_normalize():
    assert parse_config(BASE).train.std_normalize
    assert not parse_config(BASE + ["--disable-grpo-std-normalization"]).train.std_normalize
    assert not parse_config(BASE + ["--no-std-normalize"]).train.std_normalize


def test_the_external_student_url_is_held_without_its_trailing_slash():
    cfg = parse_config(BASE + ["--external-student-url", "http://10.0.0.9:30000/"])
    assert cfg.pools.external_student_url == "http://10.0.0.9:30000"


def test_abbreviated_flags_are_refused_as_on_slime():
    with pytest.raises(SystemExit) as exit_info:
        parse_config(BASE + ["--num-inner", "2"])  # --num-inner-iterations, abbreviated
    assert exit_info.value.code == 2


def test_missing_required_flags():
    with pytest.raises(UserInputError, match="--prompt-data"):
        parse_config(["--use-meta-learning"])


def test_use_meta_learning_is_the_default_and_still_accepted():
    """This program runs nothing else: a command line without the flag runs the same (slime's command lines name it)."""
    without = parse_config(["--prompt-data", "data/math_word_problems.jsonl"])
    assert without == parse_config(BASE)


def test_argparse_errors_are_one_line_with_exit_code_2(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(BASE + ["--num-inner-iterations", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--num-inner-iterations" in err


def test_help_renders_every_flag():
    """argparse formats each help text with %: a bare percent sign breaks `train.py --help`."""
    text = build_parser().format_help()
    for flag in ("--recompute-granularity", "--max-tokens-per-gpu", "--sdpo-topk", "--teacher-history"):
        assert flag in text
