"""Recording for benchmarks/inner_loop.py: which chain and problem each request of a rollout
belongs to, and the service time each stand-in worker applied, so the benchmark can compute the
lower bound of that very run. Only subclasses that record; the orchestration is the project's.
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass, field
from typing import Any

from slime_meta.grading.graders import OpenAIGrader
from slime_meta.rollout.meta_rollout import MetaLearningRollout
from slime_meta.rollout.pools import SGLangPool
from slime_meta.types import Problem

ROLES = ("student", "teacher", "grader")

Attempt = tuple[float, float]  # (generate s, grade s) of one attempt


def _stage_s(groups: list[list[Attempt]], shared_reply: bool) -> float:
    """Critical path of one stage's attempts (grouped by problem: one `n` request each).

    shared_reply False: each attempt graded when its own generation ends (the strict bound);
    True: when the slowest of its request's n generations ends (the `n` request's own bound).
    """
    if shared_reply:
        return max((max(g for g, _ in group) + max(s for _, s in group) for group in groups if group), default=0.0)
    return max((g + s for group in groups for g, s in group), default=0.0)


@dataclass
class ChainRecord:
    """Service times of one chain's requests, grouped as the chain's dependencies run."""

    stages: list[list[list[Attempt]]] = field(default_factory=list)  # closed inner iterations
    teach_s: list[float] = field(default_factory=list)
    groups: list[list[Attempt]] = field(default_factory=list)  # the open stage, per problem

    def close_iteration(self, teach_s: float) -> None:
        self.stages.append(self.groups)
        self.teach_s.append(teach_s)
        self.groups = []

    def path(self, shared_reply: bool = False) -> float:
        closed = sum(_stage_s(groups, shared_reply) + teach for groups, teach in zip(self.stages, self.teach_s))
        return closed + _stage_s(self.groups, shared_reply)


_CHAIN: contextvars.ContextVar[ChainRecord | None] = contextvars.ContextVar("bench_chain", default=None)
_GROUP: contextvars.ContextVar[list[Attempt] | None] = contextvars.ContextVar("bench_group", default=None)
_SERVICE_MS = re.compile(r"service_ms=([0-9.]+)")
_GEN_MS = re.compile(r"gen_ms=([0-9.]+)")


class Ledger:
    """Per pool: requests and summed service seconds; per chain: its record."""

    def __init__(self) -> None:
        self.work_s = {role: 0.0 for role in ROLES}
        self.requests = {role: 0 for role in ROLES}
        self.chains: list[ChainRecord] = []

    def add(self, role: str, service_s: float) -> None:
        self.work_s[role] += service_s
        self.requests[role] += 1
        if role == "teacher" and _GROUP.get() is None and (chain := _CHAIN.get()) is not None:
            chain.close_iteration(service_s)


class RecordingPool(SGLangPool):
    """The project's pool client; reads the service time each fake worker reports."""

    ledger: Ledger | None = None

    async def post(self, path: str, payload: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        reply = await super().post(path, payload, *args, **kwargs)
        if self.ledger is not None:
            results = reply if isinstance(reply, list) else [reply]  # `n` > 1: one result per row
            self.ledger.add(self.name, sum(float(r.get("meta_info", {}).get("e2e_latency", 0.0)) for r in results))
        return reply


class RecordingGrader:
    """A grader (the project's OpenAIGrader); reads the service time the fake grader writes in its reply."""

    def __init__(self, inner: OpenAIGrader):
        self.inner = inner
        self.ledger: Ledger | None = None

    async def grade(self, problem: Problem, solution: str):
        grade = await self.inner.grade(problem, solution)
        if self.ledger is not None:
            match = _SERVICE_MS.search(grade.explanation)
            grade_s = float(match.group(1)) / 1000.0 if match else 0.0
            self.ledger.add("grader", grade_s)
            group = _GROUP.get()
            generated = _GEN_MS.search(solution)  # the student's service time, written in its text
            if group is not None:
                group.append((float(generated.group(1)) / 1000.0 if generated else 0.0, grade_s))
        return grade


class InstrumentedRollout(MetaLearningRollout):
    """Tags each chain and attempt with a context variable; the orchestration is the parent's."""

    ledger: Ledger

    async def _run_chain(self, chain, *args, **kwargs) -> None:
        record = ChainRecord()
        self.ledger.chains.append(record)
        _CHAIN.set(record)  # this chain's task (and the attempt tasks it starts) see it
        await super()._run_chain(chain, *args, **kwargs)

    async def _attempts(self, *args, **kwargs):
        group: list[Attempt] = []
        _GROUP.set(group)  # each problem's attempts run in their own task (asyncio.gather)
        result = await super()._attempts(*args, **kwargs)
        chain = _CHAIN.get()
        if chain is not None:
            chain.groups.append(group)
        return result

    async def _control_grades(self, *args, **kwargs) -> list[float]:
        record = ChainRecord()
        self.ledger.chains.append(record)
        _CHAIN.set(record)
        return await super()._control_grades(*args, **kwargs)
