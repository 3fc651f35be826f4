"""Where one decode step of the embedded engine spends its time: graph, sampling, host.

    python benchmarks/decode_loop.py --out benchmarks/results/decode_loop_h200.json   # CUDA
    python benchmarks/decode_loop.py --quick --out /tmp/decode_loop.json              # CPU smoke

generation.py measures the served rate through the router and HTTP; this runs the same engine
in-process (`GenerationEngine` over the paged batch the worker builds, CUDA graphs on CUDA), so a
step's time can be split. The model: random-init Qwen2 with Qwen2.5-0.5B's shape, bf16 (decode_step.py
builds it). Per row count (32 by default): `rows` requests of `--prompt-len` random ids, each
sampling exactly `--new-tokens` tokens at temperature 1 with log-probs, all admitted at once.

Reported per row count:
- `engine_step_us`: the engine's fast-path decode seconds over its decode steps (its own counters),
  and the tokens/s that gives;
- `replay_us`: the median replay of the captured graph those steps used (CUDA events);
- `sampling_us`: the median of one token choice over (rows, vocab) logits as the engine makes it
  (the Triton kernels where the fused kernels run), host clock with the device synchronised, and
  `sampling_torch_ops_us` the same through torch's ops;
- `host_us`: the rest (building the step's inputs, reading the tokens back, each row's bookkeeping);
- `host_profile`: the engine thread's own functions by self time over the decode steps (cProfile,
  a separate run because the profiler slows the host);
- `engine_prefill_ms`: the engine's prefill seconds per prefill (all `rows` prompts in one, with
  their first tokens chosen), and `prefill_ms` one prefill of the paged batch alone, the device
  synchronised, with (on CUDA) its kernels' count, device time and the largest by name, and
  `prefill_host_profile` its host functions by self time (cProfile).
`--quick`: a 2-layer model of hidden 64 on the CPU, eager; a smoke test of the script only.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch
from decode_step import QWEN_0_5B, TINY, build_model, kernels_per_step

from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.fast_path.paged.batch import build_paged_batch
from slime_meta_engine.kernels import layer_ops
from slime_meta_engine.protocol import GenerationSpec, SamplingParams
from slime_meta_engine.rows import GenerationJob
from slime_meta_engine.sampling import RowSampling, choose_next_tokens


def request_specs(rows: int, vocab: int, args) -> list[GenerationSpec]:
    """`rows` requests of `--prompt-len` random ids, each sampling `--new-tokens` tokens with log-probs."""
    generator = torch.Generator().manual_seed(0)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    return [
        GenerationSpec(
            f"r{i}",
            tuple(torch.randint(3, vocab, (args.prompt_len,), generator=generator).tolist()),
            sampling,
            return_logprob=True,
        )
        for i in range(rows)
    ]


def run_engine(model, rows: int, args, profile: bool) -> tuple[dict, pstats.Stats | None, object]:
    """Serve `rows` requests at once; returns the engine's counters, the host profile, the batch."""
    device = model.device
    paged = build_paged_batch(
        model,
        num_rows=rows,
        pool_tokens=rows * (args.prompt_len + args.new_tokens),
        pad_token_id=0,
        use_graphs=device.type == "cuda",
    )
    engine = GenerationEngine(
        model,
        decode=lambda ids, skip: "",
        device=device,
        eos_token_ids=frozenset(),
        pad_token_id=0,
        max_batch_size=rows,
        static_batch=paged,
    )
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:  # the decode steps run on the engine's thread: profile them there
        step = engine._static_decode_step

        def profiled_step() -> None:
            profiler.enable()
            try:
                step()
            finally:
                profiler.disable()

        engine._static_decode_step = profiled_step
    specs = request_specs(rows, model.config.vocab_size, args)
    done = threading.Semaphore(0)
    outcomes = []

    def on_done(outcome) -> None:
        outcomes.append(outcome)
        done.release()

    engine.start()
    try:
        engine.submit_all([GenerationJob(spec, on_done=on_done) for spec in specs])
        for _ in specs:
            assert done.acquire(timeout=600), "the engine did not answer"
    finally:
        engine.stop()
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
        assert len(outcome.output_ids) == args.new_tokens and len(outcome.output_logprobs) == args.new_tokens
    stats = pstats.Stats(profiler) if profiler is not None else None
    return dict(engine.counters), stats, paged


def sampling_us(rows: int, vocab: int, device: torch.device, dtype: torch.dtype, reps: int, kernel: bool) -> float:
    """One token choice over (rows, vocab) logits at temperature 1, the device synchronised; with
    `kernel`, as the engine chooses where the fused kernels run (sampling.py)."""
    logits_B_V = torch.randn(rows, vocab, device=device, dtype=dtype)
    params = [SamplingParams(max_new_tokens=1, temperature=1.0)] * rows
    row_sampling = RowSampling.from_params(params, [0] * rows, vocab, device)
    generator = torch.Generator(device=device).manual_seed(0)

    def choose() -> None:
        choice = choose_next_tokens(logits_B_V, row_sampling, generator, kernel_seed=1 if kernel else None)
        choice.token_ids.tolist()
        choice.logprobs.tolist()

    return 1e3 * C.median_eager_ms(choose, reps)


def prefill_figures(model, rows: int, args) -> dict:
    """One prefill of `rows` prompts as the paged batch runs it for the engine (pages taken, prompts
    run, first-token logits; the pages released after), host clock with the device synchronised;
    on CUDA also its kernels: how many, their device time, the largest by name."""
    paged = build_paged_batch(
        model,
        num_rows=rows,
        pool_tokens=2 * rows * (args.prompt_len + args.new_tokens),
        pad_token_id=0,
        use_graphs=False,
    )  # twice the tokens: every row's pages fit whatever the page rounding
    jobs = [GenerationJob(spec, on_done=lambda _: None) for spec in request_specs(rows, model.config.vocab_size, args)]

    def prefill() -> None:
        admitted, logits_N_V, _ = paged.prefill(jobs)
        logits_N_V.sum().item()  # waits for the device
        paged.release(admitted)

    figures = {"prefill_ms": C.median_eager_ms(prefill, max(3, args.reps // 20))}
    figures["prefill_tokens_per_s"] = rows * args.prompt_len / (figures["prefill_ms"] * 1e-3)
    profiler, calls = cProfile.Profile(), 3
    profiler.enable()
    for _ in range(calls):
        prefill()
    profiler.disable()
    figures["prefill_host_profile"] = top_functions(pstats.Stats(profiler), calls, count=12)
    kernels = kernels_per_step(prefill, calls=3)
    if kernels is not None:
        counts, device_us = kernels
        figures["prefill_kernels"] = sum(counts.values())
        figures["prefill_kernel_device_ms"] = sum(device_us.values()) * 1e-3
        figures["prefill_top_kernels"] = [
            {"kernel": name[:120], "calls": counts[name], "device_us": us} for name, us in device_us.most_common(8)
        ]
    return figures


def replay_us(paged, rows: int, attended: int, reps: int) -> float | None:
    graphs = paged._graphs
    if not graphs.use_graphs:
        return None
    bucket = min(b for b in graphs.row_buckets if b >= rows)
    length = min(b for b in graphs.length_buckets if b >= attended)
    graph = graphs._graphs.get((bucket, length))
    return 1e3 * C.median_replay_ms(graph, reps, warmup=10) if graph is not None else None


def top_functions(stats: pstats.Stats, steps: int, count: int = 15) -> list[dict]:
    """The profiled functions by self time, microseconds per step (decode step or prefill)."""
    rows = []
    for (filename, line, name), (_, calls, self_s, cumulative_s, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{filename.split('/')[-1]}:{line}:{name}",
                "calls_per_step": calls / steps,
                "self_us_per_step": 1e6 * self_s / steps,
                "cumulative_us_per_step": 1e6 * cumulative_s / steps,
            }
        )
    return sorted(rows, key=lambda row: -row["self_us_per_step"])[:count]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if device.type != "cuda" else QWEN_0_5B
    report = C.report_header("decode_loop", {**vars(args), "model": shape, "dtype": str(dtype), "device": str(device)})
    model = build_model(shape, device, dtype)
    results = []
    for rows in args.rows:
        run_engine(model, rows, args, profile=False)  # warm-up: first-call costs stay out of the figures
        started = time.perf_counter()
        counters, _, paged = run_engine(model, rows, args, profile=False)
        wall_s = time.perf_counter() - started
        steps = counters["static_decode_steps"]
        step_us = 1e6 * counters["fast_decode_s"] / steps
        # The steps' mean context: prompt + half the new tokens; the graph is the bucket that covers it.
        replay = replay_us(paged, rows, args.prompt_len + args.new_tokens // 2, args.reps)
        del paged
        kernel = layer_ops.kernels_by_default(device, dtype)  # what the engine does
        sample = sampling_us(rows, shape["vocab_size"], device, dtype, args.reps, kernel=kernel)
        torch_sample = sampling_us(rows, shape["vocab_size"], device, dtype, args.reps, kernel=False)
        _, stats, _ = run_engine(model, rows, args, profile=True)
        row = {
            "rows": rows,
            "engine_prefill_ms": 1e3 * counters["prefill_s"] / counters["prefill_batches"],
            **prefill_figures(model, rows, args),
            "decode_steps": steps,
            "engine_step_us": step_us,
            "engine_tokens_per_s": rows / (step_us * 1e-6),
            "wall_s_with_prefill_and_start": wall_s,
            "replay_us": replay,
            "sampling_us": sample,
            "sampling_kernel": kernel,
            "sampling_torch_ops_us": torch_sample,
            "host_us": step_us - (replay or 0.0) - sample,
            "host_profile": top_functions(stats, steps),
        }
        results.append(row)
        print(
            f"rows {rows}: step {step_us:.0f} us = replay {replay or 0:.0f} + sampling {sample:.0f} + host "
            f"{row['host_us']:.0f}; {row['engine_tokens_per_s']:,.0f} tokens/s; prefill of {rows} prompts "
            f"{row['engine_prefill_ms']:.1f} ms in the engine, {row['prefill_ms']:.1f} ms alone "
            f"({row.get('prefill_kernel_device_ms', 0):.1f} ms of kernels)",
            file=sys.stderr,
            flush=True,
        )
    report["results"] = results
    path = C.write_json(report, args.out or C.default_out("decode_loop"))
    columns = ["rows", "engine_step_us", "replay_us", "sampling_us", "sampling_torch_ops_us", "host_us"]
    columns += ["engine_tokens_per_s", "engine_prefill_ms", "prefill_ms"]
    print(C.table([[row[column] for column in columns] for row in results], columns))
    for row in results:
        print(f"rows {row['rows']}: host functions by self time, us per step")
        for entry in row["host_profile"][:8]:
            print(f"  {entry['self_us_per_step']:8.1f}  {entry['calls_per_step']:6.1f} calls  {entry['function']}")
    print(f"json: {path}")
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="32", help="comma-separated row counts (requests in flight)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=200, help="timed repetitions per replay and sampling figure")
    p.add_argument("--quick", action="store_true", help="smoke run on CPU: tiny model, 16 + 8 tokens")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT or runs/benchmarks/decode_loop.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.prompt_len, args.new_tokens, args.reps = "1,3", 16, 8, 3
    args.rows = [int(value) for value in args.rows.split(",")]
    return args


if __name__ == "__main__":
    main()
