"""Sample conversion between slime's data source / trainer and our inner loop (pure, no slime).

The slime `Sample` itself is exercised in test_slime_integration.py; here the fields are checked
as plain values, plus the reward post-process plugin on objects with the attributes it reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime_meta.backends.slime.rollout import post_process_rewards
from slime_meta.backends.slime.runtime import router_urls
from slime_meta.backends.slime.samples import (
    META_KEY,
    is_solver_index,
    problem_from_sample,
    prompt_text,
    solver_sample_fields,
    status_value,
    teacher_sample_fields,
)
from slime_meta.types import SolverSample, TeacherSample


def teacher_sample(**overrides) -> TeacherSample:
    values = dict(
        prompt_ids=(1, 10, 11),
        response_ids=(20, 21),
        rollout_logprobs=(-0.5, -1.25),
        reward=0.75,
        advantage=1.2,
        group_index=3,
        sample_index=1,
        inner_iteration=2,
        weight_version="7",
        metadata={"finish_reason": "length", "info": "add df"},
    )
    return TeacherSample(**{**values, **overrides})


def test_teacher_sample_fields_are_what_slime_trains_on():
    fields = teacher_sample_fields(
        teacher_sample(),
        prompt="P",
        response="R",
        base_metadata={"uid": "u1", "rubric": "r"},
        trace={"steps": []},
        teacher_log_probs=[-0.1, -0.2],
        rollout_id=9,
    )
    assert fields["tokens"] == [1, 10, 11, 20, 21] and all(type(t) is int for t in fields["tokens"])
    assert fields["response_length"] == 2 and fields["loss_mask"] == [1, 1]
    assert fields["rollout_log_probs"] == [-0.5, -1.25] and fields["teacher_log_probs"] == [-0.1, -0.2]
    assert fields["reward"] == 0.75 and fields["status"] == "truncated" and fields["weight_versions"] == ["7"]
    assert fields["rollout_id"] == 9 and (fields["prompt"], fields["response"]) == ("P", "R")
    meta = fields["metadata"]
    assert meta["uid"] == "u1" and meta[META_KEY]["advantage"] == 1.2 and meta[META_KEY]["info"] == "add df"
    assert meta[META_KEY]["trace"] == {"steps": []} and meta[META_KEY]["inner_iteration"] == 2


def test_teacher_log_probs_must_align_with_the_response():
    with pytest.raises(ValueError, match="1 teacher log-probs for 2 response tokens"):
        teacher_sample_fields(teacher_sample(), prompt="", response="", teacher_log_probs=[-0.1])


@pytest.mark.parametrize(
    "finish, status", [("stop", "completed"), ("length", "truncated"), ("abort", "aborted"), (None, "completed")]
)
def test_status_from_finish_reason(finish, status):
    assert status_value(finish) == status


def test_problem_from_a_data_source_sample():
    sample = SimpleNamespace(
        prompt="What is 2+2?", label={"answer": "4"}, metadata={"uid": "q7", "rubric": "exact 4"}, group_index=0
    )
    problem = problem_from_sample(sample, rubric_key="rubric", fallback_uid="row-0")
    assert (problem.uid, problem.prompt, problem.ground_truth, problem.rubric) == ("q7", "What is 2+2?", "4", "exact 4")
    bare = problem_from_sample(
        SimpleNamespace(prompt="x", label=3, metadata=None), rubric_key="rubric", fallback_uid="row-5"
    )
    assert (bare.uid, bare.rubric, bare.ground_truth) == ("row-5", "", "3")


def test_prompt_text_of_chat_lists():
    chat = [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": "there"},
    ]
    assert prompt_text(chat) == "hi\n\nthere" and prompt_text("plain") == "plain"


def test_post_process_rewards_returns_the_rollouts_advantages():
    samples = [
        SimpleNamespace(reward=0.5, metadata={META_KEY: {"advantage": 1.0}}),
        SimpleNamespace(reward=0.0, metadata={META_KEY: {"advantage": -1.0}}),
        SimpleNamespace(reward=0.25, metadata={}),  # not ours: its reward stands
    ]
    assert post_process_rewards(None, samples) == ([0.5, 0.0, 0.25], [1.0, -1.0, 0.25])


def test_router_urls_for_shared_separate_and_external_students():
    cfg = SimpleNamespace(pools=SimpleNamespace(external_student_url=None))
    args = SimpleNamespace(
        sglang_router_ip="10.0.0.1", sglang_router_port=3000, sglang_model_routers={"default": ("10.0.0.1", 3000)}
    )
    assert router_urls(args, cfg) == ("http://10.0.0.1:3000", "http://10.0.0.1:3000")
    args.sglang_model_routers = {"actor": ("10.0.0.1", 3000), "student": ("10.0.0.2", 3100)}
    assert router_urls(args, cfg)[1] == "http://10.0.0.2:3100"
    cfg.pools.external_student_url = "http://10.0.0.9:30000"  # as the config holds it (no trailing slash)
    assert router_urls(args, cfg)[1] == "http://10.0.0.9:30000"


def test_solver_sample_fields_join_their_chains_rollout():
    solver = SolverSample(
        problem_uid="u3",
        prompt_ids=(1, 40),
        response_ids=(50, 51, 52),
        rollout_logprobs=(-0.5, -0.25, -1.0),
        temperature=0.7,
        grade=0.0,
        task_advantage=-1.5,
        prompt_text="P",
        solution_text="S",
        context_prompt_ids=(1, 9, 40),
        teacher_logprobs=(-0.1, -0.2, -0.3),
        is_error_site=True,
    )
    fields = solver_sample_fields(
        solver,
        prompt="P",
        response="S",
        teacher_log_probs=solver.teacher_logprobs,
        index=2,
        rollout_id=17,
        base_metadata={"uid": "u1"},
    )
    assert fields["tokens"] == [1, 40, 50, 51, 52] and fields["response_length"] == 3
    assert fields["teacher_log_probs"] == [-0.1, -0.2, -0.3] and fields["rollout_log_probs"] == [-0.5, -0.25, -1.0]
    assert fields["rollout_id"] == 17 and fields["reward"] == 0.0
    assert is_solver_index(fields["index"]) and not is_solver_index(17)
    assert fields["metadata"][META_KEY]["advantage"] == -1.5 and fields["metadata"]["uid"] == "u1"

    class Sample:  # the attributes post_process_rewards reads
        reward = fields["reward"]
        metadata = fields["metadata"]

    assert post_process_rewards(None, [Sample()]) == ([0.0], [-1.5])  # the task advantage, not the grade
    with pytest.raises(ValueError, match="teacher log-probs"):
        solver_sample_fields(solver, prompt="P", response="S", teacher_log_probs=(-0.1,), index=0, rollout_id=1)
