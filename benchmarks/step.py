"""The whole outer loop on one GPU: `train.py --use-meta-learning` at Qwen2.5-0.5B and 1.5B shapes.

    python benchmarks/step.py                          # GPU: both shapes
    python benchmarks/step.py --shape 0.5b --steps 4   # one shape
    python benchmarks/step.py --quick                  # CPU, a tiny shape, 2 steps (the test suite runs this)
    python benchmarks/step.py --shape smollm2          # GPU: the real SmolLM2-135M-Instruct at run_real.sh's settings
    python benchmarks/step.py --shape qwen0.5b         # GPU: the real Qwen2.5-Coder-0.5B-Instruct, house rules
    python benchmarks/step.py --shape smollm2 --quick  # CPU: the real model, run_real.sh's CPU step, 2 steps
    python benchmarks/step.py -- --compile-layers      # extra train.py flags after --

Real shapes (`smollm2`, `qwen0.5b`): the pretrained model from `python -m slime_meta.models.real NAME`
(converted once into the cache, $SLIME_META_CACHE; offline, from the GGUF placed in its gguf/), its
own tokenizer and chat template, and scripts/run_real.sh's GPU settings: 24 problems a step (16
holdout), k = 2, G = 8, K = 2, m = 2, teacher / student temperatures 1.0 / 0.5, the verifier grader;
SmolLM2 on data/easy_word_problems.jsonl with 128 teacher and 192 student tokens, lr 1e-5; the 0.5B
on data/house_rules.jsonl with 192 and 320 tokens, two holdout attempts a problem, lr 3e-6 (the
eval sets and the before-training baseline left out: they are not part of a step). With --quick,
on the CPU: run_real.sh's CPU step (6 problems, 4 holdout, k = 1, G = 4, K = 1, m = 2), 8 new tokens.

Synthetic shapes: a random-init Qwen2 model (bf16 on a GPU), a character tokenizer padded to the model's
151,936 ids (one token per character: prompt lengths are text lengths; each sampled id decodes to
one character), a generated set of long word problems (`--problem-chars` each, 8 topics; holdout
problems share the teacher prompt's topic). The real loop: train.py with its trainer, one
embedded worker behind the real sglang-router, the student sharing the teacher's pool, the
verifier grader, all on one device. Step 0 is the warm-up; figures are means over later steps.
Reported per shape:
- step time split into rollout wait / train / weight push (metrics.jsonl, `perf/*`);
- tokens per step: generated and prompt tokens from the pool counters (`pool/{teacher,student}_*`;
  a prompt counts once per returned row, so an `n = m` request counts it m times), the prompt
  tokens prefilled (each request once, from the step's traces), the tokens trained;
- peak GPU memory: `nvidia-smi` sampled every `--sample-s` during the run, the device total and
  each process's (trainer = the train.py process; workers = the rest);
- a lower bound from measured parts:
      bound = generated tokens / served tokens/s  +  trained tokens / trainer tokens/s
  served tokens/s: generation.py's served measurement (random 128-id prompts, 128 sampled tokens,
  32 in flight, 96 requests, through the pool client) repeated in this run at this shape on a
  fresh worker after the loop (generation.py's JSON, `--generation-json`, beside it at 0.5B);
  trainer tokens/s: benchmarks/trainer_memory.py's JSON (`--trainer-json`, the same shape and
  setting: dynamic batches of 8,192 tokens, full recompute; without a row for the shape, this
  run's own train time). The bound leaves out the weight push, the prefills of the step's long
  prompts (`bound_with_prefill_s` adds them) and every dependency between requests;
- the physical floor (step_floor.py: training and prefill FLOPs at `--peak-tflops`, the sequential
  decode steps reading the weights at `--bandwidth-tbs`) and the step by phase: the rollout's
  dependent phases (`perf/rollout_phase_*`), the trainer's forward and backward, reference forward
  and optimizer (`perf/train_*`), the push, idle. train.py runs at its own memory defaults (its
  start line, `trainer_plan`); the trainer row of the bound is the loop's setting;
- whether a prefix cache would pay: the share of the prefilled prompt tokens that repeat a prefix
  already computed in the same step (sorted prompts: sum of neighbouring common prefixes, what a
  cache of unbounded size could skip; the no-info control is not traced, not counted), and a
  step's prefill time: the last step's requests replayed on the fresh worker with
  `max_new_tokens = 1`, phase by phase as the step ran them, each phase all at once. A prefix
  cache saves at most prefill time x repeated share; it pays (here) if that is >= 5% of a step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from statistics import fmean
from typing import Any, Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
from gpu_memory_sampler import GpuMemorySampler  # noqa: E402
from step_floor import DEFAULT_PEAK_TFLOPS, default_bandwidth_tbs, phase_breakdown, physical_floor  # noqa: E402
from step_report import TARGETS, lower_bound, print_table, read_json, verdicts  # noqa: E402
from step_requests import prefix_sharing, replay, step_requests  # noqa: E402
from step_shapes import (  # noqa: E402
    REAL_CPU_STEP,
    REAL_GPU_STEP,
    REAL_SHAPES,
    SHAPES,
    STEP_KEYS,
    SYNTHETIC_STEP,
    build_model_dir,
    make_rows,
    padded_char_tokenizer,
)

from slime_meta.artifacts.tracking import jsonl_lines  # noqa: E402

# ----------------------------------------------------------------------------- one run


def shape_settings(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The step's settings for a shape: the meta-learning sizes (a flag given on the command line
    wins), teacher and student tokens, learning rate, the data's group key and further flags."""
    real = REAL_SHAPES.get(name)
    step = SYNTHETIC_STEP if real is None else (REAL_CPU_STEP if args.quick else REAL_GPU_STEP)
    settings: dict[str, Any] = {
        key: getattr(args, key) if getattr(args, key) is not None else step[key] for key in STEP_KEYS
    }
    if real is None:
        tokens = args.new_tokens or 64
        # A random-init model grades every attempt 0: a step without signal trains nothing (the
        # trainer skips it), and a small entropy term leaves a step that trains, to measure.
        return dict(
            settings,
            teacher_tokens=tokens,
            student_tokens=tokens,
            lr="1e-6",
            group_key="topic",
            flags=("--entropy-coef", "1e-4"),
        )
    teacher, student = (
        (args.new_tokens, args.new_tokens) if args.new_tokens else (real["teacher_tokens"], real["student_tokens"])
    )
    temperatures = ("--teacher-temperature", "1.0", "--rollout-temperature", "0.5")
    return dict(
        settings,
        teacher_tokens=teacher,
        student_tokens=student,
        lr=real["lr"],
        group_key="category",
        flags=(*real["flags"], *temperatures),
    )


def train_command(
    args: argparse.Namespace, settings: dict[str, Any], model_dir: Path, data: Path, run_dir: Path, device: str
) -> list[str]:
    return [
        sys.executable,
        str(C.REPO_ROOT / "train.py"),
        "--hf-checkpoint",
        str(model_dir),
        "--device",
        device,
        "--prompt-data",
        str(data),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rubric-key",
        "rubric",
        "--group-key",
        settings["group_key"],
        "--rollout-shuffle",
        "--use-meta-learning",
        "--rollout-batch-size",
        str(settings["rollout_batch_size"]),
        "--heldout-ipb",
        str(settings["heldout_ipb"]),
        "--n-problems-per-prompt",
        str(settings["k"]),
        "--n-samples-per-prompt",
        str(settings["g"]),
        "--num-inner-iterations",
        str(settings["inner_iterations"]),
        "--n-samples-per-inner-prompt",
        str(settings["m"]),
        "--num-rollout",
        str(args.steps),
        "--rollout-max-response-len",
        str(settings["student_tokens"]),
        "--teacher-max-tokens",
        str(settings["teacher_tokens"]),
        "--grader",
        "verifier",
        "--local-num-workers",
        "1",
        "--lr",
        settings["lr"],
        "--trace-sample-rate",
        "1",
        "--run-dir",
        str(run_dir),
        *(["--max-tokens-per-gpu", str(args.max_tokens_per_gpu)] if args.max_tokens_per_gpu else []),
        *settings["flags"],
        *args.extra,
    ]


def real_model_inputs(name: str) -> tuple[dict[str, Any], Any, Path, Path]:
    """(config shape, tokenizer, HF directory, data file) of a real shape; the directory comes from
    `python -m slime_meta.models.real`, which converts the model once into its cache."""
    from transformers import AutoConfig, AutoTokenizer

    real = REAL_SHAPES[name]
    paths = os.pathsep.join(p for p in (str(C.REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    found = subprocess.run(
        [sys.executable, "-m", "slime_meta.models.real", real["model"]],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": paths},
        cwd=C.REPO_ROOT,
    )
    if found.returncode != 0 or not found.stdout.strip():
        raise RuntimeError(f"python -m slime_meta.models.real {real['model']} failed: {found.stderr[-2000:]}")
    model_dir = Path(found.stdout.strip().splitlines()[-1])
    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    shape = {key: getattr(text, key) for key in keys}
    shape["num_key_value_heads"] = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    shape["tie_word_embeddings"] = bool(getattr(config, "tie_word_embeddings", False))
    return shape, AutoTokenizer.from_pretrained(model_dir), model_dir, C.REPO_ROOT / real["data"]


def run_shape(name: str, args: argparse.Namespace, device: str, work: Path, result: dict[str, Any]) -> None:
    """Fills `result` as it goes: what was measured stays when a later part fails."""
    from slime_meta.backends.local.workers.launcher import LocalProcessGroup

    started = time.perf_counter()
    if name in REAL_SHAPES:
        shape, tokenizer, model_dir, data = real_model_inputs(name)
    else:
        shape = SHAPES[name]
        rows = make_rows(args.problems, args.problem_chars, seed=0)
        data = work / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tokenizer = padded_char_tokenizer([r["prompt"] + r["rubric"] for r in rows], shape["vocab_size"])
        model_dir = build_model_dir(shape, tokenizer, work / "model", device)
    settings = shape_settings(name, args)
    result.update(model=shape, settings=settings, build_s=time.perf_counter() - started)
    run_dir = work / "run"
    sampler = GpuMemorySampler(args.sample_s)
    log = open(work / "train.log", "wb")
    command = train_command(args, settings, model_dir, data, run_dir, device)
    result["train_command"] = " ".join(command[1:])
    paths = os.pathsep.join(p for p in (str(C.REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": paths}
    started = time.perf_counter()
    if device == "cuda":
        sampler.start()
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=C.REPO_ROOT, preexec_fn=C._die_with_parent
    )  # noqa: PLW1509
    result["timed_out"] = False
    try:
        returncode = process.wait(timeout=args.run_timeout_s)
    except subprocess.TimeoutExpired:  # the steps logged so far still count (two at least)
        result["timed_out"] = True
        process.terminate()
        returncode = process.wait(timeout=60)
    finally:
        sampler.stopped.set()
        log.close()
    result["run_wall_s"] = time.perf_counter() - started
    result["gpu_memory"] = sampler.report(process.pid) if device == "cuda" else {"available": False}
    records = _jsonl(run_dir / "metrics.jsonl")
    result["returncode"], result["steps_logged"] = returncode, len(records)
    if (returncode != 0 and not result["timed_out"]) or len(records) < 2:
        result["log_tail"] = (work / "train.log").read_text(errors="replace")[-3000:]
        return
    measured = records[1:] or records  # step 0 is the warm-up
    result["measured_steps"] = [r["step"] for r in measured]
    keys = (
        "perf/step_time",
        "perf/rollout_wait_time",
        "perf/train_time",
        "perf/weight_push_time",
        "perf/meta_rollout_time",
        "meta_learning/inner_loop_time",
        "pool/teacher_prompt_tokens",
        "pool/teacher_completion_tokens",
        "pool/student_prompt_tokens",
        "pool/student_completion_tokens",
        "pool/teacher_requests",
        "pool/student_requests",
        "train/step_time",
        "train/num_sequences",
        "train/response_tokens",
    )
    keys += tuple(sorted({key for r in measured for key in r if key.startswith(("perf/", "worker/"))} - set(keys)))
    per = result["per_step"] = {
        key: fmean(r.get(key, 0.0) for r in measured) for key in keys if any(key in r for r in measured)
    }
    result["trainer_plan"] = trainer_plan(run_dir, work / "train.log")
    per["train/tokens"] = fmean(r["train/tokens_per_s"] * r["train/step_time"] for r in measured)
    per["generated_tokens"] = per["pool/teacher_completion_tokens"] + per["pool/student_completion_tokens"]
    per["prompt_tokens_per_row"] = per["pool/teacher_prompt_tokens"] + per["pool/student_prompt_tokens"]
    traces = _jsonl(run_dir / "traces.jsonl")
    requests_by_step = [step_requests(traces, r["step"], tokenizer) for r in measured]
    sharing = [prefix_sharing(requests) for requests in requests_by_step]
    result["prefix"] = {k: fmean(s[k] for s in sharing) for k in sharing[0]}
    last = step_requests(traces, measured[-1]["step"], tokenizer)
    result["prefix"]["by_kind"] = {
        kind: prefix_sharing([r for r in last if r["kind"] == kind])
        for kind in ("student_train", "student_holdout", "teacher")
    }
    with LocalProcessGroup(startup_timeout_s=300) as group:
        endpoints = group.start_pool(
            "replay", str(model_dir), 1, device=device, weights_root=None, log_dir=str(work / "logs")
        )
        result["replay"] = asyncio.run(replay(endpoints.router_url, last, shape["vocab_size"], args))
    result["bound"] = lower_bound(name, args, result)
    plan = result["trainer_plan"]
    result["floor"] = physical_floor(
        shape,
        per,
        requests_by_step,
        recompute=plan.get("recompute_granularity") == "full" or device == "cpu",
        # K rounds of student then teacher, then the holdout attempts (see step_floor.py).
        decode_steps=settings["inner_iterations"] * (settings["student_tokens"] + settings["teacher_tokens"])
        + settings["student_tokens"],
        peak_tflops=args.peak_tflops,
        bandwidth_tbs=args.bandwidth_tbs,
        bytes_per_param=2 if device == "cuda" else 4,
    )
    result["phases"] = phase_breakdown(per, result["replay"]["prefill_only_s"])


def trainer_plan(run_dir: Path, log: Path) -> dict[str, Any]:
    """The trainer's memory settings the run used (its saved config) and its start line on a GPU."""
    config = read_json(str(run_dir / "config.json")) or {}
    keys = ("max_tokens_per_gpu", "recompute_granularity", "compile_layers", "use_dynamic_batch_size")
    plan = {key: config.get("train", {}).get(key) for key in keys}
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    plan["line"] = next((line for line in lines if line.startswith("trainer on GPU 0:")), None)
    return plan


def _jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a last line cut off by a stopped run is left out."""
    lines = jsonl_lines(path.read_text(encoding="utf-8")) if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape",
        choices=("0.5b", "1.5b", "both", "tiny", *REAL_SHAPES),
        default="both",
        help="synthetic 0.5b / 1.5b (both), tiny (--quick's model), or a real model: smollm2 (SmolLM2-135M-Instruct), "
        "qwen0.5b (Qwen2.5-Coder-0.5B-Instruct)",
    )
    p.add_argument("--steps", type=int, default=4, help="outer steps per shape; the first is the warm-up")
    p.add_argument("--device", default="auto")
    p.add_argument("--problems", type=int, default=64, help="rows of the generated data set (8 topics)")
    p.add_argument("--problem-chars", type=int, default=1200, help="characters (= tokens) of each problem")
    shape_default = "default: the shape's (synthetic / real on a GPU / real with --quick)"
    p.add_argument("--rollout-batch-size", type=int, default=None, help=f"problems a step; {shape_default}: 8 / 24 / 6")
    p.add_argument(
        "--heldout-ipb", type=int, default=None, help=f"holdout problems a step; {shape_default}: 4 / 16 / 4"
    )
    p.add_argument("--k", type=int, default=None, help=f"problems per teacher prompt; {shape_default}: 2 / 2 / 1")
    p.add_argument("--g", type=int, default=None, help=f"infos per teacher prompt; {shape_default}: 8 / 8 / 4")
    p.add_argument("--m", type=int, default=None, help=f"attempts per inner prompt; {shape_default}: 2 / 2 / 2")
    p.add_argument("--inner-iterations", type=int, default=None, help=f"K; {shape_default}: 2 / 2 / 1")
    p.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="student and teacher output tokens; default: 64 for a synthetic shape, run_real.sh's for a real one",
    )
    p.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        default=None,
        help="passed to train.py when given; default: train.py's own choice (its start line)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=DEFAULT_PEAK_TFLOPS,
        help="bf16 matmul rate of the floor (measured on an H100 and an H200 by benchmarks/trainer.py)",
    )
    p.add_argument(
        "--bandwidth-tbs",
        type=float,
        default=None,
        help="memory bandwidth of the floor's decode steps; default by GPU name: H200 4.8, H100 and others 3.35",
    )
    p.add_argument(
        "--served",
        type=int,
        nargs=4,
        default=[128, 128, 32, 96],
        metavar=("PROMPT", "NEW", "IN_FLIGHT", "REQUESTS"),
        help="served tokens/s: prompt ids, sampled tokens, in flight, timed",
    )
    p.add_argument("--sample-s", type=float, default=0.2, help="nvidia-smi sampling interval")
    p.add_argument(
        "--run-timeout-s",
        type=float,
        default=1800,
        help="stop train.py after this long; the steps it logged by then are reported (two at least)",
    )
    p.add_argument("--generation-json", default=str(C.REPO_ROOT / "benchmarks/results/generation_h100.json"))
    p.add_argument("--trainer-json", default=str(C.REPO_ROOT / "benchmarks/results/trainer_memory_h200.json"))
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU, 2 steps, 8 new tokens: the tiny shape with short problems, or a real --shape at run_real.sh's "
        "CPU step",
    )
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="extra train.py flags after --, e.g. -- --compile-layers")
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.steps, args.problem_chars, args.new_tokens, args.g = "cpu", 2, 200, 8, 4
        if args.shape not in REAL_SHAPES:
            args.shape = "tiny"
        args.served = [16, 16, 4, 8]
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    C.quiet_transformers()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.bandwidth_tbs is None:
        args.bandwidth_tbs = default_bandwidth_tbs(torch.cuda.get_device_name() if device == "cuda" else "")
    names = ["0.5b", "1.5b"] if args.shape == "both" else [args.shape]
    report = C.report_header("step", {k: v for k, v in vars(args).items() if k != "out"})
    report.update(device=device, targets=TARGETS, shapes=[])
    real = f"_{args.shape}" if args.shape in REAL_SHAPES else ""
    out = args.out or C.default_out("step" + real + ("_quick" if args.quick else ""))
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"bench-step-{name}-") as tmp:
            print(f"  {name}: running {args.steps} steps", file=sys.stderr, flush=True)
            result: dict[str, Any] = {"shape": name}
            try:
                run_shape(name, args, device, Path(tmp), result)
            except Exception:  # noqa: BLE001 (the figures measured so far are kept and reported)
                result["error"] = traceback.format_exc()[-3000:]
                print(result["error"], file=sys.stderr, flush=True)
        result["verdicts"] = verdicts(result)
        report["shapes"].append(result)
        path = C.write_json(report, out)  # after each shape: a later one that fails keeps the earlier
    print_table(report)
    print(f"json: {path}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
