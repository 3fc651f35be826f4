"""Worker memory: peak GPU memory while serving a batch of long prompts, with and without a budget.

    python benchmarks/worker_memory.py --out benchmarks/results/worker_memory_h100.json   # CUDA only
    python benchmarks/worker_memory.py --quick --out /tmp/worker_memory.json            # CPU: tiny shape, smoke

The worker is built exactly as `python -m slime_meta_engine` builds it (`server.build_context`
with the worker's own flags, so the budget's start-up line and sizing are the real ones), from a
random-init Qwen2.5-0.5B-shape checkpoint in bf16. Each setting serves `--prompts` prompts of
`--prompt-len` random ids, all submitted at once, `--new-tokens` greedy tokens each with
log-probs; the figures are torch's peak allocated and reserved bytes from before the worker is
built to after the last answer (the CUDA context, about 0.5 GB, comes on top). Settings:
- default: no budget and no chunking (the worker's defaults);
- budget: `--mem-fraction-static F`;
- budget_chunked: the same plus `--chunked-prefill-size N`.
Equality of chunked and whole-prompt prefill: budget_chunked's answers against budget's (bf16,
CUDA graphs: first tokens, whole sequences, log-prob differences), and a float32 check on the
DynamicCache path (`--cuda-graphs off`) with fewer prompts, where tokens must be identical.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_inputs import build_model_dir, prompts  # noqa: E402

from slime_meta_engine.protocol import GenerationSpec, SamplingParams  # noqa: E402
from slime_meta_engine.rows import GenerationJob  # noqa: E402
from slime_meta_engine.server import build_context, parse_args  # noqa: E402

GIB = 2**30


def serve_batch(model_dir: Path, worker_flags: list[str], batch: list[list[int]], new_tokens: int) -> dict:
    """Build a worker with `worker_flags`, serve `batch` at once, return memory figures and answers."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    context = build_context(parse_args(["--model-path", str(model_dir), *worker_flags]))
    engine = context.engine
    started_gib = (torch.cuda.memory_allocated() - base) / GIB if device.type == "cuda" else None
    outcomes: dict[int, object] = {}
    done = threading.Semaphore(0)
    jobs = []
    for index, ids in enumerate(batch):
        spec = GenerationSpec(
            f"r{index}",
            tuple(ids),
            SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True),
            return_logprob=True,
        )

        def on_done(outcome, index=index) -> None:
            outcomes[index] = outcome
            done.release()

        jobs.append(GenerationJob(spec, on_done=on_done))
    engine.start()
    t0 = time.perf_counter()
    engine.submit_all(jobs)
    for _ in jobs:
        assert done.acquire(timeout=600)
    wall_s = time.perf_counter() - t0
    engine.stop()
    answers = [outcomes[i] for i in range(len(batch))]
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    result = {
        "worker_flags": worker_flags,
        "decode_path": engine.decode_path,
        "fast_path": engine.fast_path_info,
        "max_running_requests": context.max_batch_size,
        "prefill_batches": engine.counters["prefill_batches"],
        "serve_s": round(wall_s, 2),
        "tokens": [a.output_ids for a in answers],
        "logprobs": [a.output_logprobs for a in answers],
    }
    if device.type == "cuda":
        torch.cuda.synchronize()
        result["allocated_after_start_gib"] = round(started_gib, 3)
        result["peak_allocated_gib"] = round((torch.cuda.max_memory_allocated() - base) / GIB, 3)
        result["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
    del context, engine
    return result


def compare(chunked: dict, whole: dict) -> dict:
    """How far chunked prefill's answers are from whole-prompt prefill's."""
    first_equal = sum(a[0] == b[0] for a, b in zip(chunked["tokens"], whole["tokens"]))
    all_equal = sum(a == b for a, b in zip(chunked["tokens"], whole["tokens"]))
    first_logprob_diff = max(abs(a[0] - b[0]) for a, b in zip(chunked["logprobs"], whole["logprobs"]))
    shared_diff = 0.0  # over each row's tokens up to its first difference
    for tokens_a, tokens_b, lp_a, lp_b in zip(
        chunked["tokens"], whole["tokens"], chunked["logprobs"], whole["logprobs"]
    ):
        for ta, tb, la, lb in zip(tokens_a, tokens_b, lp_a, lp_b):
            shared_diff = max(shared_diff, abs(la - lb))
            if ta != tb:
                break
    return {
        "rows": len(whole["tokens"]),
        "first_token_equal": first_equal,
        "sequences_equal": all_equal,
        "max_abs_first_logprob_diff": float(f"{first_logprob_diff:.3g}"),
        "max_abs_logprob_diff_until_first_difference": float(f"{shared_diff:.3g}"),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=3000)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--mem-fraction-static", type=float, default=0.03)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--fp32-prompts", type=int, default=8, help="prompts of the float32 equality check")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shape, few short prompts")
    p.add_argument("--out", default="runs/worker_memory.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the worker's start-up lines
    cuda = torch.cuda.is_available()
    if args.quick:
        args.prompts, args.prompt_len, args.new_tokens, args.chunked_prefill_size, args.fp32_prompts = 6, 40, 4, 32, 3
    elif not cuda:
        raise SystemExit("error: the memory figures need a CUDA device (use --quick for a CPU smoke run)")
    report = C.report_header("worker_memory", vars(args))
    with tempfile.TemporaryDirectory() as tmp:
        kind = "qwen0.5b" if cuda and not args.quick else "tiny"
        model_dir = build_model_dir(kind, Path(tmp) / "model", torch.bfloat16 if cuda else torch.float32)
        vocab = 151936 if kind == "qwen0.5b" else 512
        batch = prompts(args.prompts, args.prompt_len, vocab, seed=3)
        budget = ["--mem-fraction-static", str(args.mem_fraction_static)]
        chunk = ["--chunked-prefill-size", str(args.chunked_prefill_size)]
        runs = {
            "default": serve_batch(model_dir, [], batch, args.new_tokens),
            "budget": serve_batch(model_dir, budget, batch, args.new_tokens),
            "budget_chunked": serve_batch(model_dir, budget + chunk, batch, args.new_tokens),
        }
        fp32 = ["--dtype", "float32", "--cuda-graphs", "off"]
        small = batch[: args.fp32_prompts]
        fp32_whole = serve_batch(model_dir, fp32, small, args.new_tokens)
        fp32_chunked = serve_batch(model_dir, fp32 + chunk, small, args.new_tokens)
    report["equality"] = {
        "bf16_static_path": compare(runs["budget_chunked"], runs["budget"]),
        "fp32_dynamic_cache_path": compare(fp32_chunked, fp32_whole),
    }
    for run in runs.values():
        run.pop("tokens"), run.pop("logprobs")
    report["runs"] = runs
    path = C.write_json(report, args.out)
    print(
        f"{'setting':<16} {'running':>8} {'after start GiB':>16} {'peak alloc GiB':>15} "
        f"{'peak reserved GiB':>18} {'serve s':>8}"
    )
    for name, run in runs.items():
        print(
            f"{name:<16} {run['max_running_requests']:>8} {run.get('allocated_after_start_gib', '-')!s:>16} "
            f"{run.get('peak_allocated_gib', '-')!s:>15} {run.get('peak_reserved_gib', '-')!s:>18} {run['serve_s']:>8}"
        )
    print("equality:", report["equality"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
