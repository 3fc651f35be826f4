"""The bracket task: its data and rule, its formats, the teacher's pretraining prior, its small model.

The model checks reuse the cached default build (`python -m slime_meta.models.tiny --task bracket`,
the one scripts/run_synthetic.sh and the efficacy benchmark use), building it once if missing.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path
from statistics import fmean

import pytest

from slime_meta.data.tasks import bracket
from slime_meta.data.tasks.bracket import BracketGeneratorTemplate, BracketTeacherTemplate
from slime_meta.models.tiny import build as tiny
from slime_meta.prompt_templates import load_template
from slime_meta.types import Grade, GradedAttempt, Problem

REPO = Path(__file__).resolve().parent.parent
SHIPPED_JSONL = REPO / "data" / "bracket.jsonl"
SHIPPED_PARQUET = REPO / "data" / "bracket.parquet"


# ---------------------------------------------------------------------------- data


def test_shipped_files_match_the_generator(tmp_path):
    rows = bracket.generate_rows(seed=0, words_per_family=12)
    assert SHIPPED_JSONL.read_bytes() == bracket.jsonl_text(rows).encode("utf-8")
    pq = pytest.importorskip("pyarrow.parquet")
    assert pq.read_table(SHIPPED_PARQUET).to_pylist() == rows
    bracket.main(["--out", str(tmp_path / "again.jsonl"), "--seed", "0"])
    assert (tmp_path / "again.jsonl").read_bytes() == SHIPPED_JSONL.read_bytes()
    assert bracket.jsonl_text(bracket.generate_rows(seed=1)) != bracket.jsonl_text(rows)


def test_every_family_hides_one_key_and_the_rule_holds():
    rows = bracket.generate_rows(seed=0, words_per_family=12)
    by_family: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_family[row["family"]].append(row)
    assert len(by_family) == 64 and len(rows) == 64 * 12
    assert {members[0]["oracle_hint"] for members in by_family.values()} == set(bracket.ALL_HINTS)
    for family, members in by_family.items():
        key = members[0]["oracle_hint"]
        assert len({m["prompt"] for m in members}) == len(members), family  # no word twice in a family
        for m in members:
            assert m["oracle_hint"] == key and key not in family
            assert len(m["prompt"]) == 4 and m["prompt"].isalpha() and m["prompt"].islower()
            assert m["label"] == key[0] + m["prompt"] + key[1]  # the rule: the word between the key's letters
            problem = Problem(uid=m["uid"], prompt=m["prompt"], label=m["label"])
            assert bracket.oracle_hint(problem) == key  # derivable from the label alone


def test_the_oracle_hint_alone_solves_and_a_wrong_one_keeps_partial_credit():
    assert bracket.apply_hint("kqpd", "df") == "dkqpdf"
    assert bracket.per_character_score("dkqpdf.", "dkqpdf") == 1.0
    assert bracket.per_character_score("akqpdf.", "dkqpdf") == pytest.approx(5 / 6)
    assert bracket.per_character_score("akqpdb.", "dkqpdf") == pytest.approx(4 / 6)


# ---------------------------------------------------------------------------- templates


def test_student_prompts_have_fixed_lengths_and_the_hint_in_front():
    template = BracketGeneratorTemplate()
    problem = Problem(uid="u", prompt="kqpd", label="dkqpdf")
    assert template.build(problem, "df") == [{"role": "user", "content": "Sdf|kqpd="}]
    assert template.build(problem, "") == [{"role": "user", "content": "S|kqpd="}]
    rows = bracket.generate_rows(seed=0, words_per_family=3)
    problems = [Problem(uid=r["uid"], prompt=r["prompt"], label=r["label"]) for r in rows]
    lengths = {len(template.build(p, r["oracle_hint"])[0]["content"]) for p, r in zip(problems, rows)}
    assert lengths == {9}  # `S` + 2-letter hint + `|` + 4-letter word + `=`


def test_templates_load_by_dotted_name_and_the_teacher_reads_expected_answers():
    generator = load_template(
        "generator", "slime_meta.data.tasks.bracket.BracketGeneratorTemplate", "--generator-template"
    )
    teacher = load_template("teacher", "slime_meta.data.tasks.bracket.BracketTeacherTemplate", "--teacher-template")
    assert isinstance(generator, BracketGeneratorTemplate) and isinstance(teacher, BracketTeacherTemplate)
    problem = Problem(uid="a", prompt="kqpd", label="dkqpdf")
    attempt = GradedAttempt(problem=problem, solution="akqpdb.", grade=Grade(score=4 / 6))
    assert teacher.build([problem], [[attempt]], "ab")[0]["content"] == "Tab#kqpd:akqpdb!dkqpdf;>"
    assert teacher.parse_info(" d f .x") == "df" and teacher.parse_info("zz.") == ""


# ---------------------------------------------------------------------------- the teacher's prior


def test_teacher_pretraining_targets_are_prompt_letters_never_the_rules_choice():
    """Targets are two a-h letters of the prompt, uniformly: the key only as often as chance."""
    sampler = bracket.PretrainingSampler(0, 0.0, tiny.Formats("bracket"))
    hits, chance = [], []
    for _ in range(60):
        for prompt, completion in sampler.teacher_batch(32):
            target = completion.removesuffix(".")
            letters = bracket.prompt_hint_letters(prompt)
            assert len(target) == 2 and set(target) <= set(letters), (prompt, completion)
            entries = prompt.split("#", 1)[1].rstrip(">").split(";")[:-1]
            key = {e.split("!")[1][0] + e.split("!")[1][-1] for e in entries}
            assert len(key) == 1  # one family per prompt: every expected answer shows the same key
            hits.append(target == key.pop())
            chance.append(1 / len(letters) ** 2)
    assert fmean(hits) == pytest.approx(fmean(chance), abs=0.015)  # no preference for the key
    assert fmean(hits) < 0.06
    student_prompt, answer = sampler.student()
    assert student_prompt.startswith("S") and answer.endswith(".") and len(answer) == 7


def test_teacher_correct_fraction_one_teaches_the_key():
    sampler = bracket.PretrainingSampler(0, 1.0, tiny.Formats("bracket"))
    for prompt, completion in sampler.teacher_batch(16):
        expected = prompt.split("!")[1].split(";")[0]
        assert completion == expected[0] + expected[-1] + "."


# ---------------------------------------------------------------------------- the model recipe


def test_cache_key_names_the_task_and_the_default_is_unchanged():
    suffix_key = tiny.cache_key()
    # The default task's key has no task field: computed here as it was before tasks existed.
    legacy = {
        "build_version": tiny.BUILD_VERSION,
        "data_sha256": tiny.file_sha256(REPO / tiny.DEFAULT_DATA),
        "seed": 0,
        "steps": tiny.DEFAULT_STEPS,
        "teacher_correct_fraction": 0.5,
        "device": "cpu",
    }
    import hashlib

    assert suffix_key == "tiny-" + hashlib.sha256(json.dumps(legacy, sort_keys=True).encode()).hexdigest()[:16]
    assert tiny.cache_key(task="synthetic_suffix") == suffix_key
    bracket_key = tiny.cache_key(task="bracket")
    assert bracket_key != suffix_key
    # The task is in the key, not only its data: the same data file under another task differs.
    assert tiny.cache_key(task="bracket", data_path=tiny.DEFAULT_DATA, teacher_correct_fraction=0.5) != suffix_key
    assert tiny.cache_key(task="bracket", teacher_correct_fraction=0.0) == bracket_key  # its own default
    with pytest.raises(ValueError, match="unknown task"):
        tiny.cache_key(task="nope")


@pytest.fixture(scope="module")
def bracket_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny.ensure_tiny_checkpoint(REPO / ".cache" / "models", task="bracket")
    summary = json.loads((path / "summary.json").read_text())
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), summary


def test_pretrained_teacher_almost_never_writes_the_key_while_the_student_applies_it(bracket_model):
    model, tokenizer, summary = bracket_model
    assert summary["settings"]["task"] == "bracket" and summary["settings"]["teacher_correct_fraction"] == 0.0
    rows = tiny.read_rows(REPO / "data" / "bracket.jsonl")[::3]  # 4 words of every family
    metrics = tiny.evaluate(model, tokenizer, rows, seed=3, device="cpu", task="bracket")
    assert metrics["student_exact_correct_hint"] >= 0.95
    assert metrics["student_exact_no_hint"] <= 0.1 and metrics["student_exact_random_hint"] <= 0.1
    assert metrics["student_per_char_correct_hint"] > metrics["student_per_char_no_hint"] + 0.2
    assert metrics["teacher_hint_exact_greedy"] <= 0.1
    assert metrics["teacher_hint_exact_sampled_t1"] <= 0.1


def test_run_script_refuses_an_unknown_task_with_one_line():
    env = {**os.environ, "TASK": "nope", "MODEL_DIR": "/nonexistent"}
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "run_synthetic.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert result.returncode == 2
    message = "TASK=nope: unknown task; use synthetic_suffix (the default) or bracket"
    assert result.stderr.strip().splitlines() == [message]
