"""Templates: verbatim rendering of hostile text, the info positions, the three ways to customise."""

import importlib

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
    cls = load_template("teacher", "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate", "--teacher-template")
    assert isinstance(cls, TeacherPromptTemplate)
    with pytest.raises(UserInputError, match="--grader-template"):
        load_template("grader", "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate", "--grader-template")
    with pytest.raises(UserInputError, match="no such file"):
        load_template("grader", "missing.txt", "--grader-template")


# ---------------------------------------------------------------------------- the design document's way

# The "Customization" snippets of the meta-learning design document, with this package's import path.
DESIGN_DOC_SNIPPETS = '''
from slime_meta.prompt_templates import GraderPromptTemplate

custom_template = GraderPromptTemplate(template="""
Your custom grader prompt here.
Use {problem}, {solution}, {rubric}, {ground_truth}
""")

from slime_meta.prompt_templates import TeacherPromptTemplate

custom_teacher_template = TeacherPromptTemplate(template="""
Your custom teacher prompt here.
""")
'''


def write_module(tmp_path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_design_document_snippets_work_as_written():
    namespace = {}
    exec(DESIGN_DOC_SNIPPETS, namespace)  # noqa: S102 - the documented user code, verbatim
    grader = namespace["custom_template"]
    assert isinstance(grader, GraderPromptTemplate)
    content = grader.build(problem("2x + 3 = 7", label="x = 2", rubric="exact"), "x = 2")[0]["content"]
    assert "Use 2x + 3 = 7, x = 2, exact, x = 2" in content
    assert isinstance(namespace["custom_teacher_template"], TeacherPromptTemplate)
    assert TeacherPromptTemplate(template="{attempts_and_grades}").text == "{attempts_and_grades}"


def test_flag_takes_a_template_instance_by_module_name(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "my_grader_templates", DESIGN_DOC_SNIPPETS)
    loaded = load_template("grader", f"{module}.custom_template", "--grader-template")
    assert loaded is importlib.import_module(module).custom_template
    write_module(
        tmp_path,
        monkeypatch,
        "my_role_templates",
        (
            "from slime_meta.prompt_templates import GeneratorPromptTemplate, TeacherPromptTemplate\n"
            "student = GeneratorPromptTemplate(template='Q: {problem}')\n"
            "teacher = TeacherPromptTemplate(template='Fix: {attempts_and_grades}')\n"
        ),
    )
    assert load_template("generator", "my_role_templates.student", "--generator-template").render(problem="p") == "Q: p"
    assert (
        load_template("teacher", "my_role_templates.teacher", "--teacher-template").text == "Fix: {attempts_and_grades}"
    )
    with pytest.raises(
        UserInputError, match="--grader-template my_role_templates.teacher: is neither a GraderPromptTemplate"
    ):
        load_template("grader", "my_role_templates.teacher", "--grader-template")


@pytest.mark.parametrize(
    "role, spec, slot, allowed",
    [
        (
            "grader",
            "Grade {problem} against {ground_truth}",
            "{solution}",
            "{ground_truth}, {problem}, {rubric}, {solution}, {solution_tag}",
        ),
        ("generator", "Hint: {additional_info}", "{problem}", "{additional_info}, {problem}"),
        (
            "teacher",
            "Improve on {problem}.",
            "{attempts_and_grades}",
            "{attempts_and_grades}, {ground_truth}, {previous_info}, {problem}, {rubric}",
        ),
    ],
)
def test_a_run_refuses_a_template_without_a_required_slot(role, spec, slot, allowed):
    with pytest.raises(UserInputError) as error:
        load_template(role, spec, f"--{role}-template")
    message = str(error.value)
    assert message.startswith(f"--{role}-template {spec}: no {slot} placeholder") and f"allowed: {allowed}" in message


def test_unknown_slot_names_the_flag_the_slot_and_the_allowed_ones(tmp_path):
    path = tmp_path / "grader.txt"
    path.write_text("Grade {solution} per {rubrik}\n")
    with pytest.raises(UserInputError) as error:
        load_template("grader", str(path), "--grader-template")
    assert str(error.value) == (
        f"--grader-template {path}: unknown placeholder {{rubrik}}; the grader template allows "
        "{ground_truth}, {problem}, {rubric}, {solution}, {solution_tag} (write {{ and }} for literal braces)"
    )


def test_train_exits_2_naming_the_missing_slot_of_a_template_instance(tmp_path, monkeypatch, capsys, tiny_checkpoint):
    import train

    module = write_module(tmp_path, monkeypatch, "doc_templates", DESIGN_DOC_SNIPPETS)
    rows = "".join(f'{{"prompt": "word{i}", "label": "w{i}"}}\n' for i in range(8))
    (tmp_path / "data.jsonl").write_text(rows)
    code = train.main(
        [
            "--use-meta-learning",
            "--hf-checkpoint",
            str(tiny_checkpoint),
            "--prompt-data",
            str(tmp_path / "data.jsonl"),
            "--rollout-batch-size",
            "3",
            "--grader-template",
            f"{module}.custom_template",
            "--teacher-template",
            f"{module}.custom_teacher_template",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(
        f"error: --teacher-template {module}.custom_teacher_template: no {{attempts_and_grades}} placeholder"
    )
    assert "allowed: {attempts_and_grades}, {ground_truth}, {previous_info}, {problem}, {rubric}" in err
    assert not (tmp_path / "run").exists()
