"""GPU accounting of a slime launch: how many GPUs training and each SGLang pool get, and the
--sglang-config generated for a separate student pool.

GPU facts this follows (slime, `slime/ray/placement_group.py` and `slime/ray/rollout.py`):
  - training (Megatron) takes actor_num_nodes x actor_num_gpus_per_node GPUs;
  - slime's --rollout-num-gpus is the sum over every SGLang model of --sglang-config (it asserts
    that), so with a separate student it is teacher GPUs + student GPUs;
  - --colocate: one placement group of max(training, rollout) GPUs, inference on the training
    GPUs first (offloaded while training runs); otherwise training + rollout GPUs, rollout after;
  - the first model of --sglang-config gets the router at --sglang-router-port and receives the
    weight updates (`update_weights: true`); a frozen model gets its own router.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Sequence

from slime_meta.backends.slime.argv import given
from slime_meta.errors import UserInputError

TEACHER_MODEL = "actor"  # slime's name for the trained model's pool in its own examples
STUDENT_MODEL = "student"
SLIME_DEFAULT_GPUS_PER_NODE = 8  # slime's default --actor-num-gpus-per-node and --num-gpus-per-node


@dataclass(frozen=True)
class InferencePool:
    model: str  # the model's name in --sglang-config (its router's key in args.sglang_model_routers)
    model_path: str | None
    num_gpus: int
    gpus_per_engine: int
    update_weights: bool

    @property
    def engines(self) -> int:
        return self.num_gpus // self.gpus_per_engine

    def as_sglang_model(self) -> dict:
        return {
            "name": self.model,
            "model_path": self.model_path,
            "update_weights": self.update_weights,
            "server_groups": [
                {"worker_type": "regular", "num_gpus": self.num_gpus, "num_gpus_per_engine": self.gpus_per_engine}
            ],
        }


@dataclass(frozen=True)
class GpuLayout:
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    num_gpus_per_node: int
    colocate: bool
    teacher: InferencePool
    student: InferencePool | None  # a separate pool slime starts; None: shared or external
    user_sglang_config: str | None = None  # the user's own --sglang-config: not generated, not split by role

    @property
    def training_gpus(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        return self.teacher.num_gpus + (self.student.num_gpus if self.student else 0)

    @property
    def total_gpus(self) -> int:
        if self.colocate:
            return max(self.training_gpus, self.rollout_gpus)
        return self.training_gpus + self.rollout_gpus

    @property
    def nodes(self) -> int:
        return math.ceil(self.total_gpus / self.num_gpus_per_node)

    def sglang_config(self) -> dict | None:
        """The --sglang-config we generate: only for a separate student pool (else slime's default)."""
        if self.student is None or self.user_sglang_config:
            return None
        return {"sglang": [self.teacher.as_sglang_model(), self.student.as_sglang_model()]}


def _positive(value: int | None, flag: str, what: str) -> int:
    if value is None or value < 1:
        raise UserInputError(f"{flag} {value}: {what} must be >= 1")
    return value


def _divisible(gpus: int, per_engine: int, gpus_flag: str, engine_flag: str) -> None:
    if gpus % per_engine:
        raise UserInputError(
            f"{gpus_flag} {gpus} is not a multiple of {engine_flag} {per_engine}: every engine needs all its GPUs"
        )


def plan_gpus(ns: argparse.Namespace, slime_ns: argparse.Namespace, argv: Sequence[str]) -> GpuLayout:
    nodes = _positive(ns.actor_num_nodes, "--actor-num-nodes", "training nodes")
    per_node = ns.actor_num_gpus_per_node if given(argv, "--actor-num-gpus-per-node") else SLIME_DEFAULT_GPUS_PER_NODE
    per_node = _positive(per_node, "--actor-num-gpus-per-node", "training GPUs per node")
    colocate = ns.colocate
    if given(argv, "--rollout-num-gpus"):
        teacher_gpus = ns.rollout_num_gpus
    elif colocate:
        teacher_gpus = nodes * per_node  # slime's own default under --colocate
    else:
        raise UserInputError(
            "--rollout-num-gpus is required without --colocate: the teacher's inference GPUs "
            "(training and inference then use separate GPUs)"
        )
    teacher_gpus = _positive(teacher_gpus, "--rollout-num-gpus", "the teacher's inference GPUs")
    _divisible(teacher_gpus, ns.rollout_num_gpus_per_engine, "--rollout-num-gpus", "--rollout-num-gpus-per-engine")
    teacher = InferencePool(TEACHER_MODEL, ns.hf_checkpoint, teacher_gpus, ns.rollout_num_gpus_per_engine, True)

    student = None
    if ns.student_checkpoint or ns.student_num_gpus:
        # A separate, frozen student pool; its checkpoint defaults to the teacher's starting one.
        flag = "--student-checkpoint" if ns.student_checkpoint else "--student-num-gpus"
        if slime_ns.sglang_config:
            raise UserInputError(
                f"--sglang-config and {flag}: give one; the student pool is generated from "
                "--student-num-gpus (and --student-checkpoint), or name a 'student' model in your own --sglang-config"
            )
        student_gpus = _positive(ns.student_num_gpus, "--student-num-gpus", "the separate student pool's GPUs")
        per_engine = ns.student_num_gpus_per_engine or ns.rollout_num_gpus_per_engine
        _divisible(student_gpus, per_engine, "--student-num-gpus", "--student-num-gpus-per-engine")
        checkpoint = ns.student_checkpoint or ns.hf_checkpoint
        student = InferencePool(STUDENT_MODEL, checkpoint, student_gpus, per_engine, False)
    return GpuLayout(
        actor_num_nodes=nodes,
        actor_num_gpus_per_node=per_node,
        num_gpus_per_node=slime_ns.num_gpus_per_node,
        colocate=colocate,
        teacher=teacher,
        student=student,
        user_sglang_config=slime_ns.sglang_config,
    )
