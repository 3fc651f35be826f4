"""Losses: forward + backward of the JSD alone and of the 3-channel loss, against a naive reference.

    python benchmarks/losses.py                      # 8,192 tokens x vocab 151,936, bf16 (GPU)
    python benchmarks/losses.py --tiny --device cpu  # a toy size, to check the script runs

Implementations, all at the same size in one run:
- naive: float32 over the full vocabulary, TRL GKD style (upcast both logits, log_softmax both,
  mixture by logsumexp, elementwise KL, sum, mean); for the 3-channel loss the same style for the
  token log-probs (log_softmax + gather), the PPO-clip GRPO term and the DPO term.
- project: `slime_meta.losses` as callers use it, default backend ("auto": the fused Triton
  kernels on CUDA when Triton imports, the torch code otherwise): `generalized_jsd`; for the
  3-channel loss `sequence_logps` + `generalized_jsd` (two calls, two gradient tensors) and
  `token_logps_and_jsd` (one call, one gradient write), each with `policy_loss`, `dpo_loss` and
  `total_loss`.
- project torch code: the same functions with `backend="torch"` (chunked, `--chunk-sizes`), the
  path taken on CPU, for `top_k`, or without Triton.

Correctness first: on fresh random logits each implementation's loss and student gradient are
compared with a float64 reference (textbook formulas in float64, chunked over rows with
activation checkpointing; written here, independent of the code under test), gradients on a
random subset of rows; every gradient must be finite; `correct` is true when the loss is within
1e-4 relative and the gradient within 1e-2 relative (bf16 rounding of the written gradient is
about 2e-3). Then timing on another draw: CUDA events, warm-up runs, the median of `--reps`;
peak memory beyond the inputs from `torch.cuda.max_memory_allocated` over one forward+backward
(the bf16 student gradient, which any implementation must write, is included).
The floor: bytes that must move (read student and teacher logits once, write the gradient once)
over the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch
import torch.nn.functional as F
from losses_reference import (  # noqa: E402
    ALPHA_SDPO,
    BETA_DPO,
    BETA_JSD,
    DPO_BETA,
    TEMPERATURE,
    reference_jsd64,
    reference_three_channel64,
)

from slime_meta.losses import fused
from slime_meta.losses.combine import ThreeChannelInputs, total_loss
from slime_meta.losses.distill import generalized_jsd, token_logps_and_jsd
from slime_meta.losses.policy import policy_loss
from slime_meta.losses.preference import dpo_loss
from slime_meta.losses.token_stats import sequence_logps

TARGETS = {"memory_vs_naive": 0.1, "time_vs_floor": 5.0}
CORRECT = {"loss_rel": 1e-4, "grad_rel": 1e-2}
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# ----------------------------------------------------------------------------- inputs


def make_inputs(n_tokens: int, vocab: int, batch: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Student and teacher logits (bf16, correlated like two nearby models), tokens, masks, old log-probs."""
    g = torch.Generator(device=device).manual_seed(seed)
    T = n_tokens // batch
    student = (torch.randn(batch, T, vocab, device=device, generator=g) * 2.0).to(torch.bfloat16)
    teacher = (student.float() + torch.randn(batch, T, vocab, device=device, generator=g)).to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (batch, T), device=device, generator=g)
    mask = torch.ones(batch, T, dtype=torch.bool, device=device)
    advantages = torch.randn(batch, device=device, generator=g)
    ref_seq = torch.randn(batch, device=device, generator=g) * 10 - T * math.log(vocab)
    return {
        "student": student.requires_grad_(True),
        "teacher": teacher,
        "tokens": tokens,
        "mask": mask,
        "advantages": advantages,
        "ref_seq": ref_seq,
    }


def old_logps(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """Behaviour log-probs near the current ones (ratios near 1, some clipped): fixed per input."""
    if "old_logp" not in x:
        with torch.no_grad():
            logp = sequence_logps(
                x["student"], x["tokens"], x["mask"], chunk_size=256, backend="torch"
            ).token_logps.float()
            g = torch.Generator(device=logp.device).manual_seed(1)
            x["old_logp"] = logp + 0.1 * torch.randn(logp.shape, device=logp.device, generator=g)
    return x["old_logp"]


# ----------------------------------------------------------------------------- implementations


def naive_jsd(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    beta: float = BETA_JSD,
    logp_s: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-vocabulary float32, every intermediate materialised (the TRL GKD way)."""
    if logp_s is None:
        logp_s = F.log_softmax(student.float() / TEMPERATURE, dim=-1)
    logp_t = F.log_softmax(teacher.float() / TEMPERATURE, dim=-1)
    logp_m = torch.logsumexp(torch.stack([logp_s + math.log(1 - beta), logp_t + math.log(beta)]), dim=0)
    kl_t = F.kl_div(logp_m, logp_t, reduction="none", log_target=True)
    kl_s = F.kl_div(logp_m, logp_s, reduction="none", log_target=True)
    per_token = (beta * kl_t + (1 - beta) * kl_s).sum(-1)
    return (per_token * mask).sum() / mask.sum()


def naive_three_channel(x: dict[str, torch.Tensor]) -> torch.Tensor:
    logp_full = F.log_softmax(x["student"].float() / TEMPERATURE, dim=-1)
    logp = logp_full.gather(-1, x["tokens"].unsqueeze(-1)).squeeze(-1)
    mask = x["mask"].float()
    ratio = torch.exp(logp - old_logps(x))
    adv = x["advantages"].unsqueeze(1)
    pg = torch.maximum(-ratio * adv, -torch.clamp(ratio, 0.8, 1.2) * adv)
    grpo = (pg * mask).sum() / mask.sum()
    jsd = naive_jsd(x["student"], x["teacher"], mask, logp_s=logp_full)
    seq = (logp * mask).sum(1)
    half = seq.shape[0] // 2
    delta = (seq[:half] - x["ref_seq"][:half]) - (seq[half:] - x["ref_seq"][half:])
    dpo = -F.logsigmoid(DPO_BETA * delta).mean()
    return grpo + ALPHA_SDPO * jsd + BETA_DPO * dpo


def project_jsd(chunk: int | None, backend: str = "auto") -> Callable[[dict], torch.Tensor]:
    def run(x: dict) -> torch.Tensor:
        return generalized_jsd(
            x["student"],
            x["teacher"],
            x["mask"],
            beta=BETA_JSD,
            temperature=TEMPERATURE,
            chunk_size=chunk,
            backend=backend,
        ).loss

    return run


def _three_channel_total(
    x: dict, token_logps_B_T: torch.Tensor, seq_logps_B: torch.Tensor, sdpo: torch.Tensor
) -> torch.Tensor:
    grpo = policy_loss(token_logps_B_T, old_logps(x), x["advantages"], x["mask"], eps_clip=0.2).loss
    half = seq_logps_B.shape[0] // 2
    dpo = dpo_loss(seq_logps_B[:half], seq_logps_B[half:], x["ref_seq"][:half], x["ref_seq"][half:], beta=DPO_BETA).loss
    return total_loss(
        ThreeChannelInputs(grpo=grpo, sdpo_jsd=sdpo, replay_dpo=dpo), alpha=ALPHA_SDPO, beta=BETA_DPO
    ).loss


def project_three_channel(chunk: int | None, backend: str = "auto"):
    """`sequence_logps` and `generalized_jsd`: two calls over the same logits."""

    def run(x: dict) -> torch.Tensor:
        logps = sequence_logps(
            x["student"], x["tokens"], x["mask"], temperature=TEMPERATURE, chunk_size=chunk, backend=backend
        )
        sdpo = project_jsd(chunk, backend)(x)
        return _three_channel_total(x, logps.token_logps, logps.seq_logps, sdpo)

    return run


def project_three_channel_combined(x: dict) -> torch.Tensor:
    """`token_logps_and_jsd`: one call, one gradient write on the fused path."""
    logps, jsd = token_logps_and_jsd(
        x["student"], x["teacher"], x["tokens"], x["mask"], beta=BETA_JSD, temperature=TEMPERATURE
    )
    return _three_channel_total(x, logps.token_logps, logps.seq_logps, jsd.loss)


# ----------------------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def forward_backward(fn: Callable[[dict], torch.Tensor], x: dict) -> torch.Tensor:
    x["student"].grad = None
    loss = fn(x)
    loss.backward()
    return loss.detach()


def float64_reference(fn64: Callable[[dict], torch.Tensor], x: dict, rows: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The loss and the gradient's `rows` (flattened token rows) in float64."""
    x64 = {k: (v.detach().double() if v.is_floating_point() else v) for k, v in x.items() if k != "old_logp"}
    x64["student"].requires_grad_(True)
    if "old_logp" in x:
        x64["old_logp"] = x["old_logp"].double()
    loss = fn64(x64)
    loss.backward()
    V = x64["student"].shape[-1]
    grad_rows = x64["student"].grad.reshape(-1, V).index_select(0, rows).clone()
    value = float(loss.detach())
    del x64, loss
    return value, grad_rows


def check(
    fn: Callable[[dict], torch.Tensor], x: dict, ref_loss: float, ref_rows: torch.Tensor, rows: torch.Tensor
) -> dict:
    loss = forward_backward(fn, x)
    grad = x["student"].grad
    V = grad.shape[-1]
    finite = bool(torch.isfinite(grad).all())
    got = grad.reshape(-1, V).index_select(0, rows).double()
    x["student"].grad = None
    diff = got - ref_rows
    grad_rel = float(diff.norm() / ref_rows.norm().clamp_min(1e-300))
    loss_abs = abs(float(loss) - ref_loss)
    return {
        "correct": finite
        and loss_abs <= CORRECT["loss_rel"] * max(1.0, abs(ref_loss))
        and grad_rel <= CORRECT["grad_rel"],
        "loss": float(loss),
        "loss_abs_err": loss_abs,
        "grad_max_abs_err": float(diff.abs().max()),
        "grad_rel_err": grad_rel,
        "grad_max_abs_ref": float(ref_rows.abs().max()),
        "grad_finite": finite,
    }


def measure(fn: Callable[[dict], torch.Tensor], x: dict, device: torch.device, warmup: int, reps: int) -> dict:
    free(device)
    x["student"].grad = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    forward_backward(fn, x)
    sync(device)
    peak = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else None
    for _ in range(warmup):
        forward_backward(fn, x)
    times = []
    for _ in range(reps):
        x["student"].grad = None
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward_backward(fn, x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            forward_backward(fn, x)
            times.append(1000 * (time.perf_counter() - t0))
    x["student"].grad = None
    return {"ms": statistics.median(times), "ms_runs": times, "peak_extra_bytes": peak}


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    report = C.report_header("losses", {k: v for k, v in vars(args).items() if k != "out"})
    report["device"] = str(device)
    logits_bytes = args.tokens * args.vocab * 2
    bandwidth = copy_bandwidth(device, min(2 * 2**30, max(2**26, logits_bytes)))
    floor_ms = 1000 * 3 * logits_bytes / bandwidth
    report.update(copy_bandwidth_tb_s=bandwidth / 1e12, logits_gb=logits_bytes / 1e9, floor_ms=floor_ms)
    print(
        f"  copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
        f"floor {floor_ms:.2f} ms for {logits_bytes / 1e9:.2f} GB of logits",
        file=sys.stderr,
    )

    kernels = device.type == "cuda" and fused.kernels_usable(torch.empty(1, device=device))
    report["fused_kernels"] = kernels
    if device.type == "cuda" and not kernels:
        print(f"  fused kernels unavailable: {getattr(fused.kernels, 'import_error', '?')}", file=sys.stderr)
    project = "project (fused kernel)" if kernels else "project (torch code: no kernels here)"
    groups: dict[str, list[tuple[str, Callable, Callable]]] = {"jsd": [], "three_channel": []}
    groups["jsd"].append(
        ("naive fp32 (TRL GKD style)", lambda x: naive_jsd(x["student"], x["teacher"], x["mask"]), None)
    )
    groups["three_channel"].append(("naive fp32", naive_three_channel, None))
    groups["jsd"].append((f"{project} generalized_jsd", project_jsd(None), None))
    groups["three_channel"].append(
        (f"{project} token_logps_and_jsd, one gradient", project_three_channel_combined, None)
    )
    groups["three_channel"].append((f"{project} sequence_logps + generalized_jsd", project_three_channel(None), None))
    for chunk in args.chunk_sizes:
        groups["jsd"].append((f"project torch code chunk={chunk}", project_jsd(chunk, "torch"), None))
        groups["three_channel"].append(
            (f"project torch code chunk={chunk}", project_three_channel(chunk, "torch"), None)
        )
    references = {"jsd": reference_jsd64, "three_channel": reference_three_channel64}

    results: dict[str, Any] = {}
    for group, impls in groups.items():
        # correctness on one draw, against float64
        x = make_inputs(args.tokens, args.vocab, args.batch, device, seed=args.seed)
        if group == "three_channel":
            old_logps(x)
        rows = torch.randperm(args.tokens, generator=torch.Generator().manual_seed(args.seed))[: args.check_rows].to(
            device
        )
        ref_loss, ref_rows = float64_reference(references[group], x, rows)
        free(device)
        checks = {}
        for name, fn, _ in impls:
            try:
                checks[name] = check(fn, x, ref_loss, ref_rows, rows)
            except OOM as error:
                checks[name] = {"error": f"out of memory: {str(error)[:160]}"}
            free(device)
            print(f"  [{group}] check {name}: {checks[name]}", file=sys.stderr, flush=True)
        del x, ref_rows
        free(device)
        # timing and memory on a fresh draw
        x = make_inputs(args.tokens, args.vocab, args.batch, device, seed=args.seed + 1)
        if group == "three_channel":
            old_logps(x)
        entries = {}
        for name, fn, _ in impls:
            entry: dict[str, Any] = {"check": checks[name]}
            if "error" not in checks[name]:
                try:
                    entry.update(measure(fn, x, device, args.warmup, args.reps))
                    entry["x_floor"] = entry["ms"] / floor_ms
                except OOM as error:
                    entry["error"] = f"out of memory: {str(error)[:160]}"
            entries[name] = entry
            free(device)
            print(
                f"  [{group}] time {name}: {entry.get('ms')} ms, peak extra {entry.get('peak_extra_bytes')}",
                file=sys.stderr,
                flush=True,
            )
        naive = next(iter(entries.values()))
        for entry in entries.values():
            if entry.get("peak_extra_bytes") is not None and naive.get("peak_extra_bytes"):
                entry["memory_vs_naive"] = entry["peak_extra_bytes"] / naive["peak_extra_bytes"]
            if entry.get("ms") and naive.get("ms"):
                entry["speedup_vs_naive"] = naive["ms"] / entry["ms"]
        results[group] = entries
        del x
        free(device)
    report["results"] = results
    report["targets"] = TARGETS
    report["all_correct"] = all(e["check"].get("correct", False) for g in results.values() for e in g.values())
    report["meets"] = {
        group: {
            name: {
                "time_vs_floor": e.get("x_floor") is not None and e["x_floor"] <= TARGETS["time_vs_floor"],
                "memory_vs_naive": e.get("memory_vs_naive") is not None
                and e["memory_vs_naive"] <= TARGETS["memory_vs_naive"],
            }
            for name, e in entries.items()
            if name.startswith("project (fused")
        }
        for group, entries in results.items()
    }
    return report


def print_table(report: dict) -> None:
    rows = []
    for group, entries in report["results"].items():
        for i, (name, e) in enumerate(entries.items()):
            c = e["check"]
            peak = e.get("peak_extra_bytes")
            rows.append(
                [
                    group if i == 0 else "",
                    name,
                    e.get("ms"),
                    e.get("x_floor"),
                    None if peak is None else peak / 1e9,
                    e.get("memory_vs_naive"),
                    c.get("loss_abs_err"),
                    c.get("grad_max_abs_err"),
                    c.get("grad_rel_err"),
                    e.get("error") or c.get("error") or ("" if c.get("correct") else "INCORRECT"),
                ]
            )
    st = report["settings"]
    print(
        f"\nlosses: {st['tokens']} tokens x vocab {st['vocab']}, bf16 logits ({report['logits_gb']:.2f} GB each), "
        f"{report['device']}; floor {report['floor_ms']:.2f} ms at {report['copy_bandwidth_tb_s']:.2f} TB/s; "
        f"errors vs float64 ({st['check_rows']} gradient rows)"
    )
    print(
        C.table(
            rows,
            [
                "loss",
                "implementation",
                "fwd+bwd ms",
                "x floor",
                "extra GB",
                "mem/naive",
                "loss err",
                "grad max err",
                "grad rel err",
                "note",
            ],
        )
    )
    print(f"all correct: {report['all_correct']}; meets: {report['meets']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=8, help="sequences (the 3-channel loss pairs them for DPO)")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[256], help="chunk sizes of the torch code measured")
    p.add_argument("--check-rows", type=int, default=256, help="gradient rows compared with float64")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="256 tokens x vocab 2048: checks the script runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.vocab, args.chunk_sizes, args.check_rows, args.reps, args.warmup = 256, 2048, [64], 32, 2, 1
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    path = C.write_json(report, args.out or C.default_out("losses" + ("_tiny" if args.tiny else "")))
    print_table(report)
    print(f"json: {path}")
    return report


if __name__ == "__main__":
    main()
