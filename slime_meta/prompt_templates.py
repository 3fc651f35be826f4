"""Prompt templates for the three roles: generator (student), grader and teacher.

A template is a text with `{placeholder}` slots. Rendering is one pass over the template, so a
value is inserted verbatim: braces, quotes and template-like strings inside a problem or a
student's solution are never interpreted. `{{` and `}}` in a template are literal braces; any
other brace that is not a known `{name}` slot stays as written (JSON examples in a template work).

Customise a role in one of three ways (`--generator-template`, `--grader-template`,
`--teacher-template`):
  - a path to a text file with the slots of that role;
  - a template text given directly on the command line (anything with a `{slot}`);
  - `package.module.ClassName`, a subclass of the role's class that overrides `build`,
    `format_info`, `format_attempt`, ... (see prompt_templates/examples/ for one).
"""

from __future__ import annotations

import importlib
import os
import re
import secrets
from pathlib import Path
from typing import ClassVar, Sequence

from slime_meta.errors import UserInputError
from slime_meta.types import GradedAttempt, Problem

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "prompt_templates"
Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

def read_template_file(path: str) -> str:
    """A template file's text; the one newline that ends the file is not part of the prompt."""
    text = Path(path).read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


_SLOT = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


class PromptTemplate:
    """A text with named slots. Subclasses name their slots and their default file."""

    role: ClassVar[str] = "template"
    slots: ClassVar[frozenset[str]] = frozenset()
    default_file: ClassVar[str | None] = None

    def __init__(self, text: str | None = None, *, source: str = "default"):
        if text is None:
            if self.default_file is None:
                raise TypeError(f"{type(self).__name__} needs a text or a default_file")
            source = str(TEMPLATE_DIR / self.default_file)
            text = read_template_file(source)
        if not text.strip():
            flag = {"generator": "--generator-template", "grader": "--grader-template", "teacher": "--teacher-template"}.get(self.role, self.role)
            raise UserInputError(f"{flag} {source}: the template is empty; give a text with its {{slots}}")
        unknown = sorted(set(self.slots_in(text)) - self.slots)
        if unknown:
            raise UserInputError(
                f"{self.role} template {source}: unknown placeholder {{{unknown[0]}}}; "
                f"allowed: {', '.join('{' + s + '}' for s in sorted(self.slots))} "
                "(write {{ and }} for literal braces)"
            )
        self.text = text
        self.source = source

    @staticmethod
    def slots_in(text: str) -> list[str]:
        return [m.group(1) for m in _SLOT.finditer(text) if m.group(1)]

    def render(self, **values: str) -> str:
        def substitute(match: re.Match) -> str:
            token = match.group(0)
            if token == "{{":
                return "{"
            if token == "}}":
                return "}"
            return str(values.get(match.group(1), ""))

        return _SLOT.sub(substitute, self.text)


class GeneratorPromptTemplate(PromptTemplate):
    """The student's prompt: a problem, plus the teacher's additional_info.

    Where the info goes: at an `{additional_info}` slot if the template has one; otherwise by
    `position`: before the problem (prefix), after it (suffix), or as a system message.
    """

    role = "generator"
    slots = frozenset({"problem", "additional_info"})
    default_file = "generator.txt"

    def format_info(self, info: str) -> str:
        return f"Additional information from your teacher:\n{info}"

    def build(self, problem: Problem, additional_info: str, position: str = "prefix") -> list[Message]:
        if "additional_info" in self.slots_in(self.text):
            return [{"role": "user", "content": self.render(problem=problem.prompt, additional_info=additional_info)}]
        user = self.render(problem=problem.prompt)
        if not additional_info:
            return [{"role": "user", "content": user}]
        info_block = self.format_info(additional_info)
        if position == "system":
            return [{"role": "system", "content": info_block}, {"role": "user", "content": user}]
        if position == "suffix":
            return [{"role": "user", "content": f"{user}\n\n{info_block}"}]
        return [{"role": "user", "content": f"{info_block}\n\n{user}"}]


def new_solution_tag(solution: str) -> str:
    """A tag name the solution does not contain: random per request, so it cannot close it."""
    while True:
        tag = f"student_solution_{secrets.token_hex(8)}"
        if tag not in solution:
            return tag


class GraderPromptTemplate(PromptTemplate):
    """The grader's prompt: problem, rubric, reference answer and one student solution.

    With a `{solution_tag}` slot (the default template has one) the solution is enclosed in
    `<tag>` ... `</tag>` with a fresh random tag per request, and the template names the tag in
    the instructions that follow it: text inside the solution cannot end the solution early and
    pose as instructions. A template without the slot gets the solution as written.
    """

    role = "grader"
    slots = frozenset({"problem", "solution", "rubric", "ground_truth", "solution_tag"})
    default_file = "grader.txt"

    def build(self, problem: Problem, solution: str, solution_tag: str | None = None) -> list[Message]:
        tag = ""
        if "solution_tag" in self.slots_in(self.text):
            tag = solution_tag or new_solution_tag(solution)
            solution = f"<{tag}>\n{solution}\n</{tag}>"
        content = self.render(
            problem=problem.prompt, solution=solution, rubric=problem.rubric, ground_truth=problem.ground_truth,
            solution_tag=tag,
        )
        return [{"role": "user", "content": content}]


ATTEMPTS_LEFT_OUT = "(attempts left out: they do not fit the model's context)"


class TeacherPromptTemplate(PromptTemplate):
    """The teacher's prompt: k train problems, the student's graded attempts, the previous info."""

    role = "teacher"
    slots = frozenset({"problem", "rubric", "ground_truth", "attempts_and_grades", "previous_info"})
    default_file = "teacher.txt"

    def format_problems(self, problems: Sequence[Problem]) -> str:
        if len(problems) == 1:
            return f"Problem:\n{problems[0].prompt}"
        return "\n\n".join(f"Problem {i + 1}:\n{p.prompt}" for i, p in enumerate(problems))

    def format_attempt(self, number: int, attempt: GradedAttempt) -> str:
        return (
            f"Attempt {number}:\n{attempt.solution}\n"
            f"GRADE: {attempt.grade.score:.2f}\nFEEDBACK: {attempt.grade.explanation}"
        )

    def format_attempts(self, problems: Sequence[Problem], attempts_K_M: Sequence[Sequence[GradedAttempt]]) -> str:
        blocks = []
        for index, (problem, attempts) in enumerate(zip(problems, attempts_K_M)):
            # Attempts can be left out to fit the model's context (slime_meta/context_budget.py).
            body = "\n\n".join(self.format_attempt(n + 1, a) for n, a in enumerate(attempts)) or ATTEMPTS_LEFT_OUT
            blocks.append(body if len(problems) == 1 else f"On problem {index + 1}:\n{body}")
        return "\n\n".join(blocks)

    def build(
        self,
        problems: Sequence[Problem],
        attempts_K_M: Sequence[Sequence[GradedAttempt]],
        previous_info: str,
    ) -> list[Message]:
        rubrics = [p.rubric for p in problems if p.rubric]
        content = self.render(
            problem=self.format_problems(problems),
            rubric="\n".join(dict.fromkeys(rubrics)) or "(none)",
            ground_truth="\n".join(p.ground_truth for p in problems),
            attempts_and_grades=self.format_attempts(problems, attempts_K_M),
            previous_info=previous_info,
        )
        return [{"role": "user", "content": content}]

    def parse_info(self, text: str) -> str:
        """The info to pass on, from the teacher's raw reply."""
        return text.strip()


ROLE_CLASSES: dict[str, type[PromptTemplate]] = {
    "generator": GeneratorPromptTemplate,
    "grader": GraderPromptTemplate,
    "teacher": TeacherPromptTemplate,
}

_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+$")


def load_template(role: str, spec: str | None, flag: str) -> PromptTemplate:
    """The template for `role` from a flag value: None, a file, `module.Class`, or a text."""
    base = ROLE_CLASSES[role]
    if not spec:
        return base()
    if os.path.isfile(spec):
        return base(read_template_file(spec), source=spec)
    looks_like_path = "/" in spec or spec.endswith((".txt", ".md", ".jinja", ".tmpl"))
    if _DOTTED.match(spec) and not looks_like_path:
        module_name, _, class_name = spec.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise UserInputError(f"{flag} {spec}: cannot import it ({exc}); give a file path, a template text or module.Class")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise UserInputError(f"{flag} {spec}: is not a subclass of {base.__name__}")
        return cls()
    if "{" in spec:
        return base(spec, source=flag)
    raise UserInputError(f"{flag} {spec}: no such file; give a file path, a template text with {{slots}} or module.Class")
