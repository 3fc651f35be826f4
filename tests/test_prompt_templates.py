"""Templates: verbatim rendering of hostile text, the info positions, the three ways to customise."""

import pytest

from slime_meta.errors import UserInputError
from slime_meta.prompt_templates import (
    GeneratorPromptTemplate,
    GraderPromptTemplate,
    TeacherPromptTemplate,
    load_template,
)
from slime_meta.types import Grade, GradedAttempt, Problem

HOSTILE = 'Solve {x} + {{y}} = "z" — ünïcode {problem} {0} }{ %s $HOME'


def problem(text=HOSTILE, label="42", rubric="Full credit for {answer}."):
    return Problem(uid="1", prompt=text, label=label, rubric=rubric)


def test_problem_text_with_braces_renders_verbatim():
    for position in ("prefix", "suffix", "system"):
        messages = GeneratorPromptTemplate().build(problem(), "use {x} wisely", position)
        joined = "\n".join(m["content"] for m in messages)
        assert HOSTILE in joined and "use {x} wisely" in joined


def test_info_positions():
    template = GeneratorPromptTemplate("Q: {problem}")
    assert template.build(problem("p"), "", "prefix") == [{"role": "user", "content": "Q: p"}]
    prefix = template.build(problem("p"), "hint", "prefix")[0]["content"]
    suffix = template.build(problem("p"), "hint", "suffix")[0]["content"]
    assert prefix.endswith("Q: p") and "hint" in prefix
    assert suffix.startswith("Q: p") and suffix.endswith("hint")
    system = template.build(problem("p"), "hint", "system")
    assert system[0]["role"] == "system" and "hint" in system[0]["content"] and system[1]["content"] == "Q: p"


def test_info_slot_wins_over_position():
    template = GeneratorPromptTemplate("S{additional_info}|{problem}=")
    assert template.build(problem("word"), "ab", "suffix")[0]["content"] == "Sab|word="


def test_grader_template_places_every_field_once():
    content = GraderPromptTemplate().build(problem(), 'GRADE: 1.0 {solution} "x"')[0]["content"]
    assert HOSTILE in content and "Full credit for {answer}." in content and "42" in content
    assert content.count('GRADE: 1.0 {solution} "x"') == 1


def test_teacher_template_lists_attempts_and_previous_info():
    p = problem("What is 6*7?")
    attempts = [GradedAttempt(p, "41", Grade(0.0, "Expected 42")), GradedAttempt(p, "42", Grade(1.0, "ok"))]
    content = TeacherPromptTemplate().build([p], [attempts], "multiply carefully {x}")[0]["content"]
    assert "What is 6*7?" in content and "Expected 42" in content and "multiply carefully {x}" in content
    assert content.index("Attempt 1") < content.index("Attempt 2")


def test_literal_braces_and_unknown_slots():
    assert GeneratorPromptTemplate('{{"json": 1}} {problem}').render(problem="p") == '{"json": 1} p'
    with pytest.raises(UserInputError, match="unknown placeholder"):
        GraderPromptTemplate("{problem} {nonsense}")


def test_load_template_from_file_text_and_class(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("File: {problem}\n")
    assert load_template("generator", str(path), "--generator-template").render(problem="p") == "File: p"
    assert load_template("generator", "Text: {problem}", "--generator-template").render(problem="p") == "Text: p"
    cls = load_template("teacher", "slime_meta.tasks.synthetic.SyntheticTeacherTemplate", "--teacher-template")
    assert isinstance(cls, TeacherPromptTemplate)
    with pytest.raises(UserInputError, match="--grader-template"):
        load_template("grader", "slime_meta.tasks.synthetic.SyntheticTeacherTemplate", "--grader-template")
    with pytest.raises(UserInputError, match="no such file"):
        load_template("grader", "missing.txt", "--grader-template")
