"""CHAMP (Concept and Hint-Augmented Math Problems; Mao, Kim and Zhou, 2024; MIT) in the project's data format.

Why this data set: its 270 competition problems each come with hints written by people (and the
concepts they use), so the student's grade *with those human hints* is a ready R_oracle for the
teacher: `--context-key oracle_hint --eval-baseline` measures it before training.

Source: `champ_dataset/dataset_files/v0.json` of PyPI `champ-dataset==1.0.0`, taken from an
installed copy of the package, else read out of its wheel (`pip download --no-deps` into the
cache; the package's own loader needs `natsort`, which this does not). In that file a problem has
its statement (`_text`), its answer (`_answer`), a `category`, its reference solution's steps and
`ch_list`, the ids of the hints (`H_...`) and concepts (`C_...`) it uses.

Columns written (data/champ.jsonl; `--input-key prompt --label-key label --rubric-key rubric
--group-key category`, ids in `id`):
- `prompt`, `label`: the statement and the answer as the data set writes them.
- `rubric`: what a full-credit solution must show, from the category and the length of the
  reference solution. It never holds the answer or a hint: the teacher reads rubrics, and a
  rubric that gave the hints away would make the teacher's job copying.
- `oracle_hint`: the problem's hints, one numbered line each. The 25 problems without hints get
  their concepts instead (every problem has at least one), so the column is never empty: an empty
  context would measure the no-hint grade twice.
- `concepts`: the concepts the problem uses, one line each (`name: statement` where named), for
  `--context-key concepts`.

    python -m slime_meta.data.tasks.champ [--out data/champ.jsonl]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from slime_meta.artifacts.pypi_wheels import download_wheel, installed_file, read_wheel_member
from slime_meta.data.tasks import writer
from slime_meta.errors import UserInputError

DISTRIBUTION, VERSION = "champ-dataset", "1.0.0"
MEMBER = "champ_dataset/dataset_files/v0.json"
COLUMNS = ("id", "category", "prompt", "label", "rubric", "oracle_hint", "concepts")

# What a full-credit solution must show in each category, written so that it names no answer.
CATEGORY_REQUIREMENTS = {
    "Number-Theory": "every divisibility, parity or congruence claim is justified and every case is covered, "
    "so that the set of values found is exactly the right one",
    "Inequality": "the bound is proved for every allowed value of the variables, and where the problem asks for "
    "a best constant or an extreme value, a case that attains it is exhibited",
    "Polynomial": "each property of the roots or coefficients that is used is stated and justified, and the "
    "result is checked against every condition of the problem",
    "Sequence": "the closed form, limit or property is derived from the definition of the sequence (by "
    "induction, bounds or monotonicity where needed), not guessed from its first terms",
    "Combinatorics": "the count is justified: the cases are described, each is counted exactly once, and none "
    "is left out",
}
GENERIC_REQUIREMENT = "each step follows from the previous ones or from a stated fact"
NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()


def load_dataset(cache_dir: Path | None = None) -> dict:
    """The parsed v0.json: from an installed `champ-dataset`, else from its wheel (fetched once, cached)."""
    installed = installed_file(DISTRIBUTION, MEMBER)
    if installed is not None:
        raw = installed.read_bytes()
    else:
        raw = read_wheel_member(download_wheel(DISTRIBUTION, VERSION, cache_dir), MEMBER)
    dataset = json.loads(raw)
    for key in ("problems", "hints", "concepts"):
        if not isinstance(dataset.get(key), dict):
            raise UserInputError(f"{MEMBER} of {DISTRIBUTION}=={VERSION}: no '{key}' table; is it the right version?")
    return dataset


def _steps_phrase(count: int) -> str:
    # In words, not digits: a digit in the rubric could be (part of) a problem's answer.
    words = NUMBER_WORDS[count] if count < len(NUMBER_WORDS) else "more than twenty"
    return f"{words} step" if count == 1 else f"{words} steps"


def rubric_for(category: str, num_steps: int) -> str:
    """The grading rubric of a problem: from its category and its reference solution's length only."""
    requirement = CATEGORY_REQUIREMENTS.get(category, GENERIC_REQUIREMENT)
    return (
        f"Full credit: a complete {category.replace('-', ' ').lower()} solution in which {requirement}; it ends "
        f"with one final answer equivalent to the reference answer (any equivalent form counts). The reference "
        f"solution takes {_steps_phrase(num_steps)}. A correct final answer whose justification has gaps earns "
        "partial credit; a wrong, missing or hedged final answer earns none."
    )


def _concept_line(concept: dict) -> str:
    name = concept.get("name")
    return f"{name}: {concept['_text']}" if name else concept["_text"]


def convert(dataset: dict) -> list[dict]:
    """One row per problem, in the file's order (grouped by category, numbered within it)."""
    hints, concepts = dataset["hints"], dataset["concepts"]
    rows = []
    for identifier, problem in dataset["problems"].items():
        used = problem["ch_list"]
        hint_texts = [hints[key]["_text"] for key in used if key.startswith("H_")]
        concept_lines = [_concept_line(concepts[key]) for key in used if key.startswith("C_")]
        oracle_lines = hint_texts or concept_lines  # problems without hints get their concepts
        rows.append(
            {
                "id": identifier,
                "category": problem["category"],
                "prompt": problem["_text"],
                "label": problem["_answer"],
                "rubric": rubric_for(problem["category"], len(problem["solution"]["steps"])),
                "oracle_hint": "\n".join(f"{i}. {line}" for i, line in enumerate(oracle_lines, start=1)),
                "concepts": "\n".join(concept_lines),
            }
        )
    return rows


def jsonl_text(rows: Sequence[dict]) -> str:
    """The rows as JSON lines with a fixed key order: the same data set gives the same bytes."""
    return writer.jsonl_text(rows, COLUMNS)


def main(argv: Sequence[str] | None = None) -> None:
    description = "Convert CHAMP (champ-dataset==1.0.0) into the project's data format."
    parser = writer.task_parser("champ", description, out="data/champ.jsonl", seed=False)
    parser.add_argument("--cache-dir", default=None, help="where the wheel is kept (default: ~/.cache/slime_meta)")
    writer.write_task(
        parser,
        argv,
        lambda args: convert(load_dataset(Path(args.cache_dir) if args.cache_dir else None)),
        COLUMNS,
        "category",
    )


if __name__ == "__main__":
    main()
