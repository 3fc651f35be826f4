"""The eval-set lift of the learning runs, with its standard error, recomputed from their results JSONs.

    python benchmarks/eval_lift.py benchmarks/results/efficacy_h100_qwen05b_price_lists_seed31.json ...
    python benchmarks/eval_lift.py --units 32 --step 40 FILE      # a given eval step (default: each file's last)
    python benchmarks/eval_lift.py --eval-set price_lists_eval_new_shops FILE   # one set (default: every set)

A results file holds one curve per eval set (`eval_curves`, by the set's name: the shop tasks' own
eval set and the one of new shops); older files hold one (`eval_curve`). Each set is a row.

The unit is one eval problem: an eval draws `--eval-num-batches` batches of the step's split, and only
the holdout problems of each batch are graded with the teacher's info and without (run_real.sh on a GPU:
2 batches x 4 teacher prompts x 4 holdout problems = 32; the batches' 16 train problems are the teacher's
own and are not graded). Each problem's grade is the mean of its attempts (`--n-holdout-samples`); the
standard error of each mean is the binomial one over the units, sqrt(p (1 - p) / n), and the lift's is
the two combined: (with - without) / sqrt(SE_with^2 + SE_without^2). Also prints each run's normalised
gain over its last window with R_oracle and R_no_info as the JSON holds them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def lift_se(with_info: float, without: float, units: int) -> float:
    """The standard error of (with - without): the two binomial errors over `units` problems combined."""
    return math.sqrt((with_info * (1 - with_info) + without * (1 - without)) / units)


def lift_in_se(with_info: float, without: float, units: int) -> float:
    se = lift_se(with_info, without, units)
    return (with_info - without) / se if se > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="efficacy results JSONs (eval_curve inside)")
    parser.add_argument("--units", type=int, default=32, help="eval problems graded with and without info (32)")
    parser.add_argument("--step", type=int, default=None, help="the eval step to read (default: the last)")
    parser.add_argument("--eval-set", default=None, help="one eval set by name (default: every set of each file)")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.results if not path.is_file()]
    if missing:
        parser.exit(2, f"eval_lift: {missing[0]} not found: give efficacy results JSONs (benchmarks/results/*.json)\n")
    header = f"{'results':<60} {'eval set':<28} {'step':>5} {'with':>6} {'without':>7} {'lift':>6}"
    print(f"{header} {'SE units':>8} {'lift/SE':>7} {'gain last':>9}")
    for path in args.results:
        result = json.loads(path.read_text())
        curves = result.get("eval_curves") or {"eval_curve": result.get("eval_curve") or []}
        if args.eval_set is not None:
            curves = {args.eval_set: curves.get(args.eval_set, [])}
        for eval_set, curve in curves.items():
            points = [p for p in curve if args.step is None or p["step"] == args.step]
            if not points:
                when = "any step" if args.step is None else f"step {args.step}"
                print(f"{path.name:<60} {eval_set:<28} no eval at {when}")
                continue
            point = points[-1]
            se = lift_in_se(point["holdout"], point["no_info"], args.units)
            print(
                f"{path.name:<60} {eval_set:<28} {point['step']:>5} {point['holdout']:>6.3f} {point['no_info']:>7.3f} "
                f"{point['holdout'] - point['no_info']:>6.3f} {args.units:>8} {se:>7.2f} "
                f"{result.get('normalised_gain_last_steps', float('nan')):>9.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
