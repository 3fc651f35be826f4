"""The untrained teacher with the best teacher prompt a search finds: the no-weights baseline of RL.

    python benchmarks/prompt_search.py TRAIN_FLAGS...                     # reflective search (GEPA-style)
    python benchmarks/prompt_search.py TRAIN_FLAGS... --method candidates # hand-written instructions, best kept
    python benchmarks/prompt_search.py --help                             # train.py's flags, then this one's

TRAIN_FLAGS are train.py's own (`--hf-checkpoint`, `--prompt-data`, `--eval-prompt-data`, `--grader`,
`--device`, the step's shape, `--teacher-template`, ...), read by train.py's parser: give the RL run's
command line and the search runs on the same models, data, grader and step shape. The teacher's
weights stay as they are (nothing is trained); only its prompt changes.

What is searched: the teacher template's *instruction*, the text before the blank line that precedes
its first `{slot}` (the default template's first paragraph). The rest of the template (the slots
and the lines around them) is kept as it is, so every candidate has the template's required slots
(`TeacherPromptTemplate.check_required`). The search starts from the run's teacher template
(`--teacher-template`, the project's default when not given).

How a candidate is scored: exactly as the RL run's reward. The candidate's template goes into the
run's own `MetaLearningRollout` (the local backend's workers behind sglang-router, the run's grader)
and runs on episodes drawn as a training step draws them: the teacher writes G infos per teacher
prompt over K inner rounds, the student answers the holdout problems of the same family with each
final info, the grader grades; the score is the mean holdout grade. Per teacher prompt (an
"instance") the score is the mean over its G infos.

`--method reflect` (default), after GEPA (Agrawal et al. 2025, "GEPA: Reflective Prompt Evolution
Can Outperform Reinforcement Learning"): a fixed Pareto set of `--pareto-batches` step draws scores
every candidate kept. Each round picks a parent from the Pareto front (candidates best on at least
one teacher prompt, drawn in proportion to how many), scores it on a fresh minibatch of
`--minibatch-batches` step draws with every chain traced, and asks a model (the teacher model
itself through its pool, or `--reflection-base-url`) to rewrite the instruction from the graded
attempts: the problems, the rubric, the infos the teacher wrote, the student's answers with them,
their grades and the grader's feedback, best and worst first. The child is scored on the same
minibatch; when it beats its parent there, it is scored on the Pareto set and kept. The best
candidate is the one with the highest mean on the Pareto set.

`--method candidates`: the run's instruction and a fixed list of hand-written ones (or `--candidates
FILE`), each scored on the same problems; the budget decides how many step draws each gets.

The budget (`--student-attempts`): every answer the student writes in the search counts, in the
inner rounds as well as on the holdout problems (one request of n attempts counts n). The default
is what the RL run of the same flags spends in `--num-rollout` steps:
    steps x [infos per step x (K x k x m + H x S) + holdout problems per step x S]
with infos per step = teacher prompts x G (`--n-samples-per-prompt`), K inner rounds, k train
problems per teacher prompt, m attempts each, H holdout problems per info, S = `--n-holdout-samples`;
the last term is the no-info control the RL run grades each step. Its holdout term, steps x infos per
step x H x S, is the RL run's reward attempts. A round (or a candidate) starts only when what it
can spend fits in what is left: the search never spends more than the budget. Scoring leaves the
no-info control out (it does not depend on the prompt); the final evaluation is not counted (nor
is the RL run's).

Then the best template (and, with `--eval-seed`, the starting one) is evaluated on each
`--eval-prompt-data` set exactly as a learning run evaluates its teacher
(`slime_meta.backends.local.evaluation.evaluate`: the same fixed episodes, the teacher's infos
against the no-info control); the eval lift's standard error is benchmarks/eval_lift.py's (binomial
over the eval set's holdout problems, the two errors combined). `--compare-with` an efficacy results
JSON puts the trained teacher's last eval beside it.

Writes to `--out` (default $OUT or runs/benchmarks, a directory per run): `prompt_search.json`
(date, command, machine, model, budget and spending, every candidate's text and scores, the
rounds, the best prompt, its eval lift) and `best_teacher_template.txt`, a file `--teacher-template`
accepts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from _common import REPO_ROOT, report_header, write_json
from eval_lift import lift_in_se, lift_se
from prompt_search_candidates import Budget, CountedStudent, rl_run_attempts, with_template, written_braces
from prompt_search_methods import Search, hand_written_instructions
from prompt_search_reflection import APIReflector, PoolReflector

from slime_meta.config.arguments import MetaConfig, _OneLineErrorParser, add_meta_learning_arguments, build_config
from slime_meta.errors import EXIT_USER_ERROR, UserInputError
from slime_meta.prompt_templates import TeacherPromptTemplate, TemplateSlotError
from slime_meta.rollout.clients import close_clients
from slime_meta.rollout.meta_rollout import MetaLearningRollout

# ----------------------------------------------------------------------------- the eval sets


def lift_record(with_info: float, without: float, units: int) -> dict[str, Any]:
    """The eval lift as benchmarks/eval_lift.py gives it: the difference, its binomial SE over `units`
    eval problems (the two errors combined), the difference in SEs, and a 95% interval."""
    se = lift_se(with_info, without, units)
    lift = with_info - without
    return {
        "with_info": with_info,
        "no_info": without,
        "lift": lift,
        "units": units,
        "se": se,
        "lift_in_se": lift_in_se(with_info, without, units) if se > 0 else None,  # no spread: no figure
        "interval_95": [lift - 1.96 * se, lift + 1.96 * se],
    }


async def eval_lifts(cfg, rollout, template, eval_sets: dict) -> dict[str, dict]:
    """Each eval set's lift with `template`, through the learning run's own evaluation."""
    from slime_meta.backends.local.evaluation import evaluate

    metrics = await evaluate(cfg, with_template(rollout, template), eval_sets, 0)
    return {
        name: lift_record(
            metrics[f"eval/{name}/holdout_grade"],
            metrics[f"eval/{name}/holdout_grade_no_info"],
            sum(len(e.holdout) for e in episodes),
        )
        for name, episodes in eval_sets.items()
    }


def trained_teacher(path: str, units_by_set: dict[str, int]) -> dict[str, Any]:
    """The trained teacher's last eval in an efficacy results JSON, as eval_lift.py reads it."""
    result = json.loads(Path(path).read_text())
    curve = result.get("eval_curve") or []
    if not curve:
        return {"file": path, "note": "no eval in this file"}
    point = curve[-1]
    units = next(iter(units_by_set.values()), 32)
    return {"file": path, "step": point["step"], **lift_record(point["holdout"], point["no_info"], units)}


# ----------------------------------------------------------------------------- flags


def add_search_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("prompt search (benchmarks/prompt_search.py)").add_argument
    add(
        "--method",
        choices=("reflect", "candidates"),
        default="reflect",
        help="GEPA-style reflective search, or the hand-written candidates each scored",
    )
    add(
        "--student-attempts",
        type=int,
        default=None,
        help="The budget of student answers (inner rounds and "
        "holdout). Default: what the RL run of these flags spends in --num-rollout steps (see the top of this file).",
    )
    add("--pareto-batches", type=int, default=2, help="Step draws in the Pareto (selection) set.")
    add("--minibatch-batches", type=int, default=1, help="Step draws a round's parent and child are scored on.")
    add("--max-rounds", type=int, default=1000, help="At most this many reflection rounds.")
    add(
        "--max-failed-proposals", type=int, default=5, help="Stop after this many proposals in a row give no candidate."
    )
    add(
        "--candidates",
        default=None,
        help="--method candidates: a file of instructions separated by lines of --- (an entry with "
        "{attempts_and_grades} is a whole template); default: a built-in list and "
        "prompt_templates/teacher_rules.txt's.",
    )
    add(
        "--reflection-base-url",
        default=None,
        help="An OpenAI-compatible endpoint that reflects (default: the teacher model through its pool).",
    )
    add("--reflection-model", default=None, help="The model name at --reflection-base-url.")
    add("--reflection-api-key-env", default="OPENAI_API_KEY", help="Its key's environment variable.")
    add("--reflection-temperature", type=float, default=1.0)
    add("--reflection-max-tokens", type=int, default=384, help="Tokens of a new instruction, at most.")
    add("--reflection-examples", type=int, default=4, help="Chains shown to the reflection, best and worst first.")
    add("--reflection-answers", type=int, default=3, help="Student answers shown per chain.")
    add("--reflection-chars", type=int, default=400, help="Characters of a problem, answer or feedback shown.")
    add(
        "--eval-seed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Also evaluate the starting template on --eval-prompt-data.",
    )
    add("--compare-with", default=None, help="An efficacy results JSON: the trained teacher's last eval beside ours.")
    add(
        "--out",
        default=None,
        help="Directory for prompt_search.json, the best template and the logs "
        "(default: $OUT or runs/benchmarks, then prompt_search-<time>).",
    )


class _SearchParser(_OneLineErrorParser):
    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {message} (see python benchmarks/prompt_search.py --help)\n")


def parse(argv: Sequence[str]) -> tuple[MetaConfig, argparse.Namespace]:
    parser = _SearchParser(
        prog="prompt_search.py",
        usage="%(prog)s --hf-checkpoint MODEL --prompt-data FILE [train.py flags] [search flags]",
        allow_abbrev=False,
        description=__doc__.splitlines()[0],
    )
    add_meta_learning_arguments(parser)
    add_search_flags(parser)
    ns = parser.parse_args(argv)
    checks = (
        (ns.student_attempts is not None and ns.student_attempts < 1, "--student-attempts", "give a number >= 1"),
        (ns.pareto_batches < 1, "--pareto-batches", "give 1 or more"),
        (ns.minibatch_batches < 1, "--minibatch-batches", "give 1 or more"),
        (ns.max_rounds < 1, "--max-rounds", "give 1 or more"),
        (ns.max_failed_proposals < 1, "--max-failed-proposals", "give 1 or more"),
        (ns.reflection_max_tokens < 1, "--reflection-max-tokens", "give 1 or more"),
        (ns.reflection_examples < 1, "--reflection-examples", "give 1 or more"),
        (ns.reflection_answers < 0, "--reflection-answers", "give 0 or more"),
        (ns.reflection_chars < 20, "--reflection-chars", "give 20 or more"),
        (ns.reflection_temperature < 0, "--reflection-temperature", "give a temperature >= 0"),
        (
            bool(ns.reflection_base_url) != bool(ns.reflection_model),
            "--reflection-base-url",
            "give it together with --reflection-model (the model name there), or neither",
        ),
        (ns.candidates is not None and not Path(ns.candidates).is_file(), "--candidates", "no such file"),
        (ns.candidates is not None and ns.method != "candidates", "--candidates", "it needs --method candidates"),
        (
            ns.compare_with is not None and not Path(ns.compare_with).is_file(),
            "--compare-with",
            "no such file; give an efficacy results JSON (benchmarks/results/efficacy_*.json)",
        ),
        (ns.backend != "local", "--backend", "the search runs on the local backend; leave --backend out"),
    )
    for bad, flag, fix in checks:
        if bad:
            value = getattr(ns, flag[2:].replace("-", "_"))
            raise UserInputError(f"{flag} {value}: {fix}")
    if ns.candidates:
        for text in hand_written_instructions(ns.candidates):
            if "{attempts_and_grades}" in text:  # a whole template: the teacher's slots, the required one
                try:
                    TeacherPromptTemplate(text, source=ns.candidates).check_required()
                except TemplateSlotError as error:
                    raise UserInputError(f"--candidates {ns.candidates}: {error.detail}") from None
    if not ns.out:
        base = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO_ROOT / "runs" / "benchmarks"
        ns.out = str(base / f"prompt_search-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = build_config(ns, default_run_dir=ns.out)
    budget_of(cfg, ns)  # a budget that cannot pay for one scoring is refused before anything starts
    return cfg, ns


def budget_of(cfg: MetaConfig, opts: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """The budget (--student-attempts, else the RL run's answers) and the RL run's figures; refused
    (UserInputError) when it cannot pay for one scoring of the seed on the Pareto set."""
    from slime_meta.assembly import batch_plan

    plan = batch_plan(cfg)
    rl = rl_run_attempts(cfg, plan)
    total = opts.student_attempts or rl["student_attempts"]
    first = opts.pareto_batches * (rl["per_step"]["inner_rounds"] + rl["per_step"]["holdout"])
    if first > total:
        raise UserInputError(
            f"--student-attempts {total}: less than one scoring of the starting template on the Pareto set "
            f"({first} answers); give at least {first}, or fewer --pareto-batches"
        )
    return total, rl


# ----------------------------------------------------------------------------- the run


@dataclass
class OpenRun:
    """A search's running pieces: the run's data, roles and rollout over started pools."""

    cfg: MetaConfig
    data: Any  # slime_meta.backends.local.data.Data
    pieces: Any  # slime_meta.assembly.RolePieces
    rollout: MetaLearningRollout  # its student a CountedStudent
    too_long: Callable[[TeacherPromptTemplate], str | None]  # why a template cannot fit the models' context


@contextlib.asynccontextmanager
async def open_run(cfg: MetaConfig, out: Path):
    """The run's inputs checked and its pools started, as train.py's local backend does, for `cfg`;
    the processes stopped when the block ends. Logs go to `out`/logs."""
    from slime_meta.artifacts.model_files import with_converted_checkpoints
    from slime_meta.assembly import build_role_pieces, build_rollout, load_tokenizer, make_pool
    from slime_meta.backends.local.data import context_limits, load_data
    from slime_meta.backends.local.inputs import check_context_fits, check_models, check_servers
    from slime_meta.backends.local.workers.launcher import LocalProcessGroup
    from slime_meta.backends.local.workers.pools import start_pools, with_local_grader
    from slime_meta.rollout.clients import close_clients
    from slime_meta.rollout.context_budget import check_flags_fit

    cfg = with_converted_checkpoints(cfg)
    teacher_model = check_models(cfg)
    data = load_data(cfg)
    tokenizer = load_tokenizer(teacher_model)
    pieces = build_role_pieces(cfg)
    check_servers(cfg)
    check_context_fits(cfg)
    limits = context_limits(cfg, pieces.chat)

    def too_long(template: TeacherPromptTemplate) -> str | None:
        try:
            check_flags_fit(limits, pieces.generator_template, template, cfg.meta.additional_info_position)
        except UserInputError as error:
            return f"it does not fit the context ({error})"
        return None

    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "weights").mkdir(exist_ok=True)
    with LocalProcessGroup(host=cfg.pools.host) as processes:
        pools = start_pools(cfg, processes, teacher_model, out)
        pieces = with_local_grader(cfg, pieces, pools.grader_url)
        teacher_pool = make_pool(cfg, "teacher", pools.teacher.router_url, cfg.sampling.teacher_concurrency)
        student_pool = make_pool(cfg, "student", pools.student_url, cfg.sampling.student_concurrency)
        rollout = build_rollout(cfg, pieces, teacher_pool, student_pool, tokenizer)
        rollout.settings = dataclasses.replace(rollout.settings, keep_solver_attempts=False, show_progress=False)
        rollout.student = CountedStudent.of(rollout.student)
        try:
            yield OpenRun(cfg, data, pieces, rollout, too_long)
        finally:
            await close_clients(teacher_pool, student_pool, pieces.grader)


def split_draws(cfg: MetaConfig, data, batches: int):
    """GEPA's two sets: `batches` step draws for the Pareto set, and a sampler of the other training
    problems for the minibatches (of all of them where too few are left for a step)."""
    from slime_meta.data.problems import ProblemSampler

    pareto = [e for _ in range(batches) for e in data.sampler.next_episodes(**data.draw_sizes)]
    used = {p.uid for e in pareto for p in (*e.holdout, *(q for c in e.train_chunks_P for q in c))}
    grouped = cfg.data.group_key is not None
    rest = [p for p in data.sampler.problems if p.uid not in used]
    feedback = ProblemSampler(rest, seed=cfg.seed + 1, shuffle=True, group_key_used=grouped)
    try:
        feedback.validate(cfg.meta.n_problems_per_prompt, data.plan.holdout_per_episode, data.plan.groups)
    except UserInputError:
        feedback = ProblemSampler(data.sampler.problems, seed=cfg.seed + 1, shuffle=True, group_key_used=grouped)
    return pareto, feedback


def make_reflector(opts: argparse.Namespace, run: OpenRun):
    if opts.reflection_base_url:
        return APIReflector(
            opts.reflection_base_url,
            opts.reflection_model,
            opts.reflection_api_key_env,
            opts.reflection_temperature,
            opts.reflection_max_tokens,
            run.cfg.grader.grader_timeout,
        )
    return PoolReflector(run.rollout.teacher, opts.reflection_temperature, opts.reflection_max_tokens)


async def search_on(run: OpenRun, opts: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The search over an open run, the best template's evaluation, and the report's figures."""
    cfg, data, pieces, rollout = run.cfg, run.data, run.pieces, run.rollout
    started = time.perf_counter()
    pareto, feedback = split_draws(cfg, data, opts.pareto_batches)
    total, rl = budget_of(cfg, opts)
    reflect = make_reflector(opts, run)
    budget = Budget(total, lambda: rollout.student.answers)
    search = Search(
        cfg, rollout, pieces.teacher_template, budget, pareto, feedback, data.draw_sizes, opts, reflect, run.too_long
    )
    first = search.cost(pareto)
    print(
        f"prompt search ({opts.method}): budget {total:,} student answers"
        + (f" (the RL run's: {rl['formula']})" if not opts.student_attempts else "")
        + f"; a scoring on the Pareto set costs {first:,}"
        + (f"; reflection by {reflect.name}" if opts.method == "reflect" else ""),
        flush=True,
    )
    try:
        if opts.method == "reflect":
            await search.reflect_rounds()
        else:
            await search.hand_written(hand_written_instructions(opts.candidates))
    finally:
        await close_clients(reflect)
    search_s, spent, best = time.perf_counter() - started, budget.spent, search.best()
    print(f"best: candidate {best.id} ({best.origin}), {best.score:.3f} on the Pareto set", flush=True)
    evals: dict[str, dict] = {}
    if data.eval_sets:
        evals["best"] = await eval_lifts(cfg, rollout, best.template, data.eval_sets)
        if opts.eval_seed:
            same = best.id == 0
            evals["seed"] = (
                evals["best"] if same else await eval_lifts(cfg, rollout, search.seed_template, data.eval_sets)
            )
    out.mkdir(parents=True, exist_ok=True)
    template_file = out / "best_teacher_template.txt"
    template_file.write_text(best.template.text + "\n", encoding="utf-8")
    units = {name: lift["units"] for name, lift in evals.get("best", {}).items()}
    seed = pieces.teacher_template
    return {
        "method": opts.method,
        "model": {
            "teacher": cfg.pools.hf_checkpoint,
            "student": cfg.pools.student_checkpoint or "the teacher's weights",
        },
        "seed_template": seed.source,
        "seed_template_class": f"{type(seed).__module__}.{type(seed).__name__}",
        "reflection": reflect.name if opts.method == "reflect" else None,
        "budget": {
            "student_attempts": total,
            "spent": spent,
            "counted": "every student answer: inner rounds and holdout (one request of n attempts counts n)",
            "rl_run": rl,
            "pareto_set": {"episodes": len(search.pareto), "answers_per_scoring": search.cost(search.pareto)},
        },
        "evaluations": search.evaluations,
        "search_s": round(search_s, 1),
        "candidates": [c.record() for c in search.candidates],
        "rounds": search.rounds,
        "hand_written_refused": search.refused,
        "best": {
            "id": best.id,
            "origin": best.origin,
            "score": best.score,
            "instruction": written_braces(best.instruction),
            "template_file": str(template_file),
        },
        "eval": evals,
        "trained_teacher": trained_teacher(opts.compare_with, units) if opts.compare_with else None,
    }


async def run_search(cfg: MetaConfig, opts: argparse.Namespace, out: Path) -> dict[str, Any]:
    async with open_run(cfg, out) as run:
        return await search_on(run, opts, out)


def in_se(lift: dict) -> str:
    return "-" if lift["lift_in_se"] is None else f"{lift['lift_in_se']:.2f}"


def print_summary(report: dict) -> None:
    budget = report["budget"]
    print(f"spent {budget['spent']:,} of {budget['student_attempts']:,} student answers", flush=True)
    for c in report["candidates"]:
        shown = c["instruction"].replace("\n", " ")[:90]
        shown_score = "-" if c["score"] is None else f"{c['score']:.3f}"
        print(f"  candidate {c['id']:>2} {c['origin']:<12} {shown_score:>6}  {shown}")
    for which, lifts in report["eval"].items():
        for name, lift in lifts.items():
            print(
                f"eval {name}, {which} template: with info {lift['with_info']:.3f}, no info {lift['no_info']:.3f}, "
                f"lift {lift['lift']:.3f} (SE {lift['se']:.3f}, {in_se(lift)} SE; {lift['units']} problems)"
            )
    trained = report.get("trained_teacher")
    if trained and "lift" in trained:
        print(
            f"trained teacher ({trained['file']}, step {trained['step']}): with info {trained['with_info']:.3f}, no "
            f"info {trained['no_info']:.3f}, lift {trained['lift']:.3f} ({in_se(trained)} SE)"
        )
    print(f"best template: {report['best']['template_file']}", flush=True)


def write_report(fields: dict[str, Any], opts: argparse.Namespace, argv: Sequence[str]) -> Path:
    """prompt_search.json in --out: the date, the command, the machine and every flag, then the figures."""
    report = report_header("prompt_search", dict(vars(opts)))
    report["command"] = " ".join(["python", "benchmarks/prompt_search.py", *argv])
    report.update(fields)
    return write_json(report, Path(opts.out) / "prompt_search.json")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, opts = parse(argv)
        fields = asyncio.run(run_search(cfg, opts, Path(opts.out)))
    except UserInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    path = write_report(fields, opts, argv)
    print_summary(json.loads(path.read_text()))
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
