"""slime's own Megatron trainer, one GPU, our plugins: one step from a saved rollout, compared.

Three stages, each its own subcommand; `all` runs `train` then `compare` (the GPU machine's part):

  rollout  (CPU is enough) one real step of our rollout plugin (`rollout.generate_rollout`) on the tiny
           Llama served by the project's own pools behind sglang-router, with all three channels:
           GRPO over the infos, SDPO's JSD to the hinted answers' top-k (--sdpo-alpha, --sdpo-topk) and
           replay DPO pairs (--replay-beta; the replay teachers are a stand-in OpenAI-compatible server that
           answers every problem with its label, named as such below). Its samples are written as slime's
           --load-debug-rollout-data file (slime's own `save_debug_rollout_data`).
  train    (GPU) `train.py --backend slime ... --debug-train-only --load-debug-rollout-data FILE`: slime's
           parse_args, Ray placement group, RolloutManager (our conversion and reward plugins), Megatron
           actor, our loss and top-k hook, one optimizer step. Megatron without TransformerEngine:
           `--transformer-impl local` with two hooks of slime_megatron_hooks.py (slime 624b824 assumes TE):
           --spec `packed_local_layer_spec` (the local spec with a THD-packed causal attention: the local
           DotProductAttention refuses slime's packed micro-batches) and --custom-megatron-init-path
           `local_spec_hf_names` (slime's HF->Megatron loader knows the TE spec's fused input norm only).
           The HF checkpoint goes to --load (slime's own loader; no torch_dist conversion).
  compare  the same step in plain torch on the same weights, float32: our plugins on slime's batch
           layout (slime's conversion, loss_function and metric reduction, one micro-batch per sample as
           Megatron ran it), and the local trainer (`LocalTrainer.compute_gradients`) on the infos and the
           SDPO samples (replay's loss value differs by design: two surrogate samples, not DPO's loss).

Needs (installs nothing): slime's source (`--slime-src`, THUDM/slime at 624b824) on every stage;
for `rollout` ray and sglang-router importable; for `train` one CUDA GPU with torch, ray 2.60,
Megatron-LM at slime's pinned commit 1dcf0da with slime's docker/patch/latest/megatron*.patch
(megatron-core 0.19.2 from PyPI lacks the --moe-use-legacy-grouped-gemm argument slime's model provider
reads), torch_memory_saver, the sglang and sglang-router wheels (slime's argument module imports both),
wandb, and what they import; docs/cluster.md ("One step of slime's Megatron trainer") lists them. With
numpy 2 the training run gets a sitecustomize that lets slime's numpy-1.x assertion pass (the hooks file).

  OUT=benchmarks/results/slime_megatron_1gpu
  python benchmarks/slime_megatron_1gpu.py rollout --slime-src /tmp/slime_src --out $OUT   # CPU
  python benchmarks/slime_megatron_1gpu.py all --slime-src /tmp/slime_src --out $OUT       # GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data/synthetic_suffix.jsonl"
ROLLOUT_FILE = "rollout_{rollout_id}.pt"
REPLAY_KEY_ENV = "SLIME_MEGATRON_1GPU_REPLAY_KEY"  # the stand-in replay teachers take any key

# Our flags, the same at rollout and at training time (the plan's --global-batch-size counts the chains).
META_FLAGS = [
    "--use-meta-learning",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "4",
    "--heldout-ipb",
    "2",
    "--num-inner-iterations",
    "1",
    "--n-samples-per-inner-prompt",
    "2",
    "--teacher-max-tokens",
    "6",
    "--rollout-max-response-len",
    "6",
    "--generator-template",
    "slime_meta.data.tasks.synthetic.SyntheticGeneratorTemplate",
    "--teacher-template",
    "slime_meta.data.tasks.synthetic.SyntheticTeacherTemplate",
    "--grader",
    "verifier",
    "--verifier-metric",
    "char",
    "--teacher-temperature",
    "1",
    "--rollout-temperature",
    "1",  # replay DPO scores at temperature 1
    "--sdpo-alpha",
    "0.5",
    "--sdpo-topk",
    "8",
    "--replay-beta",
    "0.5",
    "--student-num-gpus",
    "1",
]


def tiny_checkpoint() -> Path:
    from slime_meta.models.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(REPO / ".cache/models")


def megatron_shape(checkpoint: Path) -> list[str]:
    """Megatron's model flags for an HF Llama config (slime checks them against the config at parse time)."""
    config = json.loads((checkpoint / "config.json").read_text())
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    flags = [
        "--num-layers",
        str(config["num_hidden_layers"]),
        "--hidden-size",
        str(config["hidden_size"]),
        "--ffn-hidden-size",
        str(config["intermediate_size"]),
        "--num-attention-heads",
        str(heads),
        "--kv-channels",
        str(config.get("head_dim") or config["hidden_size"] // heads),
        "--normalization",
        "RMSNorm",
        "--norm-epsilon",
        str(config["rms_norm_eps"]),
        "--swiglu",
        "--disable-bias-linear",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        str(int(float(rope.get("rope_theta", config.get("rope_theta") or 10000)))),  # an int flag
        # No padding: Megatron's extra vocabulary rows would be logits the HF model does not have.
        "--vocab-size",
        str(config["vocab_size"]),
        "--make-vocab-size-divisible-by",
        "1",
        "--seq-length",
        str(config["max_position_embeddings"]),
        "--max-position-embeddings",
        str(config["max_position_embeddings"]),
    ]
    if config.get("num_key_value_heads", heads) != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(config["num_key_value_heads"])]
    if not config.get("tie_word_embeddings", False):
        flags.append("--untie-embeddings-and-output-weights")
    return flags


# ---------------------------------------------------------------- rollout (CPU)


class _LabelTeacher(BaseHTTPRequestHandler):
    """A stand-in replay teacher (an OpenAI-compatible /chat/completions that answers with the label
    of the problem it finds in the prompt): replay pairs need teachers that agree on a right answer."""

    labels: dict[str, str] = {}

    def do_POST(self):  # noqa: N802  (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        text = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        answer = next((label for prompt, label in self.labels.items() if prompt in text), "?")
        reply = {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "label"),
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def label_teachers(count: int):
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    _LabelTeacher.labels = {row["prompt"]: row["label"] for row in rows}
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _LabelTeacher) for _ in range(count)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}/v1" for s in servers]
    finally:
        for server in servers:
            server.shutdown()


def rollout_namespace(checkpoint: Path, run_dir: Path, prompts: Path, teacher_url: str, student_url: str, replay_urls):
    """The namespace slime's rollout manager hands our plugin: our translated flags and slime's defaults
    for what its data source reads (slime's parse_args needs Megatron, which a CPU machine lacks)."""
    from slime_meta.backends.slime.plan import meta_parser, translate

    argv = [
        *META_FLAGS,
        "--prompt-data",
        str(prompts),
        "--hf-checkpoint",
        str(checkpoint),
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--run-dir",
        str(run_dir),
        "--replay-teachers",
        *[f"t{i}@{url}#{REPLAY_KEY_ENV}" for i, url in enumerate(replay_urls)],
    ]
    namespace, _ = meta_parser().parse_known_args(list(translate(argv).slime_argv))
    args = argparse.Namespace(**vars(namespace))
    args.__dict__.update(
        rollout_global_dataset=True,
        metadata_key="metadata",
        tool_key="tools",
        multimodal_keys=None,
        apply_chat_template=False,
        apply_chat_template_kwargs={},
        rollout_seed=42,
        rollout_max_prompt_len=None,
        dump_details=None,
        buffer_filter_path=None,
        eval_prompt_data=None,
    )

    def host_port(url: str) -> tuple[str, int]:
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        return host, int(port)

    args.sglang_router_ip, args.sglang_router_port = host_port(teacher_url)
    args.sglang_model_routers = {"actor": host_port(teacher_url), "student": host_port(student_url)}
    return args


def run_rollout(out: Path, checkpoint: Path) -> dict:
    from slime.observability.rollout_data_utils import save_debug_rollout_data
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    from slime_meta.backends.local.workers.launcher import LocalProcessGroup
    from slime_meta.backends.slime import rollout as plugin
    from slime_meta.backends.slime.data import convert
    from slime_meta.backends.slime.samples import META_KEY

    out.mkdir(parents=True, exist_ok=True)
    work = out / "rollout_work"
    prompts = work / "prompts.slime.jsonl"
    work.mkdir(exist_ok=True)
    convert(DATA, prompts)
    os.environ.setdefault(REPLAY_KEY_ENV, "unused")
    # What the local trainer would train on, as the plugin turns it into slime samples: each chain's
    # trained info (its last step) and its SDPO answers with their hint top-k.
    local_inputs: dict[str, list] = {"infos": [], "sdpo": []}
    chain_output = plugin._chain_output

    def recording_chain_output(rt, base, steps, trace, solver, counts, replay=()):
        local_inputs["infos"].append(steps[-1])
        local_inputs["sdpo"].extend(x for kind, x, _ in solver if kind == "sdpo_jsd")
        return chain_output(rt, base, steps, trace, solver, counts, replay)

    plugin._chain_output = recording_chain_output
    with LocalProcessGroup() as group, label_teachers(2) as replay_urls:
        pool = group.start_pool("teacher", str(checkpoint), 1, device="cpu", weights_root=None, log_dir=str(work))
        # The student model's URL is the worker's own: the same SGLang API as a second pool, without a second start.
        args = rollout_namespace(checkpoint, work / "run", prompts, pool.router_url, pool.worker_urls[0], replay_urls)
        output = plugin.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
        plugin.close_runtimes()
    plugin._chain_output = chain_output
    import torch

    torch.save(local_inputs, out / "local_inputs_0.pt")
    samples = [s for group_ in output.samples for chain in group_ for s in chain]
    save_debug_rollout_data(str(out / ROLLOUT_FILE), samples, rollout_id=0, evaluation=False)
    kinds: dict[str, int] = {}
    for s in samples:
        kind = s.metadata[META_KEY].get("kind", "info")
        kinds[kind] = kinds.get(kind, 0) + 1
    summary = {
        "samples": len(samples),
        "kinds": kinds,
        "rollouts": len({s.rollout_id for s in samples}),
        "metrics": {k: float(v) for k, v in output.metrics.items() if isinstance(v, (int, float))},
    }
    print(json.dumps({k: summary[k] for k in ("samples", "kinds", "rollouts")}))
    return summary


# ---------------------------------------------------------------- train (GPU)

# Megatron without TransformerEngine or apex: the local layer spec and no fused kernels; no dropout,
# so the step is the same function the comparison computes. The HF directory goes to --load: slime's
# own HF->Megatron loader (hf_to_megatron, `llama`) reads it, no torch_dist conversion needed.
MEGATRON_FLAGS = [
    "--transformer-impl",
    "local",
    "--micro-batch-size",
    "1",
    "--seed",
    "1234",
    "--lr",
    "1e-6",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0.0",
    "--clip-grad",
    "1.0",
    "--adam-beta1",
    "0.9",
    "--adam-beta2",
    "0.98",
    "--attention-dropout",
    "0.0",
    "--hidden-dropout",
    "0.0",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--accumulate-allreduce-grads-in-fp32",
]


def train_argv(out: Path, checkpoint: Path) -> list[str]:
    """`train.py --backend slime` flags: ours as at rollout time, slime's debug-train-only mode, Megatron's."""
    from slime_meta.backends.slime.data import convert

    prompts = out / "prompts.slime.jsonl"
    convert(DATA, prompts)  # slime's data source reads --prompt-data even when it does not draw from it
    return [
        *META_FLAGS,
        "--prompt-data",
        str(prompts),
        "--hf-checkpoint",
        str(checkpoint),
        "--load",
        str(checkpoint),
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--run-dir",
        str(out / "train_run"),
        # Replay's pairs are in the saved rollout already: the teachers are never called when training.
        "--replay-teachers",
        "t0@http://127.0.0.1:9/v1",
        "t1@http://127.0.0.1:9/v1",
        "--debug-train-only",
        "--load-debug-rollout-data",
        str(out / ROLLOUT_FILE),
        "--num-rollout",
        "1",
        *megatron_shape(checkpoint),
        *MEGATRON_FLAGS,
        "--custom-megatron-init-path",
        "slime_megatron_hooks.local_spec_hf_names",
        "--spec",
        "slime_megatron_hooks",
        "packed_local_layer_spec",
    ]


def first_step_metrics(log_text: str) -> dict | None:
    """slime's per-step line `step 0: {'train/loss': ...}` (model.py's logger), as a dict."""
    import ast

    match = re.search(r"\bstep 0: (\{.*\})", log_text)
    return None if match is None else {k: float(v) for k, v in ast.literal_eval(match.group(1)).items()}


def run_train(out: Path, checkpoint: Path, slime_src: str, timeout: int) -> dict:
    env = dict(os.environ)
    # Ray's workers start in their own directory: slime and this repository must be on their path.
    from slime_megatron_hooks import numpy_gate_site

    gate = numpy_gate_site(out) or ""
    paths = (gate, slime_src, str(REPO), str(REPO / "benchmarks"), env.get("PYTHONPATH", ""))  # benchmarks/: hooks
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    command = [sys.executable, str(REPO / "train.py"), "--backend", "slime", *train_argv(out, checkpoint)]
    print("+", " ".join(command), flush=True)
    log_path = out / "train.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in process.stdout:
            sys.stdout.write(line)
            log.write(line)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = -9
    text = log_path.read_text()
    return {
        "returncode": code,
        "seconds": round(time.perf_counter() - started, 1),
        "first_step": first_step_metrics(text),
        "command": command[1:],
    }


# ---------------------------------------------------------------- compare (CPU or GPU)


def slime_args_for(out: Path, checkpoint: Path):
    """slime's own parse_args over the training command line: the namespace the trainer had."""
    from slime_meta.backends.slime.cli import parse_slime_args
    from slime_meta.backends.slime.plan import translate

    plan = translate(train_argv(out, checkpoint), default_run_dir=str(out / "train_run"))
    return parse_slime_args(plan.slime_argv)


def one_rank_parallel_state() -> None:
    """Megatron's parallel groups on one process (gloo): slime's log-prob kernel and reducer read them."""
    import torch
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def torch_step_loss(args, checkpoint: Path, samples, dtype) -> dict:
    """The step Megatron ran, in plain torch on the HF model: slime's conversion (our plugin), slime's
    tensorisation, the trainer's log-probs, our top-k hook and advantages, then slime's loss_function
    (our loss) per micro-batch of one sample, the reported loss as slime reduces it (sum / rollouts)."""
    import torch
    from megatron.core import mpu
    from slime.backends.megatron_utils.loss import loss_function
    from slime.observability import train_metric_utils
    from slime.observability.rollout_data_utils import tensorize_rollout_data_for_training
    from transformers import AutoModelForCausalLM

    from slime_meta.backends.slime.advantages import meta_advantages
    from slime_meta.backends.slime.loss import hold_sdpo_topk
    from slime_meta.backends.slime.train_data import convert_samples_to_train_data

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype)
    train_data = convert_samples_to_train_data(args, samples)
    keys = (
        "tokens",
        "response_lengths",
        "rewards",
        "loss_masks",
        "sample_indices",
        "rollout_ids",
        "rollout_mask_sums",
        "rollout_log_probs",
        "teacher_log_probs",
    )
    rollout_data = {key: train_data[key] for key in keys if key in train_data}
    tensorize_rollout_data_for_training(rollout_data)
    temperature = float(args.rollout_temperature)
    with torch.no_grad():
        log_probs = []
        for tokens, length in zip(rollout_data["tokens"], rollout_data["response_lengths"]):
            rows = model(input_ids=tokens[None].long()).logits[0][len(tokens) - length - 1 : len(tokens) - 1].float()
            targets = tokens[len(tokens) - length :, None].long()
            log_probs.append(torch.log_softmax(rows / temperature, -1).gather(-1, targets)[:, 0])
    rollout_data["log_probs"], rollout_data["kl"] = log_probs, [torch.zeros_like(x) for x in log_probs]
    hold_sdpo_topk(args, 0, rollout_data)
    meta_advantages(args, rollout_data)
    rollouts = len(set(int(r) for r in rollout_data["rollout_ids"]))
    num_microbatches = len(samples)
    logs = []
    for i in range(len(samples)):
        batch = {
            key: [rollout_data[key][i]]
            for key in ("loss_masks", "advantages", "log_probs", "rollout_log_probs", "teacher_log_probs")
        }
        batch["unconcat_tokens"] = [rollout_data["tokens"][i]]
        batch["total_lengths"] = [len(rollout_data["tokens"][i])]
        batch["response_lengths"] = [int(rollout_data["response_lengths"][i])]
        batch["rollout_mask_sums"] = rollout_data["rollout_mask_sums"][i : i + 1]
        logits = model(input_ids=batch["unconcat_tokens"][0][None].long()).logits.float()
        loss, _, log = loss_function(args, batch, num_microbatches, rollouts, logits)
        (loss / num_microbatches).backward()  # Megatron divides each micro-batch's loss by their number
        logs.append({"keys": log["keys"], "values": log["values"].detach().double()})
    # slime's own reduction of the micro-batches' logs (it adds them position by position).
    reduced = train_metric_utils.reduce_train_step_metrics(
        logs,
        calculate_per_token_loss=False,
        step_global_batch_size=rollouts,
        cp_size=1,
        dp_with_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
    )
    metrics = {f"train/{k}": float(v) for k, v in reduced.items()}
    grads = [p.grad.double().norm() for p in model.parameters() if p.grad is not None]
    metrics["train/grad_norm"] = float(torch.stack(grads).norm())  # before clipping, as Megatron reports it
    return metrics


def local_trainer_loss(args, checkpoint: Path, local_inputs: dict) -> dict:
    """The local trainer on the same infos and SDPO answers (no replay pairs: on slime channel 3 is two
    samples with advantages, whose loss value is the surrogate's, not DPO's; the gradient is the same)."""
    import torch

    from slime_meta.backends.local.training.channels import LossSettings
    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer

    loss = LossSettings(
        eps_clip=args.eps_clip,
        eps_clip_high=args.eps_clip_high,
        sdpo_alpha=args.sdpo_alpha,
        sdpo_topk=args.sdpo_topk,
        sdpo_form="jsd",
    )
    settings = TrainerSettings(lr=1e-6, device="cpu", temperature=float(args.rollout_temperature), loss=loss)
    torch.manual_seed(0)
    trainer = LocalTrainer(str(checkpoint), settings)
    metrics = trainer.compute_gradients(local_inputs["infos"], local_inputs["sdpo"], [])
    out = {k: float(v) for k, v in metrics.items() if k in ("loss/total", "train/loss", "train/sdpo_jsd")}
    grads = [p.grad.double().norm() for p in trainer.model.parameters() if p.grad is not None]
    out["train/grad_norm"] = float(torch.stack(grads).norm())
    return out


def run_compare(out: Path, checkpoint: Path) -> dict:
    import torch
    from slime.observability.rollout_data_utils import load_debug_rollout_data

    from slime_meta.backends.slime.samples import META_KEY

    args = slime_args_for(out, checkpoint)
    one_rank_parallel_state()
    samples = load_debug_rollout_data(str(out / ROLLOUT_FILE), rollout_id=0)
    without_replay = [s for s in samples if s.metadata[META_KEY].get("kind") != "replay"]
    result = {
        "torch_all_channels": torch_step_loss(args, checkpoint, samples, torch.float32),
        "torch_no_replay": torch_step_loss(args, checkpoint, without_replay, torch.float32),
    }
    local_inputs = torch.load(out / "local_inputs_0.pt", weights_only=False)
    result["local_trainer_no_replay"] = local_trainer_loss(args, checkpoint, local_inputs)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=("rollout", "train", "compare", "all"))
    parser.add_argument("--slime-src", default=os.environ.get("SLIME_SRC"), help="a THUDM/slime checkout (624b824)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/slime_megatron_1gpu")
    parser.add_argument("--checkpoint", type=Path, default=None, help="HF Llama directory (default: the tiny one)")
    parser.add_argument("--timeout", type=int, default=480, help="seconds for the training subprocess")
    ns = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))  # slime_meta, when the repository is not installed (pip install -e .)
    if ns.slime_src:
        sys.path.insert(0, str(Path(ns.slime_src).resolve()))
    checkpoint = (ns.checkpoint or tiny_checkpoint()).resolve()
    if ns.stage == "rollout":
        summary = run_rollout(ns.out, checkpoint)
        (ns.out / "rollout_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return 0
    if not (ns.out / "rollout_0.pt").exists():
        print(f"error: {ns.out / 'rollout_0.pt'} is missing: run the rollout stage first", file=sys.stderr)
        return 2
    result: dict = {"checkpoint": checkpoint.name}
    if ns.stage in ("train", "all"):
        result["megatron"] = run_train(ns.out, checkpoint, ns.slime_src or "", ns.timeout)
    if ns.stage in ("compare", "all"):
        result.update(run_compare(ns.out, checkpoint))
    megatron_loss = ((result.get("megatron") or {}).get("first_step") or {}).get("train/loss")
    if megatron_loss is not None and "torch_all_channels" in result:
        reference = result["torch_all_channels"]["train/loss"]
        result["megatron_vs_torch_rel_diff"] = abs(megatron_loss - reference) / max(abs(reference), 1e-12)
    print(json.dumps({k: v for k, v in result.items() if k != "megatron"}, indent=1))
    if "megatron" in result:
        print(json.dumps({k: v for k, v in result["megatron"].items() if k != "command"}, indent=1))
    (ns.out / f"{ns.stage}_result.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if (result.get("megatron") or {}).get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
