"""Plot a run: holdout grade with the teacher's info against the no-info control, per step.

Where the run measured a reference context before training (`--eval-baseline` with
`--context-key` or `--teacher-context`, e.g. the synthetic task's `oracle_hint` column), the
student's grade with it is drawn as a horizontal line: the oracle the teacher's info aims at.

With fixed eval sets (--eval-prompt-data) a third panel shows their holdout grade with and
without the info: problems the teacher never trained on.

    python -m slime_meta.artifacts.plot RUN_DIR      # writes RUN_DIR/holdout.png

A run writes the plot itself: after a step when `PlotRefresher.interval_s` (60) seconds have passed,
and once more however it ends (the last step, an error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from slime_meta.artifacts.tracking import read_metrics, reference_grades, step_records

logger = logging.getLogger(__name__)


def plot_run(run_dir: Path, out: Path | None = None) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        return None
    train_records = step_records(records)  # not an eval-only record (the final eval's, say)
    steps = [r["step"] for r in train_records]

    def series(key: str) -> list[float]:
        return [r.get(key) if r.get(key) is not None else float("nan") for r in train_records]

    eval_names = sorted({k.split("/")[1] for r in records for k in r if k.startswith("eval/") and k.endswith("/gain")})
    fig, axes = plt.subplots(1, 3 if eval_names else 2, figsize=(16.5 if eval_names else 11, 4))
    ax_holdout, ax_inner = axes[0], axes[1]
    ax_holdout.plot(steps, series("meta_learning/avg_holdout_grade"), marker="o", label="with teacher's info")
    ax_holdout.plot(
        steps, series("meta_learning/holdout_grade_no_info"), marker="s", linestyle="--", label="no info (control)"
    )
    ax_holdout.plot(
        steps, series("meta_learning/best_info_holdout_grade"), marker=".", alpha=0.5, label="best info of group"
    )
    for name, oracle in reference_grades(records).items():
        ax_holdout.axhline(
            oracle, color="black", linestyle=":", label=f"{name}: student with the reference context (oracle)"
        )
    ax_holdout.set(xlabel="outer step", ylabel="holdout grade", title="Holdout grade", ylim=(-0.02, 1.02))
    ax_holdout.legend()
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
    for name in eval_names:
        for key, style, label in (("holdout_grade", "-", "with info"), ("holdout_grade_no_info", "--", "no info")):
            points = [(r["step"], r[f"eval/{name}/{key}"]) for r in records if r.get(f"eval/{name}/{key}") is not None]
            axes[2].plot(
                [p[0] for p in points], [p[1] for p in points], marker="o", linestyle=style, label=f"{name}: {label}"
            )
    if eval_names:
        axes[2].set(
            xlabel="training steps done",
            ylabel="holdout grade",
            title="Fixed eval sets (never trained on)",
            ylim=(-0.02, 1.02),
        )
        axes[2].legend()
    fig.tight_layout()
    out = out or Path(run_dir) / "holdout.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


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
    """Redraws a run's holdout.png during the run, at most once per `interval_s` seconds: a redraw
    took about 3 s on a 2-core VM shared with other jobs (40 steps), so at most a few percent of
    the run's time there."""

    def __init__(self, run_dir: Path, interval_s: float = 60.0):
        self.run_dir, self.interval_s = Path(run_dir), interval_s
        self._last = time.monotonic()

    def after_step(self) -> Path | None:
        if time.monotonic() - self._last < self.interval_s:
            return None
        self._last = time.monotonic()
        return write_plot(self.run_dir)


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
