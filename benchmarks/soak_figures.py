"""benchmarks/soak.py's figures from its samples: per process, memory after warm-up and at the end
(medians of WINDOW samples), the least-squares slope after warm-up and the spread around it, by kind
of memory where sampled (anonymous, file-backed, the trainer's caching allocator, GPU memory); per
GPU, its memory in use. Also `fitted_slope`, which the other memory benchmarks fit with."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from slime_meta.backends.local.workers.engine_time import ENGINE_LEVELS  # noqa: E402

if TYPE_CHECKING:
    from soak import SoakRun

WINDOW = 5  # samples per median in `growth`


def fitted_slope(steps: list[int], values_kib: list[int]) -> tuple[float, float]:
    """(least-squares slope in MiB a step, standard deviation of the residuals in MiB)."""
    ys = [v / 1024 for v in values_kib]
    mean_x, mean_y = statistics.fmean(steps), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in steps)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, ys)) / sxx if sxx else 0.0
    residuals = [y - (mean_y + slope * (x - mean_x)) for x, y in zip(steps, ys)]
    return slope, statistics.pstdev(residuals)


def growth(values: list[int], start: int) -> tuple[float, float, float]:
    """(median of the WINDOW samples from `start`, median of the last WINDOW before the final
    sample, their relative difference). The final sample is taken while the run shuts down."""
    early = statistics.median(values[start : start + WINDOW])
    late = statistics.median(values[-WINDOW - 1 : -1])
    return early, late, (late - early) / early


def summarise(run: SoakRun, warmup: int) -> dict[str, dict]:
    """Per process that lived through the run: its figures after warm-up (see the module's doc)."""
    start = run.warmup_end(warmup)
    report = {}
    for name, samples in sorted(run.samples.items()):
        if len(samples) < start + 2 * WINDOW + 1:
            continue  # a process that did not live through the run (a math child, say)
        rss = [s["rss_kib"] for s in samples]
        fds = [s["fds"] for s in samples]
        measured = samples[start:-1]
        slope, noise = fitted_slope([s["step"] for s in measured], [s["rss_kib"] for s in measured])
        early, late, relative = growth(rss, start)
        # Descriptors: the end's median against the most seen in the first half after warm-up.
        # Connection pools grow to the largest burst they have served, and under load a larger burst
        # can come late (a worker's count wandered 120-133 over 200 loaded steps); a leak climbs past.
        first_half = fds[start : start + (len(fds) - start) // 2]
        report[name] = {
            "rss_mib_first": round(rss[0] / 1024, 1),
            "rss_mib_after_warmup": round(early / 1024, 1),
            "rss_mib_end": round(late / 1024, 1),
            "growth": round(relative, 4),
            "slope_mib_per_step": round(slope, 4),
            "fitted_change_mib": round(slope * (measured[-1]["step"] - measured[0]["step"]), 1),
            "noise_mib": round(noise, 2),
            "fds_after_warmup": max(first_half),
            "fds_end": growth(fds, start)[1],
            "fds_max": max(fds),
        }
        for kind in ("anon", "file"):  # where RSS grows: what was allocated, or mapped files touched
            if all(f"{kind}_kib" in s for s in measured):
                kind_slope, kind_noise = fitted_slope(
                    [s["step"] for s in measured], [s[f"{kind}_kib"] for s in measured]
                )
                report[name].update(
                    {
                        f"{kind}_mib_after_warmup": round(
                            growth([s[f"{kind}_kib"] for s in samples], start)[0] / 1024, 1
                        ),
                        f"{kind}_slope_mib_per_step": round(kind_slope, 4),
                        f"{kind}_noise_mib": round(kind_noise, 2),
                    }
                )
        for kind in ("allocated", "reserved"):  # the trainer's caching allocator: what it holds, and keeps
            if all(f"{kind}_mib" in s for s in measured):
                values = [s[f"{kind}_mib"] for s in measured]
                kind_slope, kind_noise = fitted_slope([s["step"] for s in measured], [v * 1024 for v in values])
                report[name].update(
                    {
                        f"{kind}_mib_after_warmup": round(values[0], 1),
                        f"{kind}_mib_end": round(values[-1], 1),
                        f"{kind}_slope_mib_per_step": round(kind_slope, 4),
                        f"{kind}_noise_mib": round(kind_noise, 2),
                    }
                )
        if all("gpu_mib" in s for s in samples[start:-1]):
            gpu = [s["gpu_mib"] for s in samples]
            gpu_slope, gpu_noise = fitted_slope([s["step"] for s in measured], [s["gpu_mib"] * 1024 for s in measured])
            gpu_early, gpu_late, gpu_relative = growth(gpu, start)
            report[name].update(
                gpu_mib_after_warmup=gpu_early,
                gpu_mib_end=gpu_late,
                gpu_growth=round(gpu_relative, 4),
                gpu_slope_mib_per_step=round(gpu_slope, 4),
                gpu_noise_mib=round(gpu_noise, 2),
            )
    return report


def summarise_gpus(run: SoakRun, warmup: int) -> list[dict]:
    """Per GPU: memory in use after warm-up and at the end (medians, as `growth`), and its growth."""
    start = run.warmup_end(warmup)
    if len(run.gpus) < start + 2 * WINDOW + 1:
        return []
    out = []
    for index in range(len(run.gpus[0]["used_mib"])):
        used = [g["used_mib"][index] for g in run.gpus]
        early, late, relative = growth(used, start)
        out.append({"gpu": index, "used_mib_after_warmup": early, "used_mib_end": late, "growth": round(relative, 4)})
    return out


# `worker/{pool}_*` figures that are levels, not a step's amounts
LEVEL_SUFFIXES = tuple(f"_{level}" for level in ENGINE_LEVELS)


def level_course(points: list[tuple[int, float]]) -> tuple[float, float, int | None]:
    """A level's (step or round, value) readings: its first value, its last, and where it last rose
    (None: it never did)."""
    rises = [at for (at, value), (_, before) in zip(points[1:], points) if value > before]
    return points[0][1], points[-1][1], rises[-1] if rises else None


def engine_samples(records: list[dict]) -> list[dict]:
    """Per training step of metrics.jsonl: its step time, where the local workers spent it
    (`worker/{pool}_*`: prefill, decode and idle seconds, prefill batches, ...) and what the pools were
    asked (`pool/*`: requests, tokens, retries). Eval-only records have no step time and are left out."""
    return [
        {"step": r["step"], "step_time": r["perf/step_time"]}
        | {k: v for k, v in r.items() if k.startswith(("worker/", "pool/"))}
        for r in records
        if "perf/step_time" in r and "step" in r
    ]


def summarise_engine(samples: list[dict], warmup_end: int) -> dict:
    """Medians over the steps after `warmup_end` (those `summarise` measures) of each per-step figure
    in `samples`, and per pool the seconds of one prefill batch (a pool's prefill seconds over its
    prefill batches, summed over those steps): what a change of prefill shapes costs, measured inside the run."""
    measured = [s for s in samples if s["step"] > warmup_end]
    if not measured:
        return {}
    keys = sorted({key for s in measured for key in s} - {"step"})
    out: dict = {"steps": len(measured)}
    for key in keys:
        values = [s[key] for s in measured if isinstance(s.get(key), (int, float))]
        out[f"median {key}"] = round(statistics.median(values), 4)
    for key in keys:
        if key.endswith(LEVEL_SUFFIXES):  # a level (what a worker holds or has met): where it went, and when
            points = [(s["step"], s[key]) for s in measured if isinstance(s.get(key), (int, float))]
            course = level_course(points)
            out[f"{key} after warm-up"], out[f"{key} end"], out[f"{key} last rise at step"] = course
        if key.endswith("_prefill_time"):
            pool = key.removeprefix("worker/").removesuffix("_prefill_time")
            batches = sum(s.get(f"worker/{pool}_prefill_batches", 0) for s in measured)
            if batches:
                seconds = sum(s.get(key, 0.0) for s in measured)
                out[f"{pool} seconds per prefill batch"] = round(seconds / batches, 5)
    return out
