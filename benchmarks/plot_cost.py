"""What one redraw of holdout.png costs at a long run's end: seconds, and the memory it takes at its peak.

A redraw reads the run's whole metrics history, so its cost grows with the steps done. This writes
histories of N records (a real run's metrics.jsonl, its records repeated with new step numbers) and
draws each once in a fresh process, reading that process's RSS before, at its peak (VmHWM) and after
(glibc's free pages handed back). The run redraws in a process of its own (`PlotRefresher`), so
these figures are that process's, not the trainer's.

    python benchmarks/plot_cost.py --metrics RUN_DIR/metrics.jsonl --records 1000 10000
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402 (puts the repo root on sys.path)


def one_redraw(metrics: Path, records: int) -> dict:
    """In this (fresh) process: a history of `records` records, drawn once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401 - imported before the baseline: the import is not the redraw's

    from slime_meta.artifacts.plot import plot_run

    source = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory(prefix="plot-cost-") as tmp:
        path = Path(tmp) / "metrics.jsonl"
        with path.open("w") as out:
            for step in range(records):
                out.write(json.dumps(dict(source[step % len(source)], step=step)) + "\n")
        del source
        gc.collect()
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
        before = C.status_mib("VmRSS")
        started = time.perf_counter()
        plot_run(Path(tmp))
        seconds = time.perf_counter() - started
        gc.collect()
        libc.malloc_trim(0)
        return {
            "records": records,
            "file_mib": round(path.stat().st_size / 2**20, 1),
            "seconds": round(seconds, 2),
            "rss_mib_before": round(before, 1),
            "rss_mib_peak": round(C.status_mib("VmHWM"), 1),
            "rss_mib_after": round(C.status_mib("VmRSS"), 1),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", type=Path, required=True, help="a run's metrics.jsonl, whose records are repeated")
    parser.add_argument("--records", type=int, nargs="+", default=[1000, 10000], help="history lengths to draw")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/plot_cost.json)")
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        parser.exit(2, f"error: --metrics {args.metrics}: no such file; give a run's metrics.jsonl\n")
    if args.one:
        print(json.dumps(one_redraw(args.metrics, args.records[0])))
        return 0
    rows = []
    for records in args.records:
        child = subprocess.run(
            [sys.executable, __file__, "--one", "--metrics", str(args.metrics), "--records", str(records)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    source_records = sum(1 for line in args.metrics.read_text().splitlines() if line.strip())
    report = C.report_header("plot_cost", {"metrics": str(args.metrics), "source_records": source_records})
    report.update(
        bytes_per_record=round(args.metrics.stat().st_size / source_records),
        redraws=rows,
    )
    out = args.out or C.REPO_ROOT / "benchmarks" / "results" / "plot_cost.json"
    C.write_json(report, out)
    table = [
        [r["records"], r["file_mib"], r["seconds"], r["rss_mib_before"], r["rss_mib_peak"], r["rss_mib_after"]]
        for r in rows
    ]
    print(C.table(table, ["records", "file MiB", "seconds", "RSS before", "peak", "after"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
