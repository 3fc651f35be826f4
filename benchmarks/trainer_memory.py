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

SHAPES = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=8192, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True),
}  # fmt: skip
SETTINGS = {
    "micro_batch_all": dict(max_tokens_per_gpu=None, recompute_layers=False),
    "dynamic_tokens": dict(max_tokens_per_gpu="budget", recompute_layers=False),
    "dynamic_tokens_recompute": dict(max_tokens_per_gpu="budget", recompute_layers=True),
}


def one(args: argparse.Namespace) -> dict:
    """One configuration, in this process: build, one warm-up step, `--steps` timed steps."""
    import torch
    from trainer import build_model_dir, make_samples

    from slime_meta.backends.local.trainer import LocalTrainer, TrainerSettings

    device = torch.device(args.device)
    setting = dict(SETTINGS[args.setting])
    if setting["max_tokens_per_gpu"] == "budget":
        setting["max_tokens_per_gpu"] = args.max_tokens_per_gpu
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(shape, Path(tmp) / "model", device)
        samples = make_samples(args.batch, args.seq, args.prompt_len, shape["vocab_size"], seed=0)
        settings = TrainerSettings(lr=1e-6, micro_batch_size=args.batch, device=device.type, **setting)
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
            return {"shape": args.shape, "setting": args.setting, "oom": True, "error": str(error).splitlines()[0][:200]}
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        reserved = torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None
        params = sum(p.numel() for p in trainer.model.parameters()) if hasattr(trainer, "model") else None
    timed = times[1:] or times
    return {"shape": args.shape, "setting": args.setting, "oom": False, "params": params,
            "peak_allocated_gib": peak, "peak_reserved_gib": reserved, "step_s": sum(timed) / len(timed),
            "first_step_s": times[0], **{k: v for k, v in setting.items()}}  # fmt: skip


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
    p.add_argument("--one", nargs=2, metavar=("SHAPE", "SETTING"), help=argparse.SUPPRESS)  # a child's own run
    args = p.parse_args(argv)
    if args.tiny:
        args.shapes, args.seq, args.prompt_len, args.batch, args.max_tokens_per_gpu = ["tiny"], 256, 192, 4, 512
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.one:
        args.shape, args.setting = args.one
        print(json.dumps(one(args)))
        return []
    rows = []
    for shape in args.shapes:
        for setting in args.settings:
            child = [sys.executable, __file__, "--one", shape, setting, "--device", args.device, "--seq", str(args.seq),
                     "--prompt-len", str(args.prompt_len), "--batch", str(args.batch),
                     "--max-tokens-per-gpu", str(args.max_tokens_per_gpu), "--steps", str(args.steps)]  # fmt: skip
            done = subprocess.run(child, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            rows.append(json.loads(lines[-1]) if lines else
                        {"shape": shape, "setting": setting, "failed": done.stderr.strip().splitlines()[-1:]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    report = {"benchmark": "trainer_memory", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(["benchmarks/trainer_memory.py", *(argv if argv is not None else sys.argv[1:])]),
              "seq": args.seq, "prompt_len": args.prompt_len, "batch": args.batch,
              "max_tokens_per_gpu": args.max_tokens_per_gpu, "rows": rows}  # fmt: skip
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
