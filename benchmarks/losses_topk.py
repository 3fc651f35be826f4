"""SDPO's JSD with the teacher as its top-k plus a tail bucket: how far from the full JSD, and its cost.

    python benchmarks/losses_topk.py --gap                  # CPU: the gap on the real model's distributions
    python benchmarks/losses_topk.py --time --out t.json    # GPU: 8,192 tokens x vocab 151,936, k = 100

--gap: the shipped real model (SmolLM2-135M-Instruct) answers a few easy word problems greedily
without a hint (the student's answer); the teacher is the same model with the problem's hint in
the prompt, scored on that answer. Per answer token, in float64: the full-vocabulary generalised
JSD (beta 0.5) and `topk_generalized_jsd` with the teacher's top-k for each `--ks`; reported: the
mean of each, |top-k - full| and its ratio to the full value (the top-k value is never above the
full one: merging outcomes never raises an f-divergence).

--time: bf16 student and teacher logits as in `losses.py`; forward + backward, CUDA events, the
median of `--reps`, and peak memory beyond the inputs, of the full JSD kernel (`generalized_jsd`,
the fused Triton kernel) and of `topk_generalized_jsd` (torch, chunked by `--chunk-size`) from the
teacher's top-k (computed once, outside the timing). The loss values are printed side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import losses as L
import torch

from slime_meta.losses.distill import divergence_from_logps, generalized_jsd
from slime_meta.losses.topk_distill import teacher_topk, topk_generalized_jsd

BETA = 0.5


# ----------------------------------------------------------------------------- the gap


def _chat_ids(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(prompt, add_special_tokens=False)


def _problems(path: Path, count: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("oracle_hint")][:count]


def answer_rows(model, tokenizer, problem: dict, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(student rows, teacher rows) `[R, V]` float64 logits at the student's greedy answer tokens."""
    plain = _chat_ids(tokenizer, problem["prompt"])
    hinted = _chat_ids(tokenizer, f"{problem['prompt']}\n\nHint: {problem['oracle_hint']}")
    with torch.no_grad():
        generated = model.generate(torch.tensor([plain]), max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
        answer = generated[len(plain) :]
        rows = []
        for prompt in (plain, hinted):
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0].double()
            rows.append(logits[len(prompt) - 1 : len(prompt) + len(answer) - 1])
    return rows[0], rows[1]


def measure_gap(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_meta.models.real import ensure_real_checkpoint

    C.quiet_transformers()
    checkpoint = ensure_real_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    students, teachers = [], []
    for problem in _problems(C.REPO_ROOT / args.data, args.problems):
        s, t = answer_rows(model, tokenizer, problem, args.max_new_tokens)
        students.append(s)
        teachers.append(t)
    student_N_V, teacher_N_V = torch.cat(students), torch.cat(teachers)
    full_N = divergence_from_logps(torch.log_softmax(student_N_V, -1), torch.log_softmax(teacher_N_V, -1), BETA)
    teacher_logps_N_V = torch.log_softmax(teacher_N_V, -1)
    out = {
        "model": checkpoint.name,
        "tokens": int(full_N.numel()),
        "vocab": int(student_N_V.shape[-1]),
        "full_jsd_mean": float(full_N.mean()),
        "by_k": {},
    }
    for k in args.ks:
        ids_N_K = teacher_logps_N_V.topk(k, -1).indices
        topk_N = topk_generalized_jsd(student_N_V, ids_N_K, teacher_logps_N_V.gather(-1, ids_N_K), beta=BETA).per_token
        gap_N = (topk_N - full_N).abs()
        out["by_k"][str(k)] = {
            "topk_jsd_mean": float(topk_N.mean()),
            "abs_gap_mean": float(gap_N.mean()),
            "abs_gap_max": float(gap_N.max()),
            "rel_gap_of_means": float((full_N.mean() - topk_N.mean()).abs() / full_N.mean()),
            "teacher_tail_mass_mean": float(1 - teacher_logps_N_V.gather(-1, ids_N_K).exp().sum(-1).mean()),
        }
    return out


# ----------------------------------------------------------------------------- time and memory


def measure_time(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    x = L.make_inputs(args.tokens, args.vocab, 8, device, args.seed)
    ids, logps = teacher_topk(x["teacher"].reshape(-1, args.vocab), args.k)
    x["topk_ids"], x["topk_logps"] = (
        ids.reshape(*x["teacher"].shape[:2], args.k),
        logps.reshape(*x["teacher"].shape[:2], args.k),
    )

    def full(x: dict) -> torch.Tensor:
        return generalized_jsd(x["student"], x["teacher"], x["mask"], beta=BETA).loss

    def topk(x: dict) -> torch.Tensor:
        return topk_generalized_jsd(
            x["student"], x["topk_ids"], x["topk_logps"], x["mask"], beta=BETA, chunk_size=args.chunk_size
        ).loss

    out = {"tokens": args.tokens, "vocab": args.vocab, "k": args.k, "chunk_size": args.chunk_size}
    for name, fn in (("full_jsd_kernel", full), (f"topk_jsd_k{args.k}", topk)):
        loss = float(L.forward_backward(fn, x))
        result = L.measure(fn, x, device, args.warmup, args.reps)
        peak = result["peak_extra_bytes"]
        out[name] = {"loss": loss, "ms": result["ms"], "peak_extra_gib": None if peak is None else peak / 2**30}
        L.free(device)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gap", action="store_true", help="the top-k gap on the real model's distributions (CPU)")
    p.add_argument("--time", action="store_true", help="time and memory against the full JSD kernel (CUDA)")
    p.add_argument("--ks", type=int, nargs="+", default=[20, 100, 1000])
    p.add_argument("--data", default="data/easy_word_problems.jsonl")
    p.add_argument("--problems", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="--time on cpu: a smoke run at a small --tokens/--vocab only")
    p.add_argument("--out", default=None, help="JSON report path")
    args = p.parse_args(argv)
    if not (args.gap or args.time):
        p.error("give --gap, --time or both")
    if args.time and args.device == "cuda" and not torch.cuda.is_available():
        p.error("--time needs a CUDA device")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = C.report_header("losses_topk", {k: v for k, v in vars(args).items() if k != "out"})
    if args.gap:
        report["gap"] = measure_gap(args)
    if args.time:
        report["time"] = measure_time(args)
    path = C.write_json(report, args.out or C.default_out("losses_topk"))
    print(json.dumps({k: report[k] for k in ("gap", "time") if k in report}, indent=2))
    print(f"json: {path}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
