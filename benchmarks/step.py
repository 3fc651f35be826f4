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
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from statistics import fmean
from typing import Any, Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
from step_floor import DEFAULT_PEAK_TFLOPS, default_bandwidth_tbs, phase_breakdown, physical_floor  # noqa: E402
from step_requests import prefix_sharing, replay, step_requests  # noqa: E402

from slime_meta.artifacts.tracking import jsonl_lines  # noqa: E402

TARGETS = {
    "peak_gpu_gib_0.5b": 24.0,
    "peak_gpu_gib_1.5b": 60.0,
    "step_s_0.5b": 6.0,
    "step_s_1.5b": 9.0,
    "weight_push_share": 0.05,
    "step_vs_bound": 1.5,
    "step_vs_floor_real": 3.0,  # the real models' step within 3x of its physical floor
}
COMMON = dict(
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    use_sliding_window=False,
)
SHAPES = {
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        **COMMON,
    ),
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        **COMMON,
    ),
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **dict(COMMON, max_position_embeddings=8192),
    ),
}
# The real models and run_real.sh's settings for them (see the module docstring).
REAL_SHAPES = {
    "smollm2": dict(
        model="smollm2-135m",
        data="data/easy_word_problems.jsonl",
        teacher_tokens=128,
        student_tokens=192,
        lr="1e-5",
        flags=(),
    ),
    "qwen0.5b": dict(
        model="qwen2.5-coder-0.5b",
        data="data/house_rules.jsonl",
        teacher_tokens=192,
        student_tokens=320,
        lr="3e-6",
        flags=("--n-holdout-samples", "2"),
    ),
}
# run_real.sh's step on a GPU and on the CPU: rollout batch, holdout, k, G, K, m.
REAL_GPU_STEP = dict(rollout_batch_size=24, heldout_ipb=16, k=2, g=8, inner_iterations=2, m=2)
REAL_CPU_STEP = dict(rollout_batch_size=6, heldout_ipb=4, k=1, g=4, inner_iterations=1, m=2)
SYNTHETIC_STEP = dict(rollout_batch_size=8, heldout_ipb=4, k=2, g=8, inner_iterations=2, m=2)
STEP_KEYS = tuple(SYNTHETIC_STEP)
TRAINER_MEMORY_SHAPE = {"0.5b": "0.5B", "1.5b": "1.5B", "tiny": "tiny"}  # the shape names trainer_memory.py writes
WORDS = (
    "the farmer market basket apples crate river boat morning evening price coins bag sold bought each "
    "between friends shared travelled miles garden rows seeds planted baker loaves oven hour workers "
    "factory boxes shelf library books pages class students teacher bus trip tickets"
).split()


# ----------------------------------------------------------------------------- model, tokenizer, data


def make_rows(count: int, chars: int, seed: int) -> list[dict[str, Any]]:
    """Word problems of about `chars` characters: a long story with two numbers, then the question."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        story = []
        while sum(len(s) + 1 for s in story) < chars - 120:
            story.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
        middle = len(story) // 2
        story.insert(middle, f"In the first part there were {a} items.")
        story.append(f"Later {b} more items arrived.")
        rows.append(
            {
                "prompt": " ".join(story) + " How many items were there in total?",
                "label": str(a + b),
                "rubric": f"Full credit: final answer {a + b}; {a} + {b}.",
                "topic": f"topic{i % 8}",
            }
        )
    return rows


def padded_char_tokenizer(texts: Sequence[str], vocab_size: int):
    """The project's character tokenizer, its vocabulary filled up to `vocab_size` with one token per
    further Unicode character, so every id the random model samples decodes to one character that
    encodes back to that id: a 64-token reply is 64 characters, and 64 tokens in the next prompt."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from slime_meta.models.tiny.tokenizer import train_char_tokenizer

    base = train_char_tokenizer(texts)
    backend = base.backend_tokenizer
    vocab = dict(backend.get_vocab(with_added_tokens=False))
    codepoint = 0x100
    while len(vocab) < vocab_size:
        character = chr(codepoint)
        if not 0xD800 <= codepoint <= 0xDFFF and codepoint & 0xFFFE != 0xFFFE and character not in vocab:
            vocab[character] = len(vocab)  # not a surrogate, not a noncharacter, not there yet
        codepoint += 1
    padded = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=base.unk_token, byte_fallback=True))
    padded.add_special_tokens([base.bos_token, base.eos_token, base.pad_token, base.unk_token])
    padded.decoder, padded.post_processor = backend.decoder, backend.post_processor
    return PreTrainedTokenizerFast(
        tokenizer_object=padded,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        unk_token=base.unk_token,
        model_max_length=10**9,
    )


def build_model_dir(shape: dict, tokenizer, out: Path, device: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape, **ids))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model.to(dtype).save_pretrained(out)
    del model
    tokenizer.save_pretrained(out)
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- GPU memory


class GpuMemorySampler(threading.Thread):
    """Samples `nvidia-smi` (each GPU's total and each process's use) until stopped; keeps the peaks.

    Only the GPUs this run sees count (CUDA_VISIBLE_DEVICES by index, else all): on a machine of
    several GPUs other jobs may hold the rest. `peak_device_gib` is the run's first GPU (the
    trainer's), `peak_by_gpu_gib` every one of its GPUs."""

    def __init__(self, interval_s: float):
        super().__init__(daemon=True)
        self.interval_s, self.stopped = interval_s, threading.Event()
        self.peak_by_gpu_mib, self.peak_by_pid_mib, self.samples, self.available = {}, {}, 0, True
        self.gpu_of_pid: dict[str, str] = {}
        self.started, self.first_seen_s = time.perf_counter(), {}  # when each pid first held memory
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.visible = [v.strip() for v in visible.split(",")] if visible.replace(",", "").isdigit() else None

    def _query(self, query: str) -> list[list[str]]:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        ).stdout
        return [[field.strip() for field in line.split(",")] for line in out.splitlines() if line.strip()]

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                gpus = self._query("--query-gpu=index,uuid,memory.used")
                apps = self._query("--query-compute-apps=pid,gpu_uuid,used_memory")
            except (OSError, subprocess.TimeoutExpired):
                self.available = False
                return
            index_of_uuid = {uuid: index for index, uuid, _ in gpus}
            for index, _, used in gpus:
                if self.visible is None or index in self.visible:
                    self.peak_by_gpu_mib[index] = max(self.peak_by_gpu_mib.get(index, 0.0), float(used))
            for pid, uuid, used in apps:
                index = index_of_uuid.get(uuid, "?")
                if used.isdigit() and (self.visible is None or index in self.visible):
                    key = f"{pid}@{index}"  # a process may hold memory on several GPUs
                    self.peak_by_pid_mib[key] = max(self.peak_by_pid_mib.get(key, 0.0), float(used))
                    self.first_seen_s.setdefault(key, time.perf_counter() - self.started)
            self.samples += 1
            self.stopped.wait(self.interval_s)

    def report(self, trainer_pid: int) -> dict[str, Any]:
        if not self.available or not self.samples:
            return {"available": False}
        processes = {}
        for key, mib in self.peak_by_pid_mib.items():
            pid, _, gpu = key.partition("@")
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = "(exited or outside this pid namespace)"
            role = "trainer (train.py)" if pid == str(trainer_pid) else ("worker" if "serving" in command else "other")
            # Outside this pid namespace (a container) the roles are unknown; the worker starts
            # before train.py builds its trainer, so the order of first appearance tells them apart.
            processes[key] = {
                "role": role,
                "gpu": gpu,
                "peak_gib": mib / 1024,
                "first_seen_s": round(self.first_seen_s[key], 1),
            }
        first_gpu = self.visible[0] if self.visible else min(self.peak_by_gpu_mib, key=int, default=None)
        return {
            "available": True,
            "samples": self.samples,
            "peak_device_gib": self.peak_by_gpu_mib.get(first_gpu, 0.0) / 1024,
            "peak_by_gpu_gib": {gpu: mib / 1024 for gpu, mib in sorted(self.peak_by_gpu_mib.items())},
            "processes": processes,
            "peak_sum_of_processes_gib": sum(p["peak_gib"] for p in processes.values()),
        }


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
    config = _read_json(str(run_dir / "config.json")) or {}
    keys = ("max_tokens_per_gpu", "recompute_granularity", "compile_layers", "use_dynamic_batch_size")
    plan = {key: config.get("train", {}).get(key) for key in keys}
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    plan["line"] = next((line for line in lines if line.startswith("trainer on GPU 0:")), None)
    return plan


def lower_bound(name: str, args: argparse.Namespace, result: dict) -> dict[str, Any]:
    """bound = generated tokens / served tokens/s + trained tokens / trainer tokens/s (see the docstring);
    `bound_with_prefill_s` adds the step's measured prefill time (the served figure's 128-token
    prompts leave most of this step's prefill work out; one worker does prefill and decode in turn)."""
    per, rp = result["per_step"], result["replay"]
    out: dict[str, Any] = {"formula": "generated tokens / served tokens/s + trained tokens / trainer tokens/s"}
    out["served_tokens_per_s"] = rp["served_tokens_per_s"]
    gen = _read_json(args.generation_json)
    if gen and gen.get("model") == "qwen0.5b" and name == "0.5b":  # the same shape's figure, for comparison
        out["served_tokens_per_s_generation_json"] = gen["served"]["concurrent"]["tokens_per_s"]
    memory = _read_json(args.trainer_json)
    # The trainer benchmark's row at the loop's own setting (recomputed layers or kept activations).
    recompute = result.get("trainer_plan", {}).get("recompute_granularity", "full") == "full"
    setting = "dynamic_tokens_recompute" if recompute else "dynamic_tokens"
    row = next(
        (
            r
            for r in (memory or {}).get("rows", [])
            if r["shape"] == TRAINER_MEMORY_SHAPE.get(name) and r["setting"] == setting and not r.get("oom")
        ),
        None,
    )
    if row:
        out["trainer_tokens_per_s"] = memory["batch"] * memory["seq"] / row["step_s"]
        machine = memory.get("machine")  # trainer_memory.py writes a string, the other benchmarks a dict
        gpu = machine.get("gpu", "?") if isinstance(machine, dict) else machine
        out["trainer_source"] = f"{args.trainer_json}: {row['shape']} {setting}, {gpu}"
        out["train_s"] = per["train/tokens"] / out["trainer_tokens_per_s"]
        out["trainer_json_max_tokens_per_gpu"] = memory.get("max_tokens_per_gpu")
        out["loop_train_vs_trainer_json"] = (
            per["perf/train_time"] / out["train_s"]
        )  # the loop's train part, same tokens
    else:
        out["trainer_source"] = "no trainer JSON row for this shape: this run's own train/step_time"
        out["train_s"] = per["train/step_time"]
    out["generation_s"] = per["generated_tokens"] / rp["served_tokens_per_s"]
    out["bound_s"] = out["generation_s"] + out["train_s"]
    out["bound_with_prefill_s"] = out["bound_s"] + rp["prefill_only_s"]
    out["step_vs_bound"] = per["perf/step_time"] / out["bound_s"]
    out["step_vs_bound_with_prefill"] = per["perf/step_time"] / out["bound_with_prefill_s"]
    return out


def _jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a last line cut off by a stopped run is left out."""
    lines = jsonl_lines(path.read_text(encoding="utf-8")) if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _read_json(path: str | None) -> dict | None:
    return json.loads(Path(path).read_text()) if path and Path(path).exists() else None


# ----------------------------------------------------------------------------- report


def verdicts(result: dict) -> dict[str, Any]:
    if not {"per_step", "replay", "bound"} <= set(result):
        return {"ran": False}
    per, mem, bound = result["per_step"], result["gpu_memory"], result["bound"]
    prefill_s = result["replay"]["prefill_only_s"]
    saving = prefill_s / per["perf/step_time"] * result["prefix"]["repeated_share"]
    out = {
        "weight_push_share": per["perf/weight_push_time"] / per["perf/step_time"],
        "prefill_share_of_step": prefill_s / per["perf/step_time"],
        "prefill_share_of_rollout": prefill_s / per["meta_learning/inner_loop_time"],
        "prefix_cache_max_saving_share_of_step": saving,
        "prefix_cache_pays": saving >= 0.05,
        "meets": {
            "weight_push_share": per["perf/weight_push_time"] / per["perf/step_time"] <= TARGETS["weight_push_share"],
            "step_vs_bound": bound["step_vs_bound"] <= TARGETS["step_vs_bound"],
        },
    }
    target = TARGETS.get(f"peak_gpu_gib_{result['shape']}")
    if mem.get("available") and target:
        out["meets"]["peak_gpu_gib"] = mem["peak_device_gib"] <= target
    if result["shape"] in REAL_SHAPES and result.get("floor", {}).get("step_vs_floor"):
        out["meets"]["step_vs_floor"] = result["floor"]["step_vs_floor"] <= TARGETS["step_vs_floor_real"]
    if f"step_s_{result['shape']}" in TARGETS:
        out["meets"]["step_s"] = per["perf/step_time"] <= TARGETS[f"step_s_{result['shape']}"]
    return out


def print_table(report: dict) -> None:
    rows, notes = [], []
    for r in report["shapes"]:
        v = r["verdicts"]
        if not v.get("meets"):
            why = "see error" if r.get("error") else f"rc {r.get('returncode')}"
            rows.append([r["shape"], f"failed: {why}"] + [None] * 12)
            continue
        p, b, m, pre = r["per_step"], r["bound"], r["gpu_memory"], r["prefix"]
        rows.append(
            [
                r["shape"],
                p["perf/step_time"],
                p["perf/rollout_wait_time"],
                p["perf/train_time"],
                p["perf/weight_push_time"],
                p["generated_tokens"],
                pre["prefilled_tokens"],
                p["train/tokens"],
                m.get("peak_device_gib"),
                r.get("floor", {}).get("floor_s"),
                b["bound_s"],
                b["step_vs_bound"],
                v["weight_push_share"],
                pre["repeated_share"],
            ]
        )
        procs = ", ".join(f"{p['role']} {p['peak_gib']:.1f}" for p in m.get("processes", {}).values()) or "-"
        pays = "pays" if v["prefix_cache_pays"] else "does not pay"
        notes.append(
            f"{r['shape']}: per process peak GiB: {procs}; prefill {r['replay']['prefill_only_s']:.2f}s = "
            f"{v['prefill_share_of_step']:.1%} of a step; a prefix cache would save at most "
            f"{v['prefix_cache_max_saving_share_of_step']:.1%} of a step ({pays}); meets: "
            + ", ".join(f"{k}={'yes' if ok else 'NO'}" for k, ok in v["meets"].items())
        )
    print(
        C.table(
            rows,
            [
                "shape",
                "step s",
                "rollout s",
                "train s",
                "push s",
                "gen tok",
                "prefill tok",
                "train tok",
                "peak GiB",
                "floor s",
                "bound s",
                "step/bound",
                "push share",
                "prefix repeat",
            ],
        )
    )
    print_phases(report)
    print("\n".join(notes))


def print_phases(report: dict) -> None:
    """The step by phase (seconds, means over the measured steps): the rollout's dependent phases
    (the step's prefills replayed apart, inside them), the trainer's parts, the push, idle, and
    what ran at once (rollouts ahead of training)."""
    shapes = [r for r in report["shapes"] if r.get("phases")]
    if not shapes:
        return
    rollout_names = list(dict.fromkeys(n for r in shapes for n in r["phases"]["rollout_phases"]))
    rows = []
    for r in shapes:
        ph, floor = r["phases"], r["floor"]
        rows.append(
            [
                r["shape"],
                floor["floor_s"],
                r["bound"]["bound_s"],
                ph["step"],
                ph["prefill_replayed_s"],
                *[ph["rollout_phases"].get(n) for n in rollout_names],
                ph["trainer"]["forward_backward"],
                ph["trainer"]["reference_forward"],
                ph["trainer"]["optimizer"],
                ph["push"],
                ph["idle"],
                ph.get("overlapped", 0.0),
            ]
        )
    print(
        C.table(
            rows,
            [
                "shape",
                "floor s",
                "bound s",
                "step s",
                "(prefill)",
                *rollout_names,
                "fwd+bwd",
                "ref fwd",
                "optimizer",
                "push",
                "idle",
                "overlapped",
            ],
        )
    )
    for r in shapes:
        f = r["floor"]
        print(
            f"{r['shape']}: floor {f['floor_s']:.2f}s = train {f['train_s']:.2f} ({f['train_passes']} passes) + "
            f"prefill {f['prefill_s']:.2f} + decode {f['decode_s']:.3f} ({f['decode_steps']} steps) at "
            f"{f['peak_tflops']:g} TFLOP/s, {f['bandwidth_tbs']:g} TB/s; step / floor {f['step_vs_floor']:.1f}; "
            f"trainer: {r.get('trainer_plan', {}).get('line') or r.get('trainer_plan')}"
        )
        per = r["per_step"]
        for pool in sorted({k.split("/")[1].rsplit("_busy_share")[0] for k in per if k.endswith("_busy_share")}):
            seconds = {
                kind: per.get(f"worker/{pool}_{kind}_time", 0.0)
                for kind in ("prefill", "fast_decode", "dynamic_decode", "idle")
            }
            decode_steps = per.get(f"worker/{pool}_decode_steps", 0)
            rows_per_step = per.get(f"worker/{pool}_tokens_generated", 0) / max(decode_steps, 1)
            print(
                f"{r['shape']}: {pool} worker per step: "
                + ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())
                + f" (busy {per[f'worker/{pool}_busy_share']:.0%} of the step; the rollout waited"
                f" {per['perf/rollout_wait_time']:.2f}s); {decode_steps:.0f} decode"
                f" steps of {rows_per_step:.1f}"
                f" rows, {per.get(f'worker/{pool}_prefill_batches', 0):.0f} prefills"
            )


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
