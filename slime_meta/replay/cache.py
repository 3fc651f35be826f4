"""The JSONL cache of trace replay: teacher answers and final decisions, kept across resumes.

The line formats and when each line is written are described in the docstring of
`slime_meta.replay.pairs`; these functions read the lines of one configuration and append new ones.
A third kind of line holds a pair's DPO reference log-probs under the start weights:

    {"kind": "reference", "key": reference_key(...), "chosen": -12.5, "rejected": -20.1}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

# The replay module's logger: records keep the name they had before this module was split out of it.
logger = logging.getLogger("slime_meta.replay.pairs")


def load_replay_cache(
    cache_path: Path,
    *,
    config: str,
    gen: str,
    labels: Sequence[str],
    decode_pair: Callable[[dict[str, Any]], Any],
) -> tuple[dict[str, Any], dict[tuple[str, str], tuple[str, str | None]]]:
    """(decisions, answers) of the cache file: final decisions of configuration `config` (key ->
    `decode_pair(pair)` or None), and teacher answers made with `gen` by one of `labels`
    ((label, key) -> (solution, normalised answer or None)) for keys without such a decision."""
    decisions: dict[str, Any] = {}
    answers: dict[tuple[str, str], tuple[str, str | None]] = {}
    if not cache_path.exists():
        return decisions, answers
    skipped = 0
    with open(cache_path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                kind, key = record["kind"], record["key"]
                if kind == "decision" and record["config"] == config:
                    pair = record["pair"]
                    decisions[key] = None if pair is None else decode_pair(pair)
                elif kind == "answer" and record["gen"] == gen and record["teacher"] in labels:
                    answers[(record["teacher"], key)] = (record["solution"], record["answer"])
            except (ValueError, KeyError, TypeError):
                skipped += 1  # a torn line from a crash during a write
    if skipped:
        logger.warning("replay cache %s: skipped %d unreadable line(s)", cache_path, skipped)
    return decisions, {k: v for k, v in answers.items() if k[1] not in decisions}


def append_replay_records(cache_path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Append `records` as JSON lines with flush + fsync, starting on a fresh line after a torn one."""
    lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    if not lines:
        return
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_path, "a+b") as handle:
        if handle.tell() > 0:  # "a+" is positioned at the end: start on a fresh line
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                lines = "\n" + lines
        handle.write(lines.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def reference_key(
    reference_id: str, prompt_ids: Sequence[int], chosen_ids: Sequence[int], rejected_ids: Sequence[int]
) -> str:
    """The cache key of one pair's reference log-probs: the reference weights and the exact token ids."""
    payload = json.dumps([reference_id, list(prompt_ids), list(chosen_ids), list(rejected_ids)])
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def load_reference_logps(cache_path: Path) -> dict[str, tuple[float, float]]:
    """key -> (chosen, rejected) reference log-prob sums of the cache's "reference" lines."""
    values: dict[str, tuple[float, float]] = {}
    if not cache_path.exists():
        return values
    with open(cache_path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
                if record["kind"] == "reference":
                    values[record["key"]] = (float(record["chosen"]), float(record["rejected"]))
            except (ValueError, KeyError, TypeError):
                continue  # torn lines are counted by load_replay_cache
    return values


def with_cached_reference_logps(
    cache_path: Path,
    references: dict[str, tuple[float, float]],
    pairs: Sequence[Any],
    score: Callable[[list[Any]], list[Any]],
    reference_id: str,
) -> list[Any]:
    """`pairs` (`PreferencePair`s) with their reference log-probs from `references` (the cache's,
    updated in place), the missing ones from `score`, which are then appended to the cache."""
    keys = [reference_key(reference_id, p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in pairs]
    out = [
        dataclasses.replace(p, reference_chosen_logp=references[k][0], reference_rejected_logp=references[k][1])
        if k in references
        else p
        for p, k in zip(pairs, keys)
    ]
    missing = [i for i, k in enumerate(keys) if k not in references]
    if not missing:
        return out
    records = []
    for i, pair in zip(missing, score([out[i] for i in missing])):
        out[i] = pair
        if keys[i] not in references:  # the same pair twice in one batch: one line
            references[keys[i]] = (pair.reference_chosen_logp, pair.reference_rejected_logp)
            records.append(
                {
                    "kind": "reference",
                    "key": keys[i],
                    "chosen": pair.reference_chosen_logp,
                    "rejected": pair.reference_rejected_logp,
                }
            )
    append_replay_records(cache_path, records)
    return out
