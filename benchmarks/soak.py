"""Soak: N outer steps of the demo's run, every process's resident memory and open files after each step.

    python benchmarks/soak.py --steps 500       # benchmarks/results/soak_cpu_500steps.json and .png
    python benchmarks/soak.py --steps 40 --out /tmp/soak.json
    python benchmarks/soak.py --steps 200 --cpu-load 1             # one busy loop beside the run
    python benchmarks/soak.py --steps 60 -- --max-async-level 1    # extra train.py flags after --
    # one GPU, the 0.5B real model: benchmarks/results/soak_gpu_real_200steps.json and .png
    MODEL=qwen2.5-coder-0.5b DATA=price_lists python benchmarks/soak.py --script real --steps 200
    # an earlier results file's figures from another warm-up (the file is kept), its PNG redrawn
    python benchmarks/soak.py --replot benchmarks/results/soak_gpu_real_200steps.json --warmup 101
    # what the trainer and the workers keep, by allocation site (Python's heap, tracemalloc)
    python benchmarks/soak.py --steps 100 --tracemalloc /tmp/heap

The run is `scripts/run_synthetic.sh` (what `scripts/demo.sh` runs: the tiny model, four teacher prompts
x eight infos, a checkpoint every two steps), or with `--script real` `scripts/run_real.sh` (its
MODEL, DATA, GRADER from the environment). After each step (a new line in metrics.jsonl) the
resident set size and the open file descriptors of the trainer and of each of its children (router,
workers) are read from /proc; the trainer's RSS also split into anonymous and file-backed pages.
Where `nvidia-smi` lists GPUs, also each process's GPU memory (`gpu_mib`: what the driver has
given it, the caching allocator's reserve included) and each GPU's memory in use (`gpus`).

Warm-up is the first `--warmup` steps (10: allocator arenas, torch's caches, AdamW's state, the
router's connections) and lasts at least until the run's first plot (holdout.png, drawn once 60 s
have passed: matplotlib's import, fonts and caches, about 30 MiB once). After it, per process:
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
tracebacks). Tracing slows the steps it covers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

sys.path.insert(0, str(ROOT))
from slime_meta_engine import memory_snapshots  # noqa: E402

WINDOW = 5  # samples per median in `growth`
PLOT_NAME = "holdout.png"
STATUS_FIELDS = {"VmRSS": "rss_kib", "RssAnon": "anon_kib", "RssFile": "file_kib"}
SCRIPTS = {"synthetic": "scripts/run_synthetic.sh", "real": "scripts/run_real.sh"}
OTHERS = "other children"


def memory_kib(pid: int) -> dict[str, int] | None:
    """Resident memory of a process from /proc/PID/status: rss, anon(ymous) and file(-backed) pages, KiB."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            out[STATUS_FIELDS[key]] = int(value.split()[0])
    return out if "rss_kib" in out else None


def _nvidia_smi(query: str, fields: str) -> list[list[int]]:
    """Rows of integers from `nvidia-smi --query-QUERY=FIELDS`; none without nvidia-smi or on an error."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return [[int(v) for v in line.split(",")] for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def gpu_memory_by_pid() -> dict[int, int]:
    """MiB of GPU memory per process (summed over GPUs), as the driver reports it."""
    out: dict[int, int] = {}
    for pid, mib in _nvidia_smi("compute-apps", "pid,used_memory"):
        out[pid] = out.get(pid, 0) + mib
    return out


def gpu_memory_used() -> list[int]:
    """MiB in use on each GPU; empty without GPUs."""
    return [row[0] for row in _nvidia_smi("gpu", "memory.used")]


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def descendants(pid: int) -> dict[int, str]:
    """Child processes (recursively) of `pid`: pid -> a short name: router:PORT, worker:PORT (the pid
    where the command line has no --port: a router renames itself sglang::router), trainer, and
    other:PID for anything else (the verifier's math children)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, child_parent in parents.items():
            if child_parent == parent and child not in found:
                try:
                    argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                words = [a.decode(errors="replace") for a in argv]
                port = words[words.index("--port") + 1] if "--port" in words else str(child)  # else its pid
                if any("sglang" in w and "router" in w for w in words):  # it renames itself sglang::router
                    found[child] = f"router:{port}"
                elif any(w == "slime_meta_engine" for w in words):
                    found[child] = f"worker:{port}"
                elif any(w.endswith("train.py") for w in words):
                    found[child] = "trainer"
                else:
                    found[child] = f"other:{child}"
                frontier.append(child)
    return found


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
    snapshot_steps: list[int] = field(default_factory=list)  # --tracemalloc: tracing started, snapshots
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
) -> SoakRun:
    """`SCRIPTS[script]` for `steps` outer steps in `run_dir`, sampled after each step; with
    `tracemalloc_dir`, the trainer and workers trace their heaps from the end of warm-up (`warmup` steps
    and the first plot) and snapshot them there two steps later and two steps before the end."""
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
    log_path = log_path or run_dir.parent / f"{run_dir.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpu_load)]
    started = time.monotonic()
    result = SoakRun(steps=steps, seconds=0.0, returncode=None)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            ["bash", str(ROOT / SCRIPTS[script]), *extra_args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        seen_steps, trainer_pid, plot_mtime = 0, None, None
        limit = timeout_s or max(1800, 60 * steps)
        try:
            while process.poll() is None and time.monotonic() - started < limit:
                time.sleep(0.1)
                if trainer_pid is None:
                    trainer_pid = next((p for p, n in descendants(process.pid).items() if n == "trainer"), None)
                    continue
                metrics = run_dir / "metrics.jsonl"
                done = metrics.read_text().count("\n") if metrics.exists() else 0
                if done <= seen_steps:
                    continue
                seen_steps = done
                on_gpu = gpu_memory_by_pid()
                for pid, name in {trainer_pid: "trainer", **descendants(trainer_pid)}.items():
                    memory, fds = memory_kib(pid), fd_count(pid)
                    if memory is not None and fds is not None:
                        if not name.startswith("trainer"):
                            memory = {"rss_kib": memory["rss_kib"]}
                        if pid in on_gpu:
                            memory["gpu_mib"] = on_gpu[pid]
                        result.samples.setdefault(name, []).append({"step": done, **memory, "fds": fds})
                if used := gpu_memory_used():
                    result.gpus.append({"step": done, "used_mib": used})
                try:
                    mtime = (run_dir / PLOT_NAME).stat().st_mtime
                except OSError:
                    mtime = None
                if mtime is not None and mtime != plot_mtime:
                    plot_mtime = mtime
                    result.plot_steps.append(done)
                if tracemalloc_dir is not None and heap_snapshot_due(result, done, warmup, steps):
                    result.snapshot_steps.append(done)
                    ask_for_snapshots({trainer_pid: "trainer", **descendants(trainer_pid)})
            process.wait(timeout=120)
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()
            if process.poll() is None:
                process.kill()
                process.wait()
    result.seconds = time.monotonic() - started
    result.returncode = process.returncode
    result.log = log_path.read_text(errors="replace")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        result.step_times = [r["perf/step_time"] for r in records if "perf/step_time" in r]
    return result


def heap_snapshot_due(run: SoakRun, step: int, warmup: int, steps: int) -> bool:
    """Whether the processes get SIGUSR2 after `step`: the first step past warm-up and past the first
    plot (tracing starts), two steps later and two steps before the end (the snapshots)."""
    if not run.snapshot_steps:
        return step >= warmup and bool(run.plot_steps) and step > run.plot_steps[0]
    return step in (run.snapshot_steps[0] + 2, steps - 2) and step not in run.snapshot_steps


def ask_for_snapshots(processes: dict[int, str]) -> None:
    """SIGUSR2 to the trainer and each worker: the first starts tracing, each later one writes a heap
    snapshot (memory_snapshots.install)."""
    for pid, name in processes.items():
        if name == "trainer" or name.startswith("worker:"):
            try:
                os.kill(pid, memory_snapshots.SNAPSHOT_SIGNAL)
            except ProcessLookupError:
                pass


def compare_snapshots(directory: Path) -> dict[str, dict]:
    """Per process that wrote two snapshots or more: the first against the last (memory_snapshots.compare)."""
    return {
        stem: memory_snapshots.compare(paths[0], paths[-1])
        for stem, paths in memory_snapshots.snapshots_by_process(directory).items()
        if len(paths) >= 2
    }


def fitted_slope(steps: list[int], values_kib: list[int]) -> tuple[float, float]:
    """(least-squares slope in MiB a step, standard deviation of the residuals in MiB)."""
    ys = [v / 1024 for v in values_kib]
    mean_x, mean_y = statistics.fmean(steps), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in steps)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, ys)) / sxx if sxx else 0.0
    residuals = [y - (mean_y + slope * (x - mean_x)) for x, y in zip(steps, ys)]
    return slope, statistics.pstdev(residuals)


def growth(values: list[int], start: int) -> tuple[float, float, float]:
    """(median of the WINDOW samples from `start`, median of the last WINDOW before the final
    sample, their relative difference). The final sample is taken while the run shuts down."""
    early = statistics.median(values[start : start + WINDOW])
    late = statistics.median(values[-WINDOW - 1 : -1])
    return early, late, (late - early) / early


def summarise(run: SoakRun, warmup: int) -> dict[str, dict]:
    """Per process that lived through the run: its figures after warm-up (see the module's doc)."""
    start = run.warmup_end(warmup)
    report = {}
    for name, samples in sorted(run.samples.items()):
        if len(samples) < start + 2 * WINDOW + 1:
            continue  # a process that did not live through the run (a math child, say)
        rss = [s["rss_kib"] for s in samples]
        fds = [s["fds"] for s in samples]
        measured = samples[start:-1]
        slope, noise = fitted_slope([s["step"] for s in measured], [s["rss_kib"] for s in measured])
        early, late, relative = growth(rss, start)
        # Descriptors: the end's median against the most seen in the first half after warm-up.
        # Connection pools grow to the largest burst they have served, and under load a larger burst
        # can come late (a worker's count wandered 120-133 over 200 loaded steps); a leak climbs past.
        first_half = fds[start : start + (len(fds) - start) // 2]
        report[name] = {
            "rss_mib_first": round(rss[0] / 1024, 1),
            "rss_mib_after_warmup": round(early / 1024, 1),
            "rss_mib_end": round(late / 1024, 1),
            "growth": round(relative, 4),
            "slope_mib_per_step": round(slope, 4),
            "fitted_change_mib": round(slope * (measured[-1]["step"] - measured[0]["step"]), 1),
            "noise_mib": round(noise, 2),
            "fds_after_warmup": max(first_half),
            "fds_end": growth(fds, start)[1],
            "fds_max": max(fds),
        }
        if all("gpu_mib" in s for s in samples[start:-1]):
            gpu = [s["gpu_mib"] for s in samples]
            gpu_slope, gpu_noise = fitted_slope([s["step"] for s in measured], [s["gpu_mib"] * 1024 for s in measured])
            gpu_early, gpu_late, gpu_relative = growth(gpu, start)
            report[name].update(
                gpu_mib_after_warmup=gpu_early,
                gpu_mib_end=gpu_late,
                gpu_growth=round(gpu_relative, 4),
                gpu_slope_mib_per_step=round(gpu_slope, 4),
                gpu_noise_mib=round(gpu_noise, 2),
            )
    return report


def summarise_gpus(run: SoakRun, warmup: int) -> list[dict]:
    """Per GPU: memory in use after warm-up and at the end (medians, as `growth`), and its growth."""
    start = run.warmup_end(warmup)
    if len(run.gpus) < start + 2 * WINDOW + 1:
        return []
    out = []
    for index in range(len(run.gpus[0]["used_mib"])):
        used = [g["used_mib"][index] for g in run.gpus]
        early, late, relative = growth(used, start)
        out.append({"gpu": index, "used_mib_after_warmup": early, "used_mib_end": late, "growth": round(relative, 4)})
    return out


def plotted_series(samples: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The processes as the plot draws them: the trainer, each worker and router by name, and the
    other children (the verifier's math processes, compile workers: dozens on a GPU host, most
    short-lived) summed per step into one line, so that the legend stays readable."""
    named = {name: s for name, s in samples.items() if not name.startswith("other:")}
    others = [s for name, s in samples.items() if name.startswith("other:")]
    by_step: dict[int, dict] = {}
    for series in others:
        for sample in series:
            total = by_step.setdefault(sample["step"], {"step": sample["step"], "rss_kib": 0, "fds": 0, "count": 0})
            total["rss_kib"] += sample["rss_kib"]
            total["fds"] += sample["fds"]
            total["count"] += 1
    if by_step:
        peak = max(total["rss_kib"] for total in by_step.values()) / 1024
        named[f"{OTHERS} (sum of {len(others)}; peak {peak:,.0f} MiB)"] = [by_step[step] for step in sorted(by_step)]
    return named


def run_from_report(report: dict) -> SoakRun:
    """A results file back as the run it describes, for `--replot`."""
    return SoakRun(
        steps=report["settings"]["steps"],
        seconds=report["seconds"],
        returncode=0,
        samples=report["samples"],
        gpus=report.get("gpu_samples", []),
        plot_steps=report.get("plot_steps", []),
    )


def plot(run: SoakRun, warmup: int, out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on_gpu = any("gpu_mib" in s for samples in run.samples.values() for s in samples)
    fig, axes = plt.subplots(1, 3 if on_gpu else 2, figsize=(21 if on_gpu else 14, 4.5))
    ax_rss, ax_fds = axes[0], axes[1]
    for name, samples in sorted(plotted_series(run.samples).items()):
        if len(samples) < 3:
            continue
        steps = [s["step"] for s in samples]
        ax_rss.plot(steps, [s["rss_kib"] / 1024 for s in samples], label=name)
        ax_fds.plot(steps, [s["fds"] for s in samples], label=name)
        if name == "trainer" and "anon_kib" in samples[0]:
            ax_rss.plot(steps, [s["anon_kib"] / 1024 for s in samples], linestyle=":", label="trainer: anonymous")
        on_this_gpu = [s for s in samples if "gpu_mib" in s]
        if on_gpu and on_this_gpu:
            axes[2].plot([s["step"] for s in on_this_gpu], [s["gpu_mib"] for s in on_this_gpu], label=name)
    if on_gpu:
        axes[2].set(ylabel="GPU memory (MiB)", title="GPU memory per process")
    for ax in axes:
        ax.axvline(run.warmup_end(warmup), color="grey", linestyle="--", label="end of warm-up")
        ax.set_xlabel("outer step")
    ax_rss.set(ylabel="resident memory (MiB)", title=f"Resident memory per process: {title}")
    # The scale of the named processes: the other children's sum (compile workers at the start of a GPU
    # run, gigabytes for a few steps) may run off the top; its peak is in the legend.
    named = [samples for name, samples in run.samples.items() if not name.startswith("other:")]
    named_peak = max((s["rss_kib"] / 1024 for samples in named for s in samples), default=None)
    if named_peak:
        ax_rss.set_ylim(0, 1.15 * named_peak)
    ax_fds.set(ylabel="open file descriptors", title="Open descriptors per process")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def print_figures(report: dict) -> None:
    """The table of per-process figures (and the GPU lines) of a report."""
    rows = [
        [name, f["rss_mib_after_warmup"], f["rss_mib_end"], f["growth"], f["slope_mib_per_step"], f["noise_mib"]]
        + [f"{f['fds_after_warmup']} -> {f['fds_end']:g}"]
        for name, f in report["processes"].items()
    ]
    header = ["process", "RSS after warm-up", "RSS end", "growth", "MiB/step", "noise MiB", "descriptors"]
    print(C.table(rows, header))
    for name, f in report["processes"].items():
        if "gpu_growth" in f:
            print(
                f"{name} GPU memory: {f['gpu_mib_after_warmup']} -> {f['gpu_mib_end']} MiB "
                f"(growth {f['gpu_growth']}, {f['gpu_slope_mib_per_step']} MiB/step, noise {f['gpu_noise_mib']} MiB)"
            )
    for g in report["gpus"]:
        print(f"GPU {g['gpu']} in use: {g['used_mib_after_warmup']} -> {g['used_mib_end']} MiB (growth {g['growth']})")


def replot(path: Path, warmup: int | None) -> Path:
    """An earlier results file's figures again, with another warm-up if given (the file is kept as it
    is), and its PNG redrawn."""
    report = json.loads(path.read_text())
    run = run_from_report(report)
    warmup = report["settings"]["warmup"] if warmup is None else warmup
    report.update(processes=summarise(run, warmup), gpus=summarise_gpus(run, warmup))
    print(f"soak: {path.name}, warm-up to step {run.warmup_end(warmup)}")
    print_figures(report)
    title = f"{report['settings']['steps']} steps, {report['machine']['cpu_count']} CPUs"
    return plot(run, warmup, path.with_suffix(".png"), title)


def print_heap_growth(heaps: dict) -> None:
    if len(heaps["after_steps"]) < 2:
        print(f"tracemalloc: snapshots after steps {heaps['after_steps']}, two are needed: give more --steps")
        return
    first, last = heaps["after_steps"][0], heaps["after_steps"][-1]
    for stem, heap in heaps["processes"].items():
        print(
            f"{stem}: traced Python heap {heap['traced_mib_before']} -> {heap['traced_mib_after']} MiB from step "
            f"{first} to {last} ({heap['traced_growth_kib']:+.1f} KiB); grew most:"
        )
        for site in heap["sites"][:5]:
            where = " < ".join(site["traceback"][::-1])  # innermost frame first
            print(f"  {site['size_diff_kib']:+9.1f} KiB {site['count_diff']:+7d} blocks  {where}")


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
        "--tracemalloc",
        type=Path,
        default=None,
        metavar="DIR",
        help="trace the trainer's and workers' Python heaps; snapshots after warm-up and near the end go to "
        "DIR, their comparison into the JSON",
    )
    parser.add_argument("extra", nargs="*", help="extra train.py flags, after --")
    args = parser.parse_args(argv)
    warmup_given, args.warmup = args.warmup, 10 if args.warmup is None else args.warmup
    if args.tracemalloc is not None and args.steps - 2 <= args.warmup + 2:
        parser.exit(
            2, f"error: --tracemalloc needs --steps above --warmup + 4 (steps {args.steps}, warm-up {args.warmup})\n"
        )
    if args.replot is not None:
        if not args.replot.is_file():
            parser.exit(2, f"error: --replot {args.replot}: no such file\n")
        print(f"wrote {replot(args.replot, warmup_given)}")
        return 0
    device = "gpu" if gpu_memory_used() else "cpu"
    name = f"soak_{device}{'' if args.script == 'synthetic' else '_' + args.script}_{args.steps}steps.json"
    out = args.out or ROOT / "benchmarks" / "results" / name
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
        )
    if run.returncode != 0:
        print(run.log[-3000:], file=sys.stderr)
        print(f"error: the run ended with exit code {run.returncode}", file=sys.stderr)
        return 1
    report = C.report_header(
        "soak",
        {
            "steps": args.steps,
            "warmup": args.warmup,
            "cpu_load": args.cpu_load,
            "script": SCRIPTS[args.script],
            "extra": args.extra,
            "tracemalloc": str(args.tracemalloc) if args.tracemalloc else None,
            # glibc's allocator settings change what RSS a process keeps (MALLOC_ARENA_MAX, ...)
            "malloc_env": {key: value for key, value in os.environ.items() if key.startswith("MALLOC_")},
        },
    )
    report.update(
        seconds=round(run.seconds, 1),
        median_step_s=round(statistics.median(run.step_times), 2) if run.step_times else None,
        warmup_end_step=run.warmup_end(args.warmup),
        plot_steps=run.plot_steps,
        processes=summarise(run, args.warmup),
        gpus=summarise_gpus(run, args.warmup),
        samples=run.samples,
        gpu_samples=run.gpus,
    )
    if args.tracemalloc is not None:
        report["tracemalloc"] = {
            "after_steps": run.snapshot_steps[1:],
            "processes": compare_snapshots(args.tracemalloc),
        }
    C.write_json(report, out)
    png = plot(run, args.warmup, out.with_suffix(".png"), f"{args.steps} steps, {report['machine']['cpu_count']} CPUs")
    print(
        f"soak: {args.steps} steps in {run.seconds:.0f} s (median step {report['median_step_s']} s), warm-up to step "
        f"{report['warmup_end_step']}"
    )
    print_figures(report)
    if args.tracemalloc is not None:
        print_heap_growth(report["tracemalloc"])
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
