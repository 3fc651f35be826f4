"""The CPU stages of benchmarks/slime_megatron.py: the rollout it trains from, and the same step in torch.

  run_rollout      one real step of our rollout plugin (`rollout.generate_rollout`) on the tiny Llama served
                   by the project's own pools behind sglang-router, all three channels, written as slime's
                   --load-debug-rollout-data file (slime's own `save_debug_rollout_data`); needs ray and
                   sglang-router importable.
  run_torch_step   the step Megatron runs, in plain torch on the same weights, float32: our plugins on slime's
                   batch layout, and the local trainer on the infos and SDPO answers.

Both take the benchmark's flag lists from slime_megatron.py as arguments (one definition of the command line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data/synthetic_suffix.jsonl"
ROLLOUT_FILE = "rollout_{rollout_id}.pt"
REPLAY_KEY_ENV = "SLIME_MEGATRON_REPLAY_KEY"  # the stand-in replay teachers take any key

# ---------------------------------------------------------------- rollout


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


def rollout_namespace(
    meta_flags, checkpoint: Path, run_dir: Path, prompts: Path, teacher_url: str, student_url: str, replay_urls
):
    """The namespace slime's rollout manager hands our plugin: our translated flags and slime's defaults
    for what its data source reads (slime's parse_args needs Megatron, which a CPU machine lacks)."""
    from slime_meta.backends.slime.plan import meta_parser, translate

    argv = [
        *meta_flags,
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


def run_rollout(meta_flags, out: Path, checkpoint: Path) -> dict:
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
        args = rollout_namespace(
            meta_flags, checkpoint, work / "run", prompts, pool.router_url, pool.worker_urls[0], replay_urls
        )
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


# ---------------------------------------------------------------- the same step in torch


def slime_args_for(train_argv: list[str], out: Path):
    """slime's own parse_args over the training command line: the namespace the trainer had."""
    from slime_meta.backends.slime.cli import parse_slime_args
    from slime_meta.backends.slime.plan import translate

    plan = translate(train_argv, default_run_dir=str(out / "train_run"))
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


def with_padded_vocabulary(model, padded_vocab_size: int | None):
    """The HF model with Megatron's padded vocabulary: slime's loader fills the extra rows of the embedding
    and output layer with zeros, so each padded token has logit 0 and takes its share of every softmax."""
    import torch

    vocab = model.config.vocab_size
    if not padded_vocab_size or padded_vocab_size <= vocab:
        return model
    model.resize_token_embeddings(padded_vocab_size, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[vocab:] = 0
        model.get_output_embeddings().weight[vocab:] = 0  # the same tensor when the embeddings are tied
    return model


def rollout_data_before_step(args, checkpoint: Path, samples, dtype, padded_vocab_size: int | None = None):
    """(HF model, rollout data) as the actor holds them before its training micro-batches: slime's
    conversion (our plugin) and tensorisation, the pre-step log-probs at the rollout temperature, our
    top-k hook and advantages. With `padded_vocab_size` the model has Megatron's padded vocabulary."""
    import torch
    from slime.observability.rollout_data_utils import tensorize_rollout_data_for_training
    from transformers import AutoModelForCausalLM

    from slime_meta.backends.slime.advantages import meta_advantages
    from slime_meta.backends.slime.loss import hold_sdpo_topk
    from slime_meta.backends.slime.train_data import convert_samples_to_train_data

    model = with_padded_vocabulary(
        AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype), padded_vocab_size
    )
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
    return model, rollout_data


def torch_step_loss(args, checkpoint: Path, samples, dtype, padded_vocab_size: int | None = None) -> dict:
    """The step Megatron ran, in plain torch on the HF model: the rollout data as the actor holds it
    (`rollout_data_before_step`), then slime's loss_function (our loss) per micro-batch of one sample,
    the reported loss as slime reduces it (sum / rollouts).
    With `padded_vocab_size` the model has Megatron's padded vocabulary (`with_padded_vocabulary`)."""
    import torch
    from megatron.core import mpu
    from slime.backends.megatron_utils.loss import loss_function
    from slime.observability import train_metric_utils

    model, rollout_data = rollout_data_before_step(args, checkpoint, samples, dtype, padded_vocab_size)
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


def run_torch_step(train_argv: list[str], out: Path, checkpoint: Path) -> dict:
    """All channels at Megatron's padded vocabulary (the function every Megatron run computes), and without
    replay at the checkpoint's own vocabulary beside the local trainer (which has no padding)."""
    import torch
    from slime.observability.rollout_data_utils import load_debug_rollout_data

    from slime_meta.backends.slime.samples import META_KEY

    args = slime_args_for(train_argv, out)
    one_rank_parallel_state()
    samples = load_debug_rollout_data(str(out / ROLLOUT_FILE), rollout_id=0)
    without_replay = [s for s in samples if s.metadata[META_KEY].get("kind") != "replay"]
    padded = int(args.padded_vocab_size)
    result = {
        "padded_vocab_size": padded,
        "torch_all_channels": torch_step_loss(args, checkpoint, samples, torch.float32, padded),
        "torch_no_replay": torch_step_loss(args, checkpoint, without_replay, torch.float32),
    }
    local_inputs = torch.load(out / "local_inputs_0.pt", weights_only=False)
    result["local_trainer_no_replay"] = local_trainer_loss(args, checkpoint, local_inputs)
    return result


def megatron_rank_args_on_cpu(rank: int, tensor_parallel: int, port: int, work: Path, train_argv: list[str]):
    """One gloo rank of a TP group on the host, ready to build slime's Megatron model: the process group,
    Megatron's model-parallel state, and slime's parsed arguments of `train_argv` (slime_megatron.train_argv)
    in float32 with the weights built on the host (slime's loader then overwrites all of them)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_DEVICE_MAX_CONNECTIONS="1")
    import megatron.training.arguments as megatron_arguments
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=rank, world_size=tensor_parallel)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    # Megatron's argument check reads the GPU's architecture when TP > 1 (for CUDA_DEVICE_MAX_CONNECTIONS):
    # on CPU it is given Hopper's, the GPU run's.
    megatron_arguments.get_device_arch_version = lambda: 9
    if not torch.cuda.is_available():
        # Megatron's rotary embedding moves its frequencies to torch.cuda.current_device(): here that is the host.
        torch.cuda.current_device = lambda: "cpu"
    args = slime_args_for(train_argv, work)
    args.bf16, args.params_dtype, args.use_cpu_initialization = False, torch.float32, True
    args.rank, args.world_size = rank, tensor_parallel
    return args
