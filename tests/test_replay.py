"""Trace replay pairs from N teachers, each a real local OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Callable, Iterator

import pytest

from slime_meta.errors import UserInputError
from slime_meta.replay.pairs import ReplayPairer, ReplayRequest, replay_key
from slime_meta.replay.teachers import ReplayTeacher, parse_replay_teachers
from slime_meta.replay.vote import _decide, _is_final

try:
    from tests.openai_server import run_openai_server
except ImportError:  # tests/ is on sys.path (pytest's rootdir insertion) but not a package
    from openai_server import run_openai_server

KEY_ENV = "SLIME_META_TEST_REPLAY_KEY"
SECRET = "sk-replay-secret-0123456789"

PROMPTS = {"p1": "Problem one: what is 2 + 3?", "p2": "Problem two: what is 10 / 2?", "p3": "Problem three: 7 - 4?"}


def request(uid: str, policy_solution: str) -> ReplayRequest:
    return ReplayRequest.build(PROMPTS[uid], policy_solution, uid)


def replies(table: dict[str, str]) -> Callable[[list[dict]], str]:
    """A reply_fn answering by prompt: `table[prompt]`, else "Answer: ?"."""

    def reply(messages: list[dict]) -> str:
        assert len(messages) == 1 and messages[0]["role"] == "user"
        return table.get(messages[0]["content"], "Answer: ?")

    return reply


@contextlib.contextmanager
def teachers(*settings: dict) -> Iterator[tuple[list[ReplayTeacher], list]]:
    """One server per teacher; settings are run_openai_server keyword arguments."""
    with contextlib.ExitStack() as stack:
        served = [stack.enter_context(run_openai_server(**s)) for s in settings]
        specs = [f"t{i}@{base_url}#{KEY_ENV}" for i, (base_url, _) in enumerate(served)]
        yield parse_replay_teachers(specs), [state for _, state in served]


def pairer(teacher_list, cache: Path, **overrides) -> ReplayPairer:
    settings = dict(min_agree=2, cache_path=cache, concurrency=4, initial_backoff=0.01, max_backoff=0.02)
    return ReplayPairer(teacher_list, **{**settings, **overrides})


def run(p: ReplayPairer, requests):
    return p.pairs_for_sync(requests)


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)


def n_calls(states) -> int:
    return sum(len(state.requests) for state in states)


# --------------------------------------------------------------------------- pairing


def test_two_of_three_agree_against_the_policy_gives_one_pair(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    p1 = PROMPTS["p1"]
    with teachers(
        {"reply_fn": replies({p1: "2 + 3 = 4?\nNo.\nAnswer: 5"})},
        {"reply_fn": replies({p1: "Adding gives **5**.\n\nAnswer: $5$."})},
        {"reply_fn": replies({p1: "Answer: 6"})},
    ) as (teacher_list, states):
        p = pairer(teacher_list, tmp_path / "replay.jsonl")
        pairs = run(p, [request("p1", "I think 2 + 3 = 4.\nAnswer: 4")])
    assert len(pairs) == 1
    pair = pairs[0]
    assert pair.chosen == "2 + 3 = 4?\nNo.\nAnswer: 5"  # the first agreeing teacher's full text
    assert pair.rejected == "I think 2 + 3 = 4.\nAnswer: 4"
    assert (pair.chosen_answer, pair.rejected_answer) == ("5", "4")
    assert pair.teachers == (teacher_list[0].label, teacher_list[1].label)
    assert pair.prompt_text == p1 and pair.key == replay_key(p1, pair.rejected)
    assert p.stats.pairs == 1 and p.stats.calls == 3 and p.stats.api_failures == 0
    for state, teacher in zip(states, teacher_list):  # each teacher got the prompt, its model, the key
        (sent,) = state.requests
        assert sent.model == teacher.name and sent.temperature == 0.0
        assert sent.messages == [{"role": "user", "content": p1}]
        assert sent.authorization == f"Bearer {SECRET}"
    assert SECRET not in (tmp_path / "replay.jsonl").read_text() and SECRET not in caplog.text


def test_agreement_with_the_policy_all_disagree_and_min_agree_three_give_no_pair(tmp_path):
    p1, p2, p3 = PROMPTS["p1"], PROMPTS["p2"], PROMPTS["p3"]
    with teachers(
        {"reply_fn": replies({p1: "Answer: 5", p2: "Answer: 5", p3: "Answer: 3"})},
        {"reply_fn": replies({p1: "Answer: 5", p2: "Answer: 4", p3: "Answer: 3"})},
        {"reply_fn": replies({p1: "Answer: 6", p2: "Answer: 3", p3: "Answer: 2"})},
    ) as (teacher_list, states):
        # p1: 2 agree with the policy; p2: all three differ; p3: 2 agree against the policy.
        requests = [request("p1", "Answer: 5"), request("p2", "Answer: 2"), request("p3", "Answer: 4")]
        p = pairer(teacher_list, tmp_path / "a.jsonl")
        pairs = run(p, requests)
        assert [pair.chosen_answer for pair in pairs] == ["3"]
        assert (p.stats.agree_with_policy, p.stats.no_agreement, p.stats.pairs) == (1, 1, 1)

        strict = pairer(teacher_list, tmp_path / "b.jsonl", min_agree=3)
        assert run(strict, requests) == []  # only two teachers agree on p3
        assert (strict.stats.no_agreement, strict.stats.pairs) == (3, 0)


def test_min_agree_three_pairs_when_all_three_agree(tmp_path):
    p1 = PROMPTS["p1"]
    with teachers(*[{"reply_fn": replies({p1: f"Teacher {i}.\nAnswer: 5"})} for i in range(3)]) as (teacher_list, _):
        pairs = run(pairer(teacher_list, tmp_path / "c.jsonl", min_agree=3), [request("p1", "Answer: 4")])
    assert len(pairs) == 1 and pairs[0].chosen == "Teacher 0.\nAnswer: 5" and len(pairs[0].teachers) == 3


def test_the_cache_makes_a_second_pairer_call_nothing(tmp_path):
    p1, p2 = PROMPTS["p1"], PROMPTS["p2"]
    cache = tmp_path / "run" / "replay_pairs.jsonl"
    with teachers(
        {"reply_fn": replies({p1: "Answer: 5", p2: "Answer: 5"})},
        {"reply_fn": replies({p1: "Answer: 5", p2: "Answer: 7"})},
        {"reply_fn": replies({p1: "Answer: 6", p2: "Answer: 9"})},
    ) as (teacher_list, states):
        requests = [request("p1", "Answer: 4"), request("p2", "Answer: 4"), request("p1", "Answer: 4")]
        first = pairer(teacher_list, cache)
        pairs = run(first, requests)
        assert len(pairs) == 1 and first.stats.calls == 6  # the repeated request is asked once
        calls_before = n_calls(states)

        second = pairer(teacher_list, cache)
        assert run(second, requests) == pairs
        assert n_calls(states) == calls_before and second.stats.calls == 0 and second.stats.cache_hits == 2
        assert run(second, requests) == pairs and n_calls(states) == calls_before  # the in-memory cache

    decisions = [json.loads(line) for line in cache.read_text().splitlines() if '"decision"' in line]
    assert sorted(d["outcome"] for d in decisions) == ["no_agreement", "pair"]  # no-pair decisions too
    assert [d["pair"] for d in decisions if d["outcome"] == "no_agreement"] == [None]


def test_a_torn_last_line_is_skipped_and_appends_start_on_a_fresh_line(tmp_path):
    p1, p2 = PROMPTS["p1"], PROMPTS["p2"]
    cache = tmp_path / "replay.jsonl"
    same = {"reply_fn": replies({p1: "Answer: 5", p2: "Answer: 5"})}
    with teachers(same, same) as (teacher_list, states):
        run(pairer(teacher_list, cache), [request("p1", "Answer: 4")])
        cache.write_text(cache.read_text() + '{"kind": "decision", "key": "tor')  # a crash mid-write
        p = pairer(teacher_list, cache)
        assert len(run(p, [request("p1", "Answer: 4"), request("p2", "Answer: 4")])) == 2
        assert p.stats.cache_hits == 1 and p.stats.calls == 2
        assert pairer(teacher_list, cache).pairs_for_sync([request("p2", "Answer: 4")])[0].chosen_answer == "5"
    assert n_calls(states) == 4


# --------------------------------------------------------------------------- failures


def test_a_teacher_failing_every_time_is_counted_and_the_open_decision_is_not_cached(tmp_path):
    p1 = PROMPTS["p1"]
    cache = tmp_path / "replay.jsonl"
    with teachers({"reply_fn": replies({p1: "Answer: 5"})}, {"always_status": 500}) as (teacher_list, states):
        p = pairer(teacher_list, cache, max_api_retries=2)
        assert run(p, [request("p1", "Answer: 4")]) == []  # one answer left: fewer than min_agree
        assert p.stats.api_failures == 1 and p.stats.api_retries == 2 and len(states[1].requests) == 3
        assert (p.stats.no_agreement, p.stats.undecided) == (1, 1)
        assert '"decision"' not in cache.read_text()  # a later step asks again...

        again = pairer(teacher_list, cache, max_api_retries=0)
        assert run(again, [request("p1", "Answer: 4")]) == []
        assert len(states[0].requests) == 1 and again.stats.cached_answers == 1  # ...only the failed teacher
        assert len(states[1].requests) == 4 and again.stats.api_failures == 1


def test_a_failure_that_cannot_change_the_outcome_still_caches_the_decision(tmp_path):
    p1, p2 = PROMPTS["p1"], PROMPTS["p2"]
    cache = tmp_path / "replay.jsonl"
    table = {p1: "Answer: 5", p2: "Answer: 5"}
    down = {"reply_fn": replies({p1: "Answer: 5", p2: "Answer: 9"}), "script": ["server_error"] * 4}
    other = replies({p1: "Answer: 5", p2: "Answer: 7"})
    with teachers({"reply_fn": replies(table)}, {"reply_fn": other}, down) as (teacher_list, states):
        p = pairer(teacher_list, cache, max_api_retries=1)  # teacher 2: 2 x 2 attempts, all 500
        requests = [request("p1", "Answer: 4"), request("p2", "Answer: 4")]
        pairs = run(p, requests)
        # p1: teachers 0 and 1 agree on 5; teacher 2 cannot undo that -> pair, final.
        # p2: 5 vs 7; teacher 2 could side with either -> no pair for now, left open.
        assert [pair.chosen_answer for pair in pairs] == ["5"] and p.stats.api_failures == 2
        assert p.stats.undecided == 1
        before = n_calls(states)
        again = pairer(teacher_list, cache)
        pairs = run(again, requests)  # p1 from the cache; p2: only teacher 2 is asked, and answers 9
        assert [pair.chosen_answer for pair in pairs] == ["5"] and again.stats.cache_hits == 1
        assert n_calls(states) == before + 1 and again.stats.cached_answers == 2 and again.stats.no_agreement == 1
        assert run(pairer(teacher_list, cache), requests) == pairs and n_calls(states) == before + 1


def test_rate_limits_and_malformed_replies_are_retried_and_counted(tmp_path):
    p1 = PROMPTS["p1"]
    with teachers(
        {"reply_fn": replies({p1: "Answer: 5"}), "script": ["rate_limit", "malformed"]},
        {"reply_fn": replies({p1: "Answer: 5"}), "script": ["server_error"]},
    ) as (teacher_list, _):
        p = pairer(teacher_list, tmp_path / "r.jsonl")
        assert len(run(p, [request("p1", "Answer: 4")])) == 1
    assert p.stats.api_retries == 3 and p.stats.api_failures == 0


def test_an_unreachable_teacher_and_a_404_never_fail_the_step(tmp_path):
    p1 = PROMPTS["p1"]
    with teachers({"reply_fn": replies({p1: "Answer: 5"})}, {"always_status": 404}) as (teacher_list, states):
        dead = ReplayTeacher(name="gone", base_url="http://127.0.0.1:9/v1", api_key_env=KEY_ENV)
        p = pairer([*teacher_list, dead], tmp_path / "u.jsonl", max_api_retries=1, request_timeout=2)
        assert run(p, [request("p1", "Answer: 4")]) == []
        assert p.stats.api_failures == 2 and len(states[1].requests) == 1  # a 404 is not retried


# --------------------------------------------------------------------------- the vote


def test_ties_are_skipped_and_finality():
    assert _decide(["5", "5", "6", "6"], "4", 2).tie
    assert _decide(["5", "5", "6", "6"], "4", 2).outcome == "no_agreement"
    assert _decide(["5", "5", "6", None], "4", 2).outcome == "pair"
    assert _decide(["4", "4", "5"], "4", 2).outcome == "agree_with_policy"
    assert _decide([None, None, None], "4", 1).outcome == "no_agreement"
    assert _is_final(["5", "5", None], [2], "4", 2)
    assert not _is_final(["5", "6", None], [2], "4", 2)
    assert not _is_final(["5", "5", "6", None], [3], "4", 2)  # the fourth could make a tie


# --------------------------------------------------------------------------- specs


def test_parse_replay_teachers(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    teachers_ = parse_replay_teachers(
        ["gpt-4o@https://api.openai.com/v1", f" qwen@http://127.0.0.1:8000/v1/#{KEY_ENV} "]
    )
    assert teachers_[0] == ReplayTeacher("gpt-4o", "https://api.openai.com/v1", "OPENAI_API_KEY")
    assert teachers_[1] == ReplayTeacher("qwen", "http://127.0.0.1:8000/v1", KEY_ENV)
    assert teachers_[1].label == "qwen@http://127.0.0.1:8000/v1"
    assert parse_replay_teachers([]) == []


@pytest.mark.parametrize(
    "spec",
    [
        "gpt-4o",
        "@http://127.0.0.1:8000/v1",
        "gpt 4o@http://127.0.0.1:8000/v1",
        "qwen@127.0.0.1:8000",
        "qwen@ftp://host/v1",
        "qwen@http://:8000/v1",
        "qwen@http://host:99999999/v1",
        "qwen@http://user:sk-secret@host/v1",
        "qwen@http://host/v1?key=sk-secret",
        "qwen@http://host/v1#not-a-name",
        "qwen@http://host/v1#SLIME_META_TEST_UNSET_VAR",
        "a@b@http://host/v1",
    ],
)
def test_bad_specs_raise_one_line_naming_flag_and_spec(spec, monkeypatch):
    monkeypatch.delenv("SLIME_META_TEST_UNSET_VAR", raising=False)
    with pytest.raises(UserInputError) as caught:
        parse_replay_teachers(["ok@http://127.0.0.1:1/v1", spec], flag="--replay-teachers")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--replay-teachers {spec!r}")


def test_duplicates_and_min_agree_are_checked(tmp_path):
    with pytest.raises(UserInputError, match="twice"):
        parse_replay_teachers(["m@http://h/v1", "m@http://h/v1/"])
    two = parse_replay_teachers(["a@http://h/v1", "b@http://h/v1"])
    with pytest.raises(UserInputError, match="--replay-min-agree 3"):
        ReplayPairer(two, min_agree=3, cache_path=tmp_path / "x.jsonl")
    with pytest.raises(UserInputError, match="--replay-teachers"):
        ReplayPairer([], cache_path=tmp_path / "x.jsonl")
    assert "sk-" not in repr(ReplayPairer(two, cache_path=tmp_path / "x.jsonl"))


def test_pairs_for_runs_inside_a_running_loop(tmp_path):
    p1 = PROMPTS["p1"]
    with teachers(*[{"reply_fn": replies({p1: "Answer: 5"})} for _ in range(2)]) as (teacher_list, _):
        p = pairer(teacher_list, tmp_path / "l.jsonl")

        async def two_steps():  # the trainer may call asyncio.run per step: clients follow the loop
            pairs = await p.pairs_for([request("p1", "Answer: 4")])
            await p.aclose()
            return pairs

        assert len(asyncio.run(two_steps())) == 1
        assert len(asyncio.run(two_steps())) == 1 and p.stats.cache_hits == 1
