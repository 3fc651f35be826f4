"""The outer loop on one machine: embedded workers behind the real sglang-router, a torch trainer.

Per outer step: draw problems -> meta-learning rollout over the pools -> one GRPO step ->
weights to the teacher workers -> metrics, traces, evaluation, checkpoint.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

from slime_meta.artifacts.model_files import with_converted_checkpoints
from slime_meta.artifacts.plot import PlotRefresher, write_plot
from slime_meta.artifacts.tracking import (
    RunProgress,
    Tracker,
    format_eval_line,
    format_step_line,
    oracle_grade,
    read_metrics,
    summary_line,
)
from slime_meta.artifacts.train_state import load_checkpoint, save_checkpoint, set_rng_state
from slime_meta.assembly import build_loop_parts, build_role_pieces, load_tokenizer
from slime_meta.backends.local.data import describe_plan, load_data
from slime_meta.backends.local.evaluation import eval_due, evaluate
from slime_meta.backends.local.inputs import check_models, check_servers, prepare_run_dir
from slime_meta.backends.local.step.batch import batch_producer, train_on_batch
from slime_meta.backends.local.step.metrics import StepClock, StepCounters, staleness_metrics
from slime_meta.backends.local.step.pipeline import RolloutPipeline
from slime_meta.backends.local.training.settings import return_freed_heap
from slime_meta.backends.local.training.setup import make_trainer, with_trainer_plan
from slime_meta.backends.local.workers import weight_sync
from slime_meta.backends.local.workers.launcher import LocalProcessGroup
from slime_meta.backends.local.workers.pools import start_pools, with_local_grader
from slime_meta.config.arguments import MetaConfig
from slime_meta.rollout.baseline import baseline_eval
from slime_meta.rollout.clients import close_clients
from slime_meta.rollout.meta_rollout import describe_batch


def run(cfg: MetaConfig) -> Path:
    """`asyncio.run(_run(cfg))`, except that a stop lets the run finish its cleanup.

    A stop (SIGTERM's SystemExit, Ctrl-C's KeyboardInterrupt) is raised wherever the main thread
    is: in one task, where it waits for that task's own cleanup and leaves the loop later, possibly
    while asyncio.run is cancelling the other tasks. asyncio.run then closes the loop with the run's
    task still suspended, and its cleanup (the eval not yet logged, the clients, the plot) runs at
    garbage collection without a loop and fails. Here the tasks left are cancelled and driven to
    their end whatever they raise; the stop itself is what the caller sees.
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(loop.create_task(_run(cfg)))
    finally:
        try:
            _finish_tasks(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _finish_tasks(loop: asyncio.AbstractEventLoop, rounds: int = 5) -> None:
    for _ in range(rounds):
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        if not pending:
            return
        for task in pending:
            task.cancel()
        try:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        except (SystemExit, KeyboardInterrupt):
            continue  # the stop, out of the task it was raised in: the others still finish


async def _run(cfg: MetaConfig) -> Path:
    # Once, before anything reads them: a .gguf checkpoint flag becomes its converted HF directory.
    cfg = with_converted_checkpoints(cfg)
    teacher_model = check_models(cfg)
    data = load_data(cfg)
    print(describe_plan(cfg, data), flush=True)
    resume = load_checkpoint(Path(cfg.checkpoint.load)) if cfg.checkpoint.load else None
    if resume:  # the teacher restarts from its trained weights, the data cursor where it stopped
        teacher_model = str(resume.model_dir)
        data.sampler.load_state_dict(resume.state["sampler"])
    start_step = resume.state["next_rollout_id"] if resume else 0
    tokenizer = load_tokenizer(teacher_model)
    pieces = build_role_pieces(cfg)
    check_servers(cfg)  # --grader local's checkpoint, --external-student-url answering
    cfg = with_trainer_plan(cfg, teacher_model)  # on a GPU: micro-batch tokens, recompute, compile (one line)
    run_dir = prepare_run_dir(cfg)  # only once the input is known to be good
    try:
        await _train(cfg, data, resume, start_step, teacher_model, tokenizer, pieces, run_dir)
    finally:  # however the run ends: the last step, an error, Ctrl-C or SIGTERM
        write_plot(run_dir)
    summary = summary_line(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").is_file() else None
    if summary:
        print(summary, flush=True)
    return run_dir


async def _train(cfg: MetaConfig, data, resume, start_step: int, teacher_model: str, tokenizer, pieces, run_dir: Path):
    weights_root = run_dir / "weights"
    with LocalProcessGroup(host=cfg.pools.host) as processes:
        pools = start_pools(cfg, processes, teacher_model, run_dir)
        pieces = with_local_grader(cfg, pieces, pools.grader_url)
        # Progress bars only on a terminal: in a log file they would be glued to the step lines.
        parts = build_loop_parts(
            cfg, pieces, pools.teacher.router_url, pools.student_url, tokenizer, run_dir, progress=sys.stdout.isatty()
        )
        teacher_pool, student_pool, rollout = parts.teacher_pool, parts.student_pool, parts.rollout
        solver_builder, replayer = parts.solver_builder, parts.replayer
        trainer = make_trainer(cfg, teacher_model, tokenizer)
        workers = pools.teacher.worker_urls
        sync = weight_sync.weight_sync_for_run(cfg, trainer, workers, weights_root, processes.weight_buffer_prefix)
        if resume:
            trainer.load_state_dict(resume.trainer_state)
            set_rng_state(resume.trainer_state["rng"])
        tracker = Tracker(cfg.tracking, run_dir, cfg.to_dict(), start_step=start_step)
        counters = StepCounters(processes, teacher_pool, student_pool, rollout)
        baseline = await baseline_eval(cfg, rollout, data.sampler.problems) if start_step == 0 else {}
        oracle = oracle_grade(baseline, run_dir)
        # Fixed eval sets: before training (merged into step 0's record), every --eval-interval steps, at the end.
        evaluation = await evaluate(cfg, rollout, data.eval_sets, 0) if start_step == 0 and data.eval_sets else {}
        print_eval(0, evaluation)
        if cfg.meta.num_rollout == 0:  # evaluation only: no step record to carry the baseline, so it goes with the eval
            evaluation = {**baseline, **evaluation}
            print("evaluation only (--num-rollout 0): no training step", flush=True)
        pipeline = RolloutPipeline(
            batch_producer(cfg, rollout, solver_builder, replayer, tokenizer),
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
        progress, plot = RunProgress(start_step, cfg.meta.num_rollout), PlotRefresher(run_dir)
        eval_step = start_step  # the step whose record will carry `evaluation`
        unchanged_steps: set[int] = set()  # skipped steps: their weights are the step before's
        try:
            for rollout_id in range(start_step, cfg.meta.num_rollout):
                clock = StepClock()
                # Draw and rollout: the pool serves weights of version rollout_id (one push per finished step).
                batch = await pipeline.result(rollout_id, weights_version=rollout_id)
                clock.mark("rollout")
                train_metrics = await on_thread(trainer_thread, train_on_batch, trainer, batch, replayer, rollout_id)
                clock.mark("train")
                # A step skipped (non-finite, or no training signal) left the weights as they were: nothing to push.
                if not (train_metrics.get("train/skipped_nonfinite") or train_metrics.get("train/skipped_no_signal")):
                    push = weight_sync.push_weights
                    await on_thread(
                        trainer_thread, push, trainer, workers, weights_root, rollout_id + 1, processes, sync
                    )
                else:
                    unchanged_steps.add(rollout_id)
                clock.mark("push")
                # The step's freed memory back to the system: glibc keeps it resident otherwise (settings.py).
                await on_thread(trainer_thread, return_freed_heap)

                metrics = {**batch.result.metrics, **batch.solver_metrics, **train_metrics, **clock.metrics()}
                metrics.update(counters.counters())
                metrics.update(await asyncio.to_thread(counters.blocking_counters))
                metrics.update(staleness_metrics(batch.result.samples, rollout_id, start_step, unchanged_steps))
                metrics.update(baseline if rollout_id == start_step else {})
                metrics.update(evaluation)
                tracker.log(rollout_id, metrics)
                evaluation = {}
                tracker.write_traces([describe_batch(batch.episodes, rollout_id), *batch.result.traces])
                line = format_step_line(
                    rollout_id,
                    metrics,
                    total=cfg.meta.num_rollout,
                    elapsed_s=progress.elapsed_s(),
                    eta_s=progress.eta_s(rollout_id),
                    oracle=oracle,
                )
                print(line, flush=True)
                plot.after_step()
                done = rollout_id + 1
                if eval_due(cfg, done) and data.eval_sets:
                    # Weights `done` are on the workers: logged with step `done` (the end, or a stop first: own record).
                    evaluation, eval_step = await evaluate(cfg, rollout, data.eval_sets, done), done
                    print_eval(done, evaluation)
                    if done == cfg.meta.num_rollout:
                        tracker.log(done, evaluation)
                        evaluation = {}

                if should_save(cfg, rollout_id):
                    state = {"next_rollout_id": done, "sampler": pipeline.sampler_state_for_resume(done)}
                    save_to = Path(cfg.checkpoint.save)
                    await on_thread(
                        trainer_thread,
                        save_checkpoint,
                        save_to,
                        done,
                        trainer=trainer,
                        tokenizer=tokenizer,
                        state=state,
                        retain_interval=cfg.checkpoint.save_retain_interval,
                    )
        finally:
            if evaluation:  # evaluated, but the run stopped before the step it rides with: a record of its own
                tracker.log(eval_step, evaluation)
            await pipeline.cancel()
            await close_clients(teacher_pool, student_pool, pieces.grader, replayer)
            sync.close()  # its /dev/shm file; the process group removes it too, also on SIGTERM
            tracker.finish()
            plot.close()  # a redraw still running ends before the final plot
            trainer_thread.shutdown(wait=False)  # a step in flight (an interrupt) still finishes on it


def should_save(cfg: MetaConfig, rollout_id: int) -> bool:
    """At every --save-interval steps and after the last step, when --save is given."""
    done = rollout_id + 1
    interval = cfg.checkpoint.save_interval
    return bool(cfg.checkpoint.save) and (done == cfg.meta.num_rollout or bool(interval and done % interval == 0))


def print_eval(step: int, metrics: dict) -> None:
    if metrics:
        print(format_eval_line(step, metrics), flush=True)


def on_thread(executor: Executor, fn, *args, **kwargs) -> asyncio.Future:
    return asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, **kwargs))
