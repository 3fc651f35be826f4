"""On CPU: the gradient of benchmarks/slime_megatron.py's training step through slime's Megatron model at
tensor parallel size N (gloo, N processes), against the same step in torch on the HF model.

Each rank builds and loads the model as slime_megatron_tp_check.py does (slime's parse_args over the
benchmark's command line, the hooks' local spec, slime's HF loader), float32, then runs the saved rollout's
micro-batches (one sample each, packed and padded as slime packs them) through slime's `loss_function`
(our loss) and backward, as Megatron's schedule does (the loss divided by the micro-batch count). The
gradient norm is Megatron's accounting: tensor-parallel parameters summed over ranks, the others once.
`--bf16` casts the model to bf16 and sums the micro-batches' gradients in float32 (DDP's main_grad), as the GPU
run does. `--kinds` keeps only samples of those kinds (info, sdpo_jsd, replay) in the step, to attribute the norm
to a channel; the torch step (slime_megatron_cpu.torch_step_loss) runs on the same samples.

  PYTHONPATH=MEGATRON:SLIME:SITE python benchmarks/slime_megatron_grad_check.py --tensor-parallel 2 \\
      --checkpoint DIR --rollout-dir DIR_WITH_rollout_0.pt [--kinds info,sdpo_jsd]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent


def step_samples(rollout_dir: Path, kinds: list[str] | None):
    from slime.observability.rollout_data_utils import load_debug_rollout_data

    from slime_meta.backends.slime.samples import META_KEY

    samples = load_debug_rollout_data(str(rollout_dir / "rollout_0.pt"), rollout_id=0)
    if kinds:
        samples = [s for s in samples if s.metadata[META_KEY].get("kind", "info") in kinds]
    return samples


def rollout_batches(args, checkpoint: Path, samples):
    """slime's tensorised rollout data with the pre-step log-probs (HF model, float32), our top-k hook and
    advantages: what the actor holds before its training micro-batches (as torch_step_loss)."""
    import torch
    from slime_megatron_cpu import rollout_data_before_step

    _, data = rollout_data_before_step(args, checkpoint, samples, torch.float32, int(args.padded_vocab_size))
    return data


def megatron_step(args, checkpoint: Path, data: dict, tensor_parallel: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import mpu
    from slime.backends.megatron_utils.loss import loss_function
    from slime_megatron_tp_check import packed_micro_batch, rank_model, thd_params

    model = rank_model(args, checkpoint)
    model.train()
    if args.bf16:  # as the GPU run: bf16 weights, each micro-batch's gradient added to an fp32 copy (DDP's main_grad)
        model = model.to(torch.bfloat16)
        main_grads = {name: torch.zeros(p.shape, dtype=torch.float32) for name, p in model.named_parameters()}
    rollouts = len(set(int(r) for r in data["rollout_ids"]))
    count = len(data["tokens"])
    losses = []
    for i in range(count):
        tokens = data["tokens"][i].long()
        flat, cu_seqlens = packed_micro_batch([tokens.tolist()], tensor_parallel)
        params = thd_params(cu_seqlens)
        logits = model(input_ids=flat, position_ids=None, attention_mask=None, packed_seq_params=params)
        batch = {
            key: [data[key][i]]
            for key in ("loss_masks", "advantages", "log_probs", "rollout_log_probs", "teacher_log_probs")
        }
        batch["unconcat_tokens"] = [tokens]
        batch["total_lengths"] = [len(tokens)]
        batch["response_lengths"] = [int(data["response_lengths"][i])]
        batch["rollout_mask_sums"] = data["rollout_mask_sums"][i : i + 1]
        loss, _, log = loss_function(args, batch, count, rollouts, logits.float())
        (loss / count).backward()
        if args.bf16:
            for name, p in model.named_parameters():
                if p.grad is not None:
                    main_grads[name] += p.grad.float()
                    p.grad = None
        losses.append(float(log["values"][log["keys"].index("loss")]) if "loss" in log["keys"] else None)
    # Megatron's grad-norm accounting: a tensor-parallel parameter's shards summed over ranks, others once.
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    per_param = {}
    for name, p in model.named_parameters():
        grad = main_grads[name] if args.bf16 else p.grad
        if grad is None:
            continue
        sq = grad.double().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
        per_param[name] = sq
    total_sharded = sharded.clone()
    dist.all_reduce(total_sharded, group=mpu.get_tensor_model_parallel_group())
    for name in list(per_param):
        p = dict(model.named_parameters())[name]
        if getattr(p, "tensor_model_parallel", False):
            dist.all_reduce(per_param[name], group=mpu.get_tensor_model_parallel_group())
    return {
        "grad_norm": float((total_sharded + replicated).sqrt()),
        "grad_norm_replicated_params_this_rank": float(replicated.sqrt()),
        "per_param_norm": {k: float(v.sqrt()) for k, v in per_param.items()},
    }


def torch_reference(args, checkpoint: Path, samples) -> dict:
    import slime_megatron_cpu as cpu
    import torch

    metrics = cpu.torch_step_loss(args, checkpoint, samples, torch.float32, int(args.padded_vocab_size))
    return {k: metrics[k] for k in ("train/loss", "train/grad_norm")}


def rank_main(rank: int, ns: argparse.Namespace, port: int) -> None:
    import slime_megatron
    import slime_megatron_cpu
    import torch.distributed as dist

    out = Path(ns.work)
    argv = slime_megatron.train_argv(out, ns.checkpoint, ns.tensor_parallel, 1, ns.vocab_multiple)
    args = slime_megatron_cpu.megatron_rank_args_on_cpu(rank, ns.tensor_parallel, port, out, argv)
    samples = step_samples(ns.rollout_dir, ns.kinds)
    data = rollout_batches(args, ns.checkpoint, samples)
    report = {"rank": rank, "tensor_parallel": ns.tensor_parallel, "kinds": ns.kinds, "samples": len(samples)}
    args.bf16 = ns.bf16  # built and loaded in float32 either way; then cast
    report["bf16"] = ns.bf16
    report.update(megatron_step(args, ns.checkpoint, data, ns.tensor_parallel))
    if rank == 0 and ns.torch_reference:
        report["torch"] = torch_reference(args, ns.checkpoint, samples)
    (out / f"grad_check_rank{rank}.json").write_text(json.dumps(report) + "\n")
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--rollout-dir", type=Path, required=True, help="holds rollout_0.pt")
    parser.add_argument("--slime-src", default=os.environ.get("SLIME_SRC"))
    parser.add_argument("--vocab-multiple", type=int, default=2)
    parser.add_argument("--kinds", default="", help="comma-separated sample kinds to keep (default: all)")
    parser.add_argument("--torch-reference", action="store_true", help="also the torch step on rank 0")
    parser.add_argument("--per-param", action="store_true", help="print every parameter's gradient norm")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights and activations, fp32 gradient sums")
    parser.add_argument("--port", type=int, default=29541)
    ns = parser.parse_args(argv)
    ns.kinds = [k for k in ns.kinds.split(",") if k]
    paths = [str(BENCHMARKS), str(REPO), *([str(Path(ns.slime_src).resolve())] if ns.slime_src else [])]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = paths
    ns.checkpoint, ns.rollout_dir = ns.checkpoint.resolve(), ns.rollout_dir.resolve()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as work:
        ns.work = work
        mp.spawn(rank_main, args=(ns, ns.port), nprocs=ns.tensor_parallel, join=True)
        reports = [json.loads((Path(work) / f"grad_check_rank{r}.json").read_text()) for r in range(ns.tensor_parallel)]
    for r in reports:
        if not ns.per_param:
            r.pop("per_param_norm")
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
