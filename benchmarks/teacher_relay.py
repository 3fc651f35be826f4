"""Does the untrained teacher state the fact its rubric holds? The first round of the inner loop, per family.

    python benchmarks/teacher_relay.py --gguf FILE                      # price lists, CPU
    python benchmarks/teacher_relay.py --gguf FILE --device cuda --dtype bfloat16 --samples 16

What it measures: before any training, how often the teacher's first info carries the one fact a
family's problems need and only its rubric states (on `data/price_lists.jsonl`: the shop's price).
GRPO can only reinforce what the teacher sometimes writes: a share near 0 means the run must find
the fact by chance, a share well above 0 gives the group's rewards a spread to learn from.

Each family's first round is rendered as the loop renders it: its first `--k` problems (one teacher
prompt, `--n-problems-per-prompt`), the student's greedy no-info answer to each, graded by the
project's verifier with its feedback, in the teacher template (`--teacher-template`, default
`prompt_templates/teacher_rules.txt`) inside the model's chat template; then `--samples` infos are
sampled at temperature 1 (the teacher's sampling in scripts/run_real.sh). An info states the fact
when it holds the value `--fact` captures from the rubric followed by `--fact-unit` ("7 dollars",
"$7"). The model is read from a GGUF file with transformers, as `real_baselines.py` does. Writes
`<out>.json` (settings, machine, shares per family, every info).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import fmean

from _common import default_out, quiet_transformers, report_header, table, write_json
from real_baselines import chosen_problems, generate, load_student

from slime_meta.grading.graders import VerifierGrader
from slime_meta.prompt_templates import GeneratorPromptTemplate, load_template
from slime_meta.types import GradedAttempt

DEFAULT_DATA = "data/price_lists.jsonl"
DEFAULT_TEMPLATE = "prompt_templates/teacher_rules.txt"


def states_fact(info: str, value: str, unit: str) -> bool:
    """`info` names `value` as the fact: "7 dollars", "$7", "7-dollar" (not 17 or 7.5)."""
    number = rf"(?<![\d.]){re.escape(value)}(?![\d.]\d)"
    return bool(re.search(rf"{number}[\s-]*{unit}|\${re.escape(value)}(?![\d.]\d)", info, re.IGNORECASE))


def measure(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    quiet_transformers()
    import torch

    from slime_meta.rollout.roles import PromptRenderer

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tokenizer, model = load_student(Path(args.gguf), args.device, args.dtype)
    load_s = time.perf_counter() - started
    renderer = PromptRenderer(tokenizer, True)
    problems = chosen_problems(Path(args.data), args.k, args.group_key, None)
    families = list(dict.fromkeys(p.group for p in problems))
    by_family = {family: [p for p in problems if p.group == family] for family in families}

    # The student's first-round attempts: no info, greedy, graded with feedback as the loop grades them.
    student = GeneratorPromptTemplate()
    answers = generate(
        tokenizer,
        model,
        [renderer.text(student.build(p, "", "prefix")) for p in problems],
        greedy=True,
        max_new_tokens=args.student_max_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    grader = VerifierGrader()
    attempts = {
        p.uid: GradedAttempt(problem=p, solution=text, grade=grader.grade_now(p, text))
        for p, (text, _) in zip(problems, answers)
    }

    teacher = load_template("teacher", args.teacher_template, "--teacher-template")
    prompts, owners = [], []
    for family in families:
        members = by_family[family]
        messages = teacher.build(members, [[attempts[p.uid]] for p in members], previous_info="")
        prompts += [renderer.text(messages)] * args.samples
        owners += [family] * args.samples
    started = time.perf_counter()
    infos = generate(
        tokenizer,
        model,
        prompts,
        greedy=False,
        max_new_tokens=args.teacher_max_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    generate_s = time.perf_counter() - started

    records = []
    for family, (info, hit_limit) in zip(owners, infos):
        rubric = by_family[family][0].rubric or ""
        found = re.search(args.fact, rubric)
        if found is None:
            raise SystemExit(f"--fact {args.fact!r}: no match in the rubric of family {family}: {rubric!r}")
        value = found.group(1)
        records.append(
            {
                "family": family,
                "fact": value,
                "states_fact": states_fact(info, value, args.fact_unit),
                "hit_length_limit": hit_limit,
                "info": info,
            }
        )
    first_round = {
        p.uid: {"family": p.group, "answer": attempts[p.uid].solution, "grade": attempts[p.uid].grade.score}
        for p in problems
    }
    settings = {
        "data": args.data,
        "k": args.k,
        "samples": args.samples,
        "teacher_template": args.teacher_template,
        "teacher_max_tokens": args.teacher_max_tokens,
        "student_max_tokens": args.student_max_tokens,
        "fact": args.fact,
        "fact_unit": args.fact_unit,
        "device": args.device,
        "dtype": args.dtype,
        "model": Path(args.gguf).name,
        "load_s": round(load_s, 1),
        "teacher_generate_s": round(generate_s, 1),
        "first_round": first_round,
    }
    return settings, records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=DEFAULT_DATA)
    parser.add_argument("--group-key", default="category")
    parser.add_argument("--gguf", required=True, help="the model's GGUF file (teacher and student)")
    parser.add_argument("--teacher-template", default=DEFAULT_TEMPLATE)
    parser.add_argument("--k", type=int, default=2, help="problems in the teacher prompt (--n-problems-per-prompt)")
    parser.add_argument("--samples", type=int, default=8, help="infos sampled per family (G)")
    parser.add_argument("--teacher-max-tokens", type=int, default=192)
    parser.add_argument("--student-max-tokens", type=int, default=192)
    parser.add_argument(
        "--fact", default=r"costs (\d+) dollars", help="regex whose group 1 takes the fact from the rubric"
    )
    parser.add_argument("--fact-unit", default="dollars?", help="regex for the unit after the value in an info")
    parser.add_argument("--batch-size", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", default=None, help="report path (default: $OUT or runs/benchmarks/)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else default_out("teacher_relay")

    settings, records = measure(args)
    shares: dict[str, list[float]] = defaultdict(list)
    for record in records:
        shares[record["family"]].append(float(record["states_fact"]))
        shares["all"].append(float(record["states_fact"]))
    share = {family: round(fmean(values), 3) for family, values in shares.items()}
    report = {
        **report_header("teacher_relay", settings),
        "share_stating_fact": share,
        "share_hitting_length_limit": round(fmean(r["hit_length_limit"] for r in records), 3),
        "infos": records,
    }
    print(write_json(report, out))
    rows = [[family, value, len(shares[family])] for family, value in share.items()]
    print(table(rows, ["family", "share of infos stating the fact", "n"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
