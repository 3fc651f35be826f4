"""Trainer: local-backend train steps on a Qwen2.5-0.5B-shaped model, tokens/s and MFU.

    python benchmarks/trainer.py                      # GPU: 8 sequences x 2048 tokens per step, bf16
    python benchmarks/trainer.py --tiny --device cpu  # a toy model, to check the script runs

Model: random init from Qwen2.5-0.5B's configuration (24 layers, hidden 896, 14 heads / 2 KV
heads, FFN 4864, vocab 151,936, tied embeddings; 494M parameters), saved once and loaded by
each configuration. In one run, each with float32 master weights and bf16 autocast:
- plain: HF `model(input_ids, labels=...)` + `torch.optim.AdamW`, the whole batch at once;
- LocalTrainer: the project's `LocalTrainer.train_step` on `TeacherSample`s (prompt + response
  ids, behaviour log-probs, advantages) at each `--micro-batches` size, and with its decoder
  layers compiled (`compile_layers=True`, `--compile-layers` in train.py) at each
  `--compile-micro-batches` size (GPU only). `warmup_s` is the first step's time (the compile
  falls there; the timed steps follow it). After the timed steps
  of the compiled micro-batch `--shape-change-micro`, steps on new sequence lengths (equal, then
  padded) show what recompiling costs (`shape_changes`).
tokens/s counts every token of every sequence; MFU = tokens/s x FLOPs per token / the bf16
matmul rate measured on the same card in the same run (an 8192^3 product), with FLOPs per token
= 6 N (N: parameters in matmuls; the tied embedding counted once, as the output projection) +
6 L T d (attention scores and values, causal: half of 12 L T d). LocalTrainer projects only the
response positions onto the vocabulary (the prompt's logits are never needed), so it executes
fewer FLOPs than that count: `hfu` divides the FLOPs it executes instead.
Peak memory: the largest `torch.cuda.max_memory_allocated` over the timed steps (weights and
optimizer state included).
Correctness first: every configuration's loss and gradient norm must be finite; LocalTrainer's
PPO loss and pre-clip gradient norm (learning rate 0) must match a reference step written here
(full float32 logits / temperature, logsumexp, gather, the project's `policy_loss`) on the same
batch and weights within bf16 noise (2e-2 relative), and every LocalTrainer configuration's
first step must match the others' (same weights, same batch).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch
from model_shapes import QWEN25_05B  # noqa: F401 (shared_prompts.py reads T.QWEN25_05B)
from trainer_profile import profile_step, sync  # noqa: F401 (shared_prompts.py reads T.profile_step)

TARGETS = {"mfu": 0.45, "memory_vs_plain": 0.6}
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    hidden_act="silu",
)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_peak(device: torch.device, n: int) -> float:
    """bf16 matmul FLOP/s on random data (median of 10 after 3 warm-ups)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * n**3 / statistics.median(times)


def build_model_dir(shape: dict, out: Path, device: torch.device) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with device:  # random init on the device: seconds instead of a minute on the CPU
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.to(torch.bfloat16).save_pretrained(out)
    del model
    return out


def flops_per_token(model: torch.nn.Module, seq: int) -> tuple[float, int]:
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())  # tied weights appear once
    attn_width = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    return 6.0 * params + 6.0 * cfg.num_hidden_layers * seq * attn_width, params


def make_samples(n: int, seq: int, prompt_len: int, vocab: int, seed: int):
    from slime_meta.types import TeacherSample

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, seq), generator=g)
    response = seq - prompt_len
    samples = []
    for i in range(n):
        logp = (-torch.rand(response, generator=g) * 3).tolist()
        samples.append(
            TeacherSample(
                prompt_ids=tuple(ids[i, :prompt_len].tolist()),
                response_ids=tuple(ids[i, prompt_len:].tolist()),
                rollout_logprobs=tuple(logp),
                reward=float(i % 2),
                advantage=1.0 if i % 2 else -1.0,
                group_index=i // 4,
                sample_index=i % 4,
                inner_iteration=0,
            )
        )
    return samples


def timed(
    step: Callable[[], dict], device: torch.device, warmup: int, steps: int, profile: bool = False
) -> dict[str, Any]:
    warmup_s = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        first = step()
        sync(device)
        warmup_s.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, metrics = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics.append(step())
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    out = {
        "step_s": statistics.median(times),
        "step_s_runs": times,
        "warmup_s": warmup_s,
        "peak_bytes": peak,
        "first_metrics": first if warmup else metrics[0],
        "last_metrics": metrics[-1],
    }
    if profile:
        out["profile"] = profile_step(step, device)
    return out


def reference_step(model: torch.nn.Module, samples, device: torch.device, micro: int) -> dict[str, float]:
    """The PPO loss and pre-clip gradient norm the textbook way: full float32 logits / temperature."""
    from slime_meta.losses.policy import policy_loss

    total = sum(len(s.response_ids) for s in samples)
    loss_sum = 0.0
    for start in range(0, len(samples), micro):
        chunk = samples[start : start + micro]
        tokens = torch.tensor([list(s.prompt_ids) + list(s.response_ids) for s in chunk], device=device)
        B, T = tokens.shape
        mask, rollout = torch.zeros(B, T - 1, device=device), torch.zeros(B, T - 1, device=device)
        for row, s in enumerate(chunk):
            cols = slice(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.response_ids))
            mask[row, cols] = 1.0
            rollout[row, cols] = torch.tensor(s.rollout_logprobs, device=device)
        advantages = torch.tensor([s.advantage for s in chunk], device=device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=tokens).logits[:, :-1]
        scaled = logits.float()  # temperature 1
        logp = scaled.gather(-1, tokens[:, 1:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        loss = policy_loss(logp, rollout, advantages, mask, eps_clip=0.2).loss
        share = float(mask.sum()) / total
        (loss * share).backward()
        loss_sum += float(loss.detach()) * share
        del logits, scaled, logp
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    model.zero_grad(set_to_none=True)
    return {"loss": loss_sum, "grad_norm": norm}


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer

    C.quiet_transformers()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    report = C.report_header("trainer", {k: v for k, v in vars(args).items() if k != "out"})
    report["device"] = str(device)
    peak = matmul_peak(device, args.matmul_n)
    report["matmul_peak_tflops"] = peak / 1e12
    print(f"  matmul peak {peak / 1e12:.0f} TFLOP/s", file=sys.stderr, flush=True)
    shape = TINY if args.tiny else QWEN25_05B
    tokens_per_step = args.batch * args.seq
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        model_dir = build_model_dir(shape, Path(tmp) / "model", device)
        samples = make_samples(args.batch, args.seq, args.prompt_len, shape["vocab_size"], seed=0)
        check_samples = make_samples(args.batch, args.seq, args.prompt_len, shape["vocab_size"], seed=1)

        def load() -> torch.nn.Module:
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()

        probe = load()
        fpt, n_params = flops_per_token(probe, args.seq)
        head_params = probe.get_output_embeddings().weight.numel()
        del probe
        # LocalTrainer runs the output projection on response positions only.
        response_share = (args.seq - args.prompt_len) / args.seq
        executed_fpt = fpt - 6.0 * head_params * (1.0 - response_share)
        report.update(
            flops_per_token=fpt,
            executed_flops_per_token_local_trainer=executed_fpt,
            params=n_params,
            tokens_per_step=tokens_per_step,
        )

        def finish(name: str, entry: dict, executed: float) -> None:
            entry["tokens_per_s"] = tokens_per_step / entry["step_s"]
            entry["mfu"] = entry["tokens_per_s"] * fpt / peak
            entry["hfu"] = entry["tokens_per_s"] * executed / peak
            results[name] = entry
            print(
                f"  {name}: {entry['tokens_per_s']:.0f} tok/s, MFU {entry['mfu']:.3f} (hfu {entry['hfu']:.3f}), peak "
                f"{(entry['peak_bytes'] or 0) / 1e9:.1f} GB, warm-up {entry['warmup_s']}",
                file=sys.stderr,
                flush=True,
            )
            if "profile" in entry:
                prof = entry["profile"]
                print(
                    f"    profiled step: wall {prof['wall_ms_profiled']:.0f} ms, "
                    f"kernels {prof['kernel_ms_total']:.0f} ms: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in prof["kernel_ms_by_category"].items()),
                    file=sys.stderr,
                )
                for r in prof["top_device"][:6]:
                    print(
                        f"      {r['self_device_ms']:8.1f} ms dev {r['self_cpu_ms']:8.1f} ms cpu "
                        f"{r['calls']:6d}x  {r['name']}",
                        file=sys.stderr,
                    )
                for r in prof["top_cpu"][:3]:
                    print(f"      cpu-top {r['self_cpu_ms']:8.1f} ms {r['calls']:6d}x  {r['name']}", file=sys.stderr)

        def attempt(name: str, fn: Callable[[], dict], executed: float) -> None:
            dynamo_counters = None
            if device.type == "cuda":
                from torch._dynamo.utils import counters as dynamo_counters

                dynamo_counters.clear()
            try:
                entry = fn()
                if dynamo_counters is not None:  # graphs compiled: one per distinct layer graph
                    entry["dynamo_stats"] = dict(dynamo_counters["stats"])
                finish(name, entry, executed)
            except OOM as error:
                results[name] = {"error": f"out of memory: {str(error)[:200]}"}
                print(f"  {name}: out of memory", file=sys.stderr, flush=True)
            except Exception as error:  # a compiler failure is a result, not a crash
                results[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
                print(f"  {name}: {results[name]['error']}", file=sys.stderr, flush=True)
            finally:
                free(device)
                if args.out:  # what is measured so far survives a timeout later on
                    C.write_json({**report, "results": results, "partial": True}, args.out)

        profile = device.type == "cuda" and not args.no_profile

        # plain HF + AdamW, the whole batch at once
        def plain() -> dict:
            model = load()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids) for s in samples], device=device)

            def step():
                with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return {"loss": float(loss.detach()), "grad_norm": float(norm)}

            return timed(step, device, args.warmup, args.steps, profile=profile and args.profile_plain)

        attempt("plain HF + AdamW", plain, fpt)

        # correctness: LocalTrainer against the reference step, same weights and batch, learning rate 0
        check: dict[str, Any] = {}
        try:
            reference = reference_step(load(), check_samples, device, args.check_micro)
            free(device)
            trainer = LocalTrainer(
                str(model_dir), TrainerSettings(lr=0.0, micro_batch_size=args.batch, device=device.type)
            )
            m_local = trainer.train_step(check_samples)
            del trainer
            check = {
                "reference_loss": reference["loss"],
                "reference_grad_norm": reference["grad_norm"],
                "local_trainer_pg_loss": m_local["train/pg_loss"],
                "local_trainer_grad_norm": m_local["train/grad_norm"],
            }
            check["loss_rel_diff"] = abs(m_local["train/pg_loss"] - reference["loss"]) / max(
                abs(reference["loss"]), 1e-12
            )
            check["grad_norm_rel_diff"] = (
                abs(m_local["train/grad_norm"] - reference["grad_norm"]) / reference["grad_norm"]
            )
            check["ok"] = check["loss_rel_diff"] < 2e-2 and check["grad_norm_rel_diff"] < 2e-2
        except OOM as error:
            check = {"error": f"out of memory: {str(error)[:200]}", "ok": False}
        free(device)
        report["check"] = check
        print(f"  check: {check}", file=sys.stderr, flush=True)

        def local(micro: int, compiled: bool) -> dict:
            settings = TrainerSettings(lr=1e-6, micro_batch_size=micro, device=device.type, compile_layers=compiled)
            trainer = LocalTrainer(str(model_dir), settings)
            entry = timed(
                lambda: trainer.train_step(samples),
                device,
                args.warmup,
                args.steps,
                profile=profile and (micro, compiled) in args.profile_configs,
            )
            if compiled and micro == args.shape_change_micro:
                try:
                    entry["shape_changes"] = shape_changes(trainer)
                except Exception as error:  # recorded; the timed figures above stand
                    entry["shape_changes"] = [{"error": f"{type(error).__name__}: {str(error)[:300]}"}]
            return entry

        def shape_changes(trainer) -> list[dict]:
            """Steps on new sequence lengths after the timed ones: what recompiling costs in a run."""
            from torch._dynamo.utils import counters as dynamo_counters

            vocab = shape["vocab_size"]
            plans = [
                ("all 1536", [1536] * args.batch),
                ("all 1792", [1792] * args.batch),
                ("mixed 1200-2048 (padded)", [2048 - 120 * i for i in range(args.batch)]),
                ("mixed 1100-1900 (padded)", [1900 - 110 * i for i in range(args.batch)]),
                ("all 2048 again", [args.seq] * args.batch),
            ]
            out = []
            for label, lengths in plans:
                batch = [make_samples(1, n, n // 2, vocab, seed=100 + i)[0] for i, n in enumerate(lengths)]
                t0 = time.perf_counter()
                metrics = trainer.train_step(batch)
                sync(device)
                out.append(
                    {
                        "lengths": label,
                        "step_s": time.perf_counter() - t0,
                        "unique_graphs_so_far": dynamo_counters["stats"].get("unique_graphs"),
                        "finite": metrics["train/grad_norm"] == metrics["train/grad_norm"],
                    }
                )
                print(f"    new shapes {label}: {out[-1]}", file=sys.stderr, flush=True)
            return out

        configs = [(m, False) for m in args.micro_batches]
        if device.type == "cuda" and not args.no_compile:  # last: a compile that overruns costs only itself
            configs += [(m, True) for m in args.compile_micro_batches]
        for micro, compiled in configs:
            name = f"LocalTrainer micro-batch {micro}" + (", compiled layers" if compiled else "")
            attempt(name, lambda micro=micro, compiled=compiled: local(micro, compiled), executed_fpt)

    plain_peak = results.get("plain HF + AdamW", {}).get("peak_bytes")
    firsts = []
    for name, entry in results.items():
        if entry.get("peak_bytes") and plain_peak:
            entry["memory_vs_plain"] = entry["peak_bytes"] / plain_peak
        metrics = [entry.get("first_metrics", {}), entry.get("last_metrics", {})]
        entry["finite"] = all(
            isinstance(v, float) and v == v and abs(v) != float("inf")
            for m in metrics
            for k, v in m.items()
            if k in ("loss", "grad_norm", "train/loss", "train/grad_norm")
        )
        if name.startswith("LocalTrainer") and "first_metrics" in entry:
            firsts.append((entry["first_metrics"]["train/loss"], entry["first_metrics"]["train/grad_norm"]))
    if firsts:  # every configuration's first step: same weights, same batch
        loss0, norm0 = firsts[0]
        check["configs_first_step_max_rel_diff"] = max(
            max(abs(loss - loss0) / max(abs(loss0), 1e-12), abs(norm - norm0) / max(norm0, 1e-12))
            for loss, norm in firsts
        )
        check["ok"] = check.get("ok", False) and check["configs_first_step_max_rel_diff"] < 2e-2
    report["results"] = results
    report["targets"] = TARGETS
    return report


def print_table(report: dict) -> None:
    rows = []
    for name, e in report["results"].items():
        peak = e.get("peak_bytes")
        rows.append(
            [
                name,
                e.get("tokens_per_s"),
                e.get("mfu"),
                e.get("hfu"),
                None if peak is None else peak / 1e9,
                e.get("memory_vs_plain"),
                (e.get("warmup_s") or [None])[0],
                e.get("error") or ("" if e.get("finite") else "NON-FINITE"),
            ]
        )
    st = report["settings"]
    print(
        f"\ntrainer: {'tiny' if st['tiny'] else 'Qwen2.5-0.5B'} shape ({report['params'] / 1e6:.0f}M params), "
        f"{st['batch']} x {st['seq']} tokens per step, {report['device']}; MFU against "
        f"{report['matmul_peak_tflops']:.0f} TFLOP/s measured; {report['flops_per_token'] / 1e9:.2f} GFLOP/token; "
        f"check: {report['check']}"
    )
    print(C.table(rows, ["step", "tokens/s", "MFU", "hfu", "peak GB", "mem/plain", "first step s", "note"]))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt part of each sequence (no loss there)")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[8, 4], help="LocalTrainer, eager layers")
    p.add_argument("--compile-micro-batches", type=int, nargs="+", default=[8, 4], help="LocalTrainer, compiled layers")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled configurations")
    p.add_argument(
        "--shape-change-micro",
        type=int,
        default=8,
        help="after this compiled configuration, steps on new sequence lengths (0: none)",
    )
    p.add_argument(
        "--profile-configs",
        type=lambda x: tuple(int(v) for v in x.split(",")),
        nargs="*",
        default=[(8, 1), (8, 0)],
        help="MICRO,COMPILED pairs profiled (one extra step each)",
    )
    p.add_argument("--profile-plain", action="store_true")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--check-micro", type=int, default=2, help="micro-batch of the float32-logits reference step")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.profile_configs = [(m, bool(c)) for m, c in args.profile_configs]
    if args.tiny:
        args.seq, args.prompt_len, args.batch, args.micro_batches, args.compile_micro_batches = 64, 32, 4, [4, 2], [4]
        args.matmul_n, args.check_micro, args.shape_change_micro = 256, 2, 0
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    path = C.write_json(report, args.out or C.default_out("trainer" + ("_tiny" if args.tiny else "")))
    print_table(report)
    print(f"json: {path}")
    return report


if __name__ == "__main__":
    main()
