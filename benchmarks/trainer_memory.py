"""Trainer memory: peak GPU memory and step time of one local-backend train step, per memory setting.

    python benchmarks/trainer_memory.py --out runs/trainer_memory.json            # GPU: 0.5B and 1.5B shapes
    python benchmarks/trainer_memory.py --tiny --device cpu                       # a toy model: the script runs

Each configuration runs in a fresh process (the caching allocator keeps what an earlier one
reserved), on a random-init Qwen2-shaped model in bf16 weights with fp32 master copies as the
trainer keeps them, on `--batch` teacher sequences of `--seq` tokens (`--prompt-len` of them
prompt). Settings: a fixed micro-batch of `--batch` sequences (the old default behaviour at this
batch), micro-batches packed to `--max-tokens-per-gpu` padded tokens (`--use-dynamic-batch-size`),
and the same with activation checkpointing (`--recompute-granularity full`). A configuration that
runs out of memory is reported as such. Table last, JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _common as C  # noqa: E402

SHAPES = {
    "0.5B": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
}
SETTINGS = {
    "micro_batch_all": dict(max_tokens_per_gpu=None, recompute_layers=False),
    "dynamic_tokens": dict(max_tokens_per_gpu="budget", recompute_layers=False),
    "dynamic_tokens_recompute": dict(max_tokens_per_gpu="budget", recompute_layers=True),
}


def one(args: argparse.Namespace) -> dict:
    """One configuration, in this process: build, one warm-up step, `--steps` timed steps."""
    import torch
    from trainer import build_model_dir, make_samples

    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer

    device = torch.device(args.device)
    setting = dict(SETTINGS[args.setting])
    if setting["max_tokens_per_gpu"] == "budget":
        setting["max_tokens_per_gpu"] = args.max_tokens_per_gpu
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(shape, Path(tmp) / "model", device)
        samples = make_samples(args.batch, args.seq, args.prompt_len, shape["vocab_size"], seed=0)
        # Each setting as named, on the CPU too (where the trainer would otherwise always recompute).
        settings = TrainerSettings(
            lr=1e-6,
            micro_batch_size=args.batch,
            device=device.type,
            recompute_on_cpu=setting["recompute_layers"],
            **setting,
        )
        try:
            trainer = LocalTrainer(str(model_dir), settings)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for step in range(1 + args.steps):
                started = time.perf_counter()
                trainer.train_step(samples, step=step)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
        except torch.OutOfMemoryError as error:
            first_line = str(error).splitlines()[0][:200]
            return {"shape": args.shape, "setting": args.setting, "oom": True, "error": first_line}
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        reserved = torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None
        params = sum(p.numel() for p in trainer.model.parameters()) if hasattr(trainer, "model") else None
    timed = times[1:] or times
    return {
        "shape": args.shape,
        "setting": args.setting,
        "oom": False,
        "params": params,
        "peak_allocated_gib": peak,
        "peak_reserved_gib": reserved,
        "step_s": sum(timed) / len(timed),
        "first_step_s": times[0],
        **{k: v for k, v in setting.items()},
    }


def default_step_samples(cfg, vocab: int, teacher_prompt: tuple[int, int], teacher_response: int, seed: int = 0):
    """One outer step's trainer inputs at `cfg`'s batch shape: a teacher sample per trained info
    (groups x G, x K with --train-all-inner-steps), prompts spread over `teacher_prompt` tokens and
    `teacher_response`-token infos; with a solver channel on, the chains' m no-info attempts at each
    train problem (160-token prompts, answers spread up to --rollout-max-response-len). Random ids;
    half the advantages positive, half negative (a step with signal)."""
    import torch

    from slime_meta.data.batch_split import plan_batch
    from slime_meta.types import SolverSample, TeacherSample

    m = cfg.meta
    plan = plan_batch(
        rollout_batch_size=m.rollout_batch_size,
        train_ratio=m.inner_loop_train_ratio,
        heldout_ipb=m.heldout_ipb,
        problems_per_prompt=m.n_problems_per_prompt,
    )
    G = m.n_samples_per_prompt
    chains = plan.groups * G
    infos = chains * (m.num_inner_iterations if m.train_all_inner_steps else 1)
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(4, vocab, (n,), generator=g).tolist())

    def logps(n: int) -> tuple[float, ...]:
        return tuple((-torch.rand(n, generator=g) * 3).tolist())

    low, high = teacher_prompt
    teacher = []
    for i in range(infos):
        prompt = low + (high - low) * i // max(infos - 1, 1)
        teacher.append(
            TeacherSample(
                ids(prompt),
                ids(teacher_response),
                logps(teacher_response),
                reward=float(i % 2),
                advantage=1.0 if i % 2 else -1.0,
                group_index=i // G,
                sample_index=i % G,
                inner_iteration=0,
            )
        )
    solver = []
    if cfg.objectives.needs_solver_samples:
        attempts = chains * m.n_problems_per_prompt * m.n_samples_per_inner_prompt
        longest = cfg.sampling.rollout_max_response_len
        for i in range(attempts):
            n = longest // 4 + (longest - longest // 4) * i // max(attempts - 1, 1)
            solver.append(
                SolverSample(
                    problem_uid=str(i // m.n_samples_per_inner_prompt),
                    prompt_ids=ids(160),
                    response_ids=ids(n),
                    rollout_logprobs=logps(n),
                    temperature=cfg.sampling.rollout_temperature,
                    grade=float(i % 2),
                    task_advantage=1.0 if i % 2 else -1.0,
                    prompt_text="",
                    solution_text="",
                )
            )
    return teacher, solver


def _tokens(samples) -> int:
    return sum(len(x.prompt_ids) + len(x.response_ids) for x in samples)


def real_model_step(args: argparse.Namespace, name: str, flags: str) -> dict:
    """One configuration of the real model in this process: the trainer train.py builds, `--steps` steps."""
    import resource
    import shlex

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from slime_meta.backends.local.training.setup import make_trainer
    from slime_meta.config.arguments import parse_config

    base = ["--use-meta-learning", "--prompt-data", "data/math_word_problems.jsonl", "--hf-checkpoint", args.model_path]
    cfg = parse_config(base + shlex.split(flags))
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    vocab = AutoConfig.from_pretrained(args.model_path).vocab_size
    prompts = (args.teacher_prompt_min, args.teacher_prompt_max)
    teacher, solver = default_step_samples(cfg, vocab, prompts, args.teacher_response)
    started = time.perf_counter()
    trainer = make_trainer(cfg, args.model_path, tokenizer)
    load_s, loaded_mib = time.perf_counter() - started, C.status_mib("VmRSS")
    steps = []
    for step in range(args.steps):
        started, cpu_started = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
        metrics = trainer.train_step(teacher, solver, (), step=step)
        steps.append(
            {
                "step_s": time.perf_counter() - started,
                "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu_started,
                "peak_rss_mib": C.status_mib("VmHWM"),
                "loss": metrics.get("loss/total"),
                "grad_norm": metrics.get("train/grad_norm"),
            }
        )
    t = trainer.settings
    return {
        "config": name,
        "flags": flags,
        "threads": torch.get_num_threads(),
        "load_s": load_s,
        "rss_after_load_mib": loaded_mib,
        "peak_rss_mib": C.status_mib("VmHWM"),
        "steps": steps,
        "teacher_samples": len(teacher),
        "teacher_tokens": _tokens(teacher),
        "solver_samples": len(solver),
        "solver_tokens": _tokens(solver),
        "micro_batch_size": t.micro_batch_size,
        "max_tokens_per_gpu": t.max_tokens_per_gpu,
        "recompute_layers": getattr(trainer, "recomputes_layers", t.recompute_layers),
        "kl_loss_coef": t.loss.kl_loss_coef,
        "adv_tau": t.distill.adv_tau,
    }


def real_model_main(args: argparse.Namespace) -> list[dict]:
    """Each `--flags` configuration in a fresh process (peak RSS is per process); table last."""
    from _common import machine_info

    configs = dict(item.split("=", 1) for item in args.flags) if args.flags else {"defaults": ""}
    rows = []
    for name, flags in configs.items():
        child = [
            sys.executable,
            __file__,
            "--model-path",
            args.model_path,
            "--one-real",
            name,
            f"--one-real-flags={flags}",
            "--steps",
            str(args.steps),
            "--teacher-prompt-min",
            str(args.teacher_prompt_min),
            "--teacher-prompt-max",
            str(args.teacher_prompt_max),
            "--teacher-response",
            str(args.teacher_response),
        ]
        done = subprocess.run(child, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        failed = {
            "config": name,
            "flags": flags,
            "returncode": done.returncode,
            "failed": done.stderr.strip().splitlines()[-3:],
        }
        rows.append(json.loads(lines[-1]) if lines else failed)
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "benchmark": "trainer_memory_real_model",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["benchmarks/trainer_memory.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "model_path": args.model_path,
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'config':>16} {'peak RSS GiB':>12} {'after load':>10} {'step s (CPU s)':>24}")
    for r in rows:
        if r.get("failed"):
            print(f"{r['config']:>16} {'failed (exit ' + str(r['returncode']) + ')':>12}")
            continue
        times = " ".join(f"{s['step_s']:.0f} ({s.get('cpu_s', float('nan')):.0f})" for s in r["steps"])
        peak, loaded = r["peak_rss_mib"] / 1024, r["rss_after_load_mib"] / 1024
        print(f"{r['config']:>16} {peak:>12.2f} {loaded:>10.2f} {times:>24}")
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", nargs="+", default=["0.5B", "1.5B"], choices=sorted(SHAPES))
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seq", type=int, default=4096, help="tokens per teacher sequence (prompt + response)")
    p.add_argument("--prompt-len", type=int, default=3584, help="prompt part of each sequence (no loss there)")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the toy shape, 4 sequences of 256 tokens")
    p.add_argument("--out", default=None)
    real = p.add_argument_group("real model on CPU (--model-path)")
    real.add_argument(
        "--model-path", default=None, help="an HF checkpoint directory: the trainer at train.py's defaults, on the CPU"
    )
    real.add_argument(
        "--flags",
        nargs="+",
        default=None,
        metavar="NAME=FLAGS",
        help="configurations: a name and extra train.py flags each (default: defaults=)",
    )
    real.add_argument("--teacher-prompt-min", type=int, default=1024)
    real.add_argument("--teacher-prompt-max", type=int, default=2048)
    real.add_argument("--teacher-response", type=int, default=128)
    real.add_argument("--one-real", default=None, help=argparse.SUPPRESS)  # a child's own run: its name
    real.add_argument("--one-real-flags", default="", help=argparse.SUPPRESS)  # and its flags
    p.add_argument("--one", nargs=2, metavar=("SHAPE", "SETTING"), help=argparse.SUPPRESS)  # a child's own run
    args = p.parse_args(argv)
    if args.tiny:
        args.shapes, args.seq, args.prompt_len, args.batch, args.max_tokens_per_gpu = ["tiny"], 256, 192, 4, 512
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.one_real:
        print(json.dumps(real_model_step(args, args.one_real, args.one_real_flags)))
        return []
    if args.model_path:
        return real_model_main(args)
    if args.one:
        args.shape, args.setting = args.one
        print(json.dumps(one(args)))
        return []
    rows = []
    for shape in args.shapes:
        for setting in args.settings:
            child = [
                sys.executable,
                __file__,
                "--one",
                shape,
                setting,
                "--device",
                args.device,
                "--seq",
                str(args.seq),
                "--prompt-len",
                str(args.prompt_len),
                "--batch",
                str(args.batch),
                "--max-tokens-per-gpu",
                str(args.max_tokens_per_gpu),
                "--steps",
                str(args.steps),
            ]
            done = subprocess.run(child, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            failed = {"shape": shape, "setting": setting, "failed": done.stderr.strip().splitlines()[-1:]}
            rows.append(json.loads(lines[-1]) if lines else failed)
            print(json.dumps(rows[-1]), flush=True)
    report = {
        "benchmark": "trainer_memory",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["benchmarks/trainer_memory.py", *(argv if argv is not None else sys.argv[1:])]),
        "seq": args.seq,
        "prompt_len": args.prompt_len,
        "batch": args.batch,
        "max_tokens_per_gpu": args.max_tokens_per_gpu,
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'shape':>6} {'setting':>26} {'peak GiB':>9} {'reserved':>9} {'step s':>7}")
    for r in rows:
        if r.get("oom") or r.get("failed"):
            print(f"{r['shape']:>6} {r['setting']:>26} {'OOM' if r.get('oom') else 'failed':>9}")
        else:
            peak = "-" if r["peak_allocated_gib"] is None else f"{r['peak_allocated_gib']:.1f}"
            reserved = "-" if r["peak_reserved_gib"] is None else f"{r['peak_reserved_gib']:.1f}"
            print(f"{r['shape']:>6} {r['setting']:>26} {peak:>9} {reserved:>9} {r['step_s']:>7.2f}")
    return rows


if __name__ == "__main__":
    main()
