"""Flags and config of the inference pools: the teacher's, the student's and their workers."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime_meta.config.flag_types import AddFlag, open_fraction, page_size, positive_int, prefill_chunk


@dataclass(frozen=True)
class PoolConfig:
    hf_checkpoint: str | None
    rollout_num_gpus: int
    rollout_num_gpus_per_engine: int
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    teacher_port: int | None
    student_checkpoint: str | None
    student_num_gpus: int | None
    student_num_gpus_per_engine: int
    student_router_ip: str | None
    student_router_port: int | None
    external_student_url: str | None
    local_num_workers: int
    local_student_num_workers: int
    device: str
    host: str
    sglang_mem_fraction_static: float | None = None
    sglang_chunked_prefill_size: int | None = None
    sglang_context_length: int | None = None
    sglang_page_size: int | None = None
    local_kv_cache: str = "paged"
    colocate: bool = False


def add_pool_flags(add: AddFlag) -> None:
    """GPUs, workers and engine settings of the teacher's and the student's pools."""
    add(
        "--hf-checkpoint",
        default=None,
        help="Required: the teacher model to train; nothing is downloaded unasked, so there is no default. A local "
        "HF checkpoint directory, or a .gguf file (converted once into an HF directory cached under "
        "$SLIME_META_CACHE, default ~/.cache/slime-meta; needs the packages gguf and accelerate). The demo's small "
        "model: python -m slime_meta.models.tiny; real ones: python -m slime_meta.models.real NAME.",
    )
    add(
        "--rollout-num-gpus",
        type=int,
        default=0,
        help="GPUs of the teacher's inference pool (local backend on GPUs: one worker per engine, on the GPUs after "
        "the trainer's GPU 0, or from GPU 0 on with --colocate). Default 0: slime's own default under --colocate "
        "(the training GPUs); locally, --local-num-workers workers share the trainer's device.",
    )
    add(
        "--colocate",
        action="store_true",
        help="Inference on the training GPUs (slime: one placement group, each side offloaded while the other "
        "runs; local backend: the teacher pool's GPUs start at the trainer's GPU 0). Default off: inference on "
        "GPUs of its own (local backend: the teacher pool from GPU 1, a student pool after the teacher's).",
    )
    add(
        "--rollout-num-gpus-per-engine",
        type=positive_int,
        default=1,
        help="GPUs per inference engine (the local worker uses one GPU per engine).",
    )
    add("--actor-num-nodes", type=positive_int, default=1, help="slime backend: nodes of the trainer (Megatron).")
    add(
        "--actor-num-gpus-per-node",
        type=int,
        default=0,
        help="slime backend: trainer GPUs per node (the local backend trains on its one device).",
    )
    add(
        "--teacher-port",
        type=int,
        default=None,
        help="Port of the teacher's router (slime: --sglang-router-port; local: the router we start, its workers on "
        "free ports); default: a free port.",
    )
    add(
        "--sglang-router-port",
        dest="teacher_port",
        type=int,
        default=argparse.SUPPRESS,  # the default is --teacher-port's
        help="slime's name for --teacher-port, the same on both backends.",
    )
    add(
        "--student-checkpoint",
        default=None,
        help="A separate, frozen student pool from this checkpoint (an HF directory or a .gguf file); default: with "
        "--student-num-gpus, the teacher's starting checkpoint (--hf-checkpoint), else no separate pool (the "
        "student shares the teacher's).",
    )
    add(
        "--student-num-gpus",
        type=positive_int,
        default=None,
        help="GPUs of a separate, frozen student pool (from --student-checkpoint, default the teacher's starting "
        "weights); local backend: --student-num-gpus / --student-num-gpus-per-engine workers, on CUDA placed "
        "after the teacher pool's GPUs (without --rollout-num-gpus: after the trainer's GPU 0, or from GPU 0 on "
        "with --colocate); default: no separate pool (shared with the teacher).",
    )
    add(
        "--student-num-gpus-per-engine",
        type=positive_int,
        default=None,
        help="GPUs per student engine; default: --rollout-num-gpus-per-engine.",
    )
    add(
        "--student-router-ip",
        default=None,
        help="Address of the student router; default: the teacher's (local backend: --host, the only value it takes; "
        "slime picks it itself).",
    )
    add(
        "--student-router-port",
        type=int,
        default=None,
        help="Local backend: port of the separate student pool's router we start; default: a free port "
        "(slime assigns it itself).",
    )
    add(
        "--external-student-url",
        default=None,
        help="Use an already running SGLang-API server or router (http://HOST:PORT) as the student pool; "
        "nothing is started for the student. Default: none.",
    )
    add(
        "--local-num-workers",
        type=positive_int,
        default=1,
        help="Local backend: embedded teacher workers when --rollout-num-gpus is not given (CPU, or sharing one GPU).",
    )
    add(
        "--local-student-num-workers",
        type=positive_int,
        default=1,
        help=(
            "Local backend: workers of a separate student pool (--student-checkpoint) when --student-num-gpus is not "
            "given."
        ),
    )
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="Local backend: cuda if available, else cpu.")
    add("--host", default="127.0.0.1", help="Local backend: address workers and routers bind to.")
    add(
        "--sglang-mem-fraction-static",
        type=open_fraction,
        default=None,
        help="Fraction of the GPU's total memory each inference worker may hold for weights plus its static KV "
        "cache (SGLang's --mem-fraction-static); local backend: passed to the workers, and a split with the "
        "trainer on the same GPU that cannot fit is refused at start. Default: not set: when local workers share the "
        "trainer's GPU, each gets an equal part of at most 0.3 of it (never more than the trainer's estimate "
        "leaves); otherwise workers keep up to 30%% of the memory free when they start.",
    )
    add(
        "--sglang-chunked-prefill-size",
        type=prefill_chunk,
        default=None,
        help="Tokens per prefill forward in the inference workers (SGLang's --chunked-prefill-size; -1: off). "
        "Default: not set (local workers prefill whole prompts).",
    )
    add(
        "--sglang-context-length",
        type=positive_int,
        default=None,
        help="Local backend (the worker's --static-cache-len): with the paged cache, the page pool holds this "
        "many tokens per running row, and rows of any length share them; with --local-kv-cache static, the "
        "longest request (prompt + new tokens) a slot serves on the CUDA-graph path, longer ones taking the "
        "slower generic path. Default: not set (4096). Sized within the workers' memory share. On "
        "--backend slime this is SGLang's own --context-length.",
    )
    add(
        "--sglang-page-size",
        type=page_size,
        default=None,
        help="Tokens per page of the KV cache (SGLang's --page-size). Local backend: the page size of the embedded "
        "workers' paged cache (--local-kv-cache paged); not set: 16. On --backend slime this is SGLang's own "
        "flag (SGLang's default when not set).",
    )
    add(
        "--local-kv-cache",
        choices=("paged", "static"),
        default="paged",
        help="Local backend on CUDA: the embedded workers' KV cache. paged (default): one pool of pages for all "
        "running requests, as many tokens as --sglang-context-length x the running rows; a row takes pages as "
        "its tokens arrive, so any request the pool holds decodes on the CUDA-graph path and attention reads "
        "only the row's own tokens. static: a slot of --sglang-context-length tokens per running request; "
        "longer requests take the slower generic path (docs/performance.md section 8). The CPU decodes "
        "without either.",
    )
