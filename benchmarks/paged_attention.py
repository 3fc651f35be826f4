"""One layer's decode attention over the paged KV cache: the Triton kernel against gather + SDPA.

    python benchmarks/paged_attention.py --out benchmarks/results/paged_attention_h200.json     # CUDA
    python benchmarks/paged_attention.py --splits auto,1,2,4,8,16,32                           # sweep
    TRITON_INTERPRET=1 python benchmarks/paged_attention.py --quick --out /tmp/paged_attention.json  # CPU smoke

The two ways PagedDecoder can attend for one new token per row (fast_path/paged/model.py), at the attention
shapes of Qwen2.5-0.5B (14 query heads over 2 kv heads of 64) and Qwen2.5-1.5B (12 over 2, of 128),
bf16, pages of 16 tokens in scrambled order:
- gather: each row's first `attended // 16` pages copied into a contiguous block (keys, values),
  then SDPA under the rows' length mask (`_decode_attention`): every row pays for `attended`;
- kernel: kernels/paged_attention.py, reading pages in place and stopping at each row's length.
Cases per rows (8, 32, 64): every row `L` tokens long (attended = L) for L in 256, 1,024, 4,400,
and "mixed": attended 4,400 with one row in eight that long and the others 300.

Timing: as in a decode step, each layer reads its own cache, so a step's worth of layers (more when
one layer's cache is small, so the caches together are several times the L2 and every read comes
from memory) runs in one CUDA graph; the figure is the median replay over `--reps`, divided by the
layers. The per-step mask (gather) and lengths (kernel) are made once outside, as the decoder
does. Each case also reports the largest difference between the two outputs. Without CUDA (the
interpreter, `--quick`) the same runs eagerly in float32 with a host clock: a smoke test only.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from slime_meta_engine.fast_path.static.model import _ATTENTION_BACKENDS
from slime_meta_engine.kernels.paged_attention import choose_num_splits, paged_decode_attention


@dataclass(frozen=True)
class AttentionShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


SHAPES = [AttentionShape("qwen2.5-0.5b", 14, 2, 64, 24), AttentionShape("qwen2.5-1.5b", 12, 2, 128, 28)]
# Enough layers' caches together that one layer's is out of the L2 (60 MB on an H200) when it is read.
MIN_CACHE_BYTES = 512 * 2**20
MAX_LAYERS = 256


def gather_attention(q_B_H_D, keys_P_S_K_D, values_P_S_K_D, pages_B_A, mask_B_1_1_T, scale) -> torch.Tensor:
    """PagedDecoder's gather path for one layer (fast_path/paged/model.py; family_forward._decode_attention)."""
    rows, heads, head_dim = q_B_H_D.shape
    page_size, kv_heads = keys_P_S_K_D.shape[1], keys_P_S_K_D.shape[2]
    attended = pages_B_A.shape[1] * page_size
    keys_B_T_K_D = keys_P_S_K_D[pages_B_A].view(rows, attended, kv_heads, head_dim)
    values_B_T_K_D = values_P_S_K_D[pages_B_A].view(rows, attended, kv_heads, head_dim)
    q_B_K_G_D = q_B_H_D.view(rows, kv_heads, heads // kv_heads, head_dim)
    attended_B_K_G_D = F.scaled_dot_product_attention(
        q_B_K_G_D, keys_B_T_K_D.transpose(1, 2), values_B_T_K_D.transpose(1, 2), attn_mask=mask_B_1_1_T, scale=scale
    )
    return attended_B_K_G_D.reshape(rows, heads * head_dim)


def row_lengths(rows: int, case: str, args) -> list[int]:
    if case == "mixed":
        return [args.mixed_long_length if row % 8 == 0 else args.mixed_short_length for row in range(rows)]
    return [int(case)] * rows


class Setup:
    """The caches of several layers, one page table with each row's pages scrambled, queries."""

    def __init__(self, shape: AttentionShape, lengths: list[int], attended: int, args, device, dtype):
        rows, size = len(lengths), args.page_size
        generator = torch.Generator().manual_seed(0)
        pages_per_row = attended // size
        num_pages = rows * pages_per_row + 1
        layer_bytes = 2 * num_pages * size * shape.kv_heads * shape.head_dim * dtype.itemsize
        self.layers = args.layers or min(MAX_LAYERS, max(shape.layers, -(-MIN_CACHE_BYTES // layer_bytes)))
        cache_shape = (self.layers, num_pages, size, shape.kv_heads, shape.head_dim)
        self.keys_L_P_S_K_D = torch.randn(cache_shape, device=device, dtype=dtype)
        self.values_L_P_S_K_D = torch.randn(cache_shape, device=device, dtype=dtype)
        table = torch.randperm(num_pages - 1, generator=generator)[: rows * pages_per_row] + 1
        self.table_B_M = table.view(rows, pages_per_row).to(device)
        self.q_L_B_H_D = torch.randn(self.layers, rows, shape.heads, shape.head_dim, device=device, dtype=dtype)
        self.lengths_B = torch.tensor(lengths, device=device)
        hidden_B_T = torch.arange(attended, device=device)[None, :] >= self.lengths_B[:, None]
        mask_B_T = torch.zeros(hidden_B_T.shape, device=device, dtype=dtype).masked_fill(hidden_B_T, float("-inf"))
        self.mask_B_1_1_T = mask_B_T[:, None, None, :]
        self.attended, self.scale = attended, shape.head_dim**-0.5

    def kernel_step(self, num_splits: int | None) -> list[torch.Tensor]:
        return [
            paged_decode_attention(
                self.q_L_B_H_D[layer],
                self.keys_L_P_S_K_D[layer],
                self.values_L_P_S_K_D[layer],
                self.table_B_M,
                self.lengths_B,
                self.scale,
                max_length=self.attended,
                num_splits=num_splits,
            )
            for layer in range(self.layers)
        ]

    def gather_step(self) -> list[torch.Tensor]:
        with sdpa_kernel(_ATTENTION_BACKENDS):
            return [
                gather_attention(
                    self.q_L_B_H_D[layer],
                    self.keys_L_P_S_K_D[layer],
                    self.values_L_P_S_K_D[layer],
                    self.table_B_M,
                    self.mask_B_1_1_T,
                    self.scale,
                )
                for layer in range(self.layers)
            ]


def median_step_ms(step, reps: int, device: torch.device) -> float:
    """Median time of one call of `step` (all layers): CUDA graph replays timed with events on CUDA,
    eager calls with a host clock elsewhere."""
    if device.type != "cuda":
        return C.median_eager_ms(step, reps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and initialises outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replay_ms = C.median_replay_ms(graph, reps)
    del graph
    return replay_ms


def run_case(shape: AttentionShape, rows: int, case: str, args, device, dtype) -> list[dict]:
    lengths = row_lengths(rows, case, args)
    attended = -(-max(lengths) // args.page_size) * args.page_size
    setup = Setup(shape, lengths, attended, args, device, dtype)
    with torch.inference_mode():
        gather_B_HD = setup.gather_step()[0].float()
        gather_ms = median_step_ms(setup.gather_step, args.reps, device) / setup.layers
        # Bytes a row must read at least: its own tokens' keys and values, once.
        useful_bytes = sum(lengths) * 2 * shape.kv_heads * shape.head_dim * dtype.itemsize
        results = []
        for splits in args.splits:
            num_splits = None if splits == "auto" else int(splits)
            kernel_B_HD = setup.kernel_step(num_splits)[0].float()
            kernel_ms = (
                median_step_ms(functools.partial(setup.kernel_step, num_splits), args.reps, device) / setup.layers
            )
            processors = _processors(device)
            chosen = num_splits or choose_num_splits(rows, shape.kv_heads, attended, shape.head_dim, processors)
            results.append(
                {
                    "shape": shape.name,
                    "rows": rows,
                    "case": case,
                    "attended": attended,
                    "mean_length": sum(lengths) / rows,
                    "splits": chosen,
                    "split_choice": splits,
                    "layers": setup.layers,
                    "gather_us": gather_ms * 1e3,
                    "kernel_us": kernel_ms * 1e3,
                    "speedup": gather_ms / kernel_ms,
                    "kernel_gb_s": useful_bytes / (kernel_ms * 1e-3) / 1e9,
                    "max_abs_difference": float((kernel_B_HD - gather_B_HD).abs().max()),
                }
            )
    del setup
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8,32,64", help="comma-separated row counts")
    p.add_argument("--cases", default="256,1024,4400,mixed", help="row lengths, and 'mixed' (see the docstring)")
    p.add_argument("--mixed-long-length", type=int, default=4400, help="the long rows' length in the mixed case")
    p.add_argument("--mixed-short-length", type=int, default=300, help="the short rows' length in the mixed case")
    p.add_argument("--shapes", default=",".join(shape.name for shape in SHAPES))
    p.add_argument("--splits", default="auto", help="comma-separated split counts for the kernel ('auto': its own)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=100, help="timed graph replays per figure (median)")
    p.add_argument("--layers", type=int, default=None, help="layer caches per step (default: see the docstring)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rows, short lengths, 2 layers, 2 reps")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT or runs/benchmarks/paged_attention.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.cases, args.layers, args.reps, args.splits = "2", "24,mixed", 2, 2, "auto,3"
        args.mixed_long_length, args.mixed_short_length = 40, 10
    args.rows = [int(value) for value in args.rows.split(",")]
    args.cases = args.cases.split(",")
    args.shapes = [shape for shape in SHAPES if shape.name in args.shapes.split(",")]
    args.splits = args.splits.split(",")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The interpreter cannot run bf16 dots (it multiplies their raw bits): float32 on CPU.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "shapes")}
    settings.update(shapes=[vars(shape) for shape in args.shapes], dtype=str(dtype), device=str(device))
    report = C.report_header("paged_attention", settings)
    report["machine"]["triton"] = _triton_version()
    results = []
    for shape in args.shapes:
        for rows in args.rows:
            for case in args.cases:
                results.extend(run_case(shape, rows, case, args, device, dtype))
                row = results[-1]
                timings = f"gather {row['gather_us']:.1f} us, kernel {row['kernel_us']:.1f} us"
                print(f"{shape.name} rows {rows} {case}: {timings}", file=sys.stderr, flush=True)
    report["results"] = results
    path = C.write_json(report, args.out or C.default_out("paged_attention"))
    columns = ["shape", "rows", "case", "attended", "splits", "gather_us", "kernel_us", "speedup", "kernel_gb_s"]
    columns.append("max_abs_difference")
    print(C.table([[row[column] for column in columns] for row in results], columns))
    print(f"json: {path}", file=sys.stderr)
    return report


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
