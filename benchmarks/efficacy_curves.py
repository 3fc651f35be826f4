"""Efficacy curves of several runs side by side, from the JSON files benchmarks/efficacy.py writes.

    python benchmarks/efficacy_curves.py benchmarks/results/efficacy_h100_bracket_{frozen,shared}.json \
        --out benchmarks/results/efficacy_h100_bracket.png

One panel per file: the holdout grade with the teacher's info (per step, faint, and its moving
mean), the no-info control, and R_oracle (the student with the perfect hint) as a line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def moving_mean(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def draw(reports: list[dict], titles: list[str], out: Path, width: int = 20) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(4.6 * len(reports), 3.8), sharey=True, squeeze=False)
    for ax, report, title in zip(axes[0], reports, titles):
        steps = [p["step"] for p in report["curve"]]
        holdout = [p["holdout"] for p in report["curve"]]
        no_info = [p["no_info"] for p in report["curve"]]
        ax.plot(steps, holdout, color="tab:blue", alpha=0.25, linewidth=0.8)
        ax.plot(steps, moving_mean(holdout, width), color="tab:blue", label=f"with teacher's info ({width}-step mean)")
        ax.plot(steps, moving_mean(no_info, width), color="tab:orange", linestyle="--", label="no info (control)")
        ax.axhline(report["r_oracle"], color="black", linestyle=":", label="oracle hint")
        gain = report["normalised_gain_last_steps"]
        ax.set(
            title=f"{title}\ngain {report['normalised_gain_first_steps']:.2f} -> {gain:.2f}",
            xlabel="outer step",
            ylim=(0.6, 1.0),
        )
    axes[0][0].set_ylabel("holdout grade (per character)")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=20, help="steps in the moving mean")
    args = parser.parse_args()
    reports = [json.loads(path.read_text()) for path in args.reports]
    # Older reports name neither: the task was the suffix task, the student as the command chose it.
    titles = [
        f"{r.get('task', 'synthetic_suffix')}, "
        f"{r.get('student') or ('shared' if '--shared-student' in r['command'] else 'frozen')} student"
        for r in reports
    ]
    print(draw(reports, titles, args.out, args.width))


if __name__ == "__main__":
    main()
