"""What the untrained teacher writes first on price keys: the shop's price, a pasted answer key, or other.

    python benchmarks/first_infos.py --gguf FILE                                 # price keys, CPU
    python benchmarks/first_infos.py --model-dir DIR --device cuda --dtype bfloat16 --samples 16
    python benchmarks/first_infos.py --reclassify benchmarks/results/first_infos_h200_qwen05b_price_keys.json

On `data/price_keys.jsonl` each problem's rubric is its own answer key ("Answer key for 6 mugs at
Kim's stall: full credit for 42 dollars, ...") and never the shop's price: a teacher must divide a
key by the quantity to find the price (7) that the family's holdout problems need. GRPO can only
reinforce what the teacher sometimes writes, so this measures, before any training, how each first
info reads:

- `states_price`: it states the per-item price as a price ("7 dollars each", "$7", "costs 7") or
  multiplies by it ("6 x 7 = 42"): the rule, which carries to holdout problems of the shop;
- `pastes_key`: it holds a key's number (the result of one of its own problems) and does not state
  the price: right for that problem only;
- `other`: neither.

Beside the class, `key_with_quantity`: the info names one of its problems' keys together with that
problem's count in one sentence ("Answer key for 2 diaries ...: full credit for 10 dollars"), a
worked example from which a student could divide out the price itself.

Each family's first round is rendered as the loop renders it: its first `--k` problems that do not
state the price (so the price must be inferred from their keys), the student's greedy no-info
answer to each graded by the project's verifier with its feedback, in the teacher template
(`--teacher-template`; default the loop's default, `prompt_templates/teacher.txt`) inside the
model's chat template; then `--samples` infos are sampled at temperature 1. The price of a family
is read from its `oracle_hint` (the first "N dollars"). The model is read from a GGUF file
(`--gguf`, as `real_baselines.py` does) or an HF directory (`--model-dir`). Writes `<out>.json`
(settings, machine, the shares overall and per family, every info with its class).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import fmean

from _common import default_out, quiet_transformers, report_header, table, write_json
from real_baselines import generate, load_student

from slime_meta.data.problems import load_problems
from slime_meta.grading.graders import VerifierGrader
from slime_meta.prompt_templates import GeneratorPromptTemplate, load_template
from slime_meta.types import GradedAttempt, Problem

DEFAULT_DATA = "data/price_keys.jsonl"
CLASSES = ("states_price", "pastes_key", "other")


def whole(number: int | str) -> str:
    """`number` as a whole number in a text: not inside 17, 70 or 7.5."""
    return rf"(?<![\d.,]){re.escape(str(number))}(?![\d]|[.,]\d)"


def states_price(info: str, price: int) -> bool:
    """`info` names `price` as the price of one item: "7 dollars", "$7", "7-dollar", "costs 7", "priced at 7",
    "7 each", "7 per item", or multiplies by it ("6 x 7 = 42"). A bare 7 ("buy 7 mugs") is not a stated price."""
    p = whole(price)
    patterns = (
        rf"{p}[\s-]*(?:dollars?|usd)\b",
        rf"\${p}",
        rf"\b(?:costs?|costing|priced at|price of|price is|prices? (?:are|is))\s+(?:\w+\s+){{0,2}}\$?{p}",
        rf"{p}\s*(?:each|apiece|a piece|per\b)",
        rf"(?:\bx|×|\*|\btimes)\s*\$?{p}",
        rf"{p}\s*(?:x\b|×|\*|times\b)",
    )
    return any(re.search(pattern, info, re.IGNORECASE) for pattern in patterns)


def holds_number(info: str, number: int) -> bool:
    return re.search(whole(number), info) is not None


def quantity_of(problem: Problem) -> int | None:
    """How many items the problem's buyer takes: the first whole number of its prompt ("buys 6 mugs")."""
    found = re.search(r"(?<![\d.,])(\d+)(?![\d.,])", problem.prompt)
    return None if found is None else int(found.group(1))


def key_with_quantity(info: str, examples: list[tuple[int | None, int]]) -> bool:
    """`info` names a key and its problem's count in one sentence: a worked example ((count, key) pairs)."""
    sentences = re.split(r"(?<=[.!?])\s+|\n+", info)
    return any(
        count is not None and holds_number(sentence, key) and holds_number(sentence, count)
        for sentence in sentences
        for count, key in examples
    )


def classify(info: str, price: int, keys: list[int]) -> str:
    """One of CLASSES: the price stated wins over a pasted key (an info may show both)."""
    if states_price(info, price):
        return "states_price"
    if any(holds_number(info, key) for key in keys):
        return "pastes_key"
    return "other"


def price_of(problem: Problem) -> int:
    found = re.search(r"(\d+) dollars", str(problem.metadata.get("oracle_hint", "")))
    if found is None:
        raise SystemExit(f"{problem.uid}: no 'N dollars' in its oracle_hint; give a price-keys task file")
    return int(found.group(1))


def teacher_problems(data: Path, k: int, group_key: str, families: list[str] | None) -> dict[str, list[Problem]]:
    """The first `k` problems of each family whose prompt does not state the price, in file order."""
    chosen: dict[str, list[Problem]] = defaultdict(list)
    for problem in load_problems(data, group_key=group_key, id_key="id"):
        if families is not None and problem.group not in families:
            continue
        if len(chosen[problem.group]) < k and not holds_number(problem.prompt, price_of(problem)):
            chosen[problem.group].append(problem)
    short = [family for family, members in chosen.items() if len(members) < k]
    if not chosen or short:
        raise SystemExit(f"{data}: fewer than --k {k} problems without the price in family {short or families}")
    return dict(chosen)


def load_model(args: argparse.Namespace):
    if args.gguf:
        return load_student(Path(args.gguf), args.device, args.dtype)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    return tokenizer, model.to(args.device).eval()


def sample_from_one_prompt(
    tokenizer, model, prompt: str, samples: int, max_new_tokens: int, seed: int
) -> list[tuple[str, bool]]:
    """`samples` infos at temperature 1 from one prompt, read once: its cache copied to every sample.

    On a CPU the prompt's forward pass is most of the cost (a teacher prompt holds the student's
    answers: about 900 tokens); `generate` on `samples` copies of it would run it `samples` times.
    """
    import torch

    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
    with torch.no_grad():
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        cache.batch_repeat_interleave(samples)
        torch.manual_seed(seed)
        tokens_B_T = model.generate(
            ids.repeat(samples, 1),
            attention_mask=torch.ones(samples, ids.shape[1], dtype=torch.long, device=model.device),
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
        )
    results = []
    for row in tokens_B_T[:, ids.shape[1] :].tolist():
        hit_limit = tokenizer.eos_token_id not in row
        if not hit_limit:  # what follows the end of an info is padding
            row = row[: row.index(tokenizer.eos_token_id)]
        results.append((tokenizer.decode(row, skip_special_tokens=True), hit_limit))
    return results


def measure(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    quiet_transformers()
    import torch

    from slime_meta.rollout.roles import PromptRenderer

    if args.threads:
        torch.set_num_threads(args.threads)
    by_family = teacher_problems(Path(args.data), args.k, args.group_key, args.families)
    problems = [p for members in by_family.values() for p in members]
    started = time.perf_counter()
    tokenizer, model = load_model(args)
    load_s = time.perf_counter() - started
    renderer = PromptRenderer(tokenizer, True)

    # The student's first-round attempts: no info, greedy, graded with feedback as the loop grades them.
    student = GeneratorPromptTemplate()
    started = time.perf_counter()
    answers = generate(
        tokenizer,
        model,
        [renderer.text(student.build(p, "", "prefix")) for p in problems],
        greedy=True,
        max_new_tokens=args.student_max_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    student_s = time.perf_counter() - started
    grader = VerifierGrader()
    attempts = {
        p.uid: GradedAttempt(problem=p, solution=text, grade=grader.grade_now(p, text))
        for p, (text, _) in zip(problems, answers)
    }

    teacher = load_template("teacher", args.teacher_template, "--teacher-template")
    prompts = {
        family: renderer.text(teacher.build(members, [[attempts[p.uid]] for p in members], previous_info=""))
        for family, members in by_family.items()
    }
    started = time.perf_counter()
    owners, infos = [], []
    for index, (family, prompt) in enumerate(prompts.items()):
        owners += [family] * args.samples
        if args.shared_prefill:
            infos += sample_from_one_prompt(
                tokenizer, model, prompt, args.samples, args.teacher_max_tokens, args.seed + 1000 * index
            )
    if not args.shared_prefill:
        infos = generate(
            tokenizer,
            model,
            [prompts[family] for family in owners],
            greedy=False,
            max_new_tokens=args.teacher_max_tokens,
            batch_size=args.batch_size,
            seed=args.seed,
        )
    teacher_s = time.perf_counter() - started

    records = []
    for family, (info, hit_limit) in zip(owners, infos):
        members = by_family[family]
        price, keys = price_of(members[0]), [int(p.ground_truth) for p in members]
        records.append(
            {
                "family": family,
                "price": price,
                "keys": keys,
                "class": classify(info, price, keys),
                "holds_price_number": holds_number(info, price),
                "holds_key_number": any(holds_number(info, key) for key in keys),
                "key_with_quantity": key_with_quantity(info, [(quantity_of(p), int(p.ground_truth)) for p in members]),
                "hit_length_limit": hit_limit,
                "info": info,
            }
        )
    first_round = {
        p.uid: {
            "family": p.group,
            "prompt": p.prompt,
            "rubric": p.rubric,
            "answer": attempts[p.uid].solution,
            "grade": attempts[p.uid].grade.score,
        }
        for p in problems
    }
    settings = {
        "data": args.data,
        "families": list(by_family),
        "k": args.k,
        "samples": args.samples,
        "teacher_template": args.teacher_template or "prompt_templates/teacher.txt (the loop's default)",
        "teacher_max_tokens": args.teacher_max_tokens,
        "student_max_tokens": args.student_max_tokens,
        "temperature": 1.0,
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "model": Path(args.gguf).name if args.gguf else str(args.model_dir),
        "load_s": round(load_s, 1),
        "student_generate_s": round(student_s, 1),
        "teacher_generate_s": round(teacher_s, 1),
        "shared_prefill": args.shared_prefill,
        "first_round": first_round,
    }
    return settings, records


def shares(records: list[dict]) -> dict[str, dict[str, float]]:
    """The share of each class overall ("all") and per family, with the count of infos ("n")."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups["all"].append(record)
        groups[record["family"]].append(record)
    return {
        family: {
            **{name: round(fmean(r["class"] == name for r in members), 3) for name in CLASSES},
            "key_with_quantity": round(fmean(bool(r.get("key_with_quantity")) for r in members), 3),
            "n": len(members),
        }
        for family, members in sorted(groups.items(), key=lambda item: item[0] != "all")
    }


def reclassify(path: Path) -> dict:
    """An earlier report's infos classed again by today's rules, from its first round's problems (read
    back from its data file): no model needed."""
    report = json.loads(path.read_text())
    settings = report["settings"]
    by_uid = {p.uid: p for p in load_problems(settings["data"], group_key="category", id_key="id")}
    missing = [uid for uid in settings["first_round"] if uid not in by_uid]
    if missing:
        raise SystemExit(f"first_infos: --reclassify {path}: {settings['data']} lacks its problems {missing[:3]}")
    members: dict[str, list[Problem]] = defaultdict(list)
    for uid, row in settings["first_round"].items():
        members[row["family"]].append(by_uid[uid])
    for record in report["infos"]:
        family = members[record["family"]]
        record["class"] = classify(record["info"], record["price"], record["keys"])
        record["key_with_quantity"] = key_with_quantity(
            record["info"], [(quantity_of(p), int(p.ground_truth)) for p in family]
        )
    report["shares"] = shares(report["infos"])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=DEFAULT_DATA)
    parser.add_argument("--group-key", default="category")
    parser.add_argument("--families", nargs="+", default=None, help="families to sample (default: all)")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--reclassify", help="an earlier report: class its infos again by today's rules, print the shares (no model)"
    )
    model.add_argument("--gguf", help="the model's GGUF file (teacher and student)")
    model.add_argument("--model-dir", help="the model as an HF directory (python -m slime_meta.models.real NAME)")
    parser.add_argument(
        "--teacher-template", default=None, help="default: the loop's default (prompt_templates/teacher.txt)"
    )
    parser.add_argument("--k", type=int, default=2, help="problems in the teacher prompt (--n-problems-per-prompt)")
    parser.add_argument("--samples", type=int, default=4, help="infos sampled per family")
    parser.add_argument("--teacher-max-tokens", type=int, default=192)
    parser.add_argument("--student-max-tokens", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=40)
    parser.add_argument(
        "--shared-prefill",
        action="store_true",
        help="read each teacher prompt once and sample its infos from copies of its cache (on a CPU: about "
        "--samples times less prompt work); default: every info its own row of a batch, as real_baselines.py",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", default=None, help="report path (default: $OUT or runs/benchmarks/)")
    args = parser.parse_args(argv)
    for flag, value in (("--k", args.k), ("--samples", args.samples), ("--batch-size", args.batch_size)):
        if value < 1:
            parser.exit(2, f"first_infos: {flag} {value}: give 1 or more\n")
    for flag, path in (
        ("--data", args.data),
        ("--gguf", args.gguf),
        ("--model-dir", args.model_dir),
        ("--reclassify", args.reclassify),
    ):
        if path and not Path(path).exists():
            parser.exit(2, f"first_infos: {flag} {path}: no such file or directory\n")
    if args.reclassify:
        report = reclassify(Path(args.reclassify))
        rows = [
            [family, *(v[name] for name in CLASSES), v["key_with_quantity"], v["n"]]
            for family, v in report["shares"].items()
        ]
        print(table(rows, ["family", *CLASSES, "key_with_quantity", "n"]))
        return 0
    out = Path(args.out) if args.out else default_out("first_infos")

    settings, records = measure(args)
    report = {
        **report_header("first_infos", settings),
        "shares": shares(records),
        "share_hitting_length_limit": round(fmean(r["hit_length_limit"] for r in records), 3),
        "infos": records,
    }
    print(write_json(report, out))
    rows = [
        [family, *(value[name] for name in CLASSES), value["key_with_quantity"], value["n"]]
        for family, value in report["shares"].items()
    ]
    print(table(rows, ["family", *CLASSES, "key_with_quantity", "n"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
