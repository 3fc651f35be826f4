"""A dataset for slime's data source: the rubric (and every other column) moved into `metadata`.

slime's data source keeps three things of a row: the prompt (`--input-key`), the label
(`--label-key`) and the dict under `--metadata-key` (default `metadata`); other columns are
dropped. Our rollout reads the rubric, the id and any `--context-key` column from that dict.
This converter reads any dataset our loader reads (.parquet, .jsonl, .json, with the same
row-level checks) and writes the jsonl slime wants:

    python -m slime_meta.backends.slime.data data/math_word_problems.jsonl runs/prompts.slime.jsonl
    # then: --prompt-data runs/prompts.slime.jsonl --input-key prompt --label-key label
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from slime_meta.data.problems import load_problems, problem_key
from slime_meta.errors import EXIT_USER_ERROR, UserInputError

if TYPE_CHECKING:
    from slime_meta.config.arguments import MetaConfig
    from slime_meta.types import Problem


def convert(
    source: str | Path,
    target: str | Path,
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    rubric_key: str = "rubric",
) -> int:
    """Write `target` (jsonl: prompt, label, metadata{uid, rubric, other columns}); return the row count."""
    problems = load_problems(source, input_key=input_key, label_key=label_key, rubric_key=rubric_key)
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as handle:
        for problem in problems:
            metadata = {"uid": problem.uid, **problem.metadata, "rubric": problem.rubric}  # a `uid` column wins
            row = {"prompt": problem.prompt, "label": problem.label, "metadata": metadata}
            handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return len(problems)


def converted_problems(cfg: MetaConfig, path: str) -> list[Problem]:
    """The problems of a data file, also one converted for slime's data source (rubric, id and
    other columns under `metadata`, moved back up here)."""
    d = cfg.data
    loaded = load_problems(path, input_key=d.input_key, label_key=d.label_key, rubric_key=d.rubric_key)
    return [
        replace(
            p,
            rubric=p.rubric or str(p.metadata["metadata"].get("rubric", "")),
            metadata={**p.metadata, **p.metadata["metadata"]},
            uid=str(p.metadata["metadata"].get("uid", p.uid)),
        )
        if isinstance(p.metadata.get("metadata"), dict)
        else p
        for p in loaded
    ]


def check_eval_sets_disjoint(cfg: MetaConfig) -> None:
    """slime's data source draws every row of --prompt-data: an eval problem there would be trained on."""
    pairs = list(zip(cfg.meta.eval_prompt_data[0::2], cfg.meta.eval_prompt_data[1::2]))
    if not pairs or not Path(cfg.data.prompt_data).is_file():
        return
    d = cfg.data

    def keys(path: str) -> set[str]:  # the normalised problem text: another label form is the same problem
        found = load_problems(path, input_key=d.input_key, label_key=d.label_key, rubric_key=d.rubric_key)
        return {problem_key(p) for p in found}

    train = keys(d.prompt_data)
    for name, path in pairs:
        shared = len(keys(path) & train)
        if shared:
            raise UserInputError(
                f"--eval-prompt-data {name} {path}: {shared} of its problems are in --prompt-data, and slime's data "
                "source would train on them; give disjoint files"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a .parquet, .jsonl or .json dataset")
    parser.add_argument("target", help="the .jsonl to write for slime's --prompt-data")
    parser.add_argument("--input-key", default="prompt")
    parser.add_argument("--label-key", default="label")
    parser.add_argument("--rubric-key", default="rubric")
    ns = parser.parse_args(argv)
    try:
        count = convert(ns.source, ns.target, input_key=ns.input_key, label_key=ns.label_key, rubric_key=ns.rubric_key)
    except UserInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"{count} rows -> {ns.target} (use --input-key prompt --label-key label)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
