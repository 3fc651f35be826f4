"""benchmarks/prompt_search.py: the untrained teacher's best prompt for a budget of student answers.

One search on the random-init tiny model (real workers behind the real sglang-router, one start
for the module): it runs end to end within its budget, writes its JSON and a template file that
--teacher-template takes, and a candidate's score is what grading the student's answers with the
same infos again gives. The student decodes greedily, so the same info gives the same answers; the
grader gives partial credit (the share of lowercase letters in an answer), so grades vary with the
info and an error in how they are averaged shows.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from statistics import fmean

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import prompt_search as ps  # noqa: E402
import prompt_search_candidates as ps_candidates  # noqa: E402
import prompt_search_reflection as ps_reflection  # noqa: E402

from slime_meta.config.arguments import parse_config  # noqa: E402
from slime_meta.prompt_templates import TeacherPromptTemplate, load_template  # noqa: E402
from slime_meta.types import Grade  # noqa: E402

BUDGET = 40  # the seed on the Pareto set (8 answers), then one round (8 + 8, and 8 if the child is kept)


class LetterGrader:
    """The share of lowercase letters in the answer: a grade that varies with what the student wrote."""

    async def grade(self, problem, solution: str) -> Grade:
        return Grade(score=letters(solution), explanation=f"{letters(solution):.2f} of it letters")


def letters(solution: str) -> float:
    return sum(ch.islower() for ch in solution) / len(solution) if solution else 0.0


def flags(checkpoint: Path, work: Path, *extra: str) -> list[str]:
    rows = (ROOT / "data/synthetic_suffix.jsonl").read_text().splitlines()
    (work / "eval.jsonl").write_text("\n".join(rows[:24]) + "\n")  # two families, left out of the search's draws
    (work / "teacher.txt").write_text("Teach the suffix.\n\n{attempts_and_grades}\n>\n")
    return [
        "--hf-checkpoint",
        str(checkpoint),
        "--prompt-data",
        str(ROOT / "data/synthetic_suffix.jsonl"),
        "--group-key",
        "family",
        "--eval-prompt-data",
        "held",
        str(work / "eval.jsonl"),
        "--eval-num-batches",
        "1",
        "--rollout-batch-size",
        "4",  # 2 teacher prompts of 1 train problem, 1 holdout problem each
        "--n-problems-per-prompt",
        "1",
        "--heldout-ipb",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--num-inner-iterations",
        "1",
        "--n-samples-per-inner-prompt",
        "1",
        "--generator-template",
        "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate",
        "--teacher-template",
        str(work / "teacher.txt"),
        "--teacher-temperature",
        "1.0",
        "--rollout-temperature",
        "0",
        "--teacher-max-tokens",
        "4",
        "--rollout-max-response-len",
        "8",
        "--grader",
        "verifier",
        "--num-rollout",
        "3",
        "--local-num-workers",
        "1",
        "--seed",
        "3",
        "--pareto-batches",
        "1",
        "--reflection-max-tokens",
        "24",
        "--out",
        str(work / "out"),
        *extra,
    ]


@pytest.fixture(scope="module")
def searched(tiny_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("prompt-search")
    argv = flags(tiny_checkpoint, work, "--student-attempts", str(BUDGET))
    cfg, opts = ps.parse(argv)
    out = Path(opts.out)

    async def everything():
        async with ps.open_run(cfg, out) as run:
            run.rollout.grader = LetterGrader()
            report = await ps.search_on(run, opts, out)
            # A candidate's score against the same infos answered and graded again, request by request.
            pareto, _ = ps.split_draws(cfg, run.data, 1)
            scored = await ps_candidates.score(run.rollout, run.pieces.teacher_template, pareto, 99, cfg.seed)
            per_chain = []
            for chain in scored.chains:
                holdout = next(e.holdout for e in pareto if chain.problems in e.train_chunks_P)
                grades = []
                for problem in holdout:
                    _, answers = await run.rollout.student.solve_n(problem, chain.final_info, 1)
                    grades += [letters(a.text) for a in answers]
                per_chain.append(fmean(grades))
            # One reflection by the tiny model itself, through its pool.
            instruction, scaffold = ps_candidates.split_template(run.pieces.teacher_template.text)
            seed = ps_candidates.Candidate(0, "seed", instruction, run.pieces.teacher_template)
            proposal = await ps_reflection.propose(
                seed,
                scored,
                ps.PoolReflector(run.rollout.teacher, 1.0, 24),
                new_id=1,
                scaffold=scaffold,
                seed=run.pieces.teacher_template,
                fits=run.too_long,
            )
            # The plain method on the same workers: hand-written instructions, one too long for the context.
            plain = await ps.search_on(run, plain_opts, Path(plain_opts.out))
            return report, scored, per_chain, proposal, plain

    candidates = work / "candidates.txt"
    candidates.write_text("Short one.\n---\nWhole.\n\n{attempts_and_grades}\n>\n---\n" + "Far too long. " * 30 + "\n")
    _, plain_opts = ps.parse(
        flags(tiny_checkpoint, work, "--method", "candidates", "--candidates", str(candidates))
        + ["--student-attempts", str(BUDGET), "--out", str(work / "plain")]
    )
    fields, scored, per_chain, proposal, plain = asyncio.run(everything())
    report = json.loads(ps.write_report(fields, opts, argv).read_text())  # as main() writes it
    return {
        "report": report,
        "scored": scored,
        "direct": per_chain,
        "proposal": proposal,
        "plain": plain,
        "work": work,
        "out": out,
    }


def test_the_search_runs_end_to_end_within_its_budget(searched):
    report = searched["report"]
    budget = report["budget"]
    assert budget["student_attempts"] == BUDGET
    assert 0 < budget["spent"] <= BUDGET
    # What the search spent is what its scorings cost: 8 answers each on these draws.
    assert budget["spent"] == 8 * report["evaluations"]
    assert report["evaluations"] >= 2 and report["rounds"]  # the seed, then at least one round
    assert report["candidates"][0]["origin"] == "seed" and report["candidates"][0]["score"] is not None


def test_the_results_json_has_its_fields(searched):
    saved = searched["report"]
    assert saved["benchmark"] == "prompt_search" and saved["command"].startswith("python benchmarks/prompt_search.py")
    for key in (
        "date",
        "machine",
        "settings",
        "method",
        "model",
        "budget",
        "candidates",
        "rounds",
        "best",
        "eval",
        "seed_template",
        "search_s",
    ):
        assert key in saved
    for candidate in saved["candidates"]:
        assert {"id", "origin", "instruction", "template_text", "score", "pareto_scores"} <= set(candidate)
    rl = saved["budget"]["rl_run"]
    # 3 steps x [4 infos x (1 x 1 x 1 + 1 x 1) + 2 holdout x 1] = 30
    assert rl["student_attempts"] == 30 and rl["holdout_attempts"] == 3 * 4 * 1
    lift = saved["eval"]["best"]["held"]
    assert lift["units"] == 2 and lift["lift"] == pytest.approx(lift["with_info"] - lift["no_info"])
    assert lift["interval_95"][0] <= lift["lift"] <= lift["interval_95"][1]
    assert "seed" in saved["eval"]


def test_main_writes_the_json_and_a_template_that_teacher_template_accepts(searched):
    report, out = searched["report"], searched["out"]
    template_file = Path(report["best"]["template_file"])
    assert template_file.parent == out
    best = next(c for c in report["candidates"] if c["id"] == report["best"]["id"])
    assert template_file.read_text() == best["template_text"] + "\n"
    loaded = load_template("teacher", str(template_file), "--teacher-template")
    assert loaded.text == best["template_text"]
    config = parse_config(
        ["--hf-checkpoint", "x", "--prompt-data", str(ROOT / "data/synthetic_suffix.jsonl")]
        + ["--teacher-template", str(template_file)]
    )
    assert config.meta.teacher_template == str(template_file)


def test_a_candidates_score_is_the_grade_of_its_infos_answered_again(searched):
    scored, direct = searched["scored"], searched["direct"]
    assert len(direct) == 4  # 2 teacher prompts x 2 infos
    assert scored.score == pytest.approx(fmean(direct), abs=1e-9)
    assert scored.per_prompt == pytest.approx([fmean(direct[0:2]), fmean(direct[2:4])], abs=1e-9)
    assert len(set(direct)) > 1 or 0 < direct[0] < 1  # grades that an averaging error would change
    assert scored.attempts == 8


def test_the_reflection_of_the_tiny_model_gives_a_candidate_with_the_templates_slots(searched):
    proposal = searched["proposal"]
    assert proposal.candidate is not None, proposal.refused
    template = proposal.candidate.template
    template.check_required()  # raises when a required slot is missing
    assert template.text.endswith("\n\n{attempts_and_grades}\n>")
    assert not template.text.startswith("Teach the suffix.")


def test_the_instruction_is_the_text_before_the_paragraph_of_the_first_slot():
    assert ps_candidates.split_template("Teach {{braces}}.\nMore.\n\nSee {problem}\n\n{attempts_and_grades}") == (
        "Teach {{braces}}.\nMore.",
        "See {problem}\n\n{attempts_and_grades}",
    )
    assert ps_candidates.split_template("T{previous_info}#{attempts_and_grades}>") == (
        "",
        "T{previous_info}#{attempts_and_grades}>",
    )
    assert ps_candidates.split_template("{problem}\n\n{attempts_and_grades}") == (
        "",
        "{problem}\n\n{attempts_and_grades}",
    )
    assert ps_candidates.join_template("", "{attempts_and_grades}") == "{attempts_and_grades}"


def test_a_reply_with_braces_becomes_literal_text_not_slots():
    seed = TeacherPromptTemplate()
    instruction, scaffold = ps_candidates.split_template(seed.text)
    assert instruction.startswith("You are a teacher.") and scaffold.startswith("{problem}")
    parent = ps_candidates.Candidate(0, "seed", instruction, seed)
    evaluation = ps_candidates.Evaluation(score=0.0, per_prompt=[0.0], chains=[], attempts=0)

    async def reflect(prompts):
        assert "You are a teacher." in prompts[0]
        return "Here it is:\n```text\nState the rule in {problem} and {nonsense}; no {attempts_and_grades}.\n```"

    proposal = asyncio.run(
        ps_reflection.propose(parent, evaluation, reflect, new_id=1, scaffold=scaffold, seed=seed, fits=lambda t: None)
    )
    template = proposal.candidate.template
    template.check_required()
    assert type(template) is TeacherPromptTemplate
    assert sorted(set(template.slots_in(template.text))) == sorted(set(seed.slots_in(seed.text)))
    shown = template.render(problem="P", attempts_and_grades="A")
    assert shown.startswith("State the rule in {problem} and {nonsense}; no {attempts_and_grades}.\n\nP\n")


def test_the_budget_default_is_the_rl_runs_answers():
    cfg, _ = ps.parse(
        ["--hf-checkpoint", "x", "--prompt-data", str(ROOT / "data/synthetic_suffix.jsonl"), "--group-key", "family"]
        + ["--rollout-batch-size", "24", "--heldout-ipb", "16", "--n-problems-per-prompt", "2"]
        + ["--n-samples-per-prompt", "8", "--num-inner-iterations", "2", "--n-samples-per-inner-prompt", "2"]
        + ["--n-holdout-samples", "2", "--num-rollout", "50"]
    )
    from slime_meta.assembly import batch_plan

    rl = ps.rl_run_attempts(cfg, batch_plan(cfg))
    # run_real.sh's GPU shape: 4 prompts x 8 infos; per info 2 x 2 x 2 inner + 4 x 2 holdout; control 16 x 2
    assert rl["per_step"] == {"inner_rounds": 256, "holdout": 256, "no_info_control": 32, "all": 544}
    assert rl["student_attempts"] == 50 * 544 and rl["holdout_attempts"] == 50 * 256


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--student-attempts", "0"], "--student-attempts"),
        (["--reflection-base-url", "http://127.0.0.1:1"], "--reflection-base-url"),
        (["--candidates", "/no/such/file"], "--candidates"),
        (["--pareto-batches", "0"], "--pareto-batches"),
        (["--method", "beam"], "--method"),
        (["--student-attempts", "3"], "--student-attempts"),  # less than one scoring of the Pareto set
    ],
)
def test_bad_flags_are_one_line_and_exit_code_2(tiny_checkpoint, tmp_path, capsys, extra, flag):
    argv = flags(tiny_checkpoint, tmp_path, *extra)
    try:
        code = ps.main(argv)
    except SystemExit as stopped:
        code = stopped.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and flag in err, err
    assert not (tmp_path / "out").exists()


def test_the_documented_gpu_command_parses(tiny_checkpoint):
    """docs/performance.md's command for the real-model GPU run: its flags are read and its budget computed."""
    import shlex

    text = (ROOT / "docs/performance.md").read_text()
    start = text.index("    python benchmarks/prompt_search.py")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.split("#", 1)[0].strip().rstrip("\\"))
        if not line.rstrip().endswith("\\"):
            break
    argv = shlex.split(" ".join(lines).replace('"$MODEL_DIR"', str(tiny_checkpoint)))[2:]
    cfg, opts = ps.parse(argv)
    total, rl = ps.budget_of(cfg, opts)
    assert total == rl["student_attempts"] == 27_200 and opts.compare_with and opts.method == "reflect"


def test_the_reflection_can_be_asked_of_an_openai_compatible_endpoint():
    from openai_server import run_openai_server

    def reply(messages):
        assert "The current instruction:" in messages[0]["content"]
        return "```\nTell the student the rubric's price.\n```"

    seed = TeacherPromptTemplate()
    instruction, scaffold = ps_candidates.split_template(seed.text)
    parent = ps_candidates.Candidate(0, "seed", instruction, seed)
    evaluation = ps_candidates.Evaluation(score=0.0, per_prompt=[0.0], chains=[], attempts=0)
    with run_openai_server(reply_fn=reply) as (base_url, state):
        reflector = ps.APIReflector(base_url, "reflector-model", "NO_SUCH_KEY_VARIABLE", 0.7, 64, 10.0)

        async def ask():
            try:
                return await ps_reflection.propose(
                    parent, evaluation, reflector, new_id=1, scaffold=scaffold, seed=seed, fits=lambda t: None
                )
            finally:
                await reflector.aclose()

        proposal = asyncio.run(ask())
    assert proposal.candidate.template.text == "Tell the student the rubric's price.\n\n" + scaffold
    assert state.requests[0].model == "reflector-model" and state.requests[0].body["max_tokens"] == 64


def test_the_plain_method_scores_each_hand_written_instruction_that_fits(searched):
    plain = searched["plain"]
    assert plain["method"] == "candidates"
    assert [c["origin"] for c in plain["candidates"]] == ["seed", "hand-written", "hand-written"]
    assert [c["instruction"] for c in plain["candidates"]] == ["Teach the suffix.", "Short one.", "Whole."]
    assert all(c["score"] is not None for c in plain["candidates"])
    assert len(plain["hand_written_refused"]) == 1 and "context" in plain["hand_written_refused"][0]["refused"]
    # 3 candidates x 8 answers on one draw: 24 of the 40 (a second draw for all three would need 48)
    assert plain["budget"]["spent"] == 24 and plain["budget"]["pareto_set"]["episodes"] == 2
    best = max(plain["candidates"], key=lambda c: c["score"])
    assert plain["best"]["score"] == best["score"]


def test_the_reflection_reads_the_problems_infos_answers_grades_and_feedback(searched):
    scored = searched["scored"]
    prompt = ps_reflection.reflection_prompt("Teach the suffix.", scored, 2, 3, 400)
    best, worst = ps_reflection.contrasting(scored.chains, 2)
    assert fmean(best.holdout_scores) >= fmean(worst.holdout_scores)
    assert prompt.index("Example 1: score") < prompt.index("Example 2: score") and "Example 3" not in prompt
    assert "```\nTeach the suffix.\n```" in prompt
    for chain in (best, worst):
        record = next(step["holdout"] for step in chain.trace if "holdout" in step)[0]
        assert f"Problem: {scored.problems[record['problem_uid']]}\n" in prompt
        assert f"Grade: {record['grade']:.2f}. Feedback: {record['explanation']}" in prompt
        assert f"- {chain.problems[0].prompt}\n" in prompt


def test_the_eval_lift_is_eval_lifts_own_figure():
    import eval_lift

    lift = ps.lift_record(0.932, 0.531, 32)
    assert lift["lift_in_se"] == eval_lift.lift_in_se(0.932, 0.531, 32)
    assert lift["se"] == pytest.approx(0.401 / lift["lift_in_se"])
    assert lift["interval_95"] == pytest.approx([0.401 - 1.96 * lift["se"], 0.401 + 1.96 * lift["se"]])
    assert ps.lift_record(0.0, 0.0, 2)["lift_in_se"] is None  # no spread at all: no figure, not infinity
