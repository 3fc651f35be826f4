"""Trainer steps on GRPO groups: each prompt once per row (`--share-prompt-forward`) against one row per sample.

    python benchmarks/shared_prompts.py                       # GPU: the loop's teacher batch at the 0.5B shape
    python benchmarks/shared_prompts.py --tiny --device cpu   # a toy model, to check the script runs

The batch is the teacher's part of one outer step of `benchmarks/step.py` at the 0.5B shape:
`--groups` problem sets, each the common beginning of `--group-size` samples' prompts of about
`--prompt-len` tokens (each group's length drawn within +-10%, new lengths every step, as the
loop's rollouts bring), whose last `--tail-len` tokens are each sample's own (a chain's attempts
and grades), and responses of `--response-len` tokens. The trainer runs as the loop runs it on a
GPU: micro-batches of `--max-tokens` tokens, every layer recomputed, a KL term (k3, 0.1) against
the start weights (its own log-probs before the first update, so no reference pass), learning
rate 0 (the weights stay the same, so every configuration sees the same model). Configurations:
one row per sample or shared rows, each with eager and with compiled decoder layers (compiled on CUDA only).

Per configuration: the median step time over `--steps` steps after `--warmup` (the compile, and
the recompile for new lengths, fall in the warm-up), the tokens forwarded per step, the peak
memory, the loss of the first step (the same batch and weights in every configuration: the
shared rows must give one row per sample's loss within bf16 noise), and on CUDA the graphs
torch.compile made over the whole run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch
import trainer as T  # the trainer benchmark's model shapes and helpers

from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.settings import TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.types import TeacherSample


def make_batch(groups: int, group_size: int, prompt_len: int, tail_len: int, response_len: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(groups):
        length = int(prompt_len * (0.9 + 0.2 * torch.rand((), generator=g).item()))
        common = tuple(torch.randint(4, vocab, (length - tail_len,), generator=g).tolist())
        for i in range(group_size):
            prompt = common + tuple(torch.randint(4, vocab, (tail_len,), generator=g).tolist())
            response = tuple(torch.randint(4, vocab, (response_len,), generator=g).tolist())
            logp = tuple((-torch.rand(response_len, generator=g) * 3).tolist())
            out.append(
                TeacherSample(
                    prompt,
                    response,
                    logp,
                    reward=float(i % 2),
                    advantage=(-1.0) ** i,
                    group_index=group,
                    sample_index=i,
                    inner_iteration=0,
                )
            )
    return out


CONFIGS = ("separate-eager", "shared-eager", "separate-compiled", "shared-compiled")


def config_name(share: bool, compiled: bool) -> str:
    return f"{'shared' if share else 'separate'}-{'compiled' if compiled else 'eager'}"


def compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def run(args: argparse.Namespace) -> dict:
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else args.device
        if args.device != "auto"
        else "cpu"
    )
    shape = T.TINY if args.tiny else T.QWEN25_05B
    report = C.report_header("shared_prompts", vars(args))
    report["device"] = str(device)
    batches = [
        make_batch(
            args.groups, args.group_size, args.prompt_len, args.tail_len, args.response_len, shape["vocab_size"], seed
        )
        for seed in range(args.warmup + args.steps)
    ]
    report["tokens_per_step"] = [sum(len(s.prompt_ids) + len(s.response_ids) for s in b) for b in batches]
    settings = TrainerSettings(
        lr=0.0,
        device=str(device),
        max_tokens_per_gpu=args.max_tokens,
        recompute_layers=True,
        loss=LossSettings(kl_loss_coef=0.1, kl_loss_type="k3"),
    )
    configs = [
        (share, compiled)
        for compiled in ((False, True) if device.type == "cuda" else (False,))
        for share in (False, True)
        if config_name(share, compiled) in args.configs
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = T.build_model_dir(shape, Path(tmp) / "model", device)
        for share, compiled in configs:
            name = f"{'shared' if share else 'one row per sample'}, {'compiled' if compiled else 'eager'}"
            trainer = LocalTrainer(
                str(model_dir),
                dataclasses.replace(settings, share_prompt_forward=share, compile_layers=compiled),
                reference_path=str(model_dir),
            )
            graphs_before = compiled_graphs()
            times, metrics = [], []
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for i, batch in enumerate(batches):
                if i == args.warmup and device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                metrics.append(trainer.train_step(batch))
                T.sync(device)
                times.append(time.perf_counter() - t0)
            entry = {
                "name": name,
                "share_prompt_forward": share,
                "compiled": compiled,
                "step_s": statistics.median(times[args.warmup :]),
                "step_s_runs": times,
                "forward_tokens_per_step": metrics[-1].get("train/forward_tokens"),
                "first_loss": metrics[0]["train/loss"],
                "first_grad_norm": metrics[0]["train/grad_norm"],
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                "graphs_compiled": compiled_graphs() - graphs_before,
            }
            if args.profile and share and compiled == (device.type == "cuda"):
                entry["profile"] = T.profile_step(functools.partial(trainer.train_step, batches[-1]), device)
            results.append(entry)
            print(f"{name}: {entry['step_s']:.3f} s per step", flush=True)
            del trainer
            T.free(device)
    report["configs"] = results
    base = results[0]
    report["first_loss_max_rel_diff"] = max(
        abs(r["first_loss"] - base["first_loss"]) / max(abs(base["first_loss"]), 1e-9) for r in results
    )
    return report


def print_table(report: dict) -> None:
    rows = [
        (r["name"], r["step_s"], r["forward_tokens_per_step"], r["peak_gib"], r["first_loss"], r["graphs_compiled"])
        for r in report["configs"]
    ]
    print(C.table(rows, ["configuration", "step s", "tokens forwarded", "peak GiB", "first loss", "graphs"]))
    print(
        f"tokens per step (one row per sample): {report['tokens_per_step'][-1]:,}; "
        f"largest relative loss difference between configurations: {report['first_loss_max_rel_diff']:.2e}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model and a small batch")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=4600)
    p.add_argument(
        "--tail-len",
        type=int,
        default=2000,
        help="the end of each sample's prompt that is its own (a chain's attempts and grades); 0: one prompt per group",
    )
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens per micro-batch (--max-tokens-per-gpu)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="profile one more step of the shared rows")
    p.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(CONFIGS),
        help="which configurations to run (the compiled ones on CUDA only)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.groups, args.group_size, args.prompt_len, args.tail_len, args.response_len = 2, 4, 96, 24, 8
        args.max_tokens = min(args.max_tokens, 512)
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    path = C.write_json(report, args.out or C.default_out("shared_prompts" + ("_tiny" if args.tiny else "")))
    print_table(report)
    print(f"json: {path}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
