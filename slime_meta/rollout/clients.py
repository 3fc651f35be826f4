"""The rollout's clients as a whole (the pools, the grader, the replay teachers): their per-step
counters, read and reset once a step, and their closing when a run ends. Both backends use these."""

from __future__ import annotations

from slime_meta.rollout.pools import SGLangPool


def counter_metrics(teacher_pool: SGLangPool, student_pool: SGLangPool, grader) -> dict[str, float]:
    """Per-step counters of the pools (requests, retries, tokens) and of the grader; reset after reading."""
    metrics = {f"pool/teacher_{k}": float(v) for k, v in teacher_pool.stats.snapshot_and_reset().items()}
    metrics.update({f"pool/student_{k}": float(v) for k, v in student_pool.stats.snapshot_and_reset().items()})
    metrics.update(grader_metrics(grader))
    return metrics


def grader_metrics(grader) -> dict[str, float]:
    """The grader's counters (API retries, unparseable replies), reset per step."""
    stats = getattr(grader, "stats", None)
    if stats is None:
        return {}
    values = {f"grader/{k}": float(v) for k, v in vars(stats).items() if isinstance(v, (int, float))}
    for key in vars(stats):
        if isinstance(getattr(stats, key), (int, float)):
            setattr(stats, key, type(getattr(stats, key))(0))
    return values


async def close_clients(*clients) -> None:
    """Close the HTTP sessions of pools, grader and replay teachers (those that have any)."""
    for client in clients:
        for method in ("close", "aclose"):
            if client is not None and hasattr(client, method):
                await getattr(client, method)()
                break
