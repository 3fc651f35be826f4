"""Generation: tokens/s through the router and embedded workers against plain in-process HF `generate`.

    python benchmarks/generation.py                  # GPU: Qwen2.5-0.5B shape; CPU: the demo model's shape
    python benchmarks/generation.py --quick          # CPU, a few requests (the test suite runs this)
    python benchmarks/generation.py --model-path DIR_OR_GGUF    # a real checkpoint (python -m slime_meta.models.real)

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
Generated tokens / wall time. On a GPU the workers decode through their CUDA-graph path
(`--cuda-graphs auto`; `off` measures the DynamicCache path) over the KV cache `--kv-cache`
names (static slots or a paged pool; default: the worker's); the report names the path and cache
each worker ran (`served.worker_engines`). `--also-concurrency 128` times more batches in the same
pool at those numbers in flight. Each timed phase also says where the workers' time went
(`engine_split`, from their counters before and after: prefill, decode, waiting for requests, the
prefill batches and decode steps). On a GPU every served figure is also given as a share of the
decode roofline: rows x HBM bandwidth (a device copy measured in the same run) / the bytes one
decode step must read (all weights once, plus each row's keys and values at the mean context).
Correctness first, and part of `meets.correct`:
- greedy decoding of `--check-prompts` prompts through the served path must give the tokens of
  in-process greedy `generate`, or first differ at a near-tie: at the first difference, the served
  token's logit under HF's own full forward of the shared prefix lies less than
  `NEAR_TIE_LOGIT_STDS` standard deviations of that position's logits below HF's token (bf16
  flips only such ties; a wrong forward gives gaps of whole standard deviations);
- log-probs returned with sampled tokens must match HF's full forward of the generated sequence
  (the trainer's behaviour policy): mean absolute difference below `LOGPROB_MEAN_ABS_TOLERANCE`, or
  within `LOGPROB_FLOOR_FACTOR` times the same figure for HF `generate`'s own cached sampling in the
  same dtype, the floor reported beside it (a real model's peaked distributions put bf16's own
  cached-vs-full difference above the fixed tolerance: 0.047 mean for SmolLM2-135M on CPU);
- every request must return `--new-tokens` ids.
A real checkpoint (`--model-path`, an HF directory or a .gguf file converted once into a cached one) is
loaded as it is, with its own tokenizer: the greedy check then runs on chat-template questions
(`CHAT_QUESTIONS`) and stops at the model's EOS on both sides (HF `generate` and the served path),
so the answers are the ones a user sees; the timed requests stay random prompt ids. `--dtype
bfloat16` on a CPU gives the bf16 figures there too.
CPU threads: each worker uses one (its default); the in-process runs get as many as there are
workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
import torch
from generation_roofline import decode_roofline

CHAT_QUESTIONS = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and what is it famous for?",
    "Ana has 3 marbles and gets 5 more. How many marbles does she have now?",
    "Give three tips for learning a new language.",
    "Describe how a bicycle works to a child.",
    "A train travels 60 km in 1.5 hours. What is its average speed?",
    "Name two planets of the solar system and one fact about each.",
)
TARGETS = {"cpu_vs_inprocess_batched": 0.8, "gpu_vs_inprocess_batched": 3.0, "gpu_vs_one_at_a_time": 4.0}
NEAR_TIE_LOGIT_STDS = 0.1
LOGPROB_MEAN_ABS_TOLERANCE = 1e-2
LOGPROB_FLOOR_FACTOR = 2.0  # the floor is measured on other sampled tokens: room for that

QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    use_sliding_window=False,
)


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
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=10**9,
    )


def build_model_dir(kind: str, out: Path, dtype: torch.dtype) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if kind == "qwen0.5b":
        config = Qwen2Config(**QWEN25_05B, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        from slime_meta.models.tiny.tokenizer import MODEL_SHAPE

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


def check_prompts(args: argparse.Namespace, model_dir: Path, vocab: int) -> list[list[int]]:
    """The greedy and log-prob check's prompts: chat-template questions for a real checkpoint (through
    its own tokenizer), else the first random prompts of the timed batch."""
    if not args.model_path:
        return prompts(args.concurrency, args.prompt_len, vocab, seed=1)[: args.check_prompts]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(args.check_prompts)]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
    ]


# ----------------------------------------------------------------------------- in-process


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_generate(
    model, batch: list[list[int]], new_tokens: int, device: torch.device, greedy: bool = False
) -> torch.Tensor:
    ids = torch.tensor(batch, device=device)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **sampling,
        )
    return out[:, ids.shape[1] :]


def hf_greedy_to_eos(model, prompt: list[int], new_tokens: int, device: torch.device) -> list[int]:
    """Greedy tokens up to and including the model's EOS (no forced length: EOS may be the argmax)."""
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


def in_process(
    model_dir: Path,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    vocab: int,
    check: list[list[int]],
) -> dict:
    """HF generate, batched and one at a time. On a GPU twice: with torch's default attention
    backends (cuDNN's included, which plans anew for every KV length) and with cuDNN's off (what
    the embedded worker does); the faster is the reference."""
    from transformers import AutoModelForCausalLM

    if device.type == "cpu":
        torch.set_num_threads(args.workers)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    batch = prompts(args.concurrency, args.prompt_len, vocab, seed=1)
    variants = {}
    for cudnn in (True, False) if device.type == "cuda" else (None,):
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
            "batched": {
                "tokens_per_s": len(batch) * args.new_tokens / batched_s,
                "wall_s": batched_s,
                "batch": len(batch),
            },
            "one_at_a_time": {"tokens_per_s": args.new_tokens / statistics.median(singles), "request_s": singles},
        }
        print(
            f"  in-process ({name}): {variants[name]['batched']['tokens_per_s']:.0f} tok/s batched, "
            f"{variants[name]['one_at_a_time']['tokens_per_s']:.0f} one at a time",
            file=sys.stderr,
            flush=True,
        )
    if args.model_path:
        greedy = [hf_greedy_to_eos(model, p, args.check_tokens, device) for p in check]
    else:
        greedy = [hf_generate(model, [p], args.check_tokens, device, greedy=True)[0].tolist() for p in check]
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    best = lambda key: max(variants.values(), key=lambda v: v[key]["tokens_per_s"])[key]  # noqa: E731
    return {
        "batched": best("batched"),
        "one_at_a_time": best("one_at_a_time"),
        "variants": variants,
        "greedy_reference": greedy,
    }


# ----------------------------------------------------------------------------- served


async def timed_batch(pool, prompts_: list[list[int]], sampling: dict) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*[pool.generate(input_ids=p, sampling_params=sampling) for p in prompts_])
    return time.perf_counter() - t0, [len(r.output_ids) for r in results]


ENGINE_TIME_KEYS = ("prefill_s", "fast_decode_s", "dynamic_decode_s", "idle_s", "prefill_batches", "decode_steps")


def engine_totals(worker_urls: Sequence[str]) -> dict[str, float]:
    """The workers' engine counters summed (seconds by phase, prefill batches, decode steps). A
    blocking HTTP call: made only between timed phases, with nothing in flight."""
    engines = worker_engines(worker_urls)
    return {key: sum(float(engine.get(key, 0)) for engine in engines) for key in ENGINE_TIME_KEYS}


def engine_split(before: dict[str, float], after: dict[str, float], wall_s: float, workers: int) -> dict[str, float]:
    """Where a timed phase's wall time went inside the workers' engines: each counter's change,
    and the share of the workers' wall time each phase took (idle: waiting for requests)."""
    delta = {key: after[key] - before[key] for key in ENGINE_TIME_KEYS}
    for key in ("prefill_s", "fast_decode_s", "dynamic_decode_s", "idle_s"):
        delta[key.removesuffix("_s") + "_share"] = delta[key] / (wall_s * workers)
    if delta["prefill_batches"]:
        delta["prefill_ms_per_batch"] = 1e3 * delta["prefill_s"] / delta["prefill_batches"]
    if delta["decode_steps"]:
        delta["decode_us_per_step"] = 1e6 * (delta["fast_decode_s"] + delta["dynamic_decode_s"]) / delta["decode_steps"]
    return delta


async def served(
    router_url: str,
    args: argparse.Namespace,
    vocab: int,
    greedy_reference: list[list[int]],
    check: list[list[int]],
    worker_urls: Sequence[str],
) -> dict:
    from slime_meta.rollout.pools import SGLangPool

    more = {}
    for in_flight in args.also_concurrency:
        more_pool = SGLangPool(name="bench", base_url=router_url, concurrency=in_flight, timeout_s=600)
        batch = prompts(in_flight * 3, args.prompt_len, vocab, seed=2)
        sampling = {
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "top_k": -1,
            "top_p": 1.0,
            "ignore_eos": True,
        }
        await timed_batch(more_pool, batch[:in_flight], dict(sampling, max_new_tokens=4))  # warm-up
        before = engine_totals(worker_urls)
        wall, lengths = await timed_batch(more_pool, batch, sampling)
        split = engine_split(before, engine_totals(worker_urls), wall, len(worker_urls))
        await more_pool.close()
        more[str(in_flight)] = {
            "tokens_per_s": sum(lengths) / wall,
            "wall_s": wall,
            "requests": len(batch),
            "in_flight": in_flight,
            "all_lengths_right": all(n == args.new_tokens for n in lengths),
            "engine_split": split,
        }
    pool = SGLangPool(name="bench", base_url=router_url, concurrency=args.concurrency, timeout_s=600)
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "ignore_eos": True}
    batch = prompts(max(args.requests, args.concurrency), args.prompt_len, vocab, seed=1)
    # correctness: greedy through the served path equals in-process greedy (to EOS for a real checkpoint)
    greedy_params = {"max_new_tokens": args.check_tokens, "temperature": 0.0, "ignore_eos": not args.model_path}
    served_greedy = [(await pool.generate(input_ids=p, sampling_params=greedy_params)).output_ids for p in check]
    matches = [sum(a == b for a, b in zip(s, r)) / max(1, len(r)) for s, r in zip(served_greedy, greedy_reference)]
    # behaviour log-probs, checked later against a full forward
    sampled = [await pool.generate(input_ids=p, sampling_params=sampling, return_logprob=True) for p in check]
    await asyncio.gather(
        *[pool.generate(input_ids=p, sampling_params=dict(sampling, max_new_tokens=4)) for p in batch[:8]]
    )
    before = engine_totals(worker_urls)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *[pool.generate(input_ids=p, sampling_params=sampling) for p in batch[: args.requests]]
    )
    wall = time.perf_counter() - t0
    split = engine_split(before, engine_totals(worker_urls), wall, len(worker_urls))
    lengths = [len(r.output_ids) for r in results]
    singles = []
    for p in batch[: args.one_at_a_time]:
        t1 = time.perf_counter()
        r = await pool.generate(input_ids=p, sampling_params=sampling)
        singles.append(time.perf_counter() - t1)
        lengths.append(len(r.output_ids))
    await pool.close()
    return {
        "concurrent": {
            "tokens_per_s": sum(lengths[: args.requests]) / wall,
            "wall_s": wall,
            "requests": args.requests,
            "in_flight": args.concurrency,
            "engine_split": split,
        },
        "one_at_a_time": {"tokens_per_s": args.new_tokens / statistics.median(singles), "request_s": singles},
        "more_in_flight": more,
        "all_lengths_right": all(n == args.new_tokens for n in lengths)
        and all(m["all_lengths_right"] for m in more.values()),
        "greedy_token_match": matches,
        "greedy_served": [list(ids) for ids in served_greedy],
        "sampled_check": [
            {"prompt": p, "output_ids": list(c.output_ids), "output_logprobs": list(c.output_logprobs)}
            for p, c in zip(check, sampled)
        ],
    }


def worker_engines(worker_urls: Sequence[str]) -> list[dict]:
    """Each worker's decode path and counters, from its /get_server_info."""
    engines = []
    for url in worker_urls:
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as response:
            engines.append(json.loads(response.read())["engine"])
    return engines


def full_forward_logprobs(model, prompt: list[int], output_ids: list[int], device: torch.device) -> torch.Tensor:
    """log p(output_ids[i] | everything before it) at temperature 1, from one uncached forward."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output_ids], device=device)).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(output_ids, device=device)[:, None])[:, 0].cpu()


def hf_cached_logprob_diffs(model, checks: list[dict], new_tokens: int, device: torch.device) -> torch.Tensor:
    """The same check for HF's own cached sampling (`generate` with its raw logits): the bf16 noise
    floor that the served path's figure is to be read against. Prompts of one length share a batch
    (chat-template prompts differ in length; padding would add a difference of its own)."""
    by_length: dict[int, list[list[int]]] = {}
    for c in checks:
        by_length.setdefault(len(c["prompt"]), []).append(c["prompt"])
    diffs = []
    for batch in by_length.values():
        ids = torch.tensor(batch, device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new_ids = out.sequences[:, ids.shape[1] :]
        step_logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
        cached = step_logprobs.gather(2, new_ids[..., None])[..., 0].cpu()
        diffs += [
            (cached[row] - full_forward_logprobs(model, prompt, new_ids[row].tolist(), device)).abs()
            for row, prompt in enumerate(batch)
        ]
    return torch.cat(diffs)


def verify(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    args: argparse.Namespace,
    report: dict,
    check_prompts: list[list[int]],
) -> dict:
    """Served greedy tokens and behaviour log-probs against HF's full forward (see the docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    sv, reference = report["served"], report["in_process"]["greedy_reference"]
    gaps, first_differences = [], []
    for prompt, ours, theirs in zip(check_prompts, sv["greedy_served"], reference):
        step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if step is None and len(ours) != len(theirs):  # one side stopped early with no token of its own
            first_differences.append(min(len(ours), len(theirs)))
            gaps.append(float("inf"))
            continue
        first_differences.append(step)
        if step is None:
            gaps.append(0.0)
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + theirs[:step]], device=device)).logits[0, -1].float()
        gaps.append(float((logits[theirs[step]] - logits[ours[step]]) / logits.std()))
    checks = sv["sampled_check"]
    diff = torch.cat(
        [
            (
                torch.tensor(c["output_logprobs"]) - full_forward_logprobs(model, c["prompt"], c["output_ids"], device)
            ).abs()
            for c in checks
        ]
    )
    hf_diff = hf_cached_logprob_diffs(model, checks, args.new_tokens, device)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result = {
        "greedy_agreement": sum(step is None for step in first_differences) / len(first_differences),
        "greedy_first_difference_step": first_differences,
        "greedy_first_divergence_gap_stds": gaps,
        "greedy_ok": all(g < NEAR_TIE_LOGIT_STDS for g in gaps),
        "logprob_abs_diff_mean": float(diff.mean()),
        "logprob_abs_diff_max": float(diff.max()),
        "logprob_tokens_checked": int(diff.numel()),
        "hf_generate_logprob_abs_diff_mean": float(hf_diff.mean()),
        "hf_generate_logprob_abs_diff_max": float(hf_diff.max()),
    }
    result["logprobs_within_hf_floor"] = (
        result["logprob_abs_diff_mean"] <= LOGPROB_FLOOR_FACTOR * result["hf_generate_logprob_abs_diff_mean"]
    )
    result["logprobs_ok"] = (
        result["logprob_abs_diff_mean"] < LOGPROB_MEAN_ABS_TOLERANCE or result["logprobs_within_hf_floor"]
    )
    return result


def resolve_model(args: argparse.Namespace, kind: str, tmp: Path, dtype: torch.dtype) -> Path:
    """The real checkpoint of --model-path (a .gguf converted once, cached), or a random-init one built in tmp."""
    if args.model_path:
        from slime_meta.artifacts.model_files import resolve_checkpoint

        to_stderr = lambda line: print(line, file=sys.stderr)  # noqa: E731 (stdout ends with the table)
        model_dir = Path(resolve_checkpoint(args.model_path, "--model-path", log=to_stderr))
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"error: --model-path {args.model_path}: not an HF checkpoint directory or a .gguf file")
        return model_dir
    return build_model_dir(kind, tmp / "model", dtype)


def run(args: argparse.Namespace) -> dict:
    C.quiet_transformers()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    kind = args.model or ("qwen0.5b" if device.type == "cuda" else "tiny")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    report = C.report_header("generation", {k: v for k, v in vars(args).items() if k != "out"})
    report.update(device=str(device), dtype=str(dtype).removeprefix("torch."))
    from slime_meta.backends.local.workers.launcher import LocalProcessGroup

    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        started = time.perf_counter()
        model_dir = resolve_model(args, kind, Path(tmp), dtype)
        report["model"] = model_dir.name if args.model_path else kind
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        report["build_s"] = time.perf_counter() - started
        print(f"  model {report['model']} ready in {report['build_s']:.1f}s", file=sys.stderr, flush=True)
        check = check_prompts(args, model_dir, vocab)
        report["in_process"] = in_process(model_dir, args, device, dtype, vocab, check)
        with LocalProcessGroup(startup_timeout_s=300) as group:
            t0 = time.perf_counter()
            endpoints = group.start_pool(
                "gen",
                str(model_dir),
                args.workers,
                device=device.type,
                weights_root=None,
                log_dir=str(Path(tmp) / "logs"),
                worker_args=[
                    "--max-batch-size",
                    str(max(64, args.concurrency, *args.also_concurrency)),
                    "--cuda-graphs",
                    args.cuda_graphs,
                    "--dtype",
                    report["dtype"],
                    *(["--kv-cache", args.kv_cache] if args.kv_cache else []),
                ],
            )
            report["pool_start_s"] = time.perf_counter() - t0
            report["served"] = asyncio.run(
                served(
                    endpoints.router_url,
                    args,
                    vocab,
                    report["in_process"]["greedy_reference"],
                    check,
                    endpoints.worker_urls,
                )
            )
            report["served"]["worker_engines"] = worker_engines(endpoints.worker_urls)
        print(
            f"  served: {report['served']['concurrent']['tokens_per_s']:.0f} tok/s at {args.concurrency} in flight",
            file=sys.stderr,
            flush=True,
        )
        report["verification"] = verify(model_dir, device, dtype, args, report, check)
        if device.type == "cuda":
            report["roofline"] = decode_roofline(model_dir, args, report, device)
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
        else {
            "gpu_vs_inprocess_batched": r["served_vs_inprocess_batched"] >= TARGETS["gpu_vs_inprocess_batched"],
            "gpu_vs_one_at_a_time": r["served_vs_inprocess_one_at_a_time"] >= TARGETS["gpu_vs_one_at_a_time"],
        }
    )
    vf = report["verification"]
    report["meets"]["correct"] = sv["all_lengths_right"] and vf["greedy_ok"] and vf["logprobs_ok"]
    return report


def print_table(report: dict) -> None:
    ip, sv, st = report["in_process"], report["served"], report["settings"]
    base = ip["batched"]["tokens_per_s"]
    rows = []
    for name, v in ip["variants"].items():
        tag = "" if name == "default" else f" ({name.replace('_', ' ')})"
        for label, key in ((f"batch {st['concurrency']}", "batched"), ("one at a time", "one_at_a_time")):
            rows.append(
                [f"in-process HF generate, {label}{tag}", v[key]["tokens_per_s"], v[key]["tokens_per_s"] / base]
            )
    rows += [
        [
            f"router + {st['workers']} worker(s), {st['concurrency']} in flight",
            sv["concurrent"]["tokens_per_s"],
            sv["concurrent"]["tokens_per_s"] / base,
        ],
        [
            "router + worker(s), one at a time",
            sv["one_at_a_time"]["tokens_per_s"],
            sv["one_at_a_time"]["tokens_per_s"] / base,
        ],
    ]
    vf = report["verification"]
    paths = ", ".join(sorted({e["decode_path"] for e in sv["worker_engines"]}))
    print(
        f"\ngeneration: {report['model']} ({report['dtype']}) on {report['device']}, "
        f"{st['prompt_len']}+{st['new_tokens']} tokens, "
        f"{st['requests']} served requests; worker decode path: {paths}; greedy identical served vs in-process on "
        f"{round(vf['greedy_agreement'] * len(vf['greedy_first_difference_step']))} of "
        f"{len(vf['greedy_first_difference_step'])} prompts, "
        f"token match: "
        f"{', '.join(f'{m:.2f}' for m in sv['greedy_token_match'])} (first-divergence gaps in logit stds: "
        f"{', '.join(f'{g:.3f}' for g in vf['greedy_first_divergence_gap_stds'])}); sampled log-probs vs full "
        f"forward: mean |diff| {vf['logprob_abs_diff_mean']:.2e}, max {vf['logprob_abs_diff_max']:.2e} over "
        f"{vf['logprob_tokens_checked']} tokens (HF generate's own cached vs full, the {report['dtype']} floor: "
        f"mean {vf['hf_generate_logprob_abs_diff_mean']:.2e}, "
        f"max {vf['hf_generate_logprob_abs_diff_max']:.2e}); all lengths right: {sv['all_lengths_right']}"
    )
    for in_flight, more in sv["more_in_flight"].items():
        rows.append([f"router + worker(s), {in_flight} in flight", more["tokens_per_s"], more["tokens_per_s"] / base])
    print(C.table(rows, ["path", "tokens/s", "x best in-process batched"]))
    caches = ", ".join(sorted({str((e.get("fast_path") or {}).get("kv_cache")) for e in sv["worker_engines"]}))
    print(f"worker KV cache: {caches}")
    for in_flight, figure in report.get("roofline", {}).get("by_in_flight", {}).items():
        print(
            f"decode roofline at {in_flight} in flight: {figure['roofline_tokens_per_s']:.0f} tokens/s; served "
            f"{figure['served_tokens_per_s']:.0f} = {figure['share']:.1%} of it"
        )
    timed = {st["concurrency"]: sv["concurrent"], **{int(k): v for k, v in sv["more_in_flight"].items()}}
    for in_flight, phase in timed.items():
        split = phase["engine_split"]
        print(
            f"{in_flight} in flight, the workers' time: prefill {split['prefill_share']:.0%} "
            f"({split.get('prefill_ms_per_batch', 0):.1f} ms x {split['prefill_batches']:.0f} batches), decode "
            f"{split['fast_decode_share'] + split['dynamic_decode_share']:.0%} "
            f"({split.get('decode_us_per_step', 0):.0f} us x {split['decode_steps']:.0f} steps), waiting for requests "
            f"{split['idle_share']:.0%}"
        )
    print(
        f"served vs in-process one at a time: {report['ratios']['served_vs_inprocess_one_at_a_time']:.2f}x; meets: "
        + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["meets"].items())
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--model",
        choices=("tiny", "qwen0.5b"),
        default=None,
        help="a random-init model of this shape; default: qwen0.5b on a GPU, tiny on CPU",
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="a real checkpoint instead: an HF directory or a .gguf file (converted once, cached)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="both sides' dtype; auto: bfloat16 on a GPU, float32 on CPU",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=96, help="served requests (concurrency in flight)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--one-at-a-time", type=int, default=2, help="requests timed one at a time, each path")
    p.add_argument("--check-prompts", type=int, default=4)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto", help="the workers' decode path")
    p.add_argument(
        "--kv-cache", choices=("static", "paged"), default=None, help="the workers' KV cache (default theirs)"
    )
    p.add_argument(
        "--also-concurrency",
        type=int,
        nargs="*",
        default=[],
        help="also time 3x this many requests at this many in flight, same pool",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.model = "cpu", None if args.model_path else "tiny"
        args.prompt_len, args.new_tokens, args.concurrency, args.requests, args.one_at_a_time = 16, 16, 4, 8, 1
        args.check_prompts, args.check_tokens = 2, 8
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
