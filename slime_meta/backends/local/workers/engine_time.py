"""Where each local pool's workers spent the step: prefill, decode, idle (from their engines).

A rollout slower than its generation could be the engine's work (prefills, a slow decode path)
or the clients not keeping the engine fed (dependent phases, grading, HTTP). The engines count
seconds per kind of work (`engine` in `/get_server_info`); this reads them once per step and logs
the difference, summed over a pool's workers:
- `worker/{pool}_{prefill,fast_decode,dynamic_decode,idle}_time`: seconds in each since the last
  read (fast decode: the static or paged cache with CUDA graphs; dynamic: the generic path);
- `worker/{pool}_busy_share`: busy / (busy + idle);
- `worker/{pool}_{decode_steps,prefill_batches,tokens_generated}`: how many, so that the time of
  one decode step and the rows it carried (tokens / steps) follow;
- `worker/{pool}_{eager_prefill_shapes,gpu_allocated_mib,gpu_reserved_mib}`: levels, not differences,
  the most of the pool's workers: the distinct eager prefill shapes a worker has run (on a GPU each
  new one can keep host memory for good) and its caching allocator's figures (on a GPU).
A worker that restarted starts its counters from zero: its first read counts from there.
"""

from __future__ import annotations

import json
import urllib.error

from slime_meta.backends.local.workers.local_http import LOOPBACK_OPENER

_KINDS = ("prefill_s", "fast_decode_s", "dynamic_decode_s", "idle_s")
_COUNTS = ("decode_steps", "prefill_batches", "tokens_generated")
ENGINE_LEVELS = ("eager_prefill_shapes", "gpu_allocated_mib", "gpu_reserved_mib")  # where the engine reports them


def read_engine_seconds(worker_url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """The engine's seconds per kind of work and its counts so far, and the levels it reports, or None
    when the worker does not answer."""
    try:
        with LOOPBACK_OPENER.open(worker_url.rstrip("/") + "/get_server_info", timeout=timeout_s) as response:
            engine = json.loads(response.read()).get("engine", {})
    except (urllib.error.URLError, OSError, ValueError):
        return None
    if not all(isinstance(engine.get(kind), (int, float)) for kind in _KINDS + _COUNTS):
        return None  # a server without these counters (an external SGLang worker)
    levels = {level: float(engine[level]) for level in ENGINE_LEVELS if isinstance(engine.get(level), (int, float))}
    return {kind: float(engine[kind]) for kind in _KINDS + _COUNTS} | levels


class WorkerTimeMeter:
    """Per-step differences of the engines' time counters, and their levels now, per pool."""

    def __init__(self, pool_urls: dict[str, list[str]]):
        self._pool_urls = pool_urls
        self._last: dict[str, dict[str, float]] = {}
        self.metrics()  # start counting from now: the start-up's warm-up is not a step's

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pool, urls in self._pool_urls.items():
            totals = dict.fromkeys(_KINDS + _COUNTS, 0.0)
            levels: dict[str, float] = {}
            answered = 0
            for url in urls:
                now = read_engine_seconds(url)
                if now is None:
                    continue
                answered += 1
                before = self._last.get(url, dict.fromkeys(_KINDS + _COUNTS, 0.0))
                restarted = any(now[kind] < before[kind] for kind in _KINDS + _COUNTS)
                for kind in _KINDS + _COUNTS:
                    totals[kind] += now[kind] if restarted else now[kind] - before[kind]
                self._last[url] = now
                for level in ENGINE_LEVELS:
                    if level in now:
                        levels[level] = max(levels.get(level, 0.0), now[level])
            if not answered:
                continue
            out.update({f"worker/{pool}_{level}": value for level, value in levels.items()})
            for kind in _KINDS:
                out[f"worker/{pool}_{kind.removesuffix('_s')}_time"] = totals[kind]
            for kind in _COUNTS:
                out[f"worker/{pool}_{kind}"] = totals[kind]
            busy = totals["prefill_s"] + totals["fast_decode_s"] + totals["dynamic_decode_s"]
            if busy + totals["idle_s"] > 0:
                out[f"worker/{pool}_busy_share"] = busy / (busy + totals["idle_s"])
        return out
