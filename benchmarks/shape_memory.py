"""Host memory a process keeps for each new shape it runs: the worker's matmuls and attention at many
token counts, each count twice.

    python benchmarks/shape_memory.py                                   # one GPU, Qwen2.5-0.5B's shapes
    CUDA_MODULE_LOADING=EAGER python benchmarks/shape_memory.py         # every kernel loaded at start
    python benchmarks/shape_memory.py --ops attention --shapes 256      # attention alone
    python benchmarks/shape_memory.py --device cpu --shapes 16 --max-tokens 64 --out /tmp/s.json
    python benchmarks/shape_memory.py --ops gemm --memray /tmp/gemm.memray   # who allocated what stayed

Why: a worker that serves a run prefills batches of ever-new token counts (prompts of any length, in
batches of any size), and its host memory was seen to creep by tens of KiB a step, in malloc'd
memory that Python's allocator did not hand out, while a worker asked for the same shapes round
after round stayed flat (docs/memory.md). If a new shape costs host memory that stays (a kernel
that the CUDA driver loads the first time it runs, with `CUDA_MODULE_LOADING=LAZY`, its default; a
library's plan or heuristics cache), the first pass over N new token counts grows and the second
pass over the same counts does not; with `CUDA_MODULE_LOADING=EAGER` (every kernel loaded when
CUDA starts) neither does.

Each shape is one token count M: the layer's matmuls of Qwen2.5-0.5B (q/k/v with bias, o, gate/up,
down; bf16 on the GPU) on M tokens, and attention over M tokens with a padding mask (as the
worker's eager prefill runs it: flash, memory-efficient or math). After every `--every` shapes the
process's resident memory (anonymous, file-backed) and glibc's malloc totals are read. The JSON has
every sample and, per pass, KiB per shape; with `--memray FILE` also what the first pass allocated
natively and still held at its end, by stack (slime_meta_engine/native_allocations.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from model_shapes import QWEN25_05B  # noqa: E402
from soak_figures import fitted_slope  # noqa: E402

sys.path.insert(0, str(C.REPO_ROOT))
from slime_meta_engine import native_allocations  # noqa: E402
from slime_meta_engine.memory_snapshots import malloc_figures, resident_kib  # noqa: E402

CUDA_ENV = ("CUDA_MODULE_LOADING", "CUBLASLT_HEURISTICS_CACHE_CAPACITY", "CUBLAS_WORKSPACE_CONFIG")


def layer_weights(device: str, dtype):
    """One decoder layer's projections of Qwen2.5-0.5B, random: (weight, bias) per matmul."""
    import torch

    hidden, intermediate = QWEN25_05B["hidden_size"], QWEN25_05B["intermediate_size"]
    head_dim = hidden // QWEN25_05B["num_attention_heads"]
    qkv = hidden + 2 * QWEN25_05B["num_key_value_heads"] * head_dim
    shapes = [
        (qkv, hidden, True),
        (hidden, hidden, False),
        (2 * intermediate, hidden, False),
        (hidden, intermediate, False),
    ]
    return [
        (
            torch.randn(out, inp, device=device, dtype=dtype) * 0.02,
            torch.zeros(out, device=device, dtype=dtype) if bias else None,
        )
        for out, inp, bias in shapes
    ]


def run_shape(tokens: int, ops: str, weights, hidden_in, device: str) -> None:
    """The matmuls and/or attention of one layer on `tokens` tokens."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = hidden_in[:tokens]
    if ops in ("gemm", "both"):
        for weight, bias in weights:
            source = x if weight.shape[1] == x.shape[1] else hidden_in.new_empty(tokens, weight.shape[1]).normal_()
            F.linear(source, weight, bias)
    if ops in ("attention", "both"):
        heads = QWEN25_05B["num_attention_heads"]
        head_dim = QWEN25_05B["hidden_size"] // heads
        q = x.new_empty(1, heads, tokens, head_dim).normal_()
        mask = torch.ones(1, 1, tokens, tokens, dtype=torch.bool, device=device).tril()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    if device == "cuda":
        torch.cuda.synchronize()


def sample(pass_number: int, done: int) -> dict:
    memory, malloc = resident_kib(), malloc_figures() or {}
    return {
        "pass": pass_number,
        "shapes": done,
        "rss_kib": memory.get("rss_kib"),
        "anon_kib": memory.get("anon_kib"),
        "file_kib": memory.get("file_kib"),
        "malloc_in_use_kib": malloc.get("in_use_kib"),
    }


def per_shape(samples: list[dict], key: str) -> float | None:
    """KiB per shape, the least-squares slope of `key` against the shapes run in the pass."""
    points = [(s["shapes"], s[key]) for s in samples if s[key] is not None]
    if len(points) < 3:
        return None
    slope_mib, _ = fitted_slope([p[0] for p in points], [p[1] for p in points])
    return round(slope_mib * 1024, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=512, help="distinct token counts, each run once a pass")
    parser.add_argument("--max-tokens", type=int, default=4096, help="the largest token count drawn")
    parser.add_argument("--ops", choices=("gemm", "attention", "both"), default="both")
    parser.add_argument("--every", type=int, default=16, help="shapes between two samples")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--blas",
        choices=("default", "cublas", "cublaslt"),
        default="default",
        help="the BLAS library torch's matmuls use (torch.backends.cuda.preferred_blas_library)",
    )
    parser.add_argument(
        "--memray",
        type=Path,
        default=None,
        metavar="FILE",
        help="record the first pass's native allocations into FILE (pip install memray) and report what it kept",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: benchmarks/results/...)")
    args = parser.parse_args(argv)
    if args.shapes > args.max_tokens:
        parser.error(f"--shapes {args.shapes}: at most --max-tokens ({args.max_tokens}) distinct token counts")
    if args.shapes < 3 * args.every:
        parser.error(f"--shapes {args.shapes}: give at least 3 x --every ({3 * args.every}) for a slope")

    if args.memray is not None:
        try:
            import memray  # noqa: F401
        except ImportError:
            parser.error("--memray: needs memray (pip install memray; not a dependency of the project)")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here; give --device cpu")
    if args.blas != "default":
        if args.device != "cuda":
            parser.error(f"--blas {args.blas}: a choice of the GPU's BLAS; leave it out with --device cpu")
        torch.backends.cuda.preferred_blas_library(args.blas)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    started = time.monotonic()
    weights = layer_weights(args.device, dtype)
    hidden_in = torch.randn(args.max_tokens, QWEN25_05B["hidden_size"], device=args.device, dtype=dtype)
    counts = random.Random(args.seed).sample(range(1, args.max_tokens + 1), args.shapes)
    # A warm-up shape outside the drawn ones: CUDA's context, cuBLAS's handle and workspace.
    run_shape(args.max_tokens, args.ops, weights, hidden_in, args.device)
    samples = []
    for pass_number in (1, 2):
        samples.append(sample(pass_number, 0))
        if pass_number == 1 and args.memray is not None:
            native_allocations.start(args.memray)
        for done, tokens in enumerate(counts, start=1):
            run_shape(tokens, args.ops, weights, hidden_in, args.device)
            if done % args.every == 0 or done == len(counts):
                samples.append(sample(pass_number, done))
        if pass_number == 1 and args.memray is not None:
            native_allocations.stop()
    passes = {}
    for pass_number in (1, 2):
        rows = [s for s in samples if s["pass"] == pass_number]
        passes[f"pass_{pass_number}"] = {
            "rss_mib_start": round(rows[0]["rss_kib"] / 1024, 1),
            "rss_mib_end": round(rows[-1]["rss_kib"] / 1024, 1),
            "rss_kib_per_shape": per_shape(rows, "rss_kib"),
            "anon_kib_per_shape": per_shape(rows, "anon_kib"),
            "malloc_in_use_kib_per_shape": per_shape(rows, "malloc_in_use_kib"),
        }
    report = C.report_header(
        "shape_memory",
        {
            "shapes": args.shapes,
            "max_tokens": args.max_tokens,
            "ops": args.ops,
            "every": args.every,
            "device": args.device,
            "seed": args.seed,
            "blas": args.blas,
            "cuda_env": {key: os.environ[key] for key in CUDA_ENV if key in os.environ},
        },
    )
    report.update(seconds=round(time.monotonic() - started, 1), **passes, samples=samples)
    if args.memray is not None:  # what the first pass allocated natively and still held at its end
        report["first_pass_native"] = native_allocations.live_sites(args.memray, top=10, frames=6)
    loading = os.environ.get("CUDA_MODULE_LOADING", "default").lower()
    out = args.out or C.REPO_ROOT / "benchmarks" / "results" / f"shape_memory_{args.device}_{args.ops}_{loading}.json"
    C.write_json(report, out)
    for name, figures in passes.items():
        print(
            f"{name}: RSS {figures['rss_mib_start']} -> {figures['rss_mib_end']} MiB over {args.shapes} token counts; "
            f"per shape: RSS {figures['rss_kib_per_shape']} KiB, anonymous {figures['anon_kib_per_shape']} KiB, "
            f"malloc in use {figures['malloc_in_use_kib_per_shape']} KiB"
        )
    if args.memray is not None:
        native = report["first_pass_native"]
        print(f"native allocations the first pass kept: {native['native_live_kib']:,.1f} KiB; largest:")
        for site in native["native_sites"][:5]:
            print(f"  {site['size_kib']:9.1f} KiB {site['count']:7d} blocks  {' < '.join(site['frames'])}")
    print(f"median of the last samples: {statistics.median(s['rss_kib'] for s in samples[-3:]) / 1024:.1f} MiB")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
