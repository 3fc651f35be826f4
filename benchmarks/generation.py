"""Generation: tokens/s through the router and embedded workers against plain in-process HF `generate`.

    python benchmarks/generation.py                  # GPU: Qwen2.5-0.5B shape; CPU: the demo model's shape
    python benchmarks/generation.py --quick          # CPU, a few requests (the test suite runs this)

The model is random-init from its config (no weights needed), saved once with a word-level
tokenizer of the model's vocabulary size, and loaded by both sides in the same dtype (bf16 on a
GPU, float32 on CPU). Every request is `--prompt-len` random prompt ids plus exactly
`--new-tokens` sampled tokens (temperature 1, no top-k/top-p, EOS ignored), so tokens/s compare
like with like. In one run:
- in-process batched: `model.generate` on all `--concurrency` prompts at once (the reference;
  on a GPU measured with cuDNN attention on, torch's default, and off, the faster counts);
- in-process one-at-a-time: `model.generate` on one prompt at a time;
- served: the project's launcher starts `--workers` embedded workers behind the real
  sglang-router; `--requests` requests are sent through the project's `SGLangPool` client,
  `--concurrency` in flight;
- served one-at-a-time: the same, one request in flight.
Generated tokens / wall time. Correctness first: greedy decoding of a few prompts through the
served path must give the same tokens as in-process greedy `generate` (token match fraction
reported; bf16 on a GPU may flip near-ties), and every request must return `--new-tokens` ids.
CPU threads: each worker uses one (its default); the in-process runs get as many as there are
workers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch

TARGETS = {"cpu_vs_inprocess_batched": 0.8, "gpu_vs_inprocess_batched": 3.0, "gpu_vs_one_at_a_time": 4.0}

QWEN25_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False,
)  # fmt: skip


def wordlevel_tokenizer(vocab_size: int):
    """A tokenizer with exactly `vocab_size` ids (w0 w1 ...), so any sampled id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=10**9)  # fmt: skip


def build_model_dir(kind: str, out: Path, dtype: torch.dtype) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if kind == "qwen0.5b":
        config = Qwen2Config(**QWEN25_05B, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        from slime_meta.models.tiny import MODEL_SHAPE

        shape = dict(MODEL_SHAPE, max_position_embeddings=1024)  # 128 + 128 tokens fit with room
        config = LlamaConfig(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(0)
    with torch.device("cuda" if kind == "qwen0.5b" and torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config).to(dtype)  # random init on the GPU: seconds
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    del model
    wordlevel_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (count, length), generator=g).tolist()


# ----------------------------------------------------------------------------- in-process


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_generate(model, batch: list[list[int]], new_tokens: int, device: torch.device, greedy: bool = False) -> torch.Tensor:
    ids = torch.tensor(batch, device=device)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, **sampling)  # fmt: skip
    return out[:, ids.shape[1] :]


def in_process(model_dir: Path, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, vocab: int) -> dict:
    """HF generate, batched and one at a time. On a GPU twice: with torch's default attention
    backends (cuDNN's included, which plans anew for every KV length) and with cuDNN's off (what
    the embedded worker does); the faster is the reference."""
    from transformers import AutoModelForCausalLM

    if device.type == "cpu":
        torch.set_num_threads(args.workers)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    batch = prompts(args.concurrency, args.prompt_len, vocab, seed=1)
    variants = {}
    for cudnn in ((True, False) if device.type == "cuda" else (None,)):
        if cudnn is not None:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        hf_generate(model, batch, 8, device)  # warm-up at the timed shapes
        hf_generate(model, batch[:1], 8, device)
        sync(device)
        t0 = time.perf_counter()
        out = hf_generate(model, batch, args.new_tokens, device)
        sync(device)
        batched_s = time.perf_counter() - t0
        assert out.shape == (len(batch), args.new_tokens), out.shape
        singles = []
        for p in batch[: args.one_at_a_time]:
            t0 = time.perf_counter()
            hf_generate(model, [p], args.new_tokens, device)
            sync(device)
            singles.append(time.perf_counter() - t0)
        name = "default" if cudnn is None else ("cudnn_sdp_on" if cudnn else "cudnn_sdp_off")
        variants[name] = {
            "batched": {"tokens_per_s": len(batch) * args.new_tokens / batched_s, "wall_s": batched_s, "batch": len(batch)},
            "one_at_a_time": {"tokens_per_s": args.new_tokens / statistics.median(singles), "request_s": singles},
        }
        print(f"  in-process ({name}): {variants[name]['batched']['tokens_per_s']:.0f} tok/s batched, "
              f"{variants[name]['one_at_a_time']['tokens_per_s']:.0f} one at a time", file=sys.stderr, flush=True)  # fmt: skip
    greedy = [hf_generate(model, [p], args.check_tokens, device, greedy=True)[0].tolist() for p in batch[: args.check_prompts]]
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    best = lambda key: max(variants.values(), key=lambda v: v[key]["tokens_per_s"])[key]  # noqa: E731
    return {"batched": best("batched"), "one_at_a_time": best("one_at_a_time"), "variants": variants,
            "greedy_reference": greedy}  # fmt: skip


# ----------------------------------------------------------------------------- served


async def served(router_url: str, args: argparse.Namespace, vocab: int, greedy_reference: list[list[int]]) -> dict:
    from slime_meta.pools import SGLangPool

    pool = SGLangPool(name="bench", base_url=router_url, concurrency=args.concurrency, timeout_s=600)
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "ignore_eos": True}
    batch = prompts(max(args.requests, args.concurrency), args.prompt_len, vocab, seed=1)
    check = prompts(args.concurrency, args.prompt_len, vocab, seed=1)[: args.check_prompts]
    # correctness: greedy through the served path equals in-process greedy
    greedy_params = {"max_new_tokens": args.check_tokens, "temperature": 0.0, "ignore_eos": True}
    served_greedy = [(await pool.generate(input_ids=p, sampling_params=greedy_params)).output_ids for p in check]
    matches = [sum(a == b for a, b in zip(s, r)) / max(1, len(r)) for s, r in zip(served_greedy, greedy_reference)]
    await asyncio.gather(*[pool.generate(input_ids=p, sampling_params=dict(sampling, max_new_tokens=4)) for p in batch[:8]])
    t0 = time.perf_counter()
    results = await asyncio.gather(*[pool.generate(input_ids=p, sampling_params=sampling) for p in batch[: args.requests]])
    wall = time.perf_counter() - t0
    lengths = [len(r.output_ids) for r in results]
    singles = []
    for p in batch[: args.one_at_a_time]:
        t1 = time.perf_counter()
        r = await pool.generate(input_ids=p, sampling_params=sampling)
        singles.append(time.perf_counter() - t1)
        lengths.append(len(r.output_ids))
    await pool.close()
    return {
        "concurrent": {"tokens_per_s": sum(lengths[: args.requests]) / wall, "wall_s": wall, "requests": args.requests,
                       "in_flight": args.concurrency},  # fmt: skip
        "one_at_a_time": {"tokens_per_s": args.new_tokens / statistics.median(singles), "request_s": singles},
        "all_lengths_right": all(n == args.new_tokens for n in lengths),
        "greedy_token_match": matches,
    }


def run(args: argparse.Namespace) -> dict:
    C.quiet_transformers()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    kind = args.model or ("qwen0.5b" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = C.report_header("generation", {k: v for k, v in vars(args).items() if k != "out"})
    report.update(device=str(device), model=kind, dtype=str(dtype).removeprefix("torch."))
    from slime_meta.backends.local.launcher import LocalProcessGroup

    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        started = time.perf_counter()
        model_dir = build_model_dir(kind, Path(tmp) / "model", dtype)
        vocab = int(__import__("json").loads((model_dir / "config.json").read_text())["vocab_size"])
        report["build_s"] = time.perf_counter() - started
        print(f"  model {kind} built in {report['build_s']:.1f}s", file=sys.stderr, flush=True)
        report["in_process"] = in_process(model_dir, args, device, dtype, vocab)
        with LocalProcessGroup(startup_timeout_s=300) as group:
            t0 = time.perf_counter()
            endpoints = group.start_pool(
                "gen", str(model_dir), args.workers, device=device.type, weights_root=None, log_dir=str(Path(tmp) / "logs"),
                worker_args=["--max-batch-size", str(max(64, args.concurrency))],
            )  # fmt: skip
            report["pool_start_s"] = time.perf_counter() - t0
            report["served"] = asyncio.run(served(endpoints.router_url, args, vocab, report["in_process"]["greedy_reference"]))
        print(f"  served: {report['served']['concurrent']['tokens_per_s']:.0f} tok/s at {args.concurrency} in flight",
              file=sys.stderr, flush=True)  # fmt: skip
    ip, sv = report["in_process"], report["served"]
    report["ratios"] = {
        "served_vs_inprocess_batched": sv["concurrent"]["tokens_per_s"] / ip["batched"]["tokens_per_s"],
        "served_vs_inprocess_one_at_a_time": sv["concurrent"]["tokens_per_s"] / ip["one_at_a_time"]["tokens_per_s"],
        "served_one_at_a_time_vs_inprocess_one_at_a_time": (
            sv["one_at_a_time"]["tokens_per_s"] / ip["one_at_a_time"]["tokens_per_s"]
        ),
    }
    report["targets"] = TARGETS
    r = report["ratios"]
    report["meets"] = (
        {"cpu_vs_inprocess_batched": r["served_vs_inprocess_batched"] >= TARGETS["cpu_vs_inprocess_batched"]}
        if device.type == "cpu"
        else {"gpu_vs_inprocess_batched": r["served_vs_inprocess_batched"] >= TARGETS["gpu_vs_inprocess_batched"],
              "gpu_vs_one_at_a_time": r["served_vs_inprocess_one_at_a_time"] >= TARGETS["gpu_vs_one_at_a_time"]}
    )  # fmt: skip
    report["meets"]["correct"] = sv["all_lengths_right"]
    return report


def print_table(report: dict) -> None:
    ip, sv, st = report["in_process"], report["served"], report["settings"]
    base = ip["batched"]["tokens_per_s"]
    rows = []
    for name, v in ip["variants"].items():
        tag = "" if name == "default" else f" ({name.replace('_', ' ')})"
        for label, key in ((f"batch {st['concurrency']}", "batched"), ("one at a time", "one_at_a_time")):
            rows.append([f"in-process HF generate, {label}{tag}", v[key]["tokens_per_s"], v[key]["tokens_per_s"] / base])
    rows += [
        [f"router + {st['workers']} worker(s), {st['concurrency']} in flight", sv["concurrent"]["tokens_per_s"],
         sv["concurrent"]["tokens_per_s"] / base],
        ["router + worker(s), one at a time", sv["one_at_a_time"]["tokens_per_s"], sv["one_at_a_time"]["tokens_per_s"] / base],
    ]  # fmt: skip
    print(f"\ngeneration: {report['model']} ({report['dtype']}) on {report['device']}, "
          f"{st['prompt_len']}+{st['new_tokens']} tokens, "
          f"{st['requests']} served requests; greedy token match served vs in-process: "
          f"{', '.join(f'{m:.2f}' for m in sv['greedy_token_match'])}; all lengths right: {sv['all_lengths_right']}")  # fmt: skip
    print(C.table(rows, ["path", "tokens/s", "x best in-process batched"]))
    print(f"served vs in-process one at a time: {report['ratios']['served_vs_inprocess_one_at_a_time']:.2f}x; meets: "
          + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["meets"].items()))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--model", choices=("tiny", "qwen0.5b"), default=None, help="default: qwen0.5b on a GPU, tiny on CPU")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=96, help="served requests (concurrency in flight)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--one-at-a-time", type=int, default=2, help="requests timed one at a time, each path")
    p.add_argument("--check-prompts", type=int, default=2)
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.model = "cpu", "tiny"
        args.prompt_len, args.new_tokens, args.concurrency, args.requests, args.one_at_a_time = 16, 16, 4, 8, 1
        args.check_tokens = 8
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    path = C.write_json(report, args.out or C.default_out("generation" + ("_quick" if args.quick else "")))
    print_table(report)
    print(f"json: {path}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
