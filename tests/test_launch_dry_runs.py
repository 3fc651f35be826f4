"""The launch scripts run for real with --dry-run: the plan each prints (topology, pools, flags),
the split scripts on one code path, the four-GPU benchmark beside the two-GPU one, every channel.

Everything here runs on a laptop; tests/test_slime_plan.py checks the translation behind the plans.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers_slime_plan import value

from slime_meta.backends.slime.argv import without
from slime_meta.backends.slime.plan import PLUGINS

REPO = Path(__file__).resolve().parents[1]
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


def test_a_dry_run_loads_neither_torch_nor_transformers(tmp_path):
    # A dry run plans on a login node or a laptop in about a second: importing torch and
    # transformers alone takes 3-5 s there, and nothing in a plan needs them.
    result = run_script("launch_1node_2gpu.sh", tmp_path, PYTHONPROFILEIMPORTTIME="1")
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {
        line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "slime_meta.backends.slime.dry_run" in imported
    assert not {"torch", "transformers"} & imported
