"""On CPU, before any GPU run: slime's Megatron model at tensor parallel size N (gloo, N processes), built
as benchmarks/slime_megatron.py's train stage builds it and loaded by slime's own HF loader, gives the HF
model's logits on a packed micro-batch.

What it exercises, rank by rank: slime's parse_args over the benchmark's training command line at TP N
(Megatron's padded vocabulary included), Megatron's parallel groups, slime's model provider with the
`packed_local_layer_spec` hook (local spec, THD-packed attention over each rank's H / N heads), the
`local_spec_hf_names` hook and slime's `load_hf_weights` (each rank's shard of QKV, MLP and the padded
vocabulary), then one forward of a micro-batch packed and padded as slime's data.py packs it
(sequences + one padding segment to a multiple of N x 128 tokens). The vocabulary-parallel logits are
gathered over the TP group and compared with the HF model's, sequence by sequence; the padded vocabulary
rows must give logit 0. float32 throughout (bf16 is the GPU run's).

`--sync-check` (tensor parallel 1) also sends every Megatron parameter through slime's Megatron->HF
conversion, as its weight sync to SGLang does (`convert_to_hf` with the checkpoint's model type), and
compares the HF tensors it yields with the checkpoint's: every HF tensor named once, each equal.

  PYTHONPATH=MEGATRON:SLIME:SITE python benchmarks/slime_megatron_tp_check.py --tensor-parallel 2 \\
      --checkpoint DIR --slime-src SLIME       # exit code 0: every rank within --tolerance
  ... --tensor-parallel 4 ...                  # 4 processes; the vocabulary padded to a multiple of 4
  ... --tensor-parallel 1 --sync-check --checkpoint QWEN2_DIR   # and the weight sync's names and tensors
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
SEQUENCES = ([5, 17, 42, 8, 99, 3, 64], [7, 11, 250, 300, 12], [33, 34, 35, 36, 37, 38, 39, 40, 41])


def packed_micro_batch(sequences, tensor_parallel: int, pad_multiplier: int = 128):
    """Tokens `[1, T]` and cu_seqlens as slime's data.py packs one micro-batch: the sequences one after
    another, then one padding segment (token 0) up to a multiple of TP x pad_multiplier."""
    import torch

    tokens = [torch.tensor(s, dtype=torch.long) for s in sequences]
    bounds = [0]
    for t in tokens:
        bounds.append(bounds[-1] + len(t))
    pad_size = tensor_parallel * pad_multiplier
    pad = (pad_size - bounds[-1] % pad_size) % pad_size
    flat = torch.cat(tokens)
    if pad:
        flat = torch.cat([flat, torch.zeros(pad, dtype=torch.long)])
        bounds.append(bounds[-1] + pad)
    return flat[None], torch.tensor(bounds, dtype=torch.int32)


def thd_params(cu_seqlens):
    """Megatron's THD packing parameters for a micro-batch with these sequence bounds, as slime passes them."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        qkv_format="thd",
    )


def rank_model(args, checkpoint: Path):
    """This rank's shard of slime's Megatron model (local spec with the HF names), loaded by slime's HF loader."""
    from megatron.training.global_vars import set_args
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from slime.backends.megatron_utils.model_provider import get_model_provider_func
    from slime_megatron_hooks import local_spec_hf_names

    set_args(args)
    local_spec_hf_names(args)
    model = get_model_provider_func(args)(pre_process=True, post_process=True)
    load_hf_weights(args, [model], str(checkpoint))
    return model


def sync_check(args, model, checkpoint: Path) -> dict:
    """Every parameter of the (TP 1) model through slime's Megatron->HF conversion, as the weight sync
    sends it to SGLang, against the checkpoint's tensors: names missing, extra or sent twice, and the
    largest difference."""
    from safetensors.torch import load_file
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf

    config = json.loads((checkpoint / "config.json").read_text())
    reference = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        reference.update(load_file(str(path)))
    if config.get("tie_word_embeddings"):
        reference.pop("lm_head.weight", None)
    sent, largest = [], 0.0
    for name, param in model.named_parameters():
        for hf_name, tensor in convert_to_hf(args, config["model_type"], f"module.module.{name}", param.detach()):
            sent.append(hf_name)
            if hf_name in reference:
                largest = max(largest, (tensor.float() - reference[hf_name].float()).abs().max().item())
    return {
        "missing": sorted(set(reference) - set(sent)),
        "unknown": sorted(set(sent) - set(reference)),
        "sent_twice": sorted({n for n in sent if sent.count(n) > 1}),
        "max_abs_diff": largest,
    }


def megatron_logits(args, checkpoint: Path, tensor_parallel: int, model=None):
    """This rank's model, built and loaded as in slime's actor, and the full-vocabulary logits `[T, V_padded]`."""
    import torch
    import torch.distributed as dist
    from megatron.core import mpu

    model = model or rank_model(args, checkpoint)
    model.eval()
    tokens, cu_seqlens = packed_micro_batch(SEQUENCES, tensor_parallel)
    params = thd_params(cu_seqlens)
    with torch.no_grad():
        local = model(input_ids=tokens, position_ids=None, attention_mask=None, packed_seq_params=params)
    local = local.reshape(tokens.shape[1], -1).float().contiguous()  # [T, V / TP] on this rank
    shards = [torch.empty_like(local) for _ in range(tensor_parallel)]
    dist.all_gather(shards, local, group=mpu.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1), cu_seqlens


def hf_logits(checkpoint: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor(s)[None]).logits[0] for s in SEQUENCES]


def rank_main(rank: int, ns: argparse.Namespace, port: int) -> None:
    import slime_megatron
    import slime_megatron_cpu
    import torch.distributed as dist

    out = Path(ns.work)
    argv = slime_megatron.train_argv(out, ns.checkpoint, ns.tensor_parallel, 1, ns.vocab_multiple)
    args = slime_megatron_cpu.megatron_rank_args_on_cpu(rank, ns.tensor_parallel, port, out, argv)
    model = rank_model(args, ns.checkpoint)
    logits, cu_seqlens = megatron_logits(args, ns.checkpoint, ns.tensor_parallel, model)
    vocab = json.loads((ns.checkpoint / "config.json").read_text())["vocab_size"]
    report = {"rank": rank, "padded_vocab_size": int(args.padded_vocab_size), "sequences": []}
    if ns.sync_check:
        report["sync"] = sync_check(args, model, ns.checkpoint)
    for i, reference in enumerate(hf_logits(ns.checkpoint)):
        rows = logits[int(cu_seqlens[i]) : int(cu_seqlens[i + 1])]
        difference = (rows[:, :vocab] - reference).abs().max().item()
        padding = rows[:, vocab:].abs().max().item() if rows.shape[1] > vocab else 0.0
        report["sequences"].append({"max_abs_diff": difference, "padded_rows_max_abs": padding})
    report["ok"] = all(s["max_abs_diff"] <= ns.tolerance and s["padded_rows_max_abs"] == 0 for s in report["sequences"])
    if ns.sync_check:
        sync = report["sync"]
        report["ok"] &= not (sync["missing"] or sync["unknown"] or sync["sent_twice"]) and sync["max_abs_diff"] == 0
    print(json.dumps(report), flush=True)
    (out / f"tp_check_rank{rank}.json").write_text(json.dumps(report) + "\n")
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="the HF Llama or Qwen2 directory (the tiny Llama)"
    )
    parser.add_argument("--slime-src", default=os.environ.get("SLIME_SRC"), help="a THUDM/slime checkout (624b824)")
    parser.add_argument(
        "--vocab-multiple",
        type=int,
        default=None,
        help="pad the vocabulary to a multiple of this (default: a multiple of 2 and of --tensor-parallel)",
    )
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest |logit difference| accepted")
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument(
        "--sync-check", action="store_true", help="also the weight sync's Megatron->HF conversion (TP 1 only)"
    )
    ns = parser.parse_args(argv)
    ns.vocab_multiple = ns.vocab_multiple or 2 * ns.tensor_parallel // math.gcd(2, ns.tensor_parallel)
    if ns.vocab_multiple % ns.tensor_parallel:
        parser.error(
            f"--vocab-multiple {ns.vocab_multiple} is not a multiple of --tensor-parallel {ns.tensor_parallel}"
        )
    if ns.sync_check and ns.tensor_parallel != 1:
        parser.error("--sync-check needs --tensor-parallel 1 (slime gathers a TP shard before converting it)")
    # The spawned ranks import slime, this repository and the hooks: on their path through the environment.
    paths = [str(BENCHMARKS), str(REPO), *([str(Path(ns.slime_src).resolve())] if ns.slime_src else [])]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = paths
    ns.checkpoint = ns.checkpoint.resolve()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as work:
        ns.work = work
        mp.spawn(rank_main, args=(ns, ns.port), nprocs=ns.tensor_parallel, join=True)
        reports = [json.loads((Path(work) / f"tp_check_rank{r}.json").read_text()) for r in range(ns.tensor_parallel)]
    ok = all(r["ok"] for r in reports)
    print(f"TP {ns.tensor_parallel}: " + ("every rank matches the HF logits" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
