"""Our slime plugins with slime's own source: real Sample, data source and output types.

Needs a THUDM/slime checkout (`SLIME_SRC=/path/to/slime`, or slime installed); skipped otherwise.
The SGLang pools are the embedded workers behind the real sglang-router (a tiny random model):
what slime would start on GPUs, speaking the same API. Parts that cannot run on this machine
are stubbed, as slime's own tests/plugin_contracts do: `ray` (when it is not installed); for the
parser test also `sglang.srt.server_args`, `requests` and `wandb`, which slime's argument module
imports but does not use while adding its flags. Megatron is absent, so slime's parse_args
itself is not called: its flag groups are, on one parser with ours.

The output is checked with the assertions of slime's tests/plugin_contracts (imported from the
checkout): signature identical to slime's default, groups of n_samples_per_prompt, int tokens,
str response, int response_length, reward set, Status set.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.backends.slime import rollout as plugin
from slime_meta.backends.slime.data import convert
from slime_meta.backends.slime.flags import arguments_for_slime
from slime_meta.backends.slime.plan import meta_parser, translate
from slime_meta.backends.slime.samples import META_KEY, is_solver_index

REPO = Path(__file__).resolve().parents[1]
SLIME_SRC = os.environ.get("SLIME_SRC")
if not SLIME_SRC and importlib.util.find_spec("slime") is None:
    pytest.skip("slime's source is not importable: set SLIME_SRC to a THUDM/slime checkout", allow_module_level=True)


def _stub(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


@pytest.fixture(scope="module")
def slime():
    """slime's modules (and its plugin-contract assertions); everything is undone afterwards."""
    import sglang_router  # noqa: F401  (imported first: the contracts module would stub it otherwise)
    import transformers  # noqa: F401

    saved_path, saved_modules = list(sys.path), set(sys.modules)
    if SLIME_SRC:
        sys.path[:0] = [SLIME_SRC, str(Path(SLIME_SRC) / "tests")]
    stubs = {}
    if importlib.util.find_spec("ray") is None:
        services = types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")
        stubs["ray"] = _stub("ray", _private=types.SimpleNamespace(services=services))
    sys.modules.update(stubs)
    try:
        from slime.observability.rollout_data_utils import validate_rollout_id_annotated
        from slime.rollout import base_types
        from slime.rollout.data_source import RolloutDataSourceWithBuffer
        from slime.utils.types import Sample

        contracts_file = (
            Path(sys.modules["slime"].__file__).parents[1] / "tests/plugin_contracts/test_plugin_rollout_contracts.py"
        )
        spec = importlib.util.spec_from_file_location("slime_plugin_rollout_contracts", contracts_file)
        contracts = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(contracts)
        yield types.SimpleNamespace(
            Sample=Sample,
            base_types=base_types,
            DataSource=RolloutDataSourceWithBuffer,
            contracts=contracts,
            validate_rollout_id_annotated=validate_rollout_id_annotated,
        )
    finally:
        plugin.close_runtimes()
        for name in set(sys.modules) - saved_modules:
            if name in stubs or name == "slime" or name.startswith(("slime.", "plugin_contracts", "slime_plugin_")):
                del sys.modules[name]
        for name in stubs:
            sys.modules.pop(name, None)
        sys.path[:] = saved_path


@pytest.fixture(scope="module")
def pools(tiny_checkpoint, tmp_path_factory):
    """Embedded workers behind the real sglang-router. The 'student' model's URL is the worker's
    own (the same SGLang API without the router): a second URL to route to, without paying for a
    second pool's start-up on this 2-core machine."""
    logs = tmp_path_factory.mktemp("pool-logs")
    with LocalProcessGroup() as group:
        teacher = group.start_pool(
            "teacher", str(tiny_checkpoint), 1, device="cpu", weights_root=None, log_dir=str(logs)
        )
        yield types.SimpleNamespace(teacher=teacher.router_url, student=teacher.worker_urls[0])


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def slime_args(
    tmp_path: Path, checkpoint: Path, teacher_url: str, extra=(), models=None, eval_set=None
) -> argparse.Namespace:
    """The namespace slime's rollout manager would pass: our translated flags plus what slime sets."""
    prompts = tmp_path / "prompts.slime.jsonl"
    convert(REPO / "data/synthetic_suffix.jsonl", prompts)
    argv = [
        "--use-meta-learning",
        "--prompt-data",
        str(prompts),
        "--hf-checkpoint",
        str(checkpoint),
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--heldout-ipb",
        "2",  # 2 prompts + 2 holdout
        "--num-inner-iterations",
        "1",
        "--n-samples-per-inner-prompt",
        "1",
        "--teacher-max-tokens",
        "6",
        "--rollout-max-response-len",
        "6",
        "--trace-sample-rate",
        "1.0",
        "--generator-template",
        "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate",
        "--teacher-template",
        "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate",
        "--grader",
        "verifier",
        "--verifier-metric",
        "char",
        "--ref-load",  # the reference model of the shared student's KL term (slime loads it; not read here)
        str(checkpoint),
        *extra,
    ]
    ns, _ = meta_parser().parse_known_args(list(translate(argv).slime_argv))
    args = argparse.Namespace(**vars(ns))
    # slime's defaults for what its data source reads, and what its rollout manager writes back.
    args.__dict__.update(
        rollout_global_dataset=True,
        metadata_key="metadata",
        tool_key="tools",
        multimodal_keys=None,
        apply_chat_template=False,
        apply_chat_template_kwargs={},
        rollout_seed=42,
        rollout_max_prompt_len=None,
        dump_details=None,
        buffer_filter_path=None,
        eval_prompt_data=None,
    )
    if eval_set is not None:  # slime's own --eval-prompt-data, as its parser leaves it: NAME PATH pairs
        args.eval_prompt_data = ["held", str(eval_set)]
    args.sglang_router_ip, args.sglang_router_port = host_port(teacher_url)
    args.sglang_model_routers = models or {"default": host_port(teacher_url)}
    return args


def test_train_and_eval_rollouts_meet_slimes_plugin_contract(slime, pools, tiny_checkpoint, tmp_path, capsys):
    contracts = slime.contracts
    contracts.assert_rollout_function_signature_matches_default(plugin.generate_rollout)

    held = tmp_path / "held.slime.jsonl"
    convert(REPO / "data/synthetic_suffix.jsonl", held)  # the converted format, as a user would pass it
    args = slime_args(tmp_path, tiny_checkpoint, pools.teacher, eval_set=held)
    data_source = slime.DataSource(args)
    output = plugin.generate_rollout(args, 0, data_source)
    contracts.assert_train_rollout_contract(output, n_samples_per_prompt=args.n_samples_per_prompt)
    assert isinstance(output, slime.base_types.RolloutFnTrainOutput)
    assert len(output.samples) == args.rollout_batch_size  # what slime's trainer expects per step
    slime.validate_rollout_id_annotated(output.samples)

    samples = [s for group in output.samples for s in group]
    for sample in samples:
        assert sample.response_length == len(sample.rollout_log_probs) == len(sample.loss_mask) > 0
        assert sample.tokens[-sample.response_length :] and sample.status in (
            slime.Sample.Status.COMPLETED,
            slime.Sample.Status.TRUNCATED,
        )
        assert sample.metadata["uid"].startswith("f") and sample.metadata["rubric"]  # the row's metadata
        assert "trace" in sample.metadata[META_KEY] and sample.teacher_log_probs is None
    assert len({s.index for s in samples}) == len(samples)
    # The step line, as on one machine, with the rollout's part (slime's trainer logs its loss).
    (line,) = [text for text in capsys.readouterr().out.splitlines() if text.startswith("step ")]
    assert line.startswith(f"step 1/{args.num_rollout} [") and " holdout " in line and "rollout " in line
    assert "nan" not in line
    assert output.metrics["meta_learning/num_train_problems"] == 2.0 and output.metrics["pool/teacher_requests"] > 0
    assert plugin.runtime(args).student_pool.base_url == pools.teacher  # shared pool

    raw, advantages = plugin.post_process_rewards(args, samples)
    assert raw == [s.reward for s in samples]
    assert advantages == [s.metadata[META_KEY]["advantage"] for s in samples]

    evaluation = plugin.generate_rollout(args, 0, data_source, evaluation=True)
    contracts.assert_eval_rollout_contract(evaluation)
    # slime logs each data set as eval/<key>: eval/held/holdout_grade and eval/held/holdout_grade_no_info.
    assert set(evaluation.data) == {"held/holdout_grade", "held/holdout_grade_no_info"}
    assert len(evaluation.data["held/holdout_grade"]["samples"]) == 4  # one per chain
    assert len(evaluation.data["held/holdout_grade_no_info"]["samples"]) == 2  # one per holdout problem
    with_info = evaluation.data["held/holdout_grade"]["rewards"]
    no_info = evaluation.data["held/holdout_grade_no_info"]["rewards"]
    assert evaluation.metrics["eval/held/gain"] == pytest.approx(sum(with_info) / 4 - sum(no_info) / 2)
    assert (tmp_path / "run" / "metrics.jsonl").exists() and (tmp_path / "run" / "traces.jsonl").exists()


def test_student_pool_compact_steps_and_distillation(slime, pools, tiny_checkpoint, tmp_path):
    models = {"actor": host_port(pools.teacher), "student": host_port(pools.student)}
    extra = [
        "--num-inner-iterations",
        "2",
        "--train-all-inner-steps",
        "--teacher-context",
        "Hints are two letters.",
        "--teacher-tau",
        "0.5",
        "--student-tau",
        "0.5",
        "--rollout-temperature",
        "0.7",
        "--teacher-temperature",
        "0.7",
        "--eval-baseline",
    ]
    args = slime_args(tmp_path, tiny_checkpoint, pools.teacher, extra=extra, models=models)
    output = plugin.generate_rollout(args, 0, slime.DataSource(args))
    # --eval-baseline: the student with and without the context, measured at the first step only.
    baseline = {k: v for k, v in output.metrics.items() if "baseline" in k}
    assert set(baseline) == {
        "eval/prompts.slime/baseline_student/avg",
        "eval/prompts.slime/baseline_teacher/avg",
        "eval/prompts.slime/baseline_diff",
        "eval/prompts.slime/baseline_student/se",
        "eval/prompts.slime/baseline_teacher/se",
        "eval/prompts.slime/baseline_problems",
        "eval/prompts.slime/baseline_attempts",
    }
    assert baseline["eval/prompts.slime/baseline_attempts"] == 4  # --eval-baseline-attempts' default
    assert not any("baseline" in k for k in plugin.generate_rollout(args, 1, slime.DataSource(args)).metrics)

    assert len(output.samples) == 2 and all(len(group) == 2 for group in output.samples)
    slime.validate_rollout_id_annotated(output.samples)  # each chain: one rollout of K samples
    for group in output.samples:
        for chain in group:
            infos = [s for s in chain if not is_solver_index(s.index)]
            solvers = [s for s in chain if is_solver_index(s.index)]
            assert [s.metadata[META_KEY]["inner_iteration"] for s in infos] == [0, 1]
            assert len({s.rollout_id for s in chain}) == 1 and chain[0].rollout_id is not None
            # Distillation trains the policy's own answers to the chain's problems, not the infos.
            assert len(solvers) == 1 and all(s.metadata[META_KEY]["kind"] == "distill" for s in solvers)
            for sample in chain:
                slime.contracts.assert_sample_contract(sample)
                assert len(sample.teacher_log_probs) == sample.response_length
                assert all(lp <= 0.0 for lp in sample.teacher_log_probs)
            assert all(s.teacher_log_probs == s.rollout_log_probs for s in infos)  # carried, never read
            assert any(s.teacher_log_probs != s.rollout_log_probs for s in solvers)  # the context changes them
    assert plugin.runtime(args).student_pool.base_url == pools.student  # the 'student' model's URL ...
    assert output.metrics["pool/student_requests"] > 0  # ... served the student


def test_slimes_argument_groups_take_ours_without_conflicts(slime):
    """slime adds its flags after ours; a flag defined twice would stop its parser."""
    stubs = {
        "sglang": _stub("sglang"),
        "sglang.srt": _stub("sglang.srt"),
        "sglang.srt.server_args": _stub("sglang.srt.server_args", ServerArgs=type("ServerArgs", (), {})),
        "requests": _stub("requests"),
        "wandb": _stub("wandb"),
    }
    added = {name: module for name, module in stubs.items() if importlib.util.find_spec(name.split(".")[0]) is None}
    with pytest.MonkeyPatch.context() as patch:
        for name, module in added.items():
            patch.setitem(sys.modules, name, module)
        from slime.utils.arguments import get_slime_extra_args_provider

        def megatron_parser() -> argparse.ArgumentParser:  # the Megatron flags ours share, already there
            parser = argparse.ArgumentParser(allow_abbrev=False)
            for flag in (
                "--lr",
                "--seed",
                "--save",
                "--load",
                "--micro-batch-size",
                "--clip-grad",
                "--weight-decay",
                "--adam-beta1",
                "--adam-beta2",
                "--save-interval",
                "--global-batch-size",
            ):
                parser.add_argument(flag)
            return parser

        from slime_meta.config.arguments import add_meta_learning_arguments

        with pytest.raises(argparse.ArgumentError, match="conflicting option string"):
            get_slime_extra_args_provider(add_meta_learning_arguments)(megatron_parser())
        parser = get_slime_extra_args_provider(arguments_for_slime)(megatron_parser())

    plan = translate(
        [
            "--use-meta-learning",
            "--prompt-data",
            "p.jsonl",
            "--hf-checkpoint",
            "/ckpt",
            "--colocate",
            "--rollout-temperature",
            "0.6",
            "--teacher-temperature",
            "0.9",
            "--num-inner-iterations",
            "5",
            "--ref-load",
            "/ckpt/ref",
        ]
    )
    args, unknown = parser.parse_known_args(list(plan.slime_argv))
    assert unknown == []  # every flag of the plan is known to slime's parser plus ours
    # The shared student's KL term acts on slime: slime's parser reads the switch that makes it build
    # the reference model (slime/ray/placement_group.py: with_ref = kl_coef != 0 or use_kl_loss) and
    # makes its loss add the term, with our weight and estimator (slime's own default is k1).
    assert args.use_kl_loss and (args.kl_loss_coef, args.kl_loss_type, args.kl_coef) == (0.1, "k3", 0.0)
    assert (args.rollout_temperature, args.student_temperature, args.num_inner_iterations) == (0.9, 0.6, 5)
    assert args.rollout_function_path == "slime_meta.backends.slime.rollout.generate_rollout"
    assert args.loss_type == "custom_loss" and args.input_key == "prompt" and args.colocate


def test_replay_pairs_become_two_samples_of_their_chains_rollout(slime, pools, tiny_checkpoint, tmp_path, monkeypatch):
    """Channel 3 through the real rollout: teachers on an OpenAI-compatible server answer with the
    label, the policy's wrong answers become pairs, each pair two samples (+-w) in its chain's rollout,
    the reference log-probs scored once on the frozen pool of the start weights and cached."""
    import json

    try:
        from tests.openai_server import run_openai_server
    except ImportError:
        from openai_server import run_openai_server

    labels = {}
    for line in (REPO / "data/synthetic_suffix.jsonl").read_text().splitlines():
        row = json.loads(line)
        labels[row["prompt"]] = row["label"]

    def reply(messages):
        text = messages[-1]["content"]
        return next((label for word, label in labels.items() if word in text), "?")

    monkeypatch.setenv("SLIME_META_TEST_REPLAY_KEY", "sk-test")
    with run_openai_server(reply_fn=reply) as (url_a, _), run_openai_server(reply_fn=reply) as (url_b, _):
        models = {"actor": host_port(pools.teacher), "student": host_port(pools.student)}
        extra = [
            "--student-num-gpus",
            "1",
            "--replay-beta",
            "0.5",
            "--replay-teachers",
            f"a@{url_a}#SLIME_META_TEST_REPLAY_KEY",
            f"b@{url_b}#SLIME_META_TEST_REPLAY_KEY",
            "--teacher-temperature",
            "1",
            "--rollout-temperature",
            "1",
        ]
        args = slime_args(tmp_path, tiny_checkpoint, pools.teacher, extra=extra, models=models)
        output = plugin.generate_rollout(args, 0, slime.DataSource(args))

    slime.validate_rollout_id_annotated(output.samples)
    replay = [
        s for group in output.samples for chain in group for s in chain if s.metadata[META_KEY].get("kind") == "replay"
    ]
    assert output.metrics["replay/pairs"] == len(replay) / 2 > 0
    by_pair = {}
    for s in replay:
        slime.contracts.assert_sample_contract(s)
        by_pair.setdefault(s.metadata[META_KEY]["pair_index"], []).append(s)
    for chosen, rejected in by_pair.values():
        assert chosen.metadata[META_KEY]["chosen"] and not rejected.metadata[META_KEY]["chosen"]
        assert chosen.rollout_id == rejected.rollout_id  # one step, one rollout
        assert chosen.reward == -rejected.reward > 0  # +w and -w, times --replay-beta
        assert len(chosen.rollout_log_probs) == chosen.response_length
    raw, advantages = plugin.post_process_rewards(args, replay)
    assert advantages == [s.reward for s in replay]
    assert (tmp_path / "run" / "replay_pairs.jsonl").read_text().count('"reference"') >= 1  # cached for a resume


def test_group_key_keeps_each_prompt_and_its_holdout_in_one_family(slime, pools, tiny_checkpoint, tmp_path):
    """--group-key on slime: the problems come from the per-family sampler (the local backend's),
    the data source's Samples carry the drawn problem's metadata, and a step draws new families."""
    import json

    held = tmp_path / "held.slime.jsonl"
    convert(REPO / "data/synthetic_suffix.jsonl", held)
    extra = ["--group-key", "family"]
    args = slime_args(tmp_path, tiny_checkpoint, pools.teacher, extra=extra, eval_set=held)
    first = plugin.generate_rollout(args, 0, slime.DataSource(args))
    second = plugin.generate_rollout(args, 1, slime.DataSource(args))
    evaluation = plugin.generate_rollout(args, 2, slime.DataSource(args), evaluation=True)
    batches = [json.loads(line) for line in (tmp_path / "run" / "traces.jsonl").read_text().splitlines()]
    batches = [b for b in batches if b.get("type") == "batch"]
    assert [b["rollout_id"] for b in batches] == [0, 1]
    for batch in batches:
        assert len(batch["episodes"]) == 2  # one episode (family) per teacher prompt
        for episode in batch["episodes"]:
            families = {uid.split("-")[0] for chunk in episode["train"] for uid in chunk} | {
                uid.split("-")[0] for uid in episode["holdout"]
            }
            assert len(families) == 1 and len(episode["holdout"]) == 1
    for output, batch in zip((first, second), batches):
        for group, episode in zip(output.samples, batch["episodes"]):
            assert {s.metadata["uid"] for s in group} == {episode["train"][0][0]}
            assert {s.metadata["family"] for s in group} == {episode["train"][0][0].split("-")[0]}
    assert batches[0]["episodes"] != batches[1]["episodes"]
    assert "eval/held/gain" in evaluation.metrics  # the fixed eval draw, per family as well
