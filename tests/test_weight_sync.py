"""After a train step the teacher's workers serve the new weights; a separate student pool does not move."""

from __future__ import annotations

import json
import urllib.request

from transformers import AutoTokenizer

from slime_meta.backends.local.training.settings import TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.backends.local.workers.weight_sync import push_weights
from slime_meta.rollout.pools import post_json_sync
from slime_meta.types import TeacherSample


def score(url: str, ids: list[int]) -> list[float]:
    """Log-probs of `ids` under the pool's current weights (SGLang's scoring call)."""
    reply = post_json_sync(
        url + "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0},
    )
    return [entry[0] for entry in reply["meta_info"]["input_token_logprobs"][1:]]


def weight_version(worker_url: str) -> str:
    with urllib.request.urlopen(worker_url + "/get_model_info", timeout=10) as response:
        return str(json.loads(response.read())["weight_version"])


def test_teacher_weights_change_and_student_weights_do_not(tiny_checkpoint, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    probe = tokenizer("Sab|word=wordab.", add_special_tokens=False)["input_ids"]
    weights_root = tmp_path / "weights"
    with LocalProcessGroup() as group:
        teacher = group.start_pool(
            "teacher", str(tiny_checkpoint), 1, device="cpu", weights_root=str(weights_root), log_dir=str(tmp_path)
        )
        student = group.start_pool(
            "student", str(tiny_checkpoint), 1, device="cpu", weights_root=None, log_dir=str(tmp_path)
        )
        teacher_before, student_before = score(teacher.router_url, probe), score(student.router_url, probe)
        assert teacher_before == student_before  # one checkpoint, two pools
        student_version = weight_version(student.worker_urls[0])

        prompt = tokenizer("T#abcd:abcdxy!abcdef;>", add_special_tokens=False)["input_ids"]
        reply = post_json_sync(
            teacher.router_url + "/generate",
            {"input_ids": prompt, "sampling_params": {"temperature": 1.0, "max_new_tokens": 4}, "return_logprob": True},
        )
        sample = TeacherSample(
            prompt_ids=tuple(prompt),
            response_ids=tuple(reply["output_ids"]),
            rollout_logprobs=tuple(e[0] for e in reply["meta_info"]["output_token_logprobs"]),
            reward=1.0,
            advantage=1.0,
            group_index=0,
            sample_index=0,
            inner_iteration=0,
        )
        trainer = LocalTrainer(str(tiny_checkpoint), TrainerSettings(lr=5e-2, device="cpu"))
        metrics = trainer.train_step([sample])
        assert metrics["train/logprob_abs_diff"] < 1e-4  # the trainer reproduces the engine's log-probs
        push_weights(trainer, list(teacher.worker_urls), weights_root, version=1)

        teacher_after, student_after = score(teacher.router_url, probe), score(student.router_url, probe)
        assert max(abs(a - b) for a, b in zip(teacher_after, teacher_before)) > 1e-3
        assert student_after == student_before
        assert weight_version(teacher.worker_urls[0]) == "1"
        assert weight_version(student.worker_urls[0]) == student_version
        assert [p.name for p in weights_root.iterdir()] == ["v0000001"]
