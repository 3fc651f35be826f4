"""One inference worker alone, round after round of what a run asks of it: its memory per round.

Each round pushes the trainer's weights (as a run does after each step: shared memory on the CPU,
CUDA IPC when trainer and worker share a GPU, `--weight-sync` to force one) and then sends one
`/generate` call of sampled requests of varied lengths with log-probs. After every `--every` rounds
the worker's resident memory and, on a GPU, its GPU memory (nvidia-smi) are read. It isolates what a
worker keeps per round from the rest of a run (benchmarks/soak.py measures the whole run), and
`--no-push` or `--no-requests` tells which of the two keeps it. The tokens each round's call reads and
writes are counted, so a slope per round can be put as KiB per thousand tokens and compared with a
run's step, whose calls carry many more tokens. Each sample also holds the engine's count of the
distinct eager prefill shapes it has run, and on a GPU its caching allocator's allocated and reserved
MiB (from `/get_server_info`), which tell memory kept per new shape, and a larger reserve, apart.

    python benchmarks/worker_soak.py --rounds 400                      # the tiny model on the CPU
    python benchmarks/worker_soak.py --rounds 400 --no-push            # requests only
    python benchmarks/worker_soak.py --device cuda --model-dir DIR     # a real model on one GPU
    python benchmarks/worker_soak.py --device cuda --model-dir DIR --requests 128 --new-tokens 192 \
        --time-limit-s 500                                             # a step's load; stops in time
    python benchmarks/worker_soak.py --device cuda --model-dir DIR --requests 16 --prompt-tokens 20-1500 \
        --varied-widths                                                # a new prefill width each round
    python benchmarks/worker_soak.py --device cuda --model-dir DIR --requests 64 --prompt-tokens 20-600 \
        --varied-widths --varied-rows                                  # and new rows
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common as C  # noqa: E402
from soak_figures import fitted_slope, level_course  # noqa: E402
from soak_probes import descendants, gpu_memory_by_pid, memory_kib  # noqa: E402

from slime_meta.backends.local.workers.engine_time import ENGINE_LEVELS, read_engine_seconds  # noqa: E402


def worker_pid(url: str) -> int | None:
    """The pid of this process's engine child serving `url` (soak.py names it worker:PORT)."""
    name = f"worker:{url.rsplit(':', 1)[1]}"
    return next((pid for pid, found in descendants(os.getpid()).items() if found == name), None)


# The fewest prompts no prefill graph takes (fast_path/prefill_graphs.py: graphs hold up to 8 rows).
FEWEST_EAGER_PROMPTS = 9


def prompt_count(round_index: int, requests: int, varied_rows: bool) -> int:
    """The prompts of one round: `requests`, or with `varied_rows` a count drawn anew each round from
    FEWEST_EAGER_PROMPTS..`requests` (an eager prefill's rows, as a run's admissions vary them)."""
    if not varied_rows:
        return requests
    return FEWEST_EAGER_PROMPTS + (round_index * 4001) % (requests - FEWEST_EAGER_PROMPTS + 1)


def prompt_lengths(
    round_index: int, requests: int, shortest: int, longest: int, varied_widths: bool, varied_rows: bool = False
) -> list[int]:
    """Each prompt's tokens in one round, spread over `shortest`..`longest` (with many prompts the
    round's longest is `longest` nearly every round); with `varied_widths` the round's longest is drawn
    anew each round (as a run's prefills meet new widths) and the other prompts spread below it;
    with `varied_rows` the round has `prompt_count` prompts."""
    requests = prompt_count(round_index, requests, varied_rows)
    if not varied_widths:
        return [shortest + (k * 11 + round_index) % (longest - shortest + 1) for k in range(requests)]
    width = shortest + (round_index * 7919) % (longest - shortest + 1)
    return [shortest + (k * 11 + round_index) % (width - shortest + 1) for k in range(requests - 1)] + [width]


def request_body(round_index: int, lengths: list[int], vocab: int, new_tokens: int) -> dict:
    """Prompts of `lengths` tokens, different each round, sampled with log-probs."""
    prompts = [[3 + (7 * i + 13 * round_index + 5 * k) % (vocab - 3) for i in range(n)] for k, n in enumerate(lengths)]
    return {
        "input_ids": prompts,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": new_tokens},
        "return_logprob": True,
    }


def call_tokens(response: dict | list) -> int:
    """Prompt and generated tokens of one /generate reply (a list of replies for a batch of prompts)."""
    replies = response if isinstance(response, list) else [response]
    return sum(r["meta_info"]["prompt_tokens"] + r["meta_info"]["completion_tokens"] for r in replies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--every", type=int, default=5, help="rounds between two samples")
    parser.add_argument("--warmup", type=int, default=50, help="rounds left out of the slope")
    parser.add_argument("--requests", type=int, default=16, help="prompts per /generate call")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--prompt-tokens",
        default="20-60",
        metavar="LO-HI",
        help="prompt lengths, spread over LO..HI tokens (default 20-60)",
    )
    parser.add_argument(
        "--varied-widths",
        action="store_true",
        help="a new longest prompt (LO..HI) each round: each round's prefill a new width, as in a run",
    )
    parser.add_argument(
        "--varied-rows",
        action="store_true",
        help=f"a new number of prompts ({FEWEST_EAGER_PROMPTS}..--requests) each round: each round's eager prefill "
        "new rows, as a run's admissions give",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-dir", default=None, help="an HF checkpoint (default: the tests' tiny model)")
    parser.add_argument("--weight-sync", choices=("auto", "disk", "shared-memory", "cuda-ipc"), default="auto")
    parser.add_argument("--no-push", action="store_true", help="requests only")
    parser.add_argument("--no-requests", action="store_true", help="weight pushes only")
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="stop after the round that ends past this many seconds of rounds (the start not counted); "
        "the rounds done are reported",
    )
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: benchmarks/results/...)")
    args = parser.parse_args(argv)
    if args.time_limit_s is not None and args.time_limit_s <= 0:
        parser.error(f"--time-limit-s {args.time_limit_s}: give a positive number of seconds")
    if args.rounds <= args.warmup + 2 * args.every:
        parser.error(f"--rounds {args.rounds}: give more than --warmup + 2 x --every ({args.warmup + 2 * args.every})")
    try:
        shortest, longest = (int(part) for part in args.prompt_tokens.split("-"))
    except ValueError:
        parser.error(f"--prompt-tokens {args.prompt_tokens}: give two token counts as LO-HI, e.g. 20-60")
    if not 1 <= shortest <= longest:
        parser.error(f"--prompt-tokens {args.prompt_tokens}: give 1 <= LO <= HI")
    if args.varied_rows and args.requests <= FEWEST_EAGER_PROMPTS:
        parser.error(
            f"--requests {args.requests}: --varied-rows draws {FEWEST_EAGER_PROMPTS}..N prompts a round; "
            f"give N > {FEWEST_EAGER_PROMPTS}"
        )
    if args.model_dir is not None and not (Path(args.model_dir) / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir}: no config.json there; give an HF checkpoint directory")

    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer
    from slime_meta.backends.local.workers.launcher import LocalProcessGroup
    from slime_meta.backends.local.workers.weight_sync import make_weight_sync, push_weights
    from slime_meta.rollout.pools import post_json_sync

    samples: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="worker-soak-") as tmp:
        work = Path(tmp)
        model_dir = args.model_dir
        if model_dir is None:
            sys.path.insert(0, str(ROOT / "tests"))
            from helpers_tiny import make_random_tiny_checkpoint

            model_dir = str(make_random_tiny_checkpoint(work / "tiny"))
        with LocalProcessGroup() as group:
            pool = group.start_pool(
                "teacher", model_dir, 1, device=args.device, weights_root=str(work / "w"), log_dir=str(work)
            )
            url = pool.worker_urls[0]
            pid = worker_pid(url)
            if pid is None:
                raise SystemExit(f"error: no engine process found serving {url}")
            trainer, sync = None, None
            if not args.no_push:
                trainer = LocalTrainer(model_dir, TrainerSettings(lr=1e-4, device=args.device))
                sync = make_weight_sync(
                    args.weight_sync, trainer, pool.worker_urls, work / "w", group.weight_buffer_prefix
                )
            vocab = trainer.model.config.vocab_size if trainer else 60
            tokens = 0  # prompt and generated tokens of every call so far
            rounds_started = time.monotonic()  # the time limit leaves out the worker's start
            for round_index in range(args.rounds):
                if trainer is not None:
                    push_weights(trainer, list(pool.worker_urls), work / "w", round_index + 1, group, sync)
                if not args.no_requests:
                    lengths = prompt_lengths(
                        round_index, args.requests, shortest, longest, args.varied_widths, args.varied_rows
                    )
                    body = request_body(round_index, lengths, vocab, args.new_tokens)
                    tokens += call_tokens(post_json_sync(url + "/generate", body))
                out_of_time = args.time_limit_s is not None and time.monotonic() - rounds_started > args.time_limit_s
                last = round_index == args.rounds - 1 or out_of_time
                if round_index % args.every == 0 or last:
                    memory = memory_kib(pid) or {}
                    sample = {
                        "round": round_index,
                        "tokens": tokens,
                        "rss_kib": memory.get("rss_kib"),
                        "anon_kib": memory.get("anon_kib"),
                    }
                    if args.device == "cuda":
                        sample["gpu_mib"] = gpu_memory_by_pid().get(pid)
                    # the engine's levels: eager prefill shapes met so far, and on a GPU its allocator's figures
                    engine = read_engine_seconds(url) or {}
                    sample.update({level: engine[level] for level in ENGINE_LEVELS if level in engine})
                    samples.append(sample)
                if out_of_time:
                    break
            mode = sync.mode if sync is not None else None
            if sync is not None:
                sync.close()
    rounds_done = samples[-1]["round"] + 1
    measured = [s for s in samples if s["round"] >= args.warmup and s["rss_kib"] is not None]
    if len(measured) < 3:
        raise SystemExit(
            f"error: {rounds_done} rounds done in {time.monotonic() - started:.0f} s leave {len(measured)} samples "
            f"after round {args.warmup}; give a longer --time-limit-s or a smaller --warmup"
        )
    slope, noise = fitted_slope([s["round"] for s in measured], [s["rss_kib"] for s in measured])
    tokens_after_warmup = measured[-1]["tokens"] - measured[0]["tokens"]
    per_1k_tokens = None
    if tokens_after_warmup > 0:
        per_token, _ = fitted_slope([s["tokens"] for s in measured], [s["rss_kib"] for s in measured])
        per_1k_tokens = round(per_token * 1024 * 1000, 3)
    report = C.report_header(
        "worker_soak",
        {
            "rounds": args.rounds,
            "every": args.every,
            "warmup": args.warmup,
            "requests": 0 if args.no_requests else args.requests,
            "new_tokens": args.new_tokens,
            "prompt_tokens": [shortest, longest],
            "varied_widths": args.varied_widths,
            "varied_rows": args.varied_rows,
            "eager_prefill_columns_env": os.environ.get("SLIME_META_EAGER_PREFILL_COLUMNS"),
            "eager_prefill_rows_env": os.environ.get("SLIME_META_EAGER_PREFILL_ROWS"),
            "device": args.device,
            "model_dir": args.model_dir or "the tests' tiny model",
            "weight_sync": None if args.no_push else mode,
        },
    )
    report.update(
        seconds=round(time.monotonic() - started, 1),
        rounds_done=rounds_done,
        tokens_per_round=round(tokens / rounds_done, 1),
        rss_mib_after_warmup=round(measured[0]["rss_kib"] / 1024, 1),
        rss_mib_end=round(measured[-1]["rss_kib"] / 1024, 1),
        slope_kib_per_round=round(slope * 1024, 2),
        slope_kib_per_1k_tokens=per_1k_tokens,
        noise_mib=round(noise, 2),
        samples=samples,
    )
    gpu = [s["gpu_mib"] for s in measured if s.get("gpu_mib") is not None]
    if gpu:
        report.update(gpu_mib_after_warmup=gpu[0], gpu_mib_end=gpu[-1], gpu_mib_max=max(gpu))
    for level in ENGINE_LEVELS:
        points = [(s["round"], s[level]) for s in measured if level in s]
        if points:
            course = level_course(points)
            report[f"{level}_after_warmup"], report[f"{level}_end"], report[f"{level}_last_rise_round"] = course
    what = "_".join(x for x, off in (("push", args.no_push), ("requests", args.no_requests)) if not off)
    name = f"worker_soak_{args.device}_{what}_{rounds_done}rounds.json"
    out = args.out or ROOT / "benchmarks" / "results" / name
    C.write_json(report, out)
    print(
        f"worker soak ({what}, {args.device}, weight sync {report['settings']['weight_sync']}): {rounds_done} rounds "
        f"of {args.rounds} in {report['seconds']:.0f} s, {report['tokens_per_round']:.0f} tokens a round; "
        f"RSS {report['rss_mib_after_warmup']} -> {report['rss_mib_end']} MiB after "
        f"round {args.warmup}, {report['slope_kib_per_round']:+.2f} KiB a round"
        + (f" ({per_1k_tokens:+.3f} KiB per 1k tokens)" if per_1k_tokens is not None else "")
        + f" (noise {report['noise_mib']} MiB)"
        + (f"; GPU {report['gpu_mib_after_warmup']} -> {report['gpu_mib_end']} MiB" if gpu else "")
    )
    if "eager_prefill_shapes_end" in report:
        print(
            f"eager prefill shapes met: {report['eager_prefill_shapes_after_warmup']:g} after warm-up, "
            f"{report['eager_prefill_shapes_end']:g} at the end (last new one by round "
            f"{report['eager_prefill_shapes_last_rise_round']})"
        )
    last_fifth = measured[-max(1, len(measured) // 5) :]
    print(f"median RSS over the last fifth: {statistics.median(s['rss_kib'] for s in last_fifth) / 1024:.1f} MiB")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
