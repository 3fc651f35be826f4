"""Each normalised gain of an efficacy results file with its 95% interval, recomputed from the file.

The file's per-step curve (holdout with the teacher's info and the no-info control) and its R_oracle;
R_oracle's standard error is the recorded one (`r_oracle_se`) or, for runs before it was recorded,
the binomial error of their 32 single attempts (benchmarks/efficacy.py's `legacy_oracle_se`).

  python benchmarks/gain_intervals.py benchmarks/results/efficacy_h100_qwen05b_price_lists_seed31.json ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.efficacy import legacy_oracle_se  # noqa: E402
from slime_meta.artifacts.tracking import gain_interval  # noqa: E402


def intervals(result: dict, window: int) -> dict:
    curve = result["curve"]
    holdout = [point["holdout"] for point in curve]
    no_info = [point["no_info"] for point in curve]
    oracle = result["r_oracle"]
    oracle_se = result.get("r_oracle_se")
    source = result.get("r_oracle_se_source", "recorded")
    if oracle_se is None:
        oracle_se, source = legacy_oracle_se(oracle)
    out = {"steps": len(curve), "r_oracle": oracle, "r_oracle_se": oracle_se, "r_oracle_se_source": source}
    for which, part in (("first", holdout[:window]), ("last", holdout[-window:])):
        gain, low, high = gain_interval(part, no_info, oracle, oracle_se)
        out[which] = {"gain": gain, "interval_95": [low, high] if math.isfinite(low) else None}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="efficacy JSON files (with a per-step curve)")
    parser.add_argument("--window", type=int, default=10, help="steps averaged at the start and at the end")
    ns = parser.parse_args(argv)
    report = {}
    for path in ns.results:
        if not path.is_file():
            parser.exit(2, f"error: {path}: no such file\n")
        result = json.loads(path.read_text())
        if "curve" not in result or "r_oracle" not in result:
            parser.exit(2, f"error: {path}: not an efficacy results file (no curve or r_oracle)\n")
        report[path.name] = row = intervals(result, ns.window)

        def text(part: dict) -> str:
            bounds = part["interval_95"]
            return f"{part['gain']:.2f}" + (
                f" [{bounds[0]:.2f}, {bounds[1]:.2f}]" if bounds else " [R_oracle error unknown]"
            )

        se = row["r_oracle_se"]
        print(
            f"{path.name}: {row['steps']} steps, R_oracle {row['r_oracle']:.3f}"
            + (f" ± {se:.3f}" if se is not None else "")
            + f"; normalised gain {text(row['first'])} -> {text(row['last'])}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
