"""What the slime rollout plugin keeps between calls: slime's rollout manager is one long-lived Ray
actor calling `generate_rollout` once per step, so the pieces (tokenizer, templates, grader, pool
clients, rollout, tracker) are built on the first call (`build_runtime`) and kept with an event
loop of their own (`LoopThread`).

Pools: the teacher is the first SGLang model (`args.sglang_router_ip/port`; --teacher-port
becomes --sglang-router-port); the student is --external-student-url, else the 'student' model of
--sglang-config, else the teacher's router (shared pool).
"""

from __future__ import annotations

import asyncio
import threading
from argparse import Namespace
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, TypeVar

from slime_meta.artifacts.plot import PlotRefresher
from slime_meta.artifacts.tracking import RunProgress, Tracker
from slime_meta.assembly import LoopParts, build_loop_parts, build_role_pieces, load_tokenizer
from slime_meta.backends.slime.flags import config_from_slime_args
from slime_meta.backends.slime.samples import DEFAULT_SDPO_TOPK
from slime_meta.config.arguments import MetaConfig
from slime_meta.rollout.meta_rollout import MetaLearningRollout
from slime_meta.rollout.pools import SGLangPool
from slime_meta.types import Problem

T = TypeVar("T")
STUDENT_MODEL = "student"


class LoopThread:
    """An asyncio loop in a daemon thread: pool sessions and grader clients live across calls."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="slime-meta-rollout", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def router_urls(args: Namespace, cfg: MetaConfig) -> tuple[str, str]:
    """(teacher URL, student URL) from what slime wrote into `args` after starting its routers."""
    teacher = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    external = cfg.pools.external_student_url
    if external:
        return teacher, external
    routers = getattr(args, "sglang_model_routers", None) or {}
    if STUDENT_MODEL in routers:
        ip, port = routers[STUDENT_MODEL]
        return teacher, f"http://{ip}:{port}"
    return teacher, teacher  # shared pool: the student is the evolving teacher


@dataclass
class Runtime:
    args: Namespace
    cfg: MetaConfig
    loop: LoopThread
    tokenizer: Any
    rollout: MetaLearningRollout
    teacher_pool: SGLangPool
    student_pool: SGLangPool
    run_dir: Path
    tracker: Any
    solver_builder: Any  # SolverSampleBuilder when a solver channel is on, else None
    baseline_done: bool = False  # --eval-baseline: measured once, at the first step of this run
    replayer: Any = None  # ReplayPairer with --replay-beta
    family_sampler: Any = None  # --group-key: our own per-family sampler over --prompt-data
    family_draws: int = 0
    eval_problems: dict[str, list[Problem]] | None = None
    plot: PlotRefresher | None = None  # holdout.png, redrawn while the run goes
    progress: RunProgress | None = None  # elapsed and ETA for the step line, from this process's first step
    oracle: float | None = None  # R_oracle (--eval-baseline) for the step line's normalised gain

    def close(self) -> None:
        async def close_pools() -> None:
            await self.teacher_pool.close()
            await self.student_pool.close()
            aclose = getattr(self.rollout.grader, "aclose", None)
            if aclose is not None:
                await aclose()

        self.loop.run(close_pools())
        self.loop.stop()
        if self.plot is not None:
            self.plot.close()  # a redraw still running ends before the driver's final plot


def build_runtime(args: Namespace) -> Runtime:
    cfg = config_from_slime_args(args)
    tokenizer = load_tokenizer(cfg.pools.hf_checkpoint)
    pieces = build_role_pieces(cfg)
    teacher_url, student_url = router_urls(args, cfg)
    loop = LoopThread()

    run_dir = Path(cfg.tracking.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)  # the replay pairs' cache lives there

    async def make_parts() -> LoopParts:  # in the loop thread, which the pools' clients belong to
        # The solver samples (context distillation, SDPO shaping) come from the same builder as on one
        # machine: the context goes where `distillation_prompt_ids` puts it, on both backends. No
        # progress bar inside a Ray actor's log.
        return build_loop_parts(cfg, pieces, teacher_url, student_url, tokenizer, run_dir, progress=False)

    parts = loop.run(make_parts())
    teacher_pool, student_pool, rollout, solver_builder = (
        parts.teacher_pool,
        parts.student_pool,
        parts.rollout,
        parts.solver_builder,
    )
    if solver_builder is not None and cfg.objectives.sdpo_on_any and cfg.objectives.sdpo_form == "jsd":
        # SDPO's JSD: slime's trainer has no hinted forward, so the pool scores each error site's
        # answer under the hint prompt once, returning its top-k per token (one prefill, no generation).
        topk = replace(solver_builder.settings, sdpo_topk_scoring=cfg.objectives.sdpo_topk or DEFAULT_SDPO_TOPK)
        solver_builder.settings = topk
    replayer = parts.replayer
    # Where a resumed run starts is the trainer's to know (its checkpoint): our records are appended.
    tracker = Tracker(cfg.tracking, run_dir, cfg.to_dict(), start_step=None)
    return Runtime(
        args=args,
        cfg=cfg,
        loop=loop,
        tokenizer=tokenizer,
        rollout=rollout,
        teacher_pool=teacher_pool,
        student_pool=student_pool,
        run_dir=run_dir,
        tracker=tracker,
        solver_builder=solver_builder,
        replayer=replayer,
        plot=PlotRefresher(run_dir),
    )
