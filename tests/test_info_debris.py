"""benchmarks/info_debris.py: the share of infos with a repeated sentence or a code fence, per block of steps."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from info_debris import blocks, has_repeated_sentence, main, read_chains  # noqa: E402

LINE = "Price list of Kim's stall: every item costs 7 dollars."
CLAUSE = "No credit for a different number, for several different final numbers."


def test_a_sentence_said_twice_counts_whether_on_one_line_or_two():
    assert not has_repeated_sentence(f"{LINE} {CLAUSE}")
    assert has_repeated_sentence(f"{LINE} {CLAUSE} {CLAUSE}")
    assert has_repeated_sentence(f"{LINE}\n{LINE}")
    assert not has_repeated_sentence("Answer: 24.\nAnswer: 24.")  # short pieces are not sentences of a rule


def test_blocks_report_shares_lengths_and_rewards(tmp_path):
    records = [
        {"type": "batch", "rollout_id": "0", "episodes": "[]"},
        {"type": "chain", "rollout_id": "0", "final_info": LINE, "reward": 0.5},
        {"type": "chain", "rollout_id": "3", "final_info": f"```\n{LINE}\n```", "reward": 0.25},
        {"type": "chain", "rollout_id": "12", "final_info": f"{LINE} {CLAUSE} {CLAUSE}", "reward": 1.0},
        {"type": "chain", "rollout_id": "15", "final_info": LINE, "reward": 0.75},
    ]
    path = tmp_path / "traces.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
    first, second = blocks(read_chains(path), block=10)
    assert (first["first_step"], first["infos"], first["share_fenced"], first["share_repeated_sentence"]) == (
        0,
        2,
        0.5,
        0,
    )
    assert first["reward_repeated"] is None and first["reward_not_repeated"] == 0.375
    assert (second["first_step"], second["infos"], second["share_repeated_sentence"]) == (10, 2, 0.5)
    assert (second["reward_repeated"], second["reward_not_repeated"]) == (1.0, 0.75)
    out = tmp_path / "report.json"
    assert main([str(path), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["runs"]["traces.jsonl.gz"][1]["infos"] == 2
    assert main([str(tmp_path / "missing.jsonl")]) == 2
