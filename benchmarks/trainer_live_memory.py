"""What the trainer process still holds of what its steps allocated: memray's native view, two windows.

    pip install memray                                     # not a dependency of the project
    python benchmarks/trainer_live_memory.py               # windows of 10 and 40 steps from step 15

Why: the soak (benchmarks/soak.py) sees the trainer's resident memory creep by about 11 KiB a step
on the CPU, and tracemalloc sees Python's objects only. memray records every allocation of the
process, native ones (torch, libraries) included, with its stack. Each window is one run of the
soak test's fast configuration (tests/test_reliability_soak.py: the demo-shaped model, 16 problems,
train.py's local loop in this process): memray starts after step `--start` and stops after step
`--start + N`; what the window allocated and had not freed when it stopped is grouped by where it was
allocated. A step that keeps memory makes the longer window hold more, by (steps more) x (kept per
step); what is merely live at the moment (the current connections, autograd's accumulators) is the
same in both. Memory the allocator keeps after it is freed (fragmentation) is not an allocation, so
it is in neither window: the difference between the soak's RSS slope and this one is that.

Writes `<out>.json`: per window, the live KiB by class and the largest sites.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from _common import REPO_ROOT, default_out, report_header, write_json

sys.path.insert(0, str(REPO_ROOT / "tests"))  # the soak test's configuration and model, shared with it

# Where a live allocation comes from, by the frames of its stack (first match wins).
CLASSES = (
    ("the tracer's own line tables", ("_PyCode_CreateLineArray", "call_trace")),
    ("torch autograd (grad accumulators, detach)", ("autograd",)),
    ("aiohttp connections", ("streams.py", "client_proto.py", "connector.py", "selectors.py")),
)


def classify(frames: list[str]) -> str:
    text = " | ".join(frames)
    for name, needles in CLASSES:
        if any(needle in text for needle in needles):
            return name
    return "other"


def frames_of(record) -> list[str]:
    try:
        stack = record.hybrid_stack_trace(60)
    except (NotImplementedError, RuntimeError):  # a record without a native stack
        stack = record.stack_trace(60)
    return [f"{name} ({path.rsplit('/', 1)[-1]}:{line})" for name, path, line in stack]


def summarise(trace: Path) -> dict:
    from memray import FileReader

    live = list(FileReader(str(trace)).get_leaked_allocation_records(merge_threads=True))
    by_class: dict[str, int] = defaultdict(int)
    by_site: dict[str, int] = defaultdict(int)
    for record in live:
        frames = [f for f in frames_of(record) if not any(k in f for k in ("malloc", "operator new", "memray"))]
        by_class[classify(frames)] += record.size
        by_site[" <- ".join(frames[:6])] += record.size
    largest = sorted(by_site.items(), key=lambda kv: -kv[1])[:10]
    return {
        "live_kib": round(sum(r.size for r in live) / 1024, 1),
        "live_kib_by_class": {k: round(v / 1024, 1) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "largest_sites_kib": [[round(size / 1024, 1), site] for site, size in largest],
    }


def record_window(checkpoint: Path, start: int, stop: int, work: Path) -> Path:
    """One run in this process: memray on from after step `start` to after step `stop`."""
    import memray
    from test_reliability_soak import FAST_BATCH
    from test_train_e2e import synthetic_args

    from slime_meta.artifacts.tracking import Tracker
    from slime_meta.backends.local import run as local_run
    from slime_meta.config.arguments import parse_config

    trace = work / f"trace_{start}_{stop}.bin"
    tracker = memray.Tracker(str(trace), native_traces=True)
    log = Tracker.log

    def logged(self, step, metrics):
        log(self, step, metrics)
        gc.collect()  # cyclic garbage is not kept memory
        if step == start:
            tracker.__enter__()
        elif step == stop:
            tracker.__exit__(None, None, None)

    Tracker.log = logged
    local_run.PlotRefresher.after_step = lambda self: None  # matplotlib's first import is not a step's memory
    os.environ.pop("OPENAI_API_KEY", None)
    run_dir = work / f"run_{start}_{stop}"
    local_run.run(parse_config(synthetic_args(checkpoint, run_dir, "--num-rollout", str(stop + 2), *FAST_BATCH)))
    return trace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", type=int, default=15, help="memray starts after this step (warm-up before it)")
    parser.add_argument("--windows", type=int, nargs="+", default=[10, 40], help="steps recorded, one run each")
    parser.add_argument("--out", default=None, help="report path (default: $OUT or runs/benchmarks/)")
    parser.add_argument("--window-run", nargs=4, metavar=("CKPT", "START", "STOP", "WORK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if len(set(args.windows)) < 2 or min(args.windows) < 1:
        parser.error(f"--windows {' '.join(map(str, args.windows))}: give two or more different step counts >= 1")
    try:
        import memray  # noqa: F401
    except ImportError:
        print("benchmarks/trainer_live_memory.py: needs memray (pip install memray)", file=sys.stderr)
        sys.exit(2)
    if args.window_run:  # the child: one window, in a process of its own
        checkpoint, start, stop, work = args.window_run
        record_window(Path(checkpoint), int(start), int(stop), Path(work))
        return
    out = Path(args.out) if args.out else default_out("trainer_live_memory")
    windows = {}
    with tempfile.TemporaryDirectory(prefix="live-memory-") as tmp:
        work = Path(tmp)
        from test_reliability_soak import write_demo_tokenizer_checkpoint

        checkpoint = write_demo_tokenizer_checkpoint(work / "checkpoint")
        for steps in args.windows:
            stop = args.start + steps
            command = [sys.executable, __file__, "--window-run", str(checkpoint), str(args.start), str(stop), tmp]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            windows[str(steps)] = summarise(work / f"trace_{args.start}_{stop}.bin")
            print(
                f"{steps} steps: {windows[str(steps)]['live_kib']} KiB live, {windows[str(steps)]['live_kib_by_class']}"
            )
    shortest, longest = min(args.windows), max(args.windows)
    kept = {
        name: round((windows[str(longest)]["live_kib_by_class"].get(name, 0) - kib) / (longest - shortest), 2)
        for name, kib in windows[str(shortest)]["live_kib_by_class"].items()
    }
    report = {
        **report_header("trainer_live_memory", {"start": args.start, "windows": args.windows}),
        "windows": windows,
        "kept_kib_per_step": round(
            (windows[str(longest)]["live_kib"] - windows[str(shortest)]["live_kib"]) / (longest - shortest), 2
        ),
        "kept_kib_per_step_by_class": kept,
    }
    print(f"kept per step (longest window minus shortest): {report['kept_kib_per_step']} KiB {kept}")
    print(write_json(report, out))


if __name__ == "__main__":
    main()
