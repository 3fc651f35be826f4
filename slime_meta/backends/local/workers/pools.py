"""The local run's pools of embedded workers: where each pool's workers go (GPU layouts), starting
the teacher pool, a separate student pool and the --grader local pool, and that grader.

The teacher's router listens on --teacher-port, the student's on --student-router-port (free
ports without them); the workers behind each router take free ports. A separate student starts
from --student-checkpoint, which defaults to the teacher's *starting* checkpoint (--hf-checkpoint,
also when the teacher resumes from trained weights) and stays frozen.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from slime_meta.assembly import RolePieces, llm_grader
from slime_meta.backends.local.inputs import check_model_dir
from slime_meta.backends.local.training.gpu_split import check_shared_gpu, worker_memory_args
from slime_meta.backends.local.training.settings import resolve_device
from slime_meta.backends.local.workers.grader import grader_checkpoint, start_grader_pool
from slime_meta.backends.local.workers.launcher import LocalProcessGroup, PortInUse
from slime_meta.backends.local.workers.processes import PoolEndpoints
from slime_meta.config.arguments import MetaConfig
from slime_meta.errors import UserInputError

logger = logging.getLogger(__name__)
TRAINER_GPUS = 1  # the local trainer trains on its one device, GPU 0


@dataclass(frozen=True)
class WorkerLayout:
    num_workers: int
    gpu_ids: tuple[int, ...] | None  # None: every worker sees the machine's devices as they are


def worker_layouts(cfg: MetaConfig) -> tuple[WorkerLayout, WorkerLayout]:
    """Teacher and student workers: from the slime GPU flags on GPUs, else the local counts.

    The GPUs follow slime's placement: the trainer trains on GPU 0; inference gets GPUs of its own
    after it (the teacher pool from GPU 1), or with --colocate starts on the trainer's GPU 0; a
    student pool's GPUs follow the teacher pool's. The local worker runs one engine per GPU, so a
    pool of G GPUs with E GPUs per engine gets G // E workers (E defaults to the teacher's for the
    student). Without --rollout-num-gpus, --local-num-workers teacher workers share whatever device
    they find (CPU, or GPU 0 with the trainer); a separate student pool given by --student-checkpoint
    alone has --local-student-num-workers workers sharing it too. The student layout matters only
    when `cfg.separate_student` (a shared student uses the teacher's workers).
    """
    p = cfg.pools
    first = 0 if p.colocate else TRAINER_GPUS
    if p.rollout_num_gpus > 0:
        teacher_engines = max(1, p.rollout_num_gpus // p.rollout_num_gpus_per_engine)
        gpus = range(first, first + p.rollout_num_gpus, p.rollout_num_gpus_per_engine)
        teacher = WorkerLayout(teacher_engines, tuple(gpus))
        first += p.rollout_num_gpus
    else:
        teacher = WorkerLayout(p.local_num_workers, None)
    if p.student_num_gpus:
        engines = max(1, p.student_num_gpus // p.student_num_gpus_per_engine)
        gpus = range(first, first + p.student_num_gpus, p.student_num_gpus_per_engine)
        student = WorkerLayout(engines, tuple(gpus))
    else:
        student = WorkerLayout(p.local_student_num_workers, None)
    return teacher, student


def check_gpus_exist(layouts: list[tuple[int, tuple[int, ...] | None]], device_count: int) -> None:
    """Refuse (exit 2) a layout that names a GPU the machine does not have, with the way out."""
    highest = max((max(ids) for _, ids in layouts if ids), default=-1)
    if highest < device_count:
        return
    raise UserInputError(
        f"--rollout-num-gpus / --student-num-gpus: the pools need GPU {highest}, and this machine has {device_count} "
        "GPU(s) (the trainer takes GPU 0 and inference the GPUs after it); give fewer GPUs, or --colocate to "
        "start the pools on the trainer's GPU 0"
    )


def describe_layout(layouts: list[tuple[int, tuple[int, ...] | None]], names: list[str]) -> str:
    """One start line: which GPUs the trainer and each pool use."""
    parts = ["trainer GPU 0"]
    for name, (count, ids) in zip(names, layouts):
        where = "the trainer's device" if ids is None else "GPU " + ", ".join(map(str, ids))
        parts.append(f"{name} pool {count} worker(s) on {where}")
    return "; ".join(parts)


def pool_layouts(cfg: MetaConfig, student_pool: bool, grader_pool: bool) -> list[tuple[int, tuple[int, ...] | None]]:
    """`(num_workers, gpu_ids)` of each pool the run starts: the teacher's, a separate student's, the local grader's."""
    teacher_layout, student_layout = worker_layouts(cfg)
    layouts = [(teacher_layout.num_workers, teacher_layout.gpu_ids)]
    layouts += [(student_layout.num_workers, student_layout.gpu_ids)] if student_pool else []
    layouts += [(cfg.grader.grader_num_workers, None)] if grader_pool else []  # shares the device
    return layouts


class StartedPools(NamedTuple):
    teacher: PoolEndpoints
    student_url: str  # the student's router: its own pool, an external server, or the teacher's
    grader_url: str | None  # --grader local: its OpenAI-compatible base URL; else None


def start_pools(cfg: MetaConfig, processes: LocalProcessGroup, teacher_model: str, run_dir: Path) -> StartedPools:
    """Start the teacher pool, a separate student pool and the --grader local pool when asked."""
    p, logs, (teacher_layout, student_layout) = cfg.pools, str(run_dir / "logs"), worker_layouts(cfg)
    external_student = p.external_student_url
    student_model = None
    if cfg.separate_student and not external_student:
        student_model = check_model_dir(p.student_checkpoint or p.hf_checkpoint, "--student-checkpoint")
    grader_model = grader_checkpoint(cfg) if cfg.grader.grader == "local" else None
    layouts = pool_layouts(cfg, student_model is not None, grader_model is not None)
    if resolve_device(p.device).type == "cuda":
        import torch

        check_gpus_exist(layouts, torch.cuda.device_count())
        names = ["teacher"] + ["student"] * (student_model is not None) + ["grader"] * (grader_model is not None)
        logger.info("GPUs: %s", describe_layout(layouts, names))
    # exit 2 before anything starts when they cannot fit; without the flag, the workers' share of the trainer's GPU
    worker_fraction = check_shared_gpu(cfg, teacher_model, layouts)
    worker_args = worker_memory_args(
        worker_fraction, p.sglang_chunked_prefill_size, p.sglang_context_length, p.sglang_page_size, p.local_kv_cache
    )

    def start(name: str, model: str, layout: WorkerLayout, weights_root, router_port, port_flag) -> PoolEndpoints:
        try:
            return processes.start_pool(
                name,
                model,
                layout.num_workers,
                device=p.device,
                gpu_ids=layout.gpu_ids,
                weights_root=weights_root,
                log_dir=logs,
                router_port=router_port,
                worker_args=worker_args,
            )
        except PortInUse as error:
            raise UserInputError(
                f"{port_flag} {error.port}: cannot listen there on {p.host} (in use?); give a free port, "
                "or leave the flag out for a free one"
            ) from None

    teacher = start(
        "teacher", teacher_model, teacher_layout, str(run_dir / "weights"), p.teacher_port, "--teacher-port"
    )
    grader_url = start_grader_pool(processes, cfg, grader_model, logs, worker_args) if grader_model else None
    if external_student:
        return StartedPools(teacher, external_student, grader_url)
    if student_model is not None:
        student = start("student", student_model, student_layout, None, p.student_router_port, "--student-router-port")
        return StartedPools(teacher, student.router_url, grader_url)
    return StartedPools(teacher, teacher.router_url, grader_url)  # shared pool: the student is the evolving model


def with_local_grader(cfg: MetaConfig, pieces: RolePieces, grader_url: str | None) -> RolePieces:
    """--grader local: the pieces with the LLM grader over the pool `start_pools` started, built
    here once (other graders: the pieces as they are)."""
    if pieces.grader is not None or grader_url is None:
        return pieces
    grader = llm_grader(cfg, pieces.grader_template, grader_checkpoint(cfg), grader_url)
    return dataclasses.replace(pieces, grader=grader)
