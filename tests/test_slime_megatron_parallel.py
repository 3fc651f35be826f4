"""benchmarks/slime_megatron.py's `parallel` stage and slime_megatron_tp_check.py's sizes, on CPU: the layouts
a GPU count gives, the vocabulary every run of a set pads to, the runs in turn and their comparison with
tensor parallel 1 (the training runs are stand-ins writing made-up first steps: no GPU result here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import slime_megatron  # noqa: E402
import slime_megatron_tp_check  # noqa: E402


@pytest.mark.parametrize(
    "name, layout", [("tp1", (1, 1)), ("tp4", (4, 1)), ("dp2", (1, 2)), ("tp2dp2", (2, 2)), ("tp2", (2, 1))]
)
def test_layout_names(name, layout):
    assert slime_megatron.parse_layout(name) == layout


@pytest.mark.parametrize("name", ["", "tp", "pp2", "tp2x", "dp2tp2", "tp0"])
def test_bad_layout_names_are_refused(name):
    with pytest.raises(ValueError):
        slime_megatron.parse_layout(name)


def test_four_gpus_give_tp4_and_tp2_dp2_against_tp1_all_padded_to_a_multiple_of_four():
    plan = slime_megatron.parallel_plan(4, None, 2)
    assert plan["runs"] == {"tp1": (1, 1), "tp4": (4, 1), "tp2dp2": (2, 2)}
    assert plan["reference"] == "tp1" and plan["vocab_multiple"] == 4
    two = slime_megatron.parallel_plan(2, None, 2)
    assert two["runs"] == {"tp1": (1, 1), "tp2": (2, 1), "dp2": (1, 2)} and two["vocab_multiple"] == 2
    # The reference goes first whatever the order given.
    assert list(slime_megatron.parallel_plan(4, "tp2dp2,tp1", 2)["runs"]) == ["tp1", "tp2dp2"]


@pytest.mark.parametrize(
    "gpus, layouts, message",
    [(4, "tp4,tp2dp2", "needs tp1"), (2, "tp1,tp4", "more than --gpus 2"), (3, None, "no default layouts")],
)
def test_bad_sets_are_refused(gpus, layouts, message):
    with pytest.raises(ValueError, match=message):
        slime_megatron.parallel_plan(gpus, layouts, 2)


def test_the_vocabulary_of_tp4_pads_alike_at_every_size(tmp_path):
    config = {"num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4}
    config.update(rms_norm_eps=1e-5, vocab_size=357, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for tp in (1, 2, 4):
        flags = slime_megatron.megatron_shape(tmp_path, tp, 4)
        # Megatron pads to a multiple of (this x TP): 4 at every TP, 357 -> 360.
        assert int(flags[flags.index("--make-vocab-size-divisible-by") + 1]) * tp == 4
    with pytest.raises(SystemExit, match="not a multiple of --tensor-parallel 4"):
        slime_megatron.megatron_shape(tmp_path, 4, 2)


def stand_in_step(tp: int, dp: int) -> dict:
    """A made-up first step for a layout, to check the comparison's arithmetic (not a measurement)."""
    return {
        "train/loss": 0.05 * (1 + 0.001 * (tp - 1)),
        "train/pg_loss": -0.025,
        "train/loss/grpo": 0.001,
        "train/loss/sdpo_kl": 0.146 * (1 + 0.002 * (dp - 1)),
        "train/kl_loss": 0.0 if tp == 1 else 1e-9,
        "train/ppo_kl": 0.0,
        "train/grad_norm": 10.0 + tp - 1,
    }


def test_parallel_runs_each_layout_in_turn_and_compares_with_tp1(tmp_path, monkeypatch, capsys):
    calls, stops = [], []
    monkeypatch.setattr(slime_megatron, "stop_ray", lambda: stops.append(1))

    def train(out, checkpoint, slime_src, ns):
        calls.append((ns.tag, ns.tensor_parallel, ns.data_parallel, ns.vocab_multiple, ns.kl_loss_coef))
        gpus = ns.tensor_parallel * ns.data_parallel
        return {
            "tag": ns.tag,
            "tensor_parallel": ns.tensor_parallel,
            "data_parallel": ns.data_parallel,
            "gpus": gpus,
            "returncode": 0,
            "seconds": 60.0,
            "first_step": stand_in_step(ns.tensor_parallel, ns.data_parallel),
            "perf": {"perf/step_time": 2.0 + gpus, "perf/actor_train_time": 1.5},
            "peak_memory": {str(r): {"max_allocated_GiB": 0.07} for r in range(gpus)},
        }

    (tmp_path / "nvsmi_g4_kl_tp4.csv").write_text("0, 3000 MiB\n1, 3100 MiB\n0, 3300 MiB\n2, 3200 MiB\n3, 3150 MiB\n")
    (tmp_path / "train_tp1.json").write_text(json.dumps({"first_step": {"train/loss": 1.0}}))  # another set's run
    ns = slime_megatron.main.__globals__["argparse"].Namespace(
        out=tmp_path, gpus=4, layouts=None, vocab_multiple=2, slime_src="", kl_loss_coef=0.1, timeout=1
    )
    assert slime_megatron.run_parallel(ns, tmp_path, 56, train=train) == 0
    assert calls == [("g4_kl_tp1", 1, 1, 4, 0.1), ("g4_kl_tp4", 4, 1, 4, 0.1), ("g4_kl_tp2dp2", 2, 2, 4, 0.1)]
    assert len(stops) == 4  # before every run, and after the last
    result = json.loads((tmp_path / "compare_parallel_g4_kl.json").read_text())
    assert result["reference"] == "g4_kl_tp1" and list(result["runs"]) == ["g4_kl_tp1", "g4_kl_tp4", "g4_kl_tp2dp2"]
    tp4, tp2dp2 = result["runs"]["g4_kl_tp4"], result["runs"]["g4_kl_tp2dp2"]
    assert (tp4["tensor_parallel"], tp4["data_parallel"], tp2dp2["tensor_parallel"], tp2dp2["data_parallel"]) == (
        4,
        1,
        2,
        2,
    )
    assert tp4["rel_diff_vs_reference"]["train/loss"] == pytest.approx(0.003)
    assert tp4["rel_diff_vs_reference"]["train/grad_norm"] == pytest.approx(0.3)
    assert tp2dp2["rel_diff_vs_reference"]["train/loss/sdpo_kl"] == pytest.approx(0.002)
    assert tp4["metrics"]["train/kl_loss"] == 1e-9 and tp4["abs_diff_vs_reference"]["train/kl_loss"] == 1e-9
    assert tp4["step_time_s"] == 6.0
    assert tp4["nvidia_smi_peak_MiB_per_gpu"] == {"0": 3300.0, "1": 3100.0, "2": 3200.0, "3": 3150.0}
    assert len(tp2dp2["peak_memory_per_rank"]) == 4
    table = capsys.readouterr().out
    assert "g4_kl_tp4  4x1" in table and "g4_kl_tp2dp2 2x2" in table and " kl " in table


def test_parallel_refuses_a_rollout_that_data_parallel_does_not_divide(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(slime_megatron, "stop_ray", lambda: None)
    ns = slime_megatron.main.__globals__["argparse"].Namespace(
        out=tmp_path, gpus=4, layouts=None, vocab_multiple=2, slime_src="", kl_loss_coef=0.0, timeout=1
    )
    assert slime_megatron.run_parallel(ns, tmp_path, 55, train=None) == 2
    assert "not a multiple of data parallel 2 (tp2dp2)" in capsys.readouterr().out


def test_a_failed_run_fails_the_stage(tmp_path, monkeypatch):
    monkeypatch.setattr(slime_megatron, "stop_ray", lambda: None)

    def train(out, checkpoint, slime_src, ns):
        failed = ns.tensor_parallel == 4
        return {
            "tensor_parallel": ns.tensor_parallel,
            "data_parallel": ns.data_parallel,
            "returncode": 1 if failed else 0,
            "first_step": None if failed else stand_in_step(ns.tensor_parallel, ns.data_parallel),
        }

    ns = slime_megatron.main.__globals__["argparse"].Namespace(
        out=tmp_path, gpus=4, layouts=None, vocab_multiple=2, slime_src="", kl_loss_coef=0.0, timeout=1
    )
    assert slime_megatron.run_parallel(ns, tmp_path, None, train=train) == 1
    assert json.loads((tmp_path / "compare_parallel_g4.json").read_text())["runs"]["g4_tp4"]["returncode"] == 1


def test_command_line_checks_the_set_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        slime_megatron.main(["parallel", "--gpus", "4", "--layouts", "tp4"])
    assert "needs tp1" in capsys.readouterr().err


def test_kl_adds_the_reference_model_to_the_training_command(tmp_path):
    config = {"num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4}
    config.update(rms_norm_eps=1e-5, vocab_size=357, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = slime_megatron.train_argv(tmp_path, tmp_path, 2, 2, 4, kl_loss_coef=0.1)
    assert argv[argv.index("--kl-loss-coef") + 1] == "0.1" and argv[argv.index("--ref-load") + 1] == str(tmp_path)
    assert argv[argv.index("--actor-num-gpus-per-node") + 1] == "4"
    assert argv[argv.index("--tensor-model-parallel-size") + 1] == "2"
    assert "--kl-loss-coef" not in slime_megatron.train_argv(tmp_path, tmp_path, 1, 1, 4)


def test_tp_check_pads_for_tp4_by_default(tmp_path, monkeypatch):
    """The TP check's sizes: at --tensor-parallel 4 the vocabulary pads to a multiple of 4 unless told
    otherwise, and a multiple TP does not divide is refused; the ranks are stand-ins here."""
    import torch.multiprocessing as mp

    seen = {}

    def spawn(fn, args, nprocs, join):
        ns = args[0]
        seen.update(nprocs=nprocs, vocab_multiple=ns.vocab_multiple)
        for rank in range(nprocs):
            (Path(ns.work) / f"tp_check_rank{rank}.json").write_text(json.dumps({"ok": True}))

    monkeypatch.setattr(mp, "spawn", spawn)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    assert slime_megatron_tp_check.main(["--tensor-parallel", "4", "--checkpoint", str(tmp_path)]) == 0
    assert seen == {"nprocs": 4, "vocab_multiple": 4}
    assert slime_megatron_tp_check.main(["--tensor-parallel", "2", "--checkpoint", str(tmp_path)]) == 0
    assert seen == {"nprocs": 2, "vocab_multiple": 2}
    with pytest.raises(SystemExit):
        slime_megatron_tp_check.main(["--tensor-parallel", "4", "--vocab-multiple", "2", "--checkpoint", str(tmp_path)])
