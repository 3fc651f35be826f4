"""Tests of loading problems and drawing reproducible episodes (slime_meta.data.problems)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slime_meta.data.batch_split import plan_batch
from slime_meta.data.problems import ProblemSampler, load_problems
from slime_meta.errors import UserInputError
from slime_meta.types import Problem

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SAMPLE_JSONL = DATA_DIR / "math_word_problems.jsonl"
SAMPLE_PARQUET = DATA_DIR / "math_word_problems.parquet"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def user_error(call, *args, **kwargs) -> str:
    """The message of the UserInputError the call raises (asserting that it is one line)."""
    with pytest.raises(UserInputError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def make_problems(count: int, groups: dict[str, int] | None = None) -> list[Problem]:
    if groups is None:
        return [Problem(uid=str(i), prompt=f"p{i}", label=str(i)) for i in range(count)]
    problems = []
    for name, size in groups.items():
        problems += [Problem(uid=f"{name}-{i}", prompt=f"{name}{i}", label="x", group=name) for i in range(size)]
    return problems


def uids(episodes) -> list[list[list[str]]]:
    return [[[p.uid for p in chunk] for chunk in e.train_chunks_P] + [[p.uid for p in e.holdout]] for e in episodes]


# --------------------------------------------------------------------------- loading


def test_sample_data_loads_the_same_from_all_three_formats(tmp_path):
    from_jsonl = load_problems(SAMPLE_JSONL, group_key="topic")
    from_parquet = load_problems(SAMPLE_PARQUET, group_key="topic")
    rows = [json.loads(line) for line in SAMPLE_JSONL.read_text().splitlines()]
    json_path = tmp_path / "problems.json"
    json_path.write_text(json.dumps(rows))
    from_json = load_problems(json_path, group_key="topic")
    assert len(from_jsonl) >= 40
    assert from_jsonl == from_parquet == from_json
    assert {p.group for p in from_jsonl} == {"percent", "rates", "fractions", "area"}
    assert all(p.rubric for p in from_jsonl)


def test_labels_numbers_become_strings_and_dicts_stay_dicts(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "a", "label": 12}, {"prompt": "b", "label": 2.5}, {"prompt": "c", "label": {"answer": "x = 2"}}],
    )
    problems = load_problems(path)
    assert [p.label for p in problems] == ["12", "2.5", {"answer": "x = 2"}]
    assert problems[2].ground_truth == "x = 2"
    # The parquet sample stores dict labels as JSON strings; they come back as dicts.
    parquet_labels = {p.uid: p.label for p in load_problems(SAMPLE_PARQUET)}
    assert parquet_labels["7"] == {"answer": "800", "unit": "dollars"}
    assert load_problems(SAMPLE_PARQUET)[7].ground_truth == "800"


def test_messages_column_joins_user_turns_and_input_key_wins(tmp_path):
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "First part."},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "Second part."}]},
    ]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": chat, "label": "1"}])
    assert load_problems(path)[0].prompt == "First part.\n\nSecond part."
    both = write_jsonl(tmp_path / "both.jsonl", [{"messages": chat, "prompt": "plain", "label": "1"}])
    assert load_problems(both)[0].prompt == "plain"


def test_uid_metadata_and_missing_rubric_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a7", "prompt": "p", "label": "1", "source": "book"}])
    [problem] = load_problems(path, id_key="id")
    assert problem.uid == "a7" and problem.rubric == "" and problem.metadata == {"source": "book"}
    [by_index] = load_problems(path)
    assert by_index.uid == "0" and by_index.metadata == {"id": "a7", "source": "book"}
    [only] = load_problems(path, metadata_keys=["source"])
    assert only.metadata == {"source": "book"}


def test_file_level_errors(tmp_path):
    assert "no such file" in user_error(load_problems, tmp_path / "missing.jsonl")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,label\n")
    assert "use .parquet, .jsonl or .json" in user_error(load_problems, csv)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    message = user_error(load_problems, empty)
    assert str(empty) in message and "no rows" in message


def test_unparseable_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n\n{"prompt": "b", "label": \n')
    message = user_error(load_problems, path)
    assert str(path) in message and "line 3" in message


def test_missing_columns_name_the_available_ones_and_the_flag(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "1"}])
    message = user_error(load_problems, path)
    assert "'prompt'" in message and "question, answer" in message and "--input-key" in message
    message = user_error(load_problems, path, input_key="question")
    assert "'label'" in message and "--label-key" in message
    message = user_error(load_problems, path, input_key="question", label_key="answer", group_key="topic")
    assert "'topic'" in message and "--group-key" in message
    assert load_problems(path, input_key="question", label_key="answer")[0].ground_truth == "1"


def test_rows_without_text_or_label_are_named(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "label": "1"}, {"prompt": "  ", "label": "1"}])
    message = user_error(load_problems, path)
    assert str(path) in message and "line 2" in message and "'prompt'" in message
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "ok", "label": "1"}, {"prompt": "b", "label": None}])
    message = user_error(load_problems, path)
    assert "line 2" in message and "'label'" in message
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "label": ["1", "2", ""]}), parquet)
    message = user_error(load_problems, parquet)
    assert str(parquet) in message and "row 2 (0-based)" in message and "'label'" in message


def test_bad_messages_and_empty_group_are_named(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": ["just a string"], "label": "1"}])
    message = user_error(load_problems, path)
    assert "line 1" in message and "'messages'" in message and "content" in message
    path = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "a", "label": "1", "topic": None}])
    message = user_error(load_problems, path, group_key="topic")
    assert "line 1" in message and "'topic'" in message


def test_duplicate_ids_are_an_error(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"id": 1, "prompt": "a", "label": "1"}, {"id": 1, "prompt": "b", "label": "2"}]
    )
    message = user_error(load_problems, path, id_key="id")
    assert "line 2" in message and "line 1" in message


# --------------------------------------------------------------------------- sizes


def test_rollout_batch_size_is_the_problems_drawn_and_the_ratio_splits_them():
    # The design document's example: 32 problems, 75% train, 25% holdout.
    plan = plan_batch(rollout_batch_size=32, train_ratio=0.75, heldout_ipb=None, problems_per_prompt=1)
    assert (plan.problems, plan.train, plan.holdout, plan.groups) == (32, 24, 8, 24)
    assert plan.draw_sizes == {"num_prompts": 24, "problems_per_prompt": 1, "num_holdout": 8}
    # The default flags: 4 problems = 3 train + 1 holdout.
    assert plan_batch(rollout_batch_size=4, train_ratio=0.75, heldout_ipb=None, problems_per_prompt=1).train == 3
    # round(6 x 0.75 = 4.5) goes up, whatever Python's round() would do.
    assert plan_batch(rollout_batch_size=6, train_ratio=0.75, heldout_ipb=None, problems_per_prompt=1).train == 5
    # --heldout-ipb counts out of the batch; teacher prompts = train / k.
    plan = plan_batch(rollout_batch_size=8, train_ratio=0.75, heldout_ipb=4, problems_per_prompt=2)
    assert (plan.train, plan.holdout, plan.groups, plan.holdout_per_episode) == (4, 4, 2, 4)


def test_with_families_the_holdout_splits_evenly_over_the_teacher_prompts():
    # The demo: 28 problems = 12 train (4 prompts of k=3) + 16 holdout, 4 of each prompt's family.
    plan = plan_batch(rollout_batch_size=28, train_ratio=0.75, heldout_ipb=16, problems_per_prompt=3, per_family=True)
    assert (plan.groups, plan.holdout_per_episode) == (4, 4)
    assert plan.draw_sizes == {"num_prompts": 4, "problems_per_prompt": 3, "num_holdout": 4}
    sampler = ProblemSampler(make_problems(30, {"a": 10, "b": 10, "c": 10}), seed=3, group_key_used=True)
    episodes = sampler.next_episodes(**plan.draw_sizes)
    assert sum(len(e.holdout) for e in episodes) == 16 and sum(len(c) for e in episodes for c in e.train_chunks_P) == 12
    assert all(
        len({p.group for c in e.train_chunks_P for p in c} | {p.group for p in e.holdout}) == 1 for e in episodes
    )
    assert plan.describe(samples_per_prompt=8, inner_iterations=2, inner_samples=2, holdout_samples=1).startswith(
        "plan per step: 28 problems = 12 train + 16 holdout, 4 holdout per family; 4 teacher prompts (GRPO groups) of "
        "3 x 8 infos = 32 chains"
    )


@pytest.mark.parametrize(
    "sizes, expected",
    [
        # 2 x 0.75 rounds to 2 train: no holdout left.
        (
            (2, 0.75, None, 1, False),
            ["no holdout problems", "nearest --rollout-batch-size that works: 3 (2 train + 1 holdout)"],
        ),
        # 6 train do not make prompts of 4.
        (
            (8, 0.75, None, 4, False),
            ["6 train problems do not split", "5 (4 train + 1 holdout) or 10 (8 train + 2 holdout)"],
        ),
        ((5, 0.75, 5, 1, False), ["no train problems", "--heldout-ipb 5", "6 (1 train + 5 holdout)"]),
        # 7 families cannot share 3 holdout problems evenly; only 3 or 1 prompts can.
        ((10, 0.75, 3, 1, True), ["--group-key", "works: 6 (3 train + 3 holdout)"]),
        # With families at 0.75 and k=1 the holdout (a quarter) never covers every prompt: say which --heldout-ipb does.
        (
            (8, 0.75, None, 1, True),
            [
                "no --rollout-batch-size works",
                "--heldout-ipb that works with --rollout-batch-size 8: 4 (4 train + 4 holdout)",
            ],
        ),
    ],
)
def test_impossible_splits_name_the_flags_and_the_nearest_sizes_that_work(sizes, expected):
    n, ratio, heldout, k, per_family = sizes
    message = user_error(
        plan_batch,
        rollout_batch_size=n,
        train_ratio=ratio,
        heldout_ipb=heldout,
        problems_per_prompt=k,
        per_family=per_family,
    )
    assert "--rollout-batch-size" in message and "--n-problems-per-prompt" in message
    for text in expected:
        assert text in message, (text, message)


# --------------------------------------------------------------------------- sampling


def test_no_group_episode_shape_and_distinct_problems():
    sampler = ProblemSampler(make_problems(20), seed=1)
    [episode] = sampler.next_episodes(num_prompts=3, problems_per_prompt=2, num_holdout=4)
    assert [len(chunk) for chunk in episode.train_chunks_P] == [2, 2, 2] and len(episode.holdout) == 4
    drawn = [p.uid for chunk in episode.train_chunks_P for p in chunk] + [p.uid for p in episode.holdout]
    assert len(set(drawn)) == 10


def test_sampler_is_deterministic_and_seed_dependent():
    def draw(seed: int):
        sampler = ProblemSampler(make_problems(30), seed=seed)
        return [uids(sampler.next_episodes(num_prompts=2, problems_per_prompt=2, num_holdout=1)) for _ in range(8)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_no_shuffle_uses_file_order():
    sampler = ProblemSampler(make_problems(6), seed=0, shuffle=False)
    assert uids(sampler.next_episodes(num_prompts=2, problems_per_prompt=1, num_holdout=2)) == [
        [["0"], ["1"], ["2", "3"]]
    ]


def test_epochs_wrap_and_cover_every_problem_once_per_epoch():
    sampler = ProblemSampler(make_problems(10), seed=3)
    drawn = []
    for _ in range(6):  # 6 steps x 5 problems = 3 epochs of 10
        [episode] = sampler.next_episodes(num_prompts=2, problems_per_prompt=2, num_holdout=1)
        step = [p.uid for chunk in episode.train_chunks_P for p in chunk] + [p.uid for p in episode.holdout]
        assert len(set(step)) == 5
        drawn += step
    assert sampler.epoch == 2  # 0-based: the third epoch, just used up (the next draw starts epoch 3)
    epochs = [drawn[0:10], drawn[10:20], drawn[20:30]]
    assert all(sorted(epoch, key=int) == [str(i) for i in range(10)] for epoch in epochs)
    assert epochs[0] != epochs[1]  # a new order each epoch


def test_a_step_across_an_epoch_boundary_has_no_repeats():
    sampler = ProblemSampler(make_problems(7), seed=11)
    for _ in range(20):
        [episode] = sampler.next_episodes(num_prompts=1, problems_per_prompt=3, num_holdout=2)
        step = [p.uid for p in episode.train_chunks_P[0]] + [p.uid for p in episode.holdout]
        assert len(set(step)) == 5


@pytest.mark.parametrize("grouped", [False, True])
def test_resuming_from_a_saved_state_draws_the_same_batches(grouped):
    problems = make_problems(0, {"a": 5, "b": 6, "c": 4}) if grouped else make_problems(13)
    sizes = dict(num_prompts=2, problems_per_prompt=2, num_holdout=1)
    original = ProblemSampler(problems, seed=9, group_key_used=grouped)
    for _ in range(3):
        original.next_episodes(**sizes)
    state = json.loads(json.dumps(original.state_dict()))  # what a checkpoint stores
    expected = [uids(original.next_episodes(**sizes)) for _ in range(2)]
    resumed = ProblemSampler(problems, seed=12345, group_key_used=grouped)  # the saved seed wins
    resumed.load_state_dict(state)
    assert [uids(resumed.next_episodes(**sizes)) for _ in range(2)] == expected


def test_loading_a_state_from_another_dataset_is_refused():
    state = ProblemSampler(make_problems(10), seed=0).state_dict()
    message = user_error(ProblemSampler(make_problems(11), seed=0).load_state_dict, state)
    assert "different dataset" in message


def test_group_mode_keeps_train_and_holdout_in_one_family_and_disjoint():
    problems = make_problems(0, {"percent": 6, "rates": 5, "area": 7})
    sampler = ProblemSampler(problems, seed=2, group_key_used=True)
    families_seen = []
    for _ in range(5):
        episodes = sampler.next_episodes(num_prompts=2, problems_per_prompt=2, num_holdout=2)
        assert len(episodes) == 2
        for episode in episodes:
            [train] = episode.train_chunks_P
            groups = {p.group for p in train} | {p.group for p in episode.holdout}
            assert len(groups) == 1
            assert not {p.uid for p in train} & {p.uid for p in episode.holdout}
            families_seen.append(groups.pop())
    assert set(families_seen) == {"percent", "rates", "area"}
    # Each epoch of the family order visits every family once.
    assert sorted(families_seen[:3]) == ["area", "percent", "rates"]


def test_group_mode_on_the_sample_data():
    problems = load_problems(SAMPLE_JSONL, group_key="topic")
    sampler = ProblemSampler(problems, seed=0, group_key_used=True)
    episodes = sampler.next_episodes(num_prompts=4, problems_per_prompt=3, num_holdout=3)
    assert sorted(e.holdout[0].group for e in episodes) == ["area", "fractions", "percent", "rates"]


def test_validate_names_the_small_family_and_the_numbers():
    sampler = ProblemSampler(make_problems(0, {"big": 8, "tiny": 3}), seed=0, group_key_used=True)
    sampler.validate(2, 1, num_prompts=5)
    message = user_error(sampler.validate, 2, 2, 1)
    assert "'tiny'" in message and "has 3 problems" in message and "needs 4" in message
    with pytest.raises(UserInputError):
        sampler.next_episodes(num_prompts=1, problems_per_prompt=3, num_holdout=1)
    flat = ProblemSampler(make_problems(9), seed=0)
    message = user_error(flat.validate, 2, 2, 4)
    assert "has 9 problems" in message and "needs 10" in message


def test_group_mode_needs_groups():
    with pytest.raises(UserInputError):
        ProblemSampler(make_problems(4), seed=0, group_key_used=True)


# --------------------------------------------------------------------------- eval sets held out of training


def test_problem_key_ignores_case_spacing_unicode_forms_and_the_label():
    from slime_meta.data.problems import problem_key

    same = [
        Problem(uid="0", prompt="What is 2 + 2?", label="4"),
        Problem(uid="1", prompt="  what is 2 +\n 2?\t", label="4.0"),
        Problem(uid="2", prompt="WHAT IS 2 + 2?", label={"answer": "4"}),
        Problem(uid="3", prompt="Ｗhat is ２ + ２?", label="four"),  # full-width letters and digits (NFKC)
    ]
    assert len({problem_key(p) for p in same}) == 1
    assert problem_key(Problem(uid="4", prompt="What is 2 + 3?", label="4")) != problem_key(same[0])


def test_eval_problems_leave_training_whatever_their_format_and_only_none_left_exits_2(
    tmp_path, tiny_checkpoint, capsys
):
    from slime_meta.backends.local.data import load_data
    from slime_meta.config.arguments import parse_config

    train_rows = [{"prompt": f"Ana has {i} apples and gets 2 more. How many?", "label": str(i + 2)} for i in range(12)]
    # Five of them again in the eval file, each in another form: the label "2.0" for "2", a dict
    # label, other whitespace, other case, full-width digits. Compared as (text, label), four stayed
    # in training.
    eval_rows = [
        {"prompt": train_rows[0]["prompt"], "label": "2.0"},
        {"prompt": train_rows[1]["prompt"], "label": {"answer": "3"}},
        {"prompt": "Ana has 2 apples  and gets 2 more.\nHow many?", "label": "4"},
        {"prompt": train_rows[3]["prompt"].upper(), "label": "5"},
        {"prompt": train_rows[4]["prompt"].replace("4", "４"), "label": "6"},
        {"prompt": "A problem of its own, never trained on?", "label": "1"},
    ]
    train_file = write_jsonl(tmp_path / "train.jsonl", train_rows)
    eval_file = write_jsonl(tmp_path / "eval.jsonl", eval_rows)

    def config(train: Path):
        return parse_config(
            [
                "--use-meta-learning",
                "--hf-checkpoint",
                str(tiny_checkpoint),
                "--prompt-data",
                str(train),
                "--eval-prompt-data",
                "held",
                str(eval_file),
                "--rollout-batch-size",
                "2",
                "--heldout-ipb",
                "1",
                "--teacher-template",
                "T:{problem}{attempts_and_grades}{previous_info}",
                "--teacher-max-tokens",
                "8",
                "--generator-template",
                "Q: {problem}",
                "--rollout-max-response-len",
                "8",
                "--run-dir",
                str(tmp_path / "run"),
            ]
        )

    data = load_data(config(train_file))
    assert sorted(int(p.uid) for p in data.sampler.problems) == list(range(5, 12))
    out = capsys.readouterr().out
    assert out.count("--eval-prompt-data") == 1
    assert f"5 problems of {train_file} are also in --eval-prompt-data: they are left out of training" in out

    only_eval = write_jsonl(tmp_path / "only_eval.jsonl", train_rows[:5])
    message = user_error(load_data, config(only_eval))
    assert message.startswith(f"--prompt-data {only_eval}: every problem is also in --eval-prompt-data")
