"""Generation: tokens/s through the router and embedded workers against plain in-process HF `generate`.

    python benchmarks/generation.py                  # GPU: Qwen2.5-0.5B shape; CPU: the demo model's shape
    python benchmarks/generation.py --quick          # CPU, a few requests (the test suite runs this)
    python benchmarks/generation.py --model-path DIR_OR_GGUF    # a real checkpoint (python -m slime_meta.models.real)

The model is random-init from its config (no weights needed), saved once with a word-level
tokenizer of the model's vocabulary size, and loaded by both sides in the same dtype (bf16 on a
GPU, float32 on CPU). Every request is `--prompt-len` random prompt ids plus exactly
`--new-tokens` sampled tokens (temperature 1, no top-k/top-p, EOS ignored), so tokens/s compare
like with like. In one run:
- in-process batched: `model.generate` on all `--concurrency` prompts at once (the reference;
  on a GPU measured with cuDNN attention on, torch's default, and off, the faster counts);
- in-process one-at-a-time: `model.generate` on one prompt at a time;
- served: the project's launcher starts `--workers` embedded workers behind the real
  sglang-router; `--requests` requests are sent through the project's `SGLangPool` client,
  `--concurrency` in flight;
- served one-at-a-time: the same, one request in flight.
Generated tokens / wall time. On a GPU the workers decode through their CUDA-graph path
(`--cuda-graphs auto`; `off` measures the DynamicCache path) over the KV cache `--kv-cache`
names (static slots or a paged pool; default: the worker's); the report names the path and cache
each worker ran (`served.worker_engines`). `--also-concurrency 128` times more batches in the same
pool at those numbers in flight. Each timed phase also says where the workers' time went
(`engine_split`, from their counters before and after: prefill, decode, waiting for requests, the
prefill batches and decode steps). On a GPU every served figure is also given as a share of the
decode roofline: rows x HBM bandwidth (a device copy measured in the same run) / the bytes one
decode step must read (all weights once, plus each row's keys and values at the mean context).
Correctness first, and part of `meets.correct`:
- greedy decoding of `--check-prompts` prompts through the served path must give the tokens of
  in-process greedy `generate`, or first differ at a near-tie: at the first difference, the served
  token's logit under HF's own full forward of the shared prefix lies less than
  `NEAR_TIE_LOGIT_STDS` standard deviations of that position's logits below HF's token (bf16
  flips only such ties; a wrong forward gives gaps of whole standard deviations);
- log-probs returned with sampled tokens must match HF's full forward of the generated sequence
  (the trainer's behaviour policy): mean absolute difference below `LOGPROB_MEAN_ABS_TOLERANCE`, or
  within `LOGPROB_FLOOR_FACTOR` times the same figure for HF `generate`'s own cached sampling in the
  same dtype, the floor reported beside it (a real model's peaked distributions put bf16's own
  cached-vs-full difference above the fixed tolerance: 0.047 mean for SmolLM2-135M on CPU);
- every request must return `--new-tokens` ids.
A real checkpoint (`--model-path`, an HF directory or a .gguf file converted once into a cached one) is
loaded as it is, with its own tokenizer: the greedy check then runs on chat-template questions
(`CHAT_QUESTIONS`) and stops at the model's EOS on both sides (HF `generate` and the served path),
so the answers are the ones a user sees; the timed requests stay random prompt ids. `--dtype
bfloat16` on a CPU gives the bf16 figures there too.
CPU threads: each worker uses one (its default); the in-process runs get as many as there are
workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch
from generation_inputs import build_model_dir, check_prompts, prompts  # noqa: E402
from generation_roofline import decode_roofline  # noqa: E402
from generation_served import served, worker_engines  # noqa: E402

TARGETS = {"cpu_vs_inprocess_batched": 0.8, "gpu_vs_inprocess_batched": 3.0, "gpu_vs_one_at_a_time": 4.0}
NEAR_TIE_LOGIT_STDS = 0.1
LOGPROB_MEAN_ABS_TOLERANCE = 1e-2
LOGPROB_FLOOR_FACTOR = 2.0  # the floor is measured on other sampled tokens: room for that


# ----------------------------------------------------------------------------- in-process


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_generate(
    model, batch: list[list[int]], new_tokens: int, device: torch.device, greedy: bool = False
) -> torch.Tensor:
    ids = torch.tensor(batch, device=device)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **sampling,
        )
    return out[:, ids.shape[1] :]


def hf_greedy_to_eos(model, prompt: list[int], new_tokens: int, device: torch.device) -> list[int]:
    """Greedy tokens up to and including the model's EOS (no forced length: EOS may be the argmax)."""
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


def in_process(
    model_dir: Path,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    vocab: int,
    check: list[list[int]],
) -> dict:
    """HF generate, batched and one at a time. On a GPU twice: with torch's default attention
    backends (cuDNN's included, which plans anew for every KV length) and with cuDNN's off (what
    the embedded worker does); the faster is the reference."""
    from transformers import AutoModelForCausalLM

    if device.type == "cpu":
        torch.set_num_threads(args.workers)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    batch = prompts(args.concurrency, args.prompt_len, vocab, seed=1)
    variants = {}
    for cudnn in (True, False) if device.type == "cuda" else (None,):
        if cudnn is not None:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        hf_generate(model, batch, 8, device)  # warm-up at the timed shapes
        hf_generate(model, batch[:1], 8, device)
        sync(device)
        t0 = time.perf_counter()
        out = hf_generate(model, batch, args.new_tokens, device)
        sync(device)
        batched_s = time.perf_counter() - t0
        assert out.shape == (len(batch), args.new_tokens), out.shape
        singles = []
        for p in batch[: args.one_at_a_time]:
            t0 = time.perf_counter()
            hf_generate(model, [p], args.new_tokens, device)
            sync(device)
            singles.append(time.perf_counter() - t0)
        name = "default" if cudnn is None else ("cudnn_sdp_on" if cudnn else "cudnn_sdp_off")
        variants[name] = {
            "batched": {
                "tokens_per_s": len(batch) * args.new_tokens / batched_s,
                "wall_s": batched_s,
                "batch": len(batch),
            },
            "one_at_a_time": {"tokens_per_s": args.new_tokens / statistics.median(singles), "request_s": singles},
        }
        print(
            f"  in-process ({name}): {variants[name]['batched']['tokens_per_s']:.0f} tok/s batched, "
            f"{variants[name]['one_at_a_time']['tokens_per_s']:.0f} one at a time",
            file=sys.stderr,
            flush=True,
        )
    if args.model_path:
        greedy = [hf_greedy_to_eos(model, p, args.check_tokens, device) for p in check]
    else:
        greedy = [hf_generate(model, [p], args.check_tokens, device, greedy=True)[0].tolist() for p in check]
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    best = lambda key: max(variants.values(), key=lambda v: v[key]["tokens_per_s"])[key]  # noqa: E731
    return {
        "batched": best("batched"),
        "one_at_a_time": best("one_at_a_time"),
        "variants": variants,
        "greedy_reference": greedy,
    }


def full_forward_logprobs(model, prompt: list[int], output_ids: list[int], device: torch.device) -> torch.Tensor:
    """log p(output_ids[i] | everything before it) at temperature 1, from one uncached forward."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output_ids], device=device)).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(output_ids, device=device)[:, None])[:, 0].cpu()


def hf_cached_logprob_diffs(model, checks: list[dict], new_tokens: int, device: torch.device) -> torch.Tensor:
    """The same check for HF's own cached sampling (`generate` with its raw logits): the bf16 noise
    floor that the served path's figure is to be read against. Prompts of one length share a batch
    (chat-template prompts differ in length; padding would add a difference of its own)."""
    by_length: dict[int, list[list[int]]] = {}
    for c in checks:
        by_length.setdefault(len(c["prompt"]), []).append(c["prompt"])
    diffs = []
    for batch in by_length.values():
        ids = torch.tensor(batch, device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new_ids = out.sequences[:, ids.shape[1] :]
        step_logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
        cached = step_logprobs.gather(2, new_ids[..., None])[..., 0].cpu()
        diffs += [
            (cached[row] - full_forward_logprobs(model, prompt, new_ids[row].tolist(), device)).abs()
            for row, prompt in enumerate(batch)
        ]
    return torch.cat(diffs)


def verify(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    args: argparse.Namespace,
    report: dict,
    check_prompts: list[list[int]],
) -> dict:
    """Served greedy tokens and behaviour log-probs against HF's full forward (see the docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    sv, reference = report["served"], report["in_process"]["greedy_reference"]
    gaps, first_differences = [], []
    for prompt, ours, theirs in zip(check_prompts, sv["greedy_served"], reference):
        step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if step is None and len(ours) != len(theirs):  # one side stopped early with no token of its own
            first_differences.append(min(len(ours), len(theirs)))
            gaps.append(float("inf"))
            continue
        first_differences.append(step)
        if step is None:
            gaps.append(0.0)
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + theirs[:step]], device=device)).logits[0, -1].float()
        gaps.append(float((logits[theirs[step]] - logits[ours[step]]) / logits.std()))
    checks = sv["sampled_check"]
    diff = torch.cat(
        [
            (
                torch.tensor(c["output_logprobs"]) - full_forward_logprobs(model, c["prompt"], c["output_ids"], device)
            ).abs()
            for c in checks
        ]
    )
    hf_diff = hf_cached_logprob_diffs(model, checks, args.new_tokens, device)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result = {
        "greedy_agreement": sum(step is None for step in first_differences) / len(first_differences),
        "greedy_first_difference_step": first_differences,
        "greedy_first_divergence_gap_stds": gaps,
        "greedy_ok": all(g < NEAR_TIE_LOGIT_STDS for g in gaps),
        "logprob_abs_diff_mean": float(diff.mean()),
        "logprob_abs_diff_max": float(diff.max()),
        "logprob_tokens_checked": int(diff.numel()),
        "hf_generate_logprob_abs_diff_mean": float(hf_diff.mean()),
        "hf_generate_logprob_abs_diff_max": float(hf_diff.max()),
    }
    result["logprobs_within_hf_floor"] = (
        result["logprob_abs_diff_mean"] <= LOGPROB_FLOOR_FACTOR * result["hf_generate_logprob_abs_diff_mean"]
    )
    result["logprobs_ok"] = (
        result["logprob_abs_diff_mean"] < LOGPROB_MEAN_ABS_TOLERANCE or result["logprobs_within_hf_floor"]
    )
    return result


def resolve_model(args: argparse.Namespace, kind: str, tmp: Path, dtype: torch.dtype) -> Path:
    """The real checkpoint of --model-path (a .gguf converted once, cached), or a random-init one built in tmp."""
    if args.model_path:
        from slime_meta.artifacts.model_files import resolve_checkpoint

        to_stderr = lambda line: print(line, file=sys.stderr)  # noqa: E731 (stdout ends with the table)
        model_dir = Path(resolve_checkpoint(args.model_path, "--model-path", log=to_stderr))
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"error: --model-path {args.model_path}: not an HF checkpoint directory or a .gguf file")
        return model_dir
    return build_model_dir(kind, tmp / "model", dtype)


def run(args: argparse.Namespace) -> dict:
    C.quiet_transformers()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    kind = args.model or ("qwen0.5b" if device.type == "cuda" else "tiny")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    report = C.report_header("generation", {k: v for k, v in vars(args).items() if k != "out"})
    report.update(device=str(device), dtype=str(dtype).removeprefix("torch."))
    from slime_meta.backends.local.workers.launcher import LocalProcessGroup

    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        started = time.perf_counter()
        model_dir = resolve_model(args, kind, Path(tmp), dtype)
        report["model"] = model_dir.name if args.model_path else kind
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        report["build_s"] = time.perf_counter() - started
        print(f"  model {report['model']} ready in {report['build_s']:.1f}s", file=sys.stderr, flush=True)
        check = check_prompts(args, model_dir, vocab)
        report["in_process"] = in_process(model_dir, args, device, dtype, vocab, check)
        with LocalProcessGroup(startup_timeout_s=300) as group:
            t0 = time.perf_counter()
            endpoints = group.start_pool(
                "gen",
                str(model_dir),
                args.workers,
                device=device.type,
                weights_root=None,
                log_dir=str(Path(tmp) / "logs"),
                worker_args=[
                    "--max-batch-size",
                    str(max(64, args.concurrency, *args.also_concurrency)),
                    "--cuda-graphs",
                    args.cuda_graphs,
                    "--dtype",
                    report["dtype"],
                    *(["--kv-cache", args.kv_cache] if args.kv_cache else []),
                ],
            )
            report["pool_start_s"] = time.perf_counter() - t0
            report["served"] = asyncio.run(
                served(
                    endpoints.router_url,
                    args,
                    vocab,
                    report["in_process"]["greedy_reference"],
                    check,
                    endpoints.worker_urls,
                )
            )
            report["served"]["worker_engines"] = worker_engines(endpoints.worker_urls)
        print(
            f"  served: {report['served']['concurrent']['tokens_per_s']:.0f} tok/s at {args.concurrency} in flight",
            file=sys.stderr,
            flush=True,
        )
        report["verification"] = verify(model_dir, device, dtype, args, report, check)
        if device.type == "cuda":
            report["roofline"] = decode_roofline(model_dir, args, report, device)
    ip, sv = report["in_process"], report["served"]
    report["ratios"] = {
        "served_vs_inprocess_batched": sv["concurrent"]["tokens_per_s"] / ip["batched"]["tokens_per_s"],
        "served_vs_inprocess_one_at_a_time": sv["concurrent"]["tokens_per_s"] / ip["one_at_a_time"]["tokens_per_s"],
        "served_one_at_a_time_vs_inprocess_one_at_a_time": (
            sv["one_at_a_time"]["tokens_per_s"] / ip["one_at_a_time"]["tokens_per_s"]
        ),
    }
    report["targets"] = TARGETS
    r = report["ratios"]
    report["meets"] = (
        {"cpu_vs_inprocess_batched": r["served_vs_inprocess_batched"] >= TARGETS["cpu_vs_inprocess_batched"]}
        if device.type == "cpu"
        else {
            "gpu_vs_inprocess_batched": r["served_vs_inprocess_batched"] >= TARGETS["gpu_vs_inprocess_batched"],
            "gpu_vs_one_at_a_time": r["served_vs_inprocess_one_at_a_time"] >= TARGETS["gpu_vs_one_at_a_time"],
        }
    )
    vf = report["verification"]
    report["meets"]["correct"] = sv["all_lengths_right"] and vf["greedy_ok"] and vf["logprobs_ok"]
    return report


def print_table(report: dict) -> None:
    ip, sv, st = report["in_process"], report["served"], report["settings"]
    base = ip["batched"]["tokens_per_s"]
    rows = []
    for name, v in ip["variants"].items():
        tag = "" if name == "default" else f" ({name.replace('_', ' ')})"
        for label, key in ((f"batch {st['concurrency']}", "batched"), ("one at a time", "one_at_a_time")):
            rows.append(
                [f"in-process HF generate, {label}{tag}", v[key]["tokens_per_s"], v[key]["tokens_per_s"] / base]
            )
    rows += [
        [
            f"router + {st['workers']} worker(s), {st['concurrency']} in flight",
            sv["concurrent"]["tokens_per_s"],
            sv["concurrent"]["tokens_per_s"] / base,
        ],
        [
            "router + worker(s), one at a time",
            sv["one_at_a_time"]["tokens_per_s"],
            sv["one_at_a_time"]["tokens_per_s"] / base,
        ],
    ]
    vf = report["verification"]
    paths = ", ".join(sorted({e["decode_path"] for e in sv["worker_engines"]}))
    print(
        f"\ngeneration: {report['model']} ({report['dtype']}) on {report['device']}, "
        f"{st['prompt_len']}+{st['new_tokens']} tokens, "
        f"{st['requests']} served requests; worker decode path: {paths}; greedy identical served vs in-process on "
        f"{round(vf['greedy_agreement'] * len(vf['greedy_first_difference_step']))} of "
        f"{len(vf['greedy_first_difference_step'])} prompts, "
        f"token match: "
        f"{', '.join(f'{m:.2f}' for m in sv['greedy_token_match'])} (first-divergence gaps in logit stds: "
        f"{', '.join(f'{g:.3f}' for g in vf['greedy_first_divergence_gap_stds'])}); sampled log-probs vs full "
        f"forward: mean |diff| {vf['logprob_abs_diff_mean']:.2e}, max {vf['logprob_abs_diff_max']:.2e} over "
        f"{vf['logprob_tokens_checked']} tokens (HF generate's own cached vs full, the {report['dtype']} floor: "
        f"mean {vf['hf_generate_logprob_abs_diff_mean']:.2e}, "
        f"max {vf['hf_generate_logprob_abs_diff_max']:.2e}); all lengths right: {sv['all_lengths_right']}"
    )
    for in_flight, more in sv["more_in_flight"].items():
        rows.append([f"router + worker(s), {in_flight} in flight", more["tokens_per_s"], more["tokens_per_s"] / base])
    print(C.table(rows, ["path", "tokens/s", "x best in-process batched"]))
    caches = ", ".join(sorted({str((e.get("fast_path") or {}).get("kv_cache")) for e in sv["worker_engines"]}))
    print(f"worker KV cache: {caches}")
    for in_flight, figure in report.get("roofline", {}).get("by_in_flight", {}).items():
        print(
            f"decode roofline at {in_flight} in flight: {figure['roofline_tokens_per_s']:.0f} tokens/s; served "
            f"{figure['served_tokens_per_s']:.0f} = {figure['share']:.1%} of it"
        )
    timed = {st["concurrency"]: sv["concurrent"], **{int(k): v for k, v in sv["more_in_flight"].items()}}
    for in_flight, phase in timed.items():
        split = phase["engine_split"]
        print(
            f"{in_flight} in flight, the workers' time: prefill {split['prefill_share']:.0%} "
            f"({split.get('prefill_ms_per_batch', 0):.1f} ms x {split['prefill_batches']:.0f} batches), decode "
            f"{split['fast_decode_share'] + split['dynamic_decode_share']:.0%} "
            f"({split.get('decode_us_per_step', 0):.0f} us x {split['decode_steps']:.0f} steps), waiting for requests "
            f"{split['idle_share']:.0%}"
        )
    print(
        f"served vs in-process one at a time: {report['ratios']['served_vs_inprocess_one_at_a_time']:.2f}x; meets: "
        + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["meets"].items())
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--model",
        choices=("tiny", "qwen0.5b"),
        default=None,
        help="a random-init model of this shape; default: qwen0.5b on a GPU, tiny on CPU",
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="a real checkpoint instead: an HF directory or a .gguf file (converted once, cached)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="both sides' dtype; auto: bfloat16 on a GPU, float32 on CPU",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=96, help="served requests (concurrency in flight)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--one-at-a-time", type=int, default=2, help="requests timed one at a time, each path")
    p.add_argument("--check-prompts", type=int, default=4)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto", help="the workers' decode path")
    p.add_argument(
        "--kv-cache", choices=("static", "paged"), default=None, help="the workers' KV cache (default theirs)"
    )
    p.add_argument(
        "--also-concurrency",
        type=int,
        nargs="*",
        default=[],
        help="also time 3x this many requests at this many in flight, same pool",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.model = "cpu", None if args.model_path else "tiny"
        args.prompt_len, args.new_tokens, args.concurrency, args.requests, args.one_at_a_time = 16, 16, 4, 8, 1
        args.check_prompts, args.check_tokens = 2, 8
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    path = C.write_json(report, args.out or C.default_out("generation" + ("_quick" if args.quick else "")))
    print_table(report)
    print(f"json: {path}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
