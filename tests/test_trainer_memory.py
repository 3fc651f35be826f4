"""The trainer's memory budget: micro-batches by token count (`max_tokens_per_gpu`, slime's
--use-dynamic-batch-size) and per-decoder-layer activation checkpointing (`recompute_layers`,
--recompute-granularity full). Both change how a step is computed, never what it computes.

Run as a script for the CPU measurement behind the checkpointing default on the CPU (peak memory and step
time, with and without): `python tests/test_trainer_memory.py --hidden 512 --layers 8 --tokens 1024`.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slime_meta.backends.local.training.batching import micro_batch_groups
from slime_meta.backends.local.training.channels import LossSettings
from slime_meta.backends.local.training.model_call import compile_decoder_layers
from slime_meta.backends.local.training.settings import DistillSettings, TrainerSettings
from slime_meta.backends.local.training.trainer import LocalTrainer
from slime_meta.errors import UserInputError
from slime_meta.types import PreferencePair, SolverSample, TeacherSample

BUDGET = 48  # tokens per forward in the dynamic-batching test


def ids(g: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in torch.randint(4, 60, (n,), generator=g))


def logprobs(g: torch.Generator, n: int) -> tuple[float, ...]:
    return tuple((-torch.rand(n, generator=g) * 3).tolist())


def mixed_length_batch():
    """Every channel's inputs, lengths 8 to 62: several fit a 48-token forward together, some
    only alone, and the longest teacher sequence (62) exceeds the budget on its own."""
    g = torch.Generator().manual_seed(5)
    teacher_lengths = [(5, 3), (6, 4), (4, 5), (9, 6), (12, 8), (20, 10), (30, 16), (40, 22)]
    teacher = [
        TeacherSample(
            ids(g, p),
            ids(g, r),
            logprobs(g, r),
            reward=float(i % 2),
            advantage=(-1.0) ** i * (1 + i / 8),
            group_index=0,
            sample_index=i,
            inner_iteration=0,
        )
        for i, (p, r) in enumerate(teacher_lengths)
    ]
    solver = [
        SolverSample(
            problem_uid=str(i),
            prompt_ids=ids(g, 5 + 4 * i),
            response_ids=ids(g, 3 + 3 * i),
            rollout_logprobs=logprobs(g, 3 + 3 * i),
            temperature=0.8,
            grade=0.0,
            task_advantage=0.5 - i,
            prompt_text="p",
            solution_text="s",
            context_prompt_ids=ids(g, 12),
            teacher_logprobs=logprobs(g, 3 + 3 * i),
            hint_prompt_ids=ids(g, 8 + 4 * i),
            is_error_site=True,
        )
        for i in range(5)
    ]
    pairs = [PreferencePair(ids(g, 4 + 5 * i), ids(g, 3 + 2 * i), ids(g, 5 + i)) for i in range(4)]
    return teacher, solver, pairs


def moved_reference(checkpoint: Path) -> Path:
    """Start weights unlike the policy's (as after some training): the KL term has a gradient."""
    out = checkpoint.parent / f"{checkpoint.name}-moved-reference"
    if not out.exists():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        model.save_pretrained(out)
    return out


def float64_gradients(checkpoint, settings: TrainerSettings) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """The step's gradient (no optimizer step) in float64, and every forward's (rows, columns),
    the reference's too (read from its checkpoint, it runs through the policy's modules)."""
    torch.manual_seed(0)
    trainer = LocalTrainer(str(checkpoint), settings, reference_path=str(moved_reference(Path(checkpoint))))
    trainer.model.double()  # the start weights are read in the parameters' dtype
    shapes: list[tuple[int, int]] = []

    def count(module, args, kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))

    trainer.model.model.register_forward_pre_hook(count, with_kwargs=True)
    teacher, solver, pairs = mixed_length_batch()
    metrics = trainer.compute_gradients(teacher, solver, pairs)
    assert metrics["train/num_sequences"] == 8 + 5 * settings.distill.on
    return [p.grad.detach().clone() for p in trainer.model.parameters()], shapes


def assert_same_gradient(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Equal to float32 rounding: HF's Llama computes RMSNorm in float32 even in a float64 model, so
    batch shapes move the last float32 digit. A split that changed the loss (a per-micro-batch mean,
    a dropped or doubled sequence) moves it by percents."""
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max() <= 1e-6 * e.abs().max(), (g - e).abs().max() / e.abs().max()


ALL_CHANNELS = TrainerSettings(
    lr=1e-2,
    device="cpu",
    temperature=1.2,
    distill=DistillSettings(1.0, 0.5, 0.5),
    loss=LossSettings(
        sdpo_alpha=0.5, sdpo_beta=0.3, replay_beta=0.7, kl_loss_coef=0.1, kl_loss_type="k3", use_tis=True
    ),
)


def test_token_budget_groups_pack_shortest_first_and_isolate_long_sequences():
    lengths = [30, 5, 12, 70, 8, 11, 40]
    groups = micro_batch_groups(lengths, micro_batch_size=2, max_tokens=40)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        padded = len(group) * max(lengths[i] for i in group)
        assert padded <= 40 or len(group) == 1
    assert [3] in groups  # 70 > 40: alone
    assert len(groups[0]) == 3  # 5, 8, 11 -> 3 x 11 = 33; a fourth (12) would make 48
    assert micro_batch_groups(lengths, 2) == [[1, 4], [5, 2], [0, 6], [3]]


def test_dynamic_batching_gradient_equals_micro_batch_one_and_one_big_batch(tiny_checkpoint):
    one_each, shapes_one = float64_gradients(tiny_checkpoint, dataclasses.replace(ALL_CHANNELS, micro_batch_size=1))
    all_at_once, shapes_all = float64_gradients(
        tiny_checkpoint, dataclasses.replace(ALL_CHANNELS, micro_batch_size=100)
    )
    dynamic, shapes_dynamic = float64_gradients(
        tiny_checkpoint, dataclasses.replace(ALL_CHANNELS, max_tokens_per_gpu=BUDGET)
    )
    assert_same_gradient(dynamic, one_each)
    assert_same_gradient(dynamic, all_at_once)
    assert any(g.abs().sum() > 0 for g in dynamic)
    # The budget holds for every forward (policy and reference); only a sequence longer than it runs alone.
    assert all(rows * cols <= BUDGET or rows == 1 for rows, cols in shapes_dynamic)
    assert any(rows == 1 and cols > BUDGET for rows, cols in shapes_dynamic)
    assert any(rows > 1 for rows, _ in shapes_dynamic)
    assert max(r * c for r, c in shapes_all) > BUDGET  # the fixed split does not keep it
    assert len(shapes_all) < len(shapes_dynamic) < len(shapes_one)


def test_memory_flags_reach_the_trainer(tiny_checkpoint):
    from transformers import AutoTokenizer

    from slime_meta.backends.local.training.setup import make_trainer
    from slime_meta.config.arguments import parse_config

    base = [
        "--use-meta-learning",
        "--prompt-data",
        "data/math_word_problems.jsonl",
        "--hf-checkpoint",
        str(tiny_checkpoint),
    ]
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)

    def trainer_of(*flags: str) -> LocalTrainer:
        return make_trainer(parse_config(base + list(flags)), str(tiny_checkpoint), tokenizer)

    # Defaults: micro-batches of 8,192 padded tokens; on the CPU every layer recomputed.
    default = trainer_of()
    assert default.settings.max_tokens_per_gpu == 8192 and not default.settings.recompute_layers
    assert default.recomputes_layers and all(layer.gradient_checkpointing for layer in default.model.model.layers)
    trainer = trainer_of("--max-tokens-per-gpu", "4096", "--recompute-granularity", "full")
    assert trainer.settings.max_tokens_per_gpu == 4096 and trainer.settings.recompute_layers
    # With --no-use-dynamic-batch-size, --max-tokens-per-gpu is slime's to read; the local split is by sequences.
    assert trainer_of("--no-use-dynamic-batch-size", "--max-tokens-per-gpu", "4096").settings.max_tokens_per_gpu is None
    kept = LocalTrainer(str(tiny_checkpoint), dataclasses.replace(default.settings, recompute_on_cpu=False))
    assert not kept.recomputes_layers and not kept.model.model.layers[0].gradient_checkpointing
    with pytest.raises(UserInputError, match="--recompute-granularity selective"):
        make_trainer(parse_config(base + ["--recompute-granularity", "selective"]), str(tiny_checkpoint), tokenizer)


def test_recompute_gradient_equals_kept_activations(tiny_checkpoint):
    kept, _ = float64_gradients(
        tiny_checkpoint, dataclasses.replace(ALL_CHANNELS, micro_batch_size=3, recompute_on_cpu=False)
    )
    recomputed, _ = float64_gradients(tiny_checkpoint, dataclasses.replace(ALL_CHANNELS, micro_batch_size=3))
    assert_same_gradient(recomputed, kept)


def test_recompute_inside_compiled_layers_keeps_the_gradient_and_saves_less(tiny_checkpoint):
    """--compile-layers with --recompute-granularity full: the checkpoint is traced into each layer's
    graph. Compiled with the aot_eager backend (the CUDA path's tracing and autograd split, without
    the C++ build inductor needs on a CPU); one micro-batch, so one compile."""
    results = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        settings = TrainerSettings(
            lr=1e-3, device="cpu", micro_batch_size=100, recompute_layers=recompute, recompute_on_cpu=False
        )
        trainer = LocalTrainer(str(tiny_checkpoint), settings)
        assert compile_decoder_layers(trainer.model, backend="aot_eager") == 2
        saved_bytes = 0

        def pack(tensor):
            nonlocal saved_bytes
            saved_bytes += tensor.numel() * tensor.element_size()
            return tensor

        teacher, _, _ = mixed_length_batch()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            trainer.compute_gradients(teacher)
        results[recompute] = ([p.grad.detach().clone() for p in trainer.model.parameters()], saved_bytes)
    assert_same_gradient(results[True][0], results[False][0])
    assert results[True][1] < 0.7 * results[False][1], (results[True][1], results[False][1])


def _status_kib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def write_llama(out_dir: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 64, 1),
        vocab_size=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# Freed tensors go back to the system at once, so resident memory follows live memory: large blocks
# are mmapped (a fixed threshold, not glibc's adaptive one) and the heap's top is always trimmed.
EXACT_RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def measure_step(checkpoint: Path, recompute: bool, sequences: int, tokens: int) -> tuple[float, float]:
    """(peak resident memory above the step's start in MiB, seconds) of one policy-gradient step."""
    settings = TrainerSettings(lr=1e-4, device="cpu", micro_batch_size=sequences, recompute_on_cpu=recompute)
    trainer = LocalTrainer(str(checkpoint), settings)
    g = torch.Generator().manual_seed(0)
    half = tokens // 2
    teacher = [
        TeacherSample(
            ids(g, half),
            ids(g, half),
            logprobs(g, half),
            reward=1.0,
            advantage=1.0,
            group_index=0,
            sample_index=i,
            inner_iteration=0,
        )
        for i in range(sequences)
    ]
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # peak resident size := current
    start_kib, started = _status_kib("VmRSS"), time.perf_counter()
    trainer.compute_gradients(teacher)
    return (_status_kib("VmHWM") - start_kib) / 1024, time.perf_counter() - started


def run_measurements(hidden: int, layers: int, sequences: int, tokens: int) -> list[dict]:
    """This file as a script in a fresh process under `EXACT_RSS_ENV`: each setting's figures."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, **EXACT_RSS_ENV, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [
        sys.executable,
        __file__,
        "--hidden",
        str(hidden),
        "--layers",
        str(layers),
        "--sequences",
        str(sequences),
        "--tokens",
        str(tokens),
        "--json",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_recompute_lowers_the_step_peak_memory():
    runs = run_measurements(hidden=128, layers=8, sequences=2, tokens=512)
    recomputed = max(r["peak_mib"] for r in runs if r["recompute"])
    kept = min(r["peak_mib"] for r in runs if not r["recompute"])
    assert recomputed < 0.5 * kept, runs


if __name__ == "__main__":
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="per sequence, half prompt, half response")
    parser.add_argument("--json", action="store_true", help="one JSON line of the figures")
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in EXACT_RSS_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **EXACT_RSS_ENV})
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_llama(Path(tmp), args.hidden, args.layers)
        params = sum(
            p.numel() for p in LocalTrainer(str(path), TrainerSettings(lr=1e-4, device="cpu")).model.parameters()
        )
        if not args.json:
            print(
                f"{params / 1e6:.1f}M parameters, {args.sequences} x {args.tokens} tokens, {torch.get_num_threads()} "
                "threads"
            )
        for recompute in (True, False) if args.json else (True, False, True, False):
            mib, seconds = measure_step(path, recompute, args.sequences, args.tokens)
            runs.append({"recompute": recompute, "peak_mib": mib, "step_s": seconds})
            if not args.json:
                print(f"recompute={recompute!s:5}  peak above start {mib:7.0f} MiB  step {seconds:6.2f} s")
    if args.json:
        print(json.dumps(runs))
