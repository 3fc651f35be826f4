"""One GPU divided between the local trainer and its workers: the estimate, the start-time check,
and the run-level flags reaching the workers the launcher starts."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from slime_meta.backends.local.training.gpu_split import (
    check_shared_gpu,
    default_worker_fraction,
    estimate_trainer,
    gpu_split_problem,
    model_size,
    worker_memory_args,
    workers_on_first_gpu,
)
from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.backends.local.workers.pools import start_pools
from slime_meta.config.arguments import parse_config
from slime_meta.errors import UserInputError
from slime_meta_engine.server import parse_args as parse_worker_args

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from trainer_memory import SHAPES  # noqa: E402 - the benchmark's model shapes

GB = 10**9
GIB = 2**30
BASE = ["--use-meta-learning", "--prompt-data", str(REPO_ROOT / "data/math_word_problems.jsonl")]


def test_the_estimate_covers_every_measured_trainer_peak() -> None:
    """Calibrated on the trainer memory benchmark: at or above each measured peak, and not far above."""
    report = json.loads((REPO_ROOT / "benchmarks/results/trainer_memory_h200.json").read_text())
    for row in report["rows"]:
        shape = SHAPES[row["shape"]]
        tokens = row["max_tokens_per_gpu"] or report["batch"] * report["seq"]  # micro_batch_all: one micro-batch
        estimate = estimate_trainer(
            params=row["params"],
            num_layers=shape["num_hidden_layers"],
            hidden_size=shape["hidden_size"],
            micro_batch_tokens=tokens,
            recompute=row["recompute_layers"],
            with_reference=False,
        )
        measured = row["peak_allocated_gib"] * GIB
        assert measured <= estimate.total_bytes <= 1.35 * measured, (row["shape"], row["setting"])


def trainer(state_gb: float, activation_gb: float):
    return estimate_trainer(
        params=int(state_gb * GB / 16),
        num_layers=1,
        hidden_size=1,
        micro_batch_tokens=int(activation_gb * GB / 96),
        recompute=False,
        with_reference=False,
    )


def test_a_split_that_fits_passes_and_one_that_does_not_names_the_fix() -> None:
    total = 80 * GB
    small = trainer(25, 10)  # about 36 GB with its overhead
    assert gpu_split_problem(total_bytes=total, trainer=small, num_workers=2, worker_fraction=0.2) is None
    problem = gpu_split_problem(total_bytes=total, trainer=small, num_workers=2, worker_fraction=0.4)
    assert problem is not None and "\n" not in problem
    assert "80.0 GB" in problem and "--sglang-mem-fraction-static 0.4" in problem
    most = float(problem.split("at most ")[1].split()[0])
    # The fraction it proposes fits; a little more does not.
    assert gpu_split_problem(total_bytes=total, trainer=small, num_workers=2, worker_fraction=most) is None
    assert gpu_split_problem(total_bytes=total, trainer=small, num_workers=2, worker_fraction=most + 0.01) is not None


def test_a_trainer_too_large_alone_points_at_the_trainer_flags() -> None:
    huge = trainer(60, 30)
    for fraction in (None, 0.1):
        problem = gpu_split_problem(total_bytes=80 * GB, trainer=huge, num_workers=1, worker_fraction=fraction)
        assert problem is not None and "--max-tokens-per-gpu" in problem and "--recompute-granularity full" in problem
    # On a larger GPU the same trainer fits.
    assert gpu_split_problem(total_bytes=141 * GB, trainer=huge, num_workers=1, worker_fraction=0.1) is None


def test_reference_weights_and_recompute_change_the_estimate() -> None:
    shape = dict(params=10**9, num_layers=24, hidden_size=1024, micro_batch_tokens=8192)
    plain = estimate_trainer(**shape, recompute=False, with_reference=False)
    assert estimate_trainer(**shape, recompute=False, with_reference=True).state_bytes == plain.state_bytes + 4 * 10**9
    assert estimate_trainer(**shape, recompute=True, with_reference=False).activation_bytes < plain.activation_bytes / 4


def test_without_the_flag_workers_beside_the_trainer_share_what_it_leaves() -> None:
    total = 80 * GB
    # A small trainer leaves plenty: the workers together get AUTO_WORKERS_SHARE (0.3) of the GPU.
    assert default_worker_fraction(total_bytes=total, trainer=trainer(5, 2), num_workers=1) == 0.3
    assert default_worker_fraction(total_bytes=total, trainer=trainer(5, 2), num_workers=3) == 0.1
    # A large one leaves less: an equal part of what is left, and the split then fits.
    big = trainer(55, 10)
    fraction = default_worker_fraction(total_bytes=total, trainer=big, num_workers=2)
    assert 0 < fraction < 0.15
    assert gpu_split_problem(total_bytes=total, trainer=big, num_workers=2, worker_fraction=fraction) is None
    # Nothing left: no share, and the check names the trainer's flags.
    assert default_worker_fraction(total_bytes=total, trainer=trainer(70, 20), num_workers=1) is None


def test_workers_on_the_trainers_gpu() -> None:
    assert workers_on_first_gpu([(2, None)]) == 2  # workers that see the devices as they are share GPU 0
    assert workers_on_first_gpu([(2, (0, 1)), (1, (2,))]) == 1
    assert workers_on_first_gpu([(3, (0,)), (1, None)]) == 4


def test_run_flags_are_checked_and_become_the_workers_flags(tiny_checkpoint: Path) -> None:
    for bad in (["--sglang-mem-fraction-static", "1.2"], ["--sglang-chunked-prefill-size", "0"]):
        with pytest.raises(SystemExit) as error:
            parse_config([*BASE, *bad])
        assert error.value.code == 2
    cfg = parse_config([*BASE, "--sglang-mem-fraction-static", "0.35", "--sglang-chunked-prefill-size", "-1"])
    assert (cfg.pools.sglang_mem_fraction_static, cfg.pools.sglang_chunked_prefill_size) == (0.35, -1)
    args = worker_memory_args(0.35, 2048)
    worker = parse_worker_args(["--model-path", str(tiny_checkpoint), *args])
    assert worker.mem_fraction_static == 0.35 and worker.chunked_prefill_size == 2048
    assert worker_memory_args(None, None) == ["--kv-cache", "paged"]
    cfg = parse_config([*BASE, "--sglang-context-length", "8192"])
    args = worker_memory_args(None, None, cfg.pools.sglang_context_length)
    assert parse_worker_args(["--model-path", str(tiny_checkpoint), *args]).static_cache_len == 8192
    with pytest.raises(SystemExit):
        parse_config([*BASE, "--sglang-context-length", "0"])
    # The workers' paged KV cache by default (16-token pages), its page size from --sglang-page-size;
    # --local-kv-cache static gives the static slots.
    for flags, expected in (
        ([], ("paged", 16)),
        (["--sglang-page-size", "32"], ("paged", 32)),
        (["--local-kv-cache", "static"], ("static", 16)),
    ):
        p = parse_config([*BASE, *flags]).pools
        args = worker_memory_args(None, None, None, p.sglang_page_size, p.local_kv_cache)
        worker = parse_worker_args(["--model-path", str(tiny_checkpoint), *args])
        assert (worker.kv_cache, worker.page_size) == expected, flags
    assert parse_worker_args(["--model-path", str(tiny_checkpoint)]).kv_cache == "paged"
    with pytest.raises(SystemExit) as error:
        parse_config([*BASE, "--local-kv-cache", "dense"])
    assert error.value.code == 2
    for bad in ("24", "256", "0"):
        with pytest.raises(SystemExit) as error:
            parse_config([*BASE, "--sglang-page-size", bad])
        assert error.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_the_check_does_nothing_without_cuda(tmp_path: Path) -> None:
    cfg = parse_config([*BASE, "--sglang-mem-fraction-static", "0.99"])
    check_shared_gpu(cfg, str(tmp_path / "no-such-model"), [(4, None)])  # reads nothing, refuses nothing


def test_model_size_is_read_from_the_config_alone(tiny_checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    params, layers, hidden = model_size(str(tiny_checkpoint))
    assert params == sum(p.numel() for p in model.parameters())
    assert (layers, hidden) == (model.config.num_hidden_layers, model.config.hidden_size)


def test_start_pools_passes_the_memory_flags_to_its_workers(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The real launcher and router on CPU: the flags reach the worker command, and it serves."""
    cfg = parse_config(
        [
            *BASE,
            "--hf-checkpoint",
            str(tiny_checkpoint),
            "--device",
            "cpu",
            "--run-dir",
            str(tmp_path),
            "--sglang-mem-fraction-static",
            "0.3",
            "--sglang-chunked-prefill-size",
            "64",
        ]
    )
    with LocalProcessGroup(startup_timeout_s=120) as group:
        teacher, _, _ = start_pools(cfg, group, str(tiny_checkpoint), tmp_path)
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        request = urllib.request.Request(
            f"{teacher.router_url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert len(json.loads(response.read())["output_ids"]) == 3
    log = (tmp_path / "logs" / "teacher-worker-0.log").read_text()
    assert "--mem-fraction-static 0.3 --chunked-prefill-size 64" in log


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_check_refuses_a_split_that_cannot_fit(tmp_path: Path) -> None:
    """On the real GPU with a 1.5B-shape config: workers at 0.9 beside the trainer are refused with
    the fraction that fits; that fraction with a dynamic token budget and recompute passes."""
    from transformers import Qwen2Config

    Qwen2Config(**SHAPES["1.5B"]).save_pretrained(tmp_path)  # model_size reads the config only
    flags = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--recompute-granularity", "full"]
    refused = parse_config([*BASE, "--sglang-mem-fraction-static", "0.9", *flags])
    with pytest.raises(UserInputError, match=r"--sglang-mem-fraction-static 0\.9 .* at most") as error:
        check_shared_gpu(refused, str(tmp_path), [(1, None)])
    most = float(str(error.value).split("at most ")[1].split()[0])
    check_shared_gpu(
        parse_config([*BASE, "--sglang-mem-fraction-static", str(most), *flags]), str(tmp_path), [(1, None)]
    )
    # Without the flag the check picks a share that fits.
    auto = check_shared_gpu(parse_config([*BASE, *flags]), str(tmp_path), [(1, None)])
    assert auto is not None and 0 < auto <= min(0.3, most)
