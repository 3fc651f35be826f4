"""What the teacher's infos look like as a run goes on: the debris RL can grow beside the gain.

Reads a run's traces (traces.jsonl, or .jsonl.gz as kept in benchmarks/results/traces) and reports,
per block of steps, over the traced chains' final infos: how many there are, the share holding a
code fence (```), the share with a sentence or line repeated within the info (the sign of an info
running on to the token cap), the mean length in characters, and the mean reward of each kind beside the rest's.
An info that states the rule once and then repeats it scores as well as the rule alone: nothing in
the reward tells the two apart, which is what this shows.

  python benchmarks/info_debris.py benchmarks/results/traces/qwen05b_price_lists_alone_seed32.jsonl.gz
  python benchmarks/info_debris.py TRACES... --block 10 --out info_debris.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

FENCE = "```"


def read_chains(path: Path) -> list[dict]:
    """The traced chains of a run (records of type "chain", each with its step, final info and reward)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [r for r in records if r.get("type") == "chain" and "final_info" in r]


def has_repeated_sentence(info: str) -> bool:
    """A sentence or line of at least four words that the info holds twice (the cap-filling loop)."""
    pieces = [p.strip() for p in re.split(r"\n+|(?<=[.!?])\s+", info)]
    sentences = [p for p in pieces if len(p.split()) >= 4]
    return len(sentences) != len(set(sentences))


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def blocks(chains: list[dict], block: int) -> list[dict]:
    """Per block of `block` steps: counts, shares, mean length and rewards of the final infos."""
    by_block: dict[int, list[dict]] = {}
    for chain in chains:
        by_block.setdefault(int(chain["rollout_id"]) // block, []).append(chain)
    rows = []
    for index in sorted(by_block):
        members = by_block[index]
        infos = [str(c.get("final_info") or "") for c in members]
        rewards = [float(c.get("reward", 0.0)) for c in members]
        fenced = [FENCE in i for i in infos]
        repeated = [has_repeated_sentence(i) for i in infos]
        rows.append(
            {
                "first_step": index * block,
                "last_step": index * block + block - 1,
                "infos": len(infos),
                "share_fenced": sum(fenced) / len(infos),
                "share_repeated_sentence": sum(repeated) / len(infos),
                "mean_chars": sum(len(i) for i in infos) / len(infos),
                "reward_repeated": mean([r for r, rep in zip(rewards, repeated) if rep]),
                "reward_not_repeated": mean([r for r, rep in zip(rewards, repeated) if not rep]),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path, help="traces.jsonl or .jsonl.gz files")
    parser.add_argument("--block", type=int, default=10, help="steps per block (10)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report as JSON here")
    ns = parser.parse_args(argv)
    if ns.block < 1:
        parser.error(f"--block {ns.block}: must be >= 1")
    report = {"command": "python benchmarks/info_debris.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    report["runs"] = {}
    for path in ns.traces:
        if not path.is_file():
            print(f"error: {path}: no such traces file", file=sys.stderr)
            return 2
        chains = read_chains(path)
        report["runs"][path.name] = rows = blocks(chains, ns.block)
        print(f"{path.name}: {len(chains)} traced chains")
        print(f"  {'steps':>9} {'infos':>5} {'fenced':>6} {'repeated':>8} {'chars':>6} {'reward rep / not':>17}")

        def number(x):
            return "-" if x is None else f"{x:.3f}"

        for row in rows:
            steps = f"{row['first_step']}-{row['last_step']}"
            rewards = f"{number(row['reward_repeated'])} / {number(row['reward_not_repeated'])}"
            print(
                f"  {steps:>9} {row['infos']:>5} {row['share_fenced']:>6.2f} {row['share_repeated_sentence']:>8.2f}"
                f" {row['mean_chars']:>6.0f} {rewards:>17}"
            )
    if ns.out:
        ns.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
