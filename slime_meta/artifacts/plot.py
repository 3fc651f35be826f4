"""Plot a run: holdout grade with the teacher's info against the no-info control, per step.

Steps are numbered as the console numbers them: `step 1/N` is 1 on the x axis (the records count
from 0), on whole-number ticks.

Where the run measured a reference context before training (`--eval-baseline` with
`--context-key` or `--teacher-context`, e.g. the synthetic task's `oracle_hint` column), the
student's grade with it is drawn as a horizontal line: the oracle the teacher's info aims at; a
panel then shows the normalised gain, (holdout - no info) / (oracle - no info), per step and over
the last 10 steps (0: no better than no info, 1: as good as the oracle).

With fixed eval sets (--eval-prompt-data) a third panel shows their holdout grade with and
without the info: problems the teacher never trained on.

    python -m slime_meta.artifacts.plot RUN_DIR      # writes RUN_DIR/holdout.png

A run writes the plot itself: after a step when `PlotRefresher.interval_s` (60) seconds have passed
(in a process of its own), and once more however it ends (the last step, an error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from slime_meta.artifacts.atomic_files import replace_atomically
from slime_meta.artifacts.tracking import normalised_gain, read_metrics, reference_grades, step_records

GAIN_WINDOW = 10  # steps in the gain panel's running mean, as the run's summary line takes

logger = logging.getLogger(__name__)


def plot_run(run_dir: Path, out: Path | None = None) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = read_metrics(run_dir)
    if not records:
        return None
    train_records = step_records(records)  # not an eval-only record (the final eval's, say)
    steps = [r["step"] + 1 for r in train_records]  # the console's `step 1/N` is record 0

    def series(key: str) -> list[float]:
        return [r.get(key) if r.get(key) is not None else float("nan") for r in train_records]

    eval_names = sorted({k.split("/")[1] for r in records for k in r if k.startswith("eval/") and k.endswith("/gain")})
    oracles = reference_grades(records)
    oracle = next(iter(oracles.values())) if len(oracles) == 1 else None
    panels = 2 + (oracle is not None) + bool(eval_names)
    rows, columns = (2, 2) if panels == 4 else (1, panels)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4 * rows), squeeze=False)
    axes = list(axes.flat)
    # Holdout, then the gain where there is an oracle, the inner iterations, the eval sets last.
    ax_holdout, ax_inner = axes[0], axes[2 if oracle is not None else 1]
    ax_holdout.plot(steps, series("meta_learning/avg_holdout_grade"), marker="o", label="with teacher's info")
    ax_holdout.plot(
        steps, series("meta_learning/holdout_grade_no_info"), marker="s", linestyle="--", label="no info (control)"
    )
    ax_holdout.plot(
        steps, series("meta_learning/best_info_holdout_grade"), marker=".", alpha=0.5, label="best info of group"
    )
    for name, grade in oracles.items():
        ax_holdout.axhline(
            grade, color="black", linestyle=":", label=f"{name}: student with the reference context (oracle)"
        )
    ax_holdout.set(xlabel="outer step", ylabel="holdout grade", title="Holdout grade", ylim=(-0.02, 1.02))
    ax_holdout.legend()
    if oracle is not None:
        draw_gain(
            axes[1],
            steps,
            series("meta_learning/avg_holdout_grade"),
            series("meta_learning/holdout_grade_no_info"),
            oracle,
        )
    iteration_keys = sorted(
        (k for k in train_records[-1] if k.startswith("meta_learning/inner_grade_iter_")) if train_records else (),
        key=lambda k: int(k.rsplit("_", 1)[1]),
    )
    for key in iteration_keys:
        ax_inner.plot(steps, series(key), marker="o", label=f"inner iteration {key.rsplit('_', 1)[1]}")
    ax_inner.set(
        xlabel="outer step", ylabel="train-problem grade", title="Grade per inner iteration", ylim=(-0.02, 1.02)
    )
    if iteration_keys:
        ax_inner.legend()
    ax_eval = axes[-1]
    for name in eval_names:
        for key, style, label in (("holdout_grade", "-", "with info"), ("holdout_grade_no_info", "--", "no info")):
            # An eval's record step counts the steps done before it (0: before training), as its console line does.
            points = [(r["step"], r[f"eval/{name}/{key}"]) for r in records if r.get(f"eval/{name}/{key}") is not None]
            ax_eval.plot(
                [p[0] for p in points], [p[1] for p in points], marker="o", linestyle=style, label=f"{name}: {label}"
            )
    if eval_names:
        ax_eval.set(
            xlabel="training steps done",
            ylabel="holdout grade",
            title="Fixed eval sets (never trained on)",
            ylim=(-0.02, 1.02),
        )
        ax_eval.legend()
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    out = Path(out or Path(run_dir) / "holdout.png")
    # A stop in the middle leaves the previous plot, never a cut one (the name alone no longer says the format).
    replace_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format=out.suffix.lstrip(".") or "png"))
    plt.close(fig)
    return out


def draw_gain(ax, steps: list[int], holdout: list[float], no_info: list[float], oracle: float) -> None:
    """The normalised gain of each step, and its mean over the last GAIN_WINDOW steps at each step."""
    gains = [normalised_gain(h, n, oracle) for h, n in zip(holdout, no_info)]
    ax.plot(steps, gains, marker="o", linestyle="none", alpha=0.4, label="one step")
    running = []
    for index in range(len(gains)):
        window = [g for g in gains[max(0, index + 1 - GAIN_WINDOW) : index + 1] if g == g]  # NaN: no gain that step
        running.append(sum(window) / len(window) if window else float("nan"))
    ax.plot(steps, running, label=f"mean of the last {GAIN_WINDOW} steps")
    ax.axhline(1.0, color="black", linestyle=":", label="1: as good as the oracle")
    ax.axhline(0.0, color="gray", linestyle="--", label="0: no better than no info")
    ax.set(
        xlabel="outer step",
        ylabel="normalised gain",
        title="Normalised gain: (holdout - no info) / (oracle - no info)",
    )
    ax.legend()


def write_plot(run_dir: Path) -> Path | None:
    """`plot_run` for a run in progress or ending: nothing to draw before the first step's record,
    and a plot that fails (a full disk, a broken font cache) is a warning, never the run's error."""
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        return None
    try:
        return plot_run(run_dir)
    except Exception as error:  # noqa: BLE001 - the plot must never end or mask the run's own outcome
        logger.warning("could not write %s/holdout.png: %s", run_dir, error)
        return None


class PlotRefresher:
    """Redraws a run's holdout.png during the run, at most once per `interval_s` seconds, in a short-lived
    process of its own (`python -m slime_meta.artifacts.plot RUN_DIR`). A redraw reads the run's whole
    metrics history: at 10,000 steps of records like the GPU soak's, 43 MiB parsed in 1.6 s with 210 MiB
    more resident at its peak (benchmarks/plot_cost.py, docs/memory.md). In its own process the run
    neither waits for that nor holds it, nor matplotlib and its caches; the final plot, once the run
    ends, is drawn in the run's process (`write_plot`) after `close`."""

    def __init__(self, run_dir: Path, interval_s: float = 60.0):
        self.run_dir, self.interval_s = Path(run_dir), interval_s
        self._last = time.monotonic()
        self._child: subprocess.Popen | None = None
        self._child_stderr: IO[bytes] | None = None

    def after_step(self) -> bool:
        """Start a redraw when `interval_s` has passed and none is running; True when one started."""
        self._reap()
        if self._child is not None or time.monotonic() - self._last < self.interval_s:
            return False
        if not (self.run_dir / "metrics.jsonl").is_file():
            return False
        self._last = time.monotonic()
        package_root = str(Path(__file__).resolve().parents[2])  # importable wherever the run was started
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
        }
        self._child_stderr = tempfile.TemporaryFile()
        self._child = subprocess.Popen(
            [sys.executable, "-m", "slime_meta.artifacts.plot", str(self.run_dir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._child_stderr,
            env=env,
        )
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for a redraw still running (stopped after `timeout_s`), so that the final plot comes last."""
        if self._child is not None:
            try:
                self._child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
        self._reap()

    def _reap(self) -> None:
        """A finished redraw: a failed one is a warning (a full disk, a broken font cache), never the run's error."""
        if self._child is None or self._child.poll() is None:
            return
        if self._child.returncode != 0 and self._child_stderr is not None:
            self._child_stderr.seek(0)
            lines = self._child_stderr.read().decode(errors="replace").strip().splitlines()
            reason = lines[-1] if lines else f"exit code {self._child.returncode}"
            logger.warning("could not redraw %s/holdout.png: %s", self.run_dir, reason)
        if self._child_stderr is not None:
            self._child_stderr.close()
        self._child, self._child_stderr = None, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").is_file():
        print(f"error: {args.run_dir}/metrics.jsonl not found; give the run directory of train.py", file=sys.stderr)
        return 2
    path = plot_run(args.run_dir, args.out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
