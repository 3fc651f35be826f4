"""slime's own Megatron trainer, our plugins: one step from a saved rollout, at tensor and data parallel sizes.

Stages, each its own subcommand:

  rollout  (CPU is enough) one real step of our rollout plugin on the tiny Llama with all three channels:
           GRPO over the infos, SDPO's JSD to the hinted answers' top-k (--sdpo-alpha, --sdpo-topk) and
           replay DPO pairs (--replay-beta; the replay teachers are a stand-in OpenAI-compatible server that
           answers every problem with its label), written as slime's --load-debug-rollout-data file
           (rollout_0.pt, and local_inputs_0.pt for the local trainer; slime_megatron_cpu.py).
  train    (GPUs) `train.py --backend slime ... --debug-train-only --load-debug-rollout-data FILE` on
           --tensor-parallel N x --data-parallel M GPUs: slime's parse_args, Ray placement group,
           RolloutManager (our conversion and reward plugins), Megatron actors, our loss and top-k hook, one
           optimizer step. slime takes the GPU count (--actor-num-gpus-per-node N x M) and Megatron's
           --tensor-model-parallel-size N, and Megatron derives the data parallel size from the two
           (world size / (TP x PP x CP)). Megatron without TransformerEngine: `--transformer-impl local` with
           the hooks of slime_megatron_hooks.py (slime 624b824 assumes TE). The HF checkpoint goes to --load
           (slime's own loader). Writes train_<tag>.log and train_<tag>.json (first step's metrics, slime's
           step times, peak GPU memory per rank). --grad-report logs each parameter's gradient norm at the
           optimizer step (and the JSON keeps them); --fp32 trains in float32 instead of slime's bf16.
  torch    the same step in plain torch on the same weights, float32 (CPU is enough; slime_megatron_cpu.py).
  compare  every train_<tag>.json of --out against the reference tag's (default tp1): relative differences
           of the first step's loss terms and grad norm, step time and peak memory per GPU; one JSON
           (compare_parallel.json) and a table on stdout (slime_megatron_compare.py).
  parallel (GPUs) one command for a set of layouts on one saved rollout: `train` at each (--layouts; by
           default tensor parallel 1, 2 and data parallel 2 on --gpus 2; tensor parallel 1, 4 and tensor
           parallel 2 x data parallel 2 on --gpus 4), each in its own Ray session, nvidia-smi sampled per
           GPU while it runs (nvsmi_<tag>.csv), then `compare` of these runs against tensor parallel 1:
           compare_parallel_g<N>[_kl].json. Every run of the set pads the vocabulary alike (a multiple of every
           TP of the set). --kl-loss-coef W adds the KL term to the start weights (slime's reference model
           from the checkpoint) in every run, so its value is compared too.

The vocabulary: Megatron pads it to a multiple of --make-vocab-size-divisible-by x TP with zero rows (logit 0:
each padded token takes a share of every softmax, so padding changes the function). The tiny Llama has 357
tokens, which TP 2 must pad to 358; so every run pads to a multiple of --vocab-multiple (default 2) whatever
its TP, and all runs compute the same function (the torch stage's all-channel step pads the same way).

Needs (installs nothing): slime's source (`--slime-src`, THUDM/slime at 624b824) on every stage; for `rollout`
ray and sglang-router importable; for `train` CUDA GPUs with torch, ray 2.60, Megatron-LM at slime's pinned
commit 1dcf0da with slime's docker/patch/latest/megatron*.patch, torch_memory_saver, sglang and sglang-router,
wandb and what they import (docs/cluster.md, "One step of slime's Megatron trainer"). With numpy 2 the
training run gets a sitecustomize that lets slime's numpy-1.x assertion pass (the hooks file).

  OUT=benchmarks/results/slime_megatron
  python benchmarks/slime_megatron.py rollout --slime-src /tmp/slime_src --out $OUT                  # CPU
  python benchmarks/slime_megatron.py train --slime-src /tmp/slime_src --out $OUT --tag tp1          # 1 GPU
  python benchmarks/slime_megatron.py train --slime-src /tmp/slime_src --out $OUT --tensor-parallel 2 --tag tp2
  python benchmarks/slime_megatron.py train --slime-src /tmp/slime_src --out $OUT --data-parallel 2 --tag dp2
  python benchmarks/slime_megatron.py compare --out $OUT                                             # table
  python benchmarks/slime_megatron.py parallel --slime-src /tmp/slime_src --out $OUT --gpus 4        # 4 GPUs
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from slime_megatron_compare import run_compare

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data/synthetic_suffix.jsonl"
ROLLOUT_FILE = "rollout_{rollout_id}.pt"

# Our flags, the same at rollout and at training time (the plan's --global-batch-size counts the chains).
META_FLAGS = [
    "--use-meta-learning",
    *("--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--heldout-ipb", "2"),
    *("--num-inner-iterations", "1", "--n-samples-per-inner-prompt", "2"),
    *("--teacher-max-tokens", "6", "--rollout-max-response-len", "6"),
    *("--generator-template", "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate"),
    *("--teacher-template", "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate"),
    *("--grader", "verifier", "--verifier-metric", "char"),
    *("--teacher-temperature", "1", "--rollout-temperature", "1"),  # replay DPO scores at temperature 1
    *("--sdpo-alpha", "0.5", "--sdpo-topk", "8", "--replay-beta", "0.5", "--student-num-gpus", "1"),
]

# Megatron without TransformerEngine or apex: the local layer spec and no fused kernels; no dropout,
# so the step is the same function at every parallel size. The HF directory goes to --load: slime's
# own HF->Megatron loader (hf_to_megatron, `llama`) reads it, no torch_dist conversion needed.
MEGATRON_FLAGS = [
    *("--transformer-impl", "local", "--micro-batch-size", "1", "--seed", "1234"),
    *("--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.0", "--clip-grad", "1.0"),
    *("--adam-beta1", "0.9", "--adam-beta2", "0.98", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"),
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--accumulate-allreduce-grads-in-fp32",
]
HOOK_FLAGS = [
    *("--custom-megatron-init-path", "slime_megatron_hooks.actor_init"),
    *("--spec", "slime_megatron_hooks", "packed_local_layer_spec"),
]
FP32_HOOK_FLAGS = [
    *("--custom-megatron-init-path", "slime_megatron_hooks.actor_init_fp32"),
    *("--spec", "slime_megatron_hooks", "packed_local_layer_spec"),
]
GRAD_REPORT_FLAGS = ["--custom-megatron-before-train-step-hook-path", "slime_megatron_hooks.grad_norm_report"]
# The parallel stage's layouts by GPU count: the reference (tensor parallel 1) first.
LAYOUTS = {2: ("tp1", "tp2", "dp2"), 4: ("tp1", "tp4", "tp2dp2")}


def tiny_checkpoint() -> Path:
    from slime_meta.models.tiny.build import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(REPO / ".cache/models")


def megatron_shape(checkpoint: Path, tensor_parallel: int, vocab_multiple: int) -> list[str]:
    """Megatron's model flags for an HF Llama or Qwen2 config (slime checks them against the config at
    parse time). Qwen2 is Llama with biases on the query, key and value projections."""
    config = json.loads((checkpoint / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    if heads % tensor_parallel or kv_heads % tensor_parallel:
        raise SystemExit(f"{checkpoint}: {heads} heads, {kv_heads} KV heads: not divisible by TP {tensor_parallel}")
    if vocab_multiple % tensor_parallel:
        raise SystemExit(f"--vocab-multiple {vocab_multiple} is not a multiple of --tensor-parallel {tensor_parallel}")
    rope = config.get("rope_parameters") or {}
    flags = [
        *("--num-layers", str(config["num_hidden_layers"]), "--hidden-size", str(config["hidden_size"])),
        *("--ffn-hidden-size", str(config["intermediate_size"]), "--num-attention-heads", str(heads)),
        *("--kv-channels", str(config.get("head_dim") or config["hidden_size"] // heads)),
        *("--normalization", "RMSNorm", "--norm-epsilon", str(config["rms_norm_eps"])),
        *("--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope"),
        "--rotary-base",
        str(int(float(rope.get("rope_theta", config.get("rope_theta") or 10000)))),  # an int flag
        # Megatron pads to a multiple of this x TP: the same padded vocabulary at every TP (module docstring).
        *(
            "--vocab-size",
            str(config["vocab_size"]),
            "--make-vocab-size-divisible-by",
            str(vocab_multiple // tensor_parallel),
        ),
        *("--seq-length", str(config["max_position_embeddings"])),
        *("--max-position-embeddings", str(config["max_position_embeddings"])),
    ]
    if kv_heads != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(kv_heads)]
    if config.get("model_type") == "qwen2":
        flags.append("--add-qkv-bias")
    if not config.get("tie_word_embeddings", False):
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def train_argv(
    out: Path,
    checkpoint: Path,
    tensor_parallel: int = 1,
    data_parallel: int = 1,
    vocab_multiple: int = 2,
    grad_report: bool = False,
    fp32: bool = False,
    kl_loss_coef: float = 0.0,
):
    """`train.py --backend slime` flags: ours as at rollout time, slime's debug-train-only mode, Megatron's.
    `grad_report`: each parameter's gradient norm in the log (slime_megatron_hooks.grad_norm_report);
    `fp32`: the model, gradients and optimizer in float32, not slime's bf16 (slime_megatron_hooks.actor_init_fp32);
    `kl_loss_coef`: the KL term to the start weights (slime's reference model, read from the checkpoint)."""
    from slime_meta.backends.slime.data import convert

    prompts = out / "prompts.slime.jsonl"
    convert(DATA, prompts)  # slime's data source reads --prompt-data even when it does not draw from it
    return [
        *META_FLAGS,
        *("--prompt-data", str(prompts), "--hf-checkpoint", str(checkpoint), "--load", str(checkpoint)),
        *("--actor-num-gpus-per-node", str(tensor_parallel * data_parallel), "--rollout-num-gpus", "1"),
        *("--tensor-model-parallel-size", str(tensor_parallel)),
        # The actors' own environment too (Ray's runtime env), not only the driver's (run_train sets it there).
        *("--train-env-vars", json.dumps({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})),
        *("--run-dir", str(out / "train_run")),
        # Replay's pairs are in the saved rollout already: the teachers are never called when training.
        *("--replay-teachers", "t0@http://127.0.0.1:9/v1", "t1@http://127.0.0.1:9/v1"),
        *("--debug-train-only", "--load-debug-rollout-data", str(out / ROLLOUT_FILE), "--num-rollout", "1"),
        *megatron_shape(checkpoint, tensor_parallel, vocab_multiple),
        *MEGATRON_FLAGS,
        *(FP32_HOOK_FLAGS if fp32 else HOOK_FLAGS),
        *(GRAD_REPORT_FLAGS if grad_report else []),
        *(("--kl-loss-coef", str(kl_loss_coef), "--ref-load", str(checkpoint)) if kl_loss_coef else ()),
    ]


# ---------------------------------------------------------------- train (GPUs)


def logged_dict(log_text: str, pattern: str) -> dict | None:
    """The first dict slime logs after `pattern` (`step 0: {...}`, `perf 0: {...}`), its numbers as floats."""
    match = re.search(pattern + r" (\{.*\})", log_text)
    if match is None:
        return None
    return {k: float(v) for k, v in ast.literal_eval(match.group(1)).items() if isinstance(v, (int, float))}


def peak_memory(log_text: str) -> dict:
    """Per rank, the largest torch allocator peaks the hooks' reporter logged (GiB), and the largest
    device memory in use that slime's memory_utils logged (GB, every process on that GPU)."""
    ranks: dict[str, dict] = {}
    for rank, allocated, reserved in re.findall(
        r"peak_memory rank (\d+): allocated ([\d.]+) GiB reserved ([\d.]+)", log_text
    ):
        entry = ranks.setdefault(rank, {})
        entry["max_allocated_GiB"] = max(entry.get("max_allocated_GiB", 0.0), float(allocated))
        entry["max_reserved_GiB"] = max(entry.get("max_reserved_GiB", 0.0), float(reserved))
    for rank, used in re.findall(r"\[Rank (\d+)\] Memory-Usage [^{]*\{[^}]*'used_GB': ([\d.]+)", log_text):
        entry = ranks.setdefault(rank, {})
        entry["device_used_GB"] = max(entry.get("device_used_GB", 0.0), float(used))
    return dict(sorted(ranks.items(), key=lambda kv: int(kv[0])))


def grad_report(log_text: str) -> dict | None:
    """The hooks' `grad_report` lines (--grad-report): the first step's total and each parameter's norm."""
    total = re.search(r"grad_report total: (\{.*\})", log_text)
    if total is None:
        return None
    params = {}
    for name, row in re.findall(r"grad_report (\S+): (\{.*\})", log_text):
        if name != "total" and name not in params:
            params[name] = json.loads(row)
    return {"total": json.loads(total.group(1)), "params": params}


def run_train(out: Path, checkpoint: Path, slime_src: str, ns: argparse.Namespace) -> dict:
    env = dict(os.environ)
    # Ray's workers start in their own directory: slime and this repository must be on their path.
    from slime_megatron_hooks import numpy_gate_site

    gate = numpy_gate_site(out) or ""
    paths = (gate, slime_src, str(REPO), str(REPO / "benchmarks"), env.get("PYTHONPATH", ""))  # benchmarks/: hooks
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Megatron's argument check on Hopper and older: TP or CP > 1 needs one CUDA connection (parse time, driver side).
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env["RAY_DEDUP_LOGS"] = "0"  # Ray folds lines that differ only in numbers: each rank's memory lines must stay
    argv = train_argv(
        out,
        checkpoint,
        ns.tensor_parallel,
        ns.data_parallel,
        ns.vocab_multiple,
        ns.grad_report,
        ns.fp32,
        getattr(ns, "kl_loss_coef", 0.0),
    )
    command = [sys.executable, str(REPO / "train.py"), "--backend", "slime", *argv]
    print("+", " ".join(command), flush=True)
    log_path = out / f"train_{ns.tag}.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        # Its own session: on timeout the whole group goes (Ray's local cluster is started by train.py).
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

        def copy_output():
            for line in process.stdout:
                sys.stdout.write(line)
                log.write(line)
                log.flush()

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        try:
            code = process.wait(timeout=ns.timeout)
        except subprocess.TimeoutExpired:
            print(f"train: no exit after {ns.timeout} s; stopping its process group", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
        reader.join(timeout=10)
    text = log_path.read_text()
    return {
        "tag": ns.tag,
        "tensor_parallel": ns.tensor_parallel,
        "data_parallel": ns.data_parallel,
        "gpus": ns.tensor_parallel * ns.data_parallel,
        "vocab_multiple": ns.vocab_multiple,
        "kl_loss_coef": getattr(ns, "kl_loss_coef", 0.0),
        "returncode": code,
        "seconds": round(time.perf_counter() - started, 1),
        "first_step": logged_dict(text, r"\bstep 0:"),
        "perf": logged_dict(text, r"\bperf 0:"),
        "peak_memory": peak_memory(text),
        "grad_report": grad_report(text),
        "command": command[1:],
    }


# ---------------------------------------------------------------- parallel (GPUs): one command for a set of layouts


def parse_layout(name: str) -> tuple[int, int]:
    """`tp4` -> (4, 1), `dp2` -> (1, 2), `tp2dp2` -> (2, 2): Megatron's tensor parallel and the data parallel size."""
    match = re.fullmatch(r"(?:tp(\d+))?(?:dp(\d+))?", name)
    if not name or match is None:
        raise ValueError(f"layout {name!r}: write tpN, dpM or tpNdpM (e.g. tp4, dp2, tp2dp2)")
    tp, dp = int(match.group(1) or 1), int(match.group(2) or 1)
    if tp < 1 or dp < 1:
        raise ValueError(f"layout {name!r}: sizes must be >= 1")
    return tp, dp


def parallel_plan(gpus: int, layouts: str | None, vocab_multiple: int) -> dict:
    """The parallel stage's runs: tag -> (TP, DP) with the tensor parallel 1 reference first, and the
    vocabulary multiple every run pads to (a multiple of every TP of the set, so all compute one function)."""
    names = [n.strip() for n in layouts.split(",") if n.strip()] if layouts else list(LAYOUTS.get(gpus, ()))
    if not names:
        raise ValueError(f"--gpus {gpus}: no default layouts (2 or 4); give --layouts, e.g. tp1,tp2dp2")
    runs = {name: parse_layout(name) for name in names}
    reference = [name for name, (tp, dp) in runs.items() if (tp, dp) == (1, 1)]
    if not reference:
        raise ValueError("--layouts: the set needs tp1 (tensor parallel 1 on one GPU), the reference")
    for name, (tp, dp) in runs.items():
        if tp * dp > gpus:
            raise ValueError(f"layout {name}: {tp * dp} GPUs, more than --gpus {gpus}")
    multiple = vocab_multiple
    for tp, _ in runs.values():
        multiple = multiple * tp // math.gcd(multiple, tp)
    ordered = {reference[0]: runs[reference[0]], **{n: r for n, r in runs.items() if n != reference[0]}}
    return {"runs": ordered, "reference": reference[0], "vocab_multiple": multiple}


class GpuSampler:
    """nvidia-smi's memory in use per GPU every half second while a run goes, into nvsmi_<tag>.csv
    (`index, memory.used` lines, what gpu_peaks reads); nothing where nvidia-smi is missing."""

    def __init__(self, path: Path):
        self.path, self.process, self.file = path, None, None

    def __enter__(self):
        smi = shutil.which("nvidia-smi")
        if smi:
            self.file = open(self.path, "w")
            query = [smi, "--query-gpu=index,memory.used", "--format=csv,noheader", "-lms", "500"]
            self.process = subprocess.Popen(query, stdout=self.file, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
            self.file.close()
        return False


def stop_ray() -> None:
    """Each run in its own Ray session: what a run left of Ray's local cluster goes before the next one."""
    ray = shutil.which("ray")
    if ray:
        subprocess.run([ray, "stop", "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def run_parallel(ns: argparse.Namespace, checkpoint: Path, samples: int | None, train=None) -> int:
    """Every layout of the set in turn on the saved rollout, then their comparison with tensor parallel 1.
    `train(out, checkpoint, slime_src, ns) -> result` is run_train (a stand-in in the tests)."""
    train = train or run_train
    plan = parallel_plan(ns.gpus, ns.layouts, ns.vocab_multiple)
    prefix = f"g{ns.gpus}{'_kl' if ns.kl_loss_coef else ''}_"  # a set with the KL term keeps files of its own
    for name, (tp, dp) in plan["runs"].items():
        if samples is not None and samples % dp:
            print(f"error: the rollout has {samples} samples, not a multiple of data parallel {dp} ({name})")
            return 2
    print(f"parallel: {', '.join(plan['runs'])} on the saved rollout, vocabulary multiple {plan['vocab_multiple']}")
    tags, ok = [], True
    for name, (tp, dp) in plan["runs"].items():
        run_ns = argparse.Namespace(**{**vars(ns), "tensor_parallel": tp, "data_parallel": dp})
        run_ns.vocab_multiple, run_ns.tag = plan["vocab_multiple"], prefix + name
        stop_ray()
        with GpuSampler(ns.out / f"nvsmi_{run_ns.tag}.csv"):
            result = {"checkpoint": checkpoint.name, **train(ns.out, checkpoint, ns.slime_src or "", run_ns)}
        (ns.out / f"train_{run_ns.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
        ok &= result["returncode"] == 0 and bool(result["first_step"])
        tags.append(run_ns.tag)
    stop_ray()
    run_compare(ns.out, prefix + plan["reference"], tags=tags, name=f"compare_parallel_{prefix[:-1]}.json")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=("rollout", "train", "torch", "compare", "parallel"))
    parser.add_argument("--slime-src", default=os.environ.get("SLIME_SRC"), help="a THUDM/slime checkout (624b824)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/slime_megatron")
    parser.add_argument("--checkpoint", type=Path, default=None, help="HF Llama directory (default: the tiny one)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="Megatron's tensor model parallel size")
    parser.add_argument("--data-parallel", type=int, default=1, help="data parallel size (GPUs = TP x DP)")
    parser.add_argument("--vocab-multiple", type=int, default=2, help="pad the vocabulary to a multiple of this")
    parser.add_argument("--tag", default=None, help="names train_<tag>.json/.log (default tp<N>dp<M>)")
    parser.add_argument("--reference", default="tp1", help="compare: the tag every run is put against")
    parser.add_argument(
        "--grad-report", action="store_true", help="train: log each parameter's gradient norm (`grad_report` lines)"
    )
    parser.add_argument("--fp32", action="store_true", help="train: float32 model and optimizer instead of bf16")
    parser.add_argument("--timeout", type=int, default=480, help="seconds for the training subprocess")
    parser.add_argument(
        "--gpus", type=int, default=2, help="parallel: the GPUs of the set (2: tp1,tp2,dp2; 4: tp1,tp4,tp2dp2)"
    )
    parser.add_argument("--layouts", default=None, help="parallel: the runs, e.g. tp1,tp4,tp2dp2 (default by --gpus)")
    parser.add_argument(
        "--kl-loss-coef", type=float, default=0.0, help="train, parallel: the KL term to the start weights (0: none)"
    )
    ns = parser.parse_args(argv)
    if ns.stage == "parallel":
        try:
            parallel_plan(ns.gpus, ns.layouts, ns.vocab_multiple)
        except ValueError as error:
            parser.error(str(error))
    ns.tag = ns.tag or f"tp{ns.tensor_parallel}dp{ns.data_parallel}"
    if ns.stage == "compare":
        run_compare(ns.out, ns.reference)
        return 0
    sys.path.insert(0, str(REPO))  # slime_meta, when the repository is not installed (pip install -e .)
    if ns.slime_src:
        sys.path.insert(0, str(Path(ns.slime_src).resolve()))
    checkpoint = (ns.checkpoint or tiny_checkpoint()).resolve()
    import slime_megatron_cpu as cpu

    if ns.stage == "rollout":
        summary = cpu.run_rollout(META_FLAGS, ns.out, checkpoint)
        (ns.out / "rollout_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return 0
    if not (ns.out / "rollout_0.pt").exists():
        print(f"error: {ns.out / 'rollout_0.pt'} is missing: run the rollout stage first", file=sys.stderr)
        return 2
    if ns.stage == "torch":
        result = {
            "checkpoint": checkpoint.name,
            **cpu.run_torch_step(train_argv(ns.out, checkpoint), ns.out, checkpoint),
        }
        print(json.dumps(result, indent=1))
        (ns.out / "torch_step.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0
    summary = ns.out / "rollout_summary.json"
    samples = json.loads(summary.read_text())["samples"] if summary.exists() else None
    if ns.stage == "parallel":
        return run_parallel(ns, checkpoint, samples)
    if samples is not None and samples % ns.data_parallel:
        # slime's static micro-batching (micro-batch size 1) gives every data parallel rank the same number
        # of micro-batches, and refuses a step whose sample count does not divide (dp_schedule.py).
        print(f"error: the rollout has {samples} samples, not a multiple of --data-parallel {ns.data_parallel}")
        return 2
    result = {"checkpoint": checkpoint.name, **run_train(ns.out, checkpoint, ns.slime_src or "", ns)}
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=1))
    (ns.out / f"train_{ns.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["returncode"] == 0 and result["first_step"] else 1


if __name__ == "__main__":
    sys.exit(main())
