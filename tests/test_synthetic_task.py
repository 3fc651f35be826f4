"""The synthetic suffix task: deterministic data, the shipped files, exact prompt formats, scoring."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from slime_meta.data.tasks import synthetic
from slime_meta.data.tasks.synthetic import SyntheticGeneratorTemplate, SyntheticTeacherTemplate
from slime_meta.prompt_templates import load_template
from slime_meta.types import Grade, GradedAttempt, Problem

REPO = Path(__file__).resolve().parent.parent
SHIPPED_JSONL = REPO / "data" / "synthetic_suffix.jsonl"
SHIPPED_PARQUET = REPO / "data" / "synthetic_suffix.parquet"


def graded(problem: Problem, solution: str, score: float = 0.0) -> GradedAttempt:
    return GradedAttempt(problem=problem, solution=solution, grade=Grade(score=score))


# ---------------------------------------------------------------------------- data


def test_generation_is_deterministic_for_a_seed(tmp_path):
    first = synthetic.jsonl_text(synthetic.generate_rows(seed=0, words_per_family=12))
    again = synthetic.jsonl_text(synthetic.generate_rows(seed=0, words_per_family=12))
    other = synthetic.jsonl_text(synthetic.generate_rows(seed=1, words_per_family=12))
    assert first == again
    assert first != other
    synthetic.main(["--out", str(tmp_path / "a.jsonl"), "--seed", "0", "--words-per-family", "12"])
    synthetic.main(["--out", str(tmp_path / "b.jsonl"), "--seed", "0", "--words-per-family", "12"])
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes() == first.encode()


def test_shipped_files_match_the_generator():
    rows = synthetic.generate_rows(seed=0, words_per_family=12)
    assert SHIPPED_JSONL.read_bytes() == synthetic.jsonl_text(rows).encode("utf-8")
    pq = pytest.importorskip("pyarrow.parquet")
    assert pq.read_table(SHIPPED_PARQUET).to_pylist() == rows
    assert SHIPPED_JSONL.stat().st_size < 200_000 and SHIPPED_PARQUET.stat().st_size < 200_000


def test_every_family_shares_one_suffix():
    rows = synthetic.generate_rows(seed=0, words_per_family=12)
    assert len(rows) == 64 * 12
    by_family: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_family[row["family"]].append(row)
    assert len(by_family) == 64
    assert {members[0]["oracle_hint"] for members in by_family.values()} == set(synthetic.ALL_SUFFIXES)
    for family, members in by_family.items():
        assert {m["label"][4:] for m in members} == {members[0]["oracle_hint"]}, family
        assert len({m["prompt"] for m in members}) == len(members)  # no repeated word in a family
        for m in members:
            assert len(m["prompt"]) == 4 and m["prompt"].isalpha() and m["prompt"].islower()
            assert m["label"] == m["prompt"] + m["oracle_hint"]
            assert m["oracle_hint"] not in family  # the group key does not spell the rule
            assert m["rubric"] == synthetic.RUBRIC


# ---------------------------------------------------------------------------- templates


def test_generator_template_renders_the_exact_format():
    template = SyntheticGeneratorTemplate()
    problem = Problem(uid="u", prompt="kqpd", label="kqpddf")
    assert template.build(problem, "df") == [{"role": "user", "content": "Sdf|kqpd="}]
    assert template.build(problem, "") == [{"role": "user", "content": "S|kqpd="}]


def test_templates_load_by_dotted_name():
    generator = load_template(
        "generator", "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate", "--generator-template"
    )
    teacher = load_template("teacher", "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate", "--teacher-template")
    assert isinstance(generator, SyntheticGeneratorTemplate)
    assert isinstance(teacher, SyntheticTeacherTemplate)


def test_teacher_template_lists_attempts_with_expected_answers():
    first = Problem(uid="a", prompt="kqpd", label="kqpddf")
    second = Problem(uid="b", prompt="jrjw", label="jrjwdf")
    attempts_K_M = [
        [graded(first, "kqpdab."), graded(first, "kqpddf.", 1.0)],
        [graded(second, "  jrjwhh.\n")],
    ]
    messages = SyntheticTeacherTemplate().build([first, second], attempts_K_M, "ab")
    assert messages == [{"role": "user", "content": "Tab#kqpd:kqpdab!kqpddf;kqpd:kqpddf!kqpddf;jrjw:jrjwhh!jrjwdf;>"}]
    no_info = SyntheticTeacherTemplate().build([first], [[graded(first, "kqpdab.")]], "")
    assert no_info[0]["content"] == "T#kqpd:kqpdab!kqpddf;>"


def test_teacher_template_bounds_attempts():
    problem = Problem(uid="a", prompt="kqpd", label="kqpddf")
    template = SyntheticTeacherTemplate()
    # Only letters survive (delimiters stay unambiguous), cut at the answer's `.` and at 8 chars.
    assert template.format_attempt(1, graded(problem, "kq;p!d:abcdefghij.zz")) == "kqpd:kqpdabcd!kqpddf;"
    assert template.format_attempt(1, graded(problem, "")) == "kqpd:!kqpddf;"
    many = [[graded(problem, "kqpdaa.")] for _ in range(synthetic.MAX_TEACHER_ENTRIES + 5)]
    content = template.build([problem] * len(many), many, "")[0]["content"]
    assert content.count(";") == synthetic.MAX_TEACHER_ENTRIES
    assert len(content) + 4 <= 256  # prompt, a 2-letter hint, `.` and EOS fit the tiny model


@pytest.mark.parametrize(
    ("reply", "info"),
    [("df.", "df"), ("df", "df"), ("dfa.", "df"), ("zd.f", "d"), (" d f .", "df"), ("xy.", ""), ("", ""), ("DF.", "")],
)
def test_parse_info_keeps_at_most_two_hint_letters(reply, info):
    assert SyntheticTeacherTemplate().parse_info(reply) == info


def test_teacher_template_cleans_a_raw_previous_info():
    problem = Problem(uid="a", prompt="kqpd", label="kqpddf")
    content = SyntheticTeacherTemplate().build([problem], [[graded(problem, "kqpdab.")]], "ab. more text")
    assert content[0]["content"].startswith("Tab#")


# ---------------------------------------------------------------------------- scoring


def test_per_character_score_gives_partial_credit():
    assert synthetic.per_character_score("kqpddf.", "kqpddf") == 1.0
    assert synthetic.per_character_score("kqpdab.", "kqpddf") == pytest.approx(4 / 6)
    assert synthetic.per_character_score("kqpdaf", "kqpddf") == pytest.approx(5 / 6)
    assert synthetic.per_character_score("kqpddfxy", "kqpddf") == pytest.approx(6 / 8)
    assert synthetic.per_character_score("", "kqpddf") == 0.0
    assert synthetic.per_character_score(".", "") == 1.0
    assert synthetic.exact_score(" kqpddf.\n", "kqpddf") == 1.0
    assert synthetic.exact_score("kqpdd.", "kqpddf") == 0.0


def test_oracle_hint_from_metadata_or_label():
    assert (
        synthetic.oracle_hint(Problem(uid="a", prompt="kqpd", label="kqpddf", metadata={"oracle_hint": "df"})) == "df"
    )
    assert synthetic.oracle_hint(Problem(uid="a", prompt="kqpd", label="kqpddf")) == "df"
    assert synthetic.oracle_hint(Problem(uid="a", prompt="kqpd", label={"answer": "kqpdgh"})) == "gh"
