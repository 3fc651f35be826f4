"""The outer loop on one machine: embedded workers behind the real sglang-router, a torch trainer.

Per outer step: draw problems -> meta-learning rollout over the pools -> one GRPO step ->
weights to the teacher workers -> metrics, traces, checkpoint.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

from slime_meta.artifacts.tracking import Tracker, format_eval_line, format_step_line
from slime_meta.artifacts.train_state import load_checkpoint, save_checkpoint, set_rng_state
from slime_meta.backends.local import components as C
from slime_meta.backends.local.launcher import LocalProcessGroup
from slime_meta.backends.local.pipeline import RolloutPipeline
from slime_meta.backends.local.worker_time import WorkerTimeMeter
from slime_meta.config.arguments import MetaConfig
from slime_meta.rollout.meta_rollout import describe_batch


def print_eval(step: int, metrics: dict) -> None:
    if metrics:
        print(format_eval_line(step, metrics), flush=True)


def on_thread(executor: Executor, fn, *args, **kwargs) -> asyncio.Future:
    return asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, **kwargs))


def run(cfg: MetaConfig) -> Path:
    return asyncio.run(_run(cfg))


async def _run(cfg: MetaConfig) -> Path:
    teacher_model = C.check_model_dir(cfg.pools.hf_checkpoint, "--hf-checkpoint")
    if cfg.pools.student_checkpoint:
        C.check_model_dir(cfg.pools.student_checkpoint, "--student-checkpoint")
    data = C.load_data(cfg)
    print(C.describe_plan(cfg, data), flush=True)
    resume = load_checkpoint(Path(cfg.checkpoint.load)) if cfg.checkpoint.load else None
    if resume:  # the teacher restarts from its trained weights, the data cursor where it stopped
        teacher_model = str(resume.model_dir)
        data.sampler.load_state_dict(resume.state["sampler"])
    start_step = resume.state["next_rollout_id"] if resume else 0
    tokenizer = C.load_tokenizer(teacher_model)
    pieces = C.build_role_pieces(cfg)
    external_student_url = C.external_student_url(cfg) if cfg.pools.student_router_ip else None
    cfg = C.with_trainer_plan(cfg, teacher_model)  # on a GPU: micro-batch tokens, recompute, compile (one line)
    run_dir = C.prepare_run_dir(cfg)  # only once the input is known to be good
    weights_root = run_dir / "weights"

    with LocalProcessGroup(host=cfg.pools.host) as processes:
        teacher_endpoints, student_url, grader_url = C.start_pools(
            cfg, processes, teacher_model, run_dir, external_student_url
        )
        pieces = C.with_local_grader(cfg, pieces, grader_url)
        teacher_pool = C.make_pool(cfg, "teacher", teacher_endpoints.router_url, cfg.sampling.teacher_concurrency)
        student_pool = C.make_pool(cfg, "student", student_url, cfg.sampling.student_concurrency)
        rollout = C.build_rollout(cfg, pieces, teacher_pool, student_pool, tokenizer)
        solver_builder = C.make_solver_builder(cfg, pieces, teacher_pool, tokenizer)
        replayer = C.make_replayer(cfg, run_dir)
        trainer = C.make_trainer(cfg, teacher_model, tokenizer)
        weight_sync = C.make_weight_sync(cfg, trainer, teacher_endpoints.worker_urls, weights_root, processes)
        if resume:
            trainer.load_state_dict(resume.trainer_state)
            set_rng_state(resume.trainer_state["rng"])
        tracker = Tracker(cfg.tracking, run_dir, cfg.to_dict(), start_step=start_step)
        # Each step: the local workers' seconds in prefill, decode and idle (worker/*).
        worker_time = WorkerTimeMeter({name: list(processes.pool(name).worker_urls) for name in processes.pool_names()})
        baseline = await C.baseline_eval(cfg, rollout, data.sampler.problems) if start_step == 0 else {}
        # Fixed eval sets: before training (merged into step 0's record), every --eval-interval steps, at the end.
        evaluation = await C.evaluate(cfg, rollout, data.eval_sets, 0) if start_step == 0 and data.eval_sets else {}
        print_eval(0, evaluation)

        async def produce(step: int, episodes: list):
            result = await rollout.run(episodes, step, seed=cfg.seed)
            return (
                episodes,
                result,
                *await C.solver_channel_inputs(solver_builder, replayer, result.chains, tokenizer, trainer),
            )

        pipeline = RolloutPipeline(
            produce,
            lambda: data.sampler.next_episodes(**data.draw_sizes),
            data.sampler.state_dict,
            max_async_level=cfg.meta.max_async_level,
            start_step=start_step,
            end_step=cfg.meta.num_rollout,
        )
        # The trainer's work (a step, the weight push, a checkpoint) runs on one thread of its own.
        # Why not asyncio.to_thread: glibc gives a new thread's allocations an arena of their own and
        # keeps freed memory per arena, and the default executor starts a new thread whenever the loop
        # asks while the last one is still winding down, as it does under CPU contention: each such
        # thread that trained kept 60-90 MB (the trainer +190 MB in 40 steps, 850 -> 1,040 MB).
        trainer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        try:
            for rollout_id in range(start_step, cfg.meta.num_rollout):
                step_started = time.perf_counter()
                # The pool serves weights of version rollout_id: one push per finished step.
                episodes, result, solver, pairs, solver_metrics = await pipeline.result(
                    rollout_id, weights_version=rollout_id
                )
                rollout_done = time.perf_counter()
                train_metrics = await on_thread(
                    trainer_thread, trainer.train_step, result.samples, solver, pairs, rollout_id
                )
                train_done = time.perf_counter()
                # A step skipped (non-finite, or no training signal) left the weights as they were: nothing to push.
                if not (train_metrics.get("train/skipped_nonfinite") or train_metrics.get("train/skipped_no_signal")):
                    await on_thread(
                        trainer_thread,
                        C.push_weights,
                        trainer,
                        teacher_endpoints.worker_urls,
                        weights_root,
                        rollout_id + 1,
                        processes,
                        weight_sync,
                    )
                step_done = time.perf_counter()
                # The step's wall time split where it is spent: waiting for the rollout (its part not
                # hidden behind the previous step with --max-async-level), training, the weight push.
                timings = {
                    "perf/step_time": step_done - step_started,
                    "perf/rollout_wait_time": rollout_done - step_started,
                    "perf/train_time": train_done - rollout_done,
                    "perf/weight_push_time": step_done - train_done,
                }

                metrics = {**result.metrics, **solver_metrics, **train_metrics, **timings}
                metrics.update(C.counter_metrics(teacher_pool, student_pool, rollout.grader))
                metrics.update(await asyncio.to_thread(C.process_metrics, processes))
                metrics.update(await asyncio.to_thread(worker_time.metrics))
                metrics.update(C.staleness_metrics(result.samples, rollout_id, start_step))
                metrics.update(baseline if rollout_id == start_step else {})
                metrics.update(evaluation)
                tracker.log(rollout_id, metrics)
                tracker.write_traces([describe_batch(episodes, rollout_id), *result.traces])
                print(format_step_line(rollout_id, metrics), flush=True)
                done, evaluation = rollout_id + 1, {}
                if C.eval_due(cfg, done) and data.eval_sets:
                    # Weights `done` are on the workers: logged with step `done` (the end: a record of its own).
                    evaluation = await C.evaluate(cfg, rollout, data.eval_sets, done)
                    print_eval(done, evaluation)
                    if done == cfg.meta.num_rollout:
                        tracker.log(done, evaluation)

                if C.should_save(cfg, rollout_id):
                    state = {
                        "next_rollout_id": rollout_id + 1,
                        "sampler": pipeline.sampler_state_for_resume(rollout_id + 1),
                    }
                    await on_thread(
                        trainer_thread,
                        save_checkpoint,
                        Path(cfg.checkpoint.save),
                        rollout_id + 1,
                        trainer=trainer,
                        tokenizer=tokenizer,
                        state=state,
                    )
        finally:
            await pipeline.cancel()
            await C.close_clients(teacher_pool, student_pool, pieces.grader, replayer)
            weight_sync.close()  # its /dev/shm file; the process group removes it too, also on SIGTERM
            tracker.finish()
            trainer_thread.shutdown(wait=False)  # a step in flight (an interrupt) still finishes on it
    C.write_plot(run_dir)
    return run_dir
