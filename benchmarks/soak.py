"""Soak: N outer steps of the demo's run, every process's resident memory and open files after each step.

    python benchmarks/soak.py --steps 500       # benchmarks/results/soak_cpu_500steps.json and .png
    python benchmarks/soak.py --steps 40 --out /tmp/soak.json
    python benchmarks/soak.py --steps 200 --cpu-load 1             # one busy loop beside the run
    python benchmarks/soak.py --steps 60 -- --max-async-level 1    # extra train.py flags after --
    # one GPU, the 0.5B real model: benchmarks/results/soak_gpu_real_200steps.json and .png
    MODEL=qwen2.5-coder-0.5b DATA=price_lists python benchmarks/soak.py --script real --steps 200
    # an earlier results file's figures from another warm-up (the file is kept), its PNG redrawn
    python benchmarks/soak.py --replot benchmarks/results/soak_gpu_real_200steps.json --warmup 101
    # ... and the run's per-step engine figures stored in it (a file from before soak.py kept them)
    python benchmarks/soak.py --replot FILE.json --metrics RUN_DIR/metrics.jsonl
    # what the trainer and the workers keep, by allocation site (Python's heap, tracemalloc)
    python benchmarks/soak.py --steps 100 --tracemalloc /tmp/heap
    # and natively, by stack (pip install memray); a run stopped after 20 minutes, its steps reported
    python benchmarks/soak.py --steps 600 --time-limit-s 1200 --tracemalloc /tmp/heap --memray

The run is `scripts/run_synthetic.sh` (what `scripts/demo.sh` runs: the tiny model, four teacher prompts
x eight infos, a checkpoint every two steps), or with `--script real` `scripts/run_real.sh` (its
MODEL, DATA, GRADER from the environment). After each step (a new line in metrics.jsonl) the
resident set size and the open file descriptors of the trainer and of each of its children (router,
workers) are read from /proc, the trainer's, workers' and router's RSS also split into anonymous,
file-backed and shared pages.
Where `nvidia-smi` lists GPUs, also each process's GPU memory (`gpu_mib`: what the driver has
given it, the caching allocator's reserve included) and each GPU's memory in use (`gpus`); the
trainer's samples also get its caching allocator's own figures from the step's metrics (`allocated_mib`,
what it holds; `reserved_mib`, its reserve), which tell a larger reserve from tensors kept.
The JSON also keeps each step's time, where the local workers spent it and what the pools were asked
(`engine_samples`, the `worker/*` and `pool/*` metrics: prefill, decode and idle seconds, prefill
batches, requests) and their medians after
warm-up (`engine`), so that two soaks of different engine settings compare in cost as well as memory.

Warm-up is the first `--warmup` steps (10: allocator arenas, torch's caches, AdamW's state, the
router's connections) and lasts at least until the run's first plot (holdout.png, drawn once 60 s
have passed; runs that drew it in the trainer's process imported matplotlib then, about 30 MiB once;
it is drawn in a process of its own now). After it, per process:
- slope: the least-squares slope of RSS against the step, MiB a step, and what it adds up to over
  the steps measured; `noise`: the standard deviation of RSS around that line;
- growth: the median of the last 5 samples (before the last one, which is taken while the run
  shuts down) over the median of the first 5 after warm-up, as `tests/test_reliability_soak.py` checks it.
The same figures for GPU memory (`gpu_*`) where it was sampled. The JSON holds every sample; the
PNG draws RSS and descriptors (and GPU memory) per process against the step.

With `--tracemalloc DIR` the run's trainer and workers trace their Python heaps
(slime_meta_engine/memory_snapshots.py): each is sent SIGUSR2 once warm-up is over (after step
`--warmup` and after the first plot, whose imports are one-time: tracing starts), two steps later and
two steps before the end (a snapshot each, in DIR), and the two snapshots are compared into the JSON's
`tracemalloc` (the traced heap's growth and the allocation sites that grew most, with their
tracebacks). Tracing slows the steps it covers. `--memray` (with `--tracemalloc`; `pip install memray`)
also records each process's native allocations from the first snapshot to the last
(slime_meta_engine/native_allocations.py): what C/C++ code allocated there and still held, by stack.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from soak_figures import WINDOW, engine_samples, summarise, summarise_engine, summarise_gpus  # noqa: E402
from soak_heaps import (  # noqa: E402
    ask_for_snapshots,
    compare_snapshots,
    heap_snapshot_due,
    print_heap_growth,
    wait_for_snapshots,
)
from soak_plot import plot, print_figures  # noqa: E402
from soak_probes import (  # noqa: E402
    allocator_mib,
    descendants,
    fd_count,
    gpu_memory_by_pid,
    gpu_memory_used,
    memory_kib,
)

sys.path.insert(0, str(ROOT))
from slime_meta_engine import memory_snapshots, native_allocations  # noqa: E402

PLOT_NAME = "holdout.png"
SCRIPTS = {"synthetic": "scripts/run_synthetic.sh", "real": "scripts/run_real.sh"}
CUDA_ENV_PREFIXES = ("CUBLAS", "CUDA_", "PYTORCH_", "TORCH_", "TRITON_")


@dataclass
class SoakRun:
    """What `run_soak` saw: per process name, one sample per step (step, rss_kib, fds, and for the
    trainer anon_kib and file_kib; gpu_mib where a GPU was in use), each GPU's memory in use per step,
    the steps after which the run had redrawn its plot, the run's step times and exit code, and with
    --tracemalloc the steps after which tracing started and the heaps were snapshot."""

    steps: int
    seconds: float
    returncode: int | None
    samples: dict[str, list[dict]] = field(default_factory=dict)
    gpus: list[dict] = field(default_factory=list)
    plot_steps: list[int] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    engine: list[dict] = field(default_factory=list)  # per step: step time, the workers' engine time
    snapshot_steps: list[int] = field(default_factory=list)  # --tracemalloc: tracing started, snapshots
    time_limited: bool = False  # stopped at the time limit before its last step
    log: str = ""

    def warmup_end(self, warmup: int) -> int:
        """The first step measured after warm-up: `warmup`, or the step after the first plot when later."""
        return max(warmup, self.plot_steps[0] + 1) if self.plot_steps else warmup

    def series(self, name: str, key: str = "rss_kib") -> list[int]:
        return [s[key] for s in self.samples.get(name, [])]


def run_soak(
    steps: int,
    run_dir: Path,
    *,
    cpu_load: int = 0,
    extra_args: tuple[str, ...] = (),
    timeout_s: float | None = None,
    log_path: Path | None = None,
    script: str = "synthetic",
    tracemalloc_dir: Path | None = None,
    warmup: int = 10,
    native: bool = False,
) -> SoakRun:
    """`SCRIPTS[script]` for `steps` outer steps in `run_dir`, sampled after each step; with
    `tracemalloc_dir`, the trainer and workers trace their heaps from the end of warm-up (`warmup` steps
    and the first plot) and snapshot them there two steps later and two steps before the end. With
    `timeout_s` the run is stopped after the first step that ends past it (`SoakRun.time_limited`; the
    last snapshot is taken then), and what it sampled up to there is the result."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "NUM_ROLLOUT": str(steps),
        "RUN_DIR": str(run_dir),
        "PYTHON": sys.executable,
        "MODEL_CACHE": str(ROOT / ".cache" / "models"),
    }
    env.pop("OPENAI_API_KEY", None)
    if tracemalloc_dir is not None:
        env[memory_snapshots.ENV_DIR] = str(tracemalloc_dir)
        if native:
            env[native_allocations.ENV_NATIVE] = "1"
    log_path = log_path or run_dir.parent / f"{run_dir.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpu_load)]
    started = time.monotonic()
    result = SoakRun(steps=steps, seconds=0.0, returncode=None)
    with log_path.open("w") as log:
        # A process group of its own, so that a stop reaches the trainer, its router and its workers.
        process = subprocess.Popen(
            ["bash", str(ROOT / SCRIPTS[script]), *extra_args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        seen_steps, trainer_pid, plot_mtime = 0, None, None
        limit = timeout_s or max(1800, 60 * steps)
        try:
            while process.poll() is None:
                time.sleep(0.1)
                if trainer_pid is None:
                    trainer_pid = next((p for p, n in descendants(process.pid).items() if n == "trainer"), None)
                    continue
                metrics = run_dir / "metrics.jsonl"
                records = metrics.read_text() if metrics.exists() else ""
                done = records.count("\n")
                if done <= seen_steps:
                    if time.monotonic() - started > limit + 600:
                        break  # no step in ten minutes past the limit: stop it as it is
                    continue
                seen_steps = done
                processes = {trainer_pid: "trainer", **descendants(trainer_pid)}
                sample_processes(result, done, processes, allocator_mib(records))
                try:
                    mtime = (run_dir / PLOT_NAME).stat().st_mtime
                except OSError:
                    mtime = None
                if mtime is not None and mtime != plot_mtime:
                    plot_mtime = mtime
                    result.plot_steps.append(done)
                result.time_limited = time.monotonic() - started > limit and done < steps
                last_snapshot = result.time_limited and len(result.snapshot_steps) == 2
                if tracemalloc_dir is not None and (heap_snapshot_due(result, done, warmup, steps) or last_snapshot):
                    result.snapshot_steps.append(done)
                    ask_for_snapshots(processes)
                    if last_snapshot:
                        wait_for_snapshots(tracemalloc_dir, processes, 2)  # the first signal wrote none
                if result.time_limited:
                    break
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()
            stop_group(process)
    result.seconds = time.monotonic() - started
    result.returncode = process.returncode
    result.log = log_path.read_text(errors="replace")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        records = metrics_records(metrics)
        result.step_times = [r["perf/step_time"] for r in records if "perf/step_time" in r]
        result.engine = engine_samples(records)
    return result


def sample_processes(run: SoakRun, step: int, processes: dict[int, str], allocator: dict | None = None) -> None:
    """One sample per process after `step`: its memory (split by kind for the trainer, workers and
    router; RSS alone for the other children), descriptors and GPU memory, and the trainer's caching
    allocator's figures (`allocator`, from the step's metrics); and each GPU's in use."""
    on_gpu = gpu_memory_by_pid()
    for pid, name in processes.items():
        memory, fds = memory_kib(pid), fd_count(pid)
        if memory is None or fds is None:
            continue  # it ended between the listing and the read
        if name.startswith("other:"):
            memory = {"rss_kib": memory["rss_kib"]}
        if pid in on_gpu:
            memory["gpu_mib"] = on_gpu[pid]
        if name == "trainer" and allocator:
            memory.update(allocator)
        run.samples.setdefault(name, []).append({"step": step, **memory, "fds": fds})
    if used := gpu_memory_used():
        run.gpus.append({"step": step, "used_mib": used})


def stop_group(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """End whatever is left of the run's process group: SIGTERM, and SIGKILL to what is still there
    after `grace_s`, so that no worker or router outlives a run that was stopped or that failed."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # the group is gone
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_alive(process.pid):
            process.poll()
            time.sleep(0.2)
    process.wait()


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def metrics_records(path: Path) -> list[dict]:
    """A run's metrics.jsonl, one record a line."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_from_report(report: dict) -> SoakRun:
    """A results file back as the run it describes, for `--replot`."""
    return SoakRun(
        steps=report["settings"]["steps"],
        seconds=report["seconds"],
        returncode=0,
        samples=report["samples"],
        gpus=report.get("gpu_samples", []),
        plot_steps=report.get("plot_steps", []),
        engine=report.get("engine_samples", []),
    )


def replot(path: Path, warmup: int | None, metrics: Path | None = None) -> Path:
    """An earlier results file's figures again, with another warm-up if given (the file is kept as it
    is), and its PNG redrawn. With `metrics` (the run's metrics.jsonl) the run's per-step engine
    figures are read from it and stored in the file, for a file written before soak.py kept them."""
    report = json.loads(path.read_text())
    if metrics is not None:
        report["engine_samples"] = engine_samples(metrics_records(metrics))
    run = run_from_report(report)
    warmup = report["settings"]["warmup"] if warmup is None else warmup
    report.update(processes=summarise(run, warmup), gpus=summarise_gpus(run, warmup))
    report["engine"] = summarise_engine(run.engine, run.warmup_end(warmup))
    if metrics is not None:
        saved = json.loads(path.read_text())
        saved.update(engine_samples=report["engine_samples"], engine=report["engine"])
        C.write_json(saved, path)
    print(f"soak: {path.name}, warm-up to step {run.warmup_end(warmup)}")
    print_figures(report)
    steps = report.get("steps_done", report["settings"]["steps"])  # a run stopped at its time limit did fewer
    title = f"{steps} steps, {report['machine']['cpu_count']} CPUs"
    return plot(run, warmup, path.with_suffix(".png"), title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="outer steps of the run (NUM_ROLLOUT)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="steps left out before the figures (at least; default 10)"
    )
    parser.add_argument("--cpu-load", type=int, default=0, help="busy-loop processes beside the run")
    parser.add_argument(
        "--script",
        choices=sorted(SCRIPTS),
        default="synthetic",
        help="the run: synthetic (scripts/run_synthetic.sh, the default) or real (scripts/run_real.sh)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/soak_<cpu|gpu>[_real]_<N>steps.json)",
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="the run's directory (default: a temporary one)")
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="an earlier results JSON: its figures (with --warmup: from that step) and PNG again, no run",
    )
    parser.add_argument(
        "--metrics",
        type=Path,
        default=None,
        help="with --replot: the run's metrics.jsonl, whose per-step engine figures are stored in the results file",
    )
    parser.add_argument(
        "--tracemalloc",
        type=Path,
        default=None,
        metavar="DIR",
        help="trace the trainer's and workers' Python heaps; snapshots after warm-up and near the end go to "
        "DIR, their comparison into the JSON",
    )
    parser.add_argument(
        "--memray",
        action="store_true",
        help="with --tracemalloc: also record native allocations (memray) between the two snapshots",
    )
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="stop the run after the first step that ends past this many seconds and report the steps done",
    )
    parser.add_argument("extra", nargs="*", help="extra train.py flags, after --")
    args = parser.parse_args(argv)
    warmup_given, args.warmup = args.warmup, 10 if args.warmup is None else args.warmup
    if args.tracemalloc is not None and args.steps - 2 <= args.warmup + 2:
        parser.exit(
            2, f"error: --tracemalloc needs --steps above --warmup + 4 (steps {args.steps}, warm-up {args.warmup})\n"
        )
    if args.time_limit_s is not None and args.time_limit_s <= 0:
        parser.exit(2, f"error: --time-limit-s {args.time_limit_s:g}: give a positive number of seconds\n")
    if args.memray:
        if args.tracemalloc is None:
            parser.exit(2, "error: --memray records between the heap snapshots: give --tracemalloc DIR as well\n")
        try:
            import memray  # noqa: F401
        except ImportError:
            parser.exit(2, "error: --memray needs memray: pip install memray (not a dependency of the project)\n")
    if args.replot is not None:
        if not args.replot.is_file():
            parser.exit(2, f"error: --replot {args.replot}: no such file\n")
        if args.metrics is not None and not args.metrics.is_file():
            parser.exit(2, f"error: --metrics {args.metrics}: no such file (give the run's metrics.jsonl)\n")
        print(f"wrote {replot(args.replot, warmup_given, args.metrics)}")
        return 0
    device = "gpu" if gpu_memory_used() else "cpu"
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        run_dir = args.run_dir or Path(tmp) / "run"
        run = run_soak(
            args.steps,
            run_dir,
            cpu_load=args.cpu_load,
            extra_args=tuple(args.extra),
            script=args.script,
            tracemalloc_dir=args.tracemalloc,
            warmup=args.warmup,
            timeout_s=args.time_limit_s,
            native=args.memray,
        )
    trainer_samples = run.samples.get("trainer", [])
    steps_done = trainer_samples[-1]["step"] if trainer_samples else 0
    if run.time_limited and len(trainer_samples) < run.warmup_end(args.warmup) + 2 * WINDOW + 1:
        print(f"error: --time-limit-s {args.time_limit_s:g}: {steps_done} steps done, too few to measure after warm-up")
        return 1
    if run.returncode != 0 and not run.time_limited:
        print(run.log[-3000:], file=sys.stderr)
        print(f"error: the run ended with exit code {run.returncode}", file=sys.stderr)
        return 1
    name = f"soak_{device}{'' if args.script == 'synthetic' else '_' + args.script}_{steps_done}steps.json"
    out = args.out or ROOT / "benchmarks" / "results" / name
    report = C.report_header(
        "soak",
        {
            "steps": args.steps,
            "warmup": args.warmup,
            "cpu_load": args.cpu_load,
            "script": SCRIPTS[args.script],
            "extra": args.extra,
            "tracemalloc": str(args.tracemalloc) if args.tracemalloc else None,
            "memray": args.memray,
            "time_limit_s": args.time_limit_s,
            # glibc's allocator settings change what RSS a process keeps (MALLOC_ARENA_MAX, ...)
            "malloc_env": {key: value for key, value in os.environ.items() if key.startswith("MALLOC_")},
            # and so do CUDA's libraries' (CUBLASLT_HEURISTICS_CACHE_CAPACITY, CUDA_MODULE_LOADING, ...)
            "cuda_env": {key: value for key, value in os.environ.items() if key.startswith(CUDA_ENV_PREFIXES)},
        },
    )
    report.update(steps_done=steps_done, time_limited=run.time_limited)
    report.update(
        seconds=round(run.seconds, 1),
        median_step_s=round(statistics.median(run.step_times), 2) if run.step_times else None,
        warmup_end_step=run.warmup_end(args.warmup),
        plot_steps=run.plot_steps,
        processes=summarise(run, args.warmup),
        gpus=summarise_gpus(run, args.warmup),
        engine=summarise_engine(run.engine, run.warmup_end(args.warmup)),
        samples=run.samples,
        gpu_samples=run.gpus,
        engine_samples=run.engine,
    )
    if args.tracemalloc is not None:
        report["tracemalloc"] = {
            "after_steps": run.snapshot_steps[1:],
            "processes": compare_snapshots(args.tracemalloc),
        }
    C.write_json(report, out)
    png = plot(run, args.warmup, out.with_suffix(".png"), f"{steps_done} steps, {report['machine']['cpu_count']} CPUs")
    if run.time_limited:
        print(f"soak: stopped at the time limit ({args.time_limit_s:g} s) after {steps_done} of {args.steps} steps")
    print(
        f"soak: {steps_done} steps in {run.seconds:.0f} s (median step {report['median_step_s']} s), warm-up to step "
        f"{report['warmup_end_step']}"
    )
    print_figures(report)
    if args.tracemalloc is not None:
        print_heap_growth(report["tracemalloc"])
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
