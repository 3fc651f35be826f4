"""Prompt templates for the three roles: student (the generator template), grader and teacher.

A template is a text with `{placeholder}` slots. Rendering is one pass over the template, so a
value is inserted verbatim: braces, quotes and template-like strings inside a problem or a
student's solution are never interpreted. `{{` and `}}` in a template are literal braces; any
other brace that is not a known `{name}` slot stays as written (JSON examples in a template work).

Build one in Python as the design document shows:

    from slime_meta.prompt_templates import GraderPromptTemplate
    custom_template = GraderPromptTemplate(template='''Grade {solution} against {ground_truth}.''')

Customise a role for a run in one of four ways (`--generator-template`, `--grader-template`,
`--teacher-template`):
  - a path to a text file with the slots of that role;
  - a template text given directly on the command line (anything with a `{slot}`);
  - `package.module.name`, where `name` is a template instance such as `custom_template` above;
  - `package.module.ClassName`, a subclass of the role's class that overrides `build`,
    `format_info`, `format_attempt`, ... (`slime_meta/data/tasks/synthetic.py` has two).

Every slot in a template must be one of its role's (`{typo}` is refused at construction). A
template a run uses must also have the role's required slots (`required`: the problem for the
student, the solution for the grader, the graded attempts for the teacher); a bad template
ends the run before it starts, in one line naming the slot and the allowed ones.
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


def _listed(slots: frozenset[str]) -> str:
    return ", ".join("{" + slot + "}" for slot in sorted(slots))


class TemplateSlotError(UserInputError):
    """A template with a slot its role does not have, or without one its role needs."""

    def __init__(self, owner: str, detail: str):
        super().__init__(f"{owner}: {detail}")
        self.detail = detail


class PromptTemplate:
    """A text with named slots. Subclasses name their slots, the required ones and their default file."""

    role: ClassVar[str] = "template"
    slots: ClassVar[frozenset[str]] = frozenset()
    required: ClassVar[frozenset[str]] = frozenset()  # checked by `check_required` (load_template does)
    default_file: ClassVar[str | None] = None
    # False: the text is a completion format for base models (the model continues it), so it is
    # always sent as plain text, never wrapped in a chat template. None: the run decides
    # (--apply-chat-template; by default each model's own chat template when it has one).
    chat_format: ClassVar[bool | None] = None

    def __init__(self, template: str | None = None, *, source: str | None = None):
        if template is None:
            if self.default_file is None:
                raise TypeError(f"{type(self).__name__} needs a template text or a default_file")
            source = str(TEMPLATE_DIR / self.default_file)
            template = read_template_file(source)
        owner = f"{type(self).__name__} ({source or 'template text'})"
        if not template.strip():
            raise TemplateSlotError(owner, f"the template is empty; give a text with its {_listed(self.slots)} slots")
        unknown = sorted(set(self.slots_in(template)) - self.slots)
        if unknown:
            raise TemplateSlotError(
                owner,
                f"unknown placeholder {{{unknown[0]}}}; the {self.role} template allows {_listed(self.slots)}"
                " (write {{ and }} for literal braces)",
            )
        self.text = template
        self.source = source or "template text"

    def check_required(self) -> None:
        """Raise TemplateSlotError when a slot the role needs is missing (a run cannot use it then)."""
        missing = sorted(self.required - set(self.slots_in(self.text)))
        if missing:
            raise TemplateSlotError(
                f"{type(self).__name__} ({self.source})",
                f"no {{{missing[0]}}} placeholder, which the {self.role} template needs "
                f"(required: {_listed(self.required)}; allowed: {_listed(self.slots)})",
            )

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
    required = frozenset({"problem"})  # without it the student never sees the problem
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
    required = frozenset({"solution"})  # what is graded
    default_file = "grader.txt"

    def build(self, problem: Problem, solution: str, solution_tag: str | None = None) -> list[Message]:
        tag = ""
        if "solution_tag" in self.slots_in(self.text):
            tag = solution_tag or new_solution_tag(solution)
            solution = f"<{tag}>\n{solution}\n</{tag}>"
        content = self.render(
            problem=problem.prompt,
            solution=solution,
            rubric=problem.rubric,
            ground_truth=problem.ground_truth,
            solution_tag=tag,
        )
        return [{"role": "user", "content": content}]


ATTEMPTS_LEFT_OUT = "(attempts left out: they do not fit the model's context)"


def attempts_in_round(attempts_K_M: Sequence[Sequence[GradedAttempt]], iteration: int) -> list[list[GradedAttempt]]:
    """The attempts made in inner round `iteration`, per problem (`attempt.iteration` says which)."""
    return [[a for a in attempts if a.iteration == iteration] for attempts in attempts_K_M]


class TeacherPromptTemplate(PromptTemplate):
    """The teacher's prompt: k train problems, the student's graded attempts, the previous info."""

    role = "teacher"
    slots = frozenset({"problem", "rubric", "ground_truth", "attempts_and_grades", "previous_info"})
    required = frozenset({"attempts_and_grades"})  # the inner loop's only signal: graded attempts and feedback
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
            # Attempts can be left out to fit the model's context (slime_meta/rollout/context_budget.py).
            body = "\n\n".join(self.format_attempt(n + 1, a) for n, a in enumerate(attempts)) or ATTEMPTS_LEFT_OUT
            blocks.append(body if len(problems) == 1 else f"On problem {index + 1}:\n{body}")
        return "\n\n".join(blocks)

    def format_round_header(self, iteration: int, info: str, is_last: bool) -> str:
        if is_last and info:
            return f"Round {iteration + 1}, with your previous additional information:"
        if not info:
            return f"Round {iteration + 1}, with no additional information:"
        return f"Round {iteration + 1}, with this additional information from you:\n{info}\n\nAttempts:"

    def format_rounds(
        self, problems: Sequence[Problem], attempts_K_M: Sequence[Sequence[GradedAttempt]], round_infos: Sequence[str]
    ) -> str:
        """Every round's attempts, oldest first, each under the info the student had in it.

        A round whose attempts were all left out for length is left out whole (its info too).
        """
        blocks = []
        for iteration, info in enumerate(round_infos):
            in_round_K_M = attempts_in_round(attempts_K_M, iteration)
            if any(in_round_K_M):
                header = self.format_round_header(iteration, info, is_last=iteration == len(round_infos) - 1)
                blocks.append(f"{header}\n{self.format_attempts(problems, in_round_K_M)}")
        return "\n\n".join(blocks) or ATTEMPTS_LEFT_OUT

    def build(
        self,
        problems: Sequence[Problem],
        attempts_K_M: Sequence[Sequence[GradedAttempt]],
        previous_info: str,
        round_infos: Sequence[str] = (),
    ) -> list[Message]:
        """The teacher's messages.

        `round_infos[r]`: the info the student had in inner round r ("" in the first; the last is
        `previous_info`). With more than one round, `attempts_K_M` holds every round's attempts
        (`attempt.iteration` says which) and they are shown round by round (`format_rounds`):
        the teacher reads its own earlier infos beside what they did. Without, one round as is.
        """
        rubrics = [p.rubric for p in problems if p.rubric]
        if len(round_infos) > 1:
            attempts = self.format_rounds(problems, attempts_K_M, round_infos)
        else:
            attempts = self.format_attempts(problems, attempts_K_M)
        content = self.render(
            problem=self.format_problems(problems),
            rubric="\n".join(dict.fromkeys(rubrics)) or "(none)",
            ground_truth="\n".join(p.ground_truth for p in problems),
            attempts_and_grades=attempts,
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
    """The template for `role` from a flag value: None, a file, `module.name` (an instance or a class), or a text.

    Whatever the source, the template has only its role's slots and every required one; a bad
    one raises UserInputError naming `flag`, the value, the slot and the allowed slots.
    """
    base = ROLE_CLASSES[role]
    try:
        template = _template_from(base, spec, flag)
        template.check_required()
    except TemplateSlotError as error:
        raise UserInputError(f"{flag} {spec or '(default)'}: {error.detail}") from None
    return template


def _template_from(base: type[PromptTemplate], spec: str | None, flag: str) -> PromptTemplate:
    if not spec:
        return base()
    if os.path.isfile(spec):
        return base(read_template_file(spec), source=spec)
    looks_like_path = "/" in spec or spec.endswith((".txt", ".md", ".jinja", ".tmpl"))
    if _DOTTED.match(spec) and not looks_like_path:
        module_name, _, attribute = spec.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise UserInputError(
                f"{flag} {spec}: cannot import it ({exc}); give a file path, a template text, "
                f"module.name of a {base.__name__}, or module.Class"
            ) from None
        if isinstance(found, base):
            return found
        if isinstance(found, type) and issubclass(found, base):
            return found()
        raise UserInputError(f"{flag} {spec}: is neither a {base.__name__} nor a subclass of it")
    if "{" in spec:
        return base(spec, source=flag)
    raise UserInputError(
        f"{flag} {spec}: no such file; give a file path, a template text with {{slots}}, "
        f"module.name of a {base.__name__}, or module.Class"
    )
