"""One graph-replayed decode step of the engine's fast path, with the fused Triton kernels and without.

    python benchmarks/decode_step.py --out benchmarks/results/decode_step_h200.json     # CUDA
    python benchmarks/decode_step.py --rows 32 --reps 2000 --fused on                   # one setting
    python benchmarks/decode_step.py --kv-cache static                                  # the slots
    python benchmarks/decode_step.py --quick --out /tmp/decode_step.json                # CPU smoke

The model: random-init Qwen2 with Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 query heads over
2 kv heads of 64, FFN 4864, vocab 151,936, tied embeddings), bf16, behind the engine's paged batch
(`build_paged_batch`, each row given distinct pages; `--kv-cache static`: `build_static_batch`),
graphs captured for every row bucket. kernels/layer_ops.py makes each RMSNorm, rotation and SiLU-and-
multiply one kernel, joins the residual adds to the norms after them, and on the paged cache the
rotation and the two cache writes. `SLIME_META_FUSED_OPS=0` (read when the decoder is built) turns
them off; each setting builds its own batch.

Per setting and rows (1, 8, 32, 64 by default, every row attending `--attended` = 256 key columns):
the median of `--reps` replays of the captured step, each timed with CUDA events; the kernels one
step launches (torch.profiler over an eager step, which launches what the graph replays), total and
per layer, with their device time by name; and the device time of the kernels inside 20 replays
against the replays' wall time (`kernel_share_of_replay`: near 1, the kernels themselves are the
step; well under 1, the gaps between launches are). `--quick` (and any run without CUDA): a
2-layer model of hidden 64, eager steps timed with a host clock; the kernels run only under
TRITON_INTERPRET=1 there. A smoke test only.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections import Counter

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch

from slime_meta_engine.fast_path.paged.batch import DEFAULT_PAGE_SIZE, build_paged_batch
from slime_meta_engine.fast_path.static.batch import build_static_batch
from slime_meta_engine.kernels import layer_ops

QWEN_0_5B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with torch.device(device):  # initialise where it runs: 0.5B float32 weights on the host take long
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape, initializer_range=0.02), dtype=dtype)
    model.eval().requires_grad_(False)
    return model


def build_batch(model, fused: bool, rows: int, attended: int, use_graphs: bool, kv_cache: str):
    """The static or paged batch with the kernels on or off, as the engine builds it (the switch is
    read here). The paged batch's rows get distinct pages for `attended` tokens each."""
    previous = os.environ.get(layer_ops.SWITCH_ENV)
    os.environ[layer_ops.SWITCH_ENV] = "1" if fused else "0"
    try:
        if kv_cache == "static":
            batch = build_static_batch(
                model, num_slots=rows, requested_capacity=attended, pad_token_id=0, use_graphs=use_graphs
            )
        else:
            batch = build_paged_batch(
                model, num_rows=rows, pool_tokens=rows * attended, pad_token_id=0, use_graphs=use_graphs
            )
            pages_per_row = attended // DEFAULT_PAGE_SIZE
            pages_R_A = 1 + torch.arange(rows * pages_per_row, device=model.device).view(rows, pages_per_row)
            batch._decoder.page_table_R_M[:, :pages_per_row] = pages_R_A  # page 0 is the scratch page
    finally:
        if previous is None:
            os.environ.pop(layer_ops.SWITCH_ENV)
        else:
            os.environ[layer_ops.SWITCH_ENV] = previous
    decoder = batch._decoder
    if fused and not decoder.fused_kernels and layer_ops.interpreted():
        decoder.fused_kernels = True  # the CPU smoke run under the interpreter: read at every call
    return batch


def kernels_per_step(step, calls: int = 1) -> tuple[Counter, Counter] | None:
    """The device kernels (and copies/fills) one call of `step` launches, by name, and their device
    microseconds per call, summed by name (the mean over `calls` calls); None where the profiler
    cannot see the device."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    counts, device_us = Counter(), Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts[event.name] += 1 / calls
            device_us[event.name] += event.device_time / calls
    return (counts, device_us) if counts else None


def run_setting(model, fused: bool, args, device: torch.device) -> list[dict]:
    largest = max(args.rows)
    batch = build_batch(model, fused, largest, args.attended, use_graphs=device.type == "cuda", kv_cache=args.kv_cache)
    decoder, graphs = batch._decoder, batch._graphs
    layers = decoder.shape.num_layers
    generator = torch.Generator().manual_seed(1)
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            tokens = torch.randint(3, decoder.shape.vocab_size, (rows,), generator=generator).tolist()
            # Every row holds attended - 1 tokens, so the step attends to all `attended` columns.
            positions = [args.attended - 1] * rows
            # The paged step's third input: each row's page for its new token (the last it holds).
            last_page = args.attended // DEFAULT_PAGE_SIZE - 1
            more = [] if args.kv_cache == "static" else [decoder.page_table_R_M[:rows, last_page].tolist()]
            logits = graphs.step(tokens, positions, *more)  # writes the inputs, compiles, checks the shapes
            assert logits.shape[0] >= rows and bool(torch.isfinite(logits[:rows].float()).all())
            bucket = logits.shape[0]
            graph = graphs._graphs.get((bucket, args.attended)) if graphs.use_graphs else None
            if graph is not None:
                step_ms = C.median_replay_ms(graph, args.reps, warmup=10)
            else:
                step_ms = C.median_eager_ms(functools.partial(graphs.step, tokens, positions, *more), args.reps)
            inputs_I_B = graphs._inputs_I_S[:, :bucket]
            eager = kernels_per_step(functools.partial(decoder.decode, *inputs_I_B, args.attended))
            names, eager_us = eager if eager else (None, None)
            kernels = round(sum(names.values())) if names else None
            # Kernel time inside the replayed graph against the replay's wall time: the difference
            # is the time the GPU spends between kernels (launch gaps), not in them.
            replayed = kernels_per_step(graph.replay, calls=20) if graph is not None else None
            replay_kernel_us = sum(replayed[1].values()) if replayed else None
            results.append(
                {
                    "fused": fused,
                    "fused_kernels_used": decoder.fused_kernels,
                    "rows": rows,
                    "bucket_rows": bucket,
                    "attended": args.attended,
                    "timing": "graph replay, CUDA events" if graph is not None else "eager, host clock",
                    "step_us": step_ms * 1e3,
                    "kernels_per_step": kernels,
                    "kernels_per_layer": kernels / layers if kernels else None,
                    "kernel_names": dict(names.most_common()) if names else None,
                    "kernel_us_eager_by_name": {k: round(v, 2) for k, v in eager_us.most_common()}
                    if eager_us
                    else None,
                    "kernel_us_in_replay": replay_kernel_us,
                    "kernel_share_of_replay": replay_kernel_us / (step_ms * 1e3) if replay_kernel_us else None,
                    "kernel_us_in_replay_by_name": (
                        {k: round(v, 2) for k, v in replayed[1].most_common()} if replayed else None
                    ),
                }
            )
            busy = f", kernels busy {replay_kernel_us:.0f} us" if replay_kernel_us else ""
            print(
                f"fused {fused} rows {rows}: {step_ms * 1e3:.1f} us, {kernels} kernels{busy}",
                file=sys.stderr,
                flush=True,
            )
    del batch, decoder, graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.quick or device.type != "cuda" else QWEN_0_5B
    if args.layers:
        shape = {**shape, "num_hidden_layers": args.layers}
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    settings.update(model=shape, dtype=str(dtype), device=str(device))
    report = C.report_header("decode_step", settings)
    report["machine"]["triton"] = None if layer_ops.triton_unavailable_reason() else _triton_version()
    model = build_model(shape, device, dtype)
    unavailable = layer_ops.kernels_unavailable_reason(device, dtype)
    results = run_setting(model, False, args, device) if args.fused != "on" else []
    if unavailable is None and args.fused != "off":
        results += run_setting(model, True, args, device)
    else:
        report["fused_skipped"] = unavailable
        print(f"fused kernels skipped: {unavailable}", file=sys.stderr)
    by_key = {(row["fused"], row["rows"]): row for row in results}
    for row in results:
        if row["fused"] and (False, row["rows"]) in by_key:
            row["speedup"] = by_key[(False, row["rows"])]["step_us"] / row["step_us"]
    report["results"] = results
    path = C.write_json(report, args.out or C.default_out("decode_step"))
    columns = ["fused", "rows", "bucket_rows", "attended", "step_us", "speedup"]
    columns += ["kernels_per_step", "kernels_per_layer", "kernel_share_of_replay"]
    print(C.table([[row.get(column) for column in columns] for row in results], columns))
    print(f"json: {path}")
    return report


def _triton_version() -> str:
    import triton

    return triton.__version__


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32,64", help="comma-separated row counts")
    p.add_argument("--attended", type=int, default=256, help="key columns every row attends to")
    p.add_argument("--reps", type=int, default=500, help="timed replays per figure (median)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's, 24)")
    p.add_argument(
        "--kv-cache",
        choices=("static", "paged"),
        default="paged",
        help="the engine's cache (default paged, the workers')",
    )
    p.add_argument("--fused", choices=("both", "on", "off"), default="both", help="which kernel settings to run")
    p.add_argument("--quick", action="store_true", help="smoke run on CPU: tiny model, eager, 3 reps")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT or runs/benchmarks/decode_step.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.attended, args.reps = "1,3", 32, 3
    args.rows = [int(value) for value in args.rows.split(",")]
    return args


if __name__ == "__main__":
    main()
