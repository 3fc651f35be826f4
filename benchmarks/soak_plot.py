"""benchmarks/soak.py's figures drawn and printed: resident memory, descriptors and GPU memory per
process against the step (PNG), and the table of per-process figures."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

if TYPE_CHECKING:
    from soak import SoakRun

OTHERS = "other children"


def plotted_series(samples: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The processes as the plot draws them: the trainer, each worker and router by name, and the
    other children (the verifier's math processes, compile workers: dozens on a GPU host, most
    short-lived) summed per step into one line, so that the legend stays readable."""
    named = {name: s for name, s in samples.items() if not name.startswith("other:")}
    others = [s for name, s in samples.items() if name.startswith("other:")]
    by_step: dict[int, dict] = {}
    for series in others:
        for sample in series:
            total = by_step.setdefault(sample["step"], {"step": sample["step"], "rss_kib": 0, "fds": 0, "count": 0})
            total["rss_kib"] += sample["rss_kib"]
            total["fds"] += sample["fds"]
            total["count"] += 1
    if by_step:
        peak = max(total["rss_kib"] for total in by_step.values()) / 1024
        named[f"{OTHERS} (sum of {len(others)}; peak {peak:,.0f} MiB)"] = [by_step[step] for step in sorted(by_step)]
    return named


def plot(run: SoakRun, warmup: int, out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on_gpu = any("gpu_mib" in s for samples in run.samples.values() for s in samples)
    fig, axes = plt.subplots(1, 3 if on_gpu else 2, figsize=(21 if on_gpu else 14, 4.5))
    ax_rss, ax_fds = axes[0], axes[1]
    for name, samples in sorted(plotted_series(run.samples).items()):
        if len(samples) < 3:
            continue
        steps = [s["step"] for s in samples]
        ax_rss.plot(steps, [s["rss_kib"] / 1024 for s in samples], label=name)
        ax_fds.plot(steps, [s["fds"] for s in samples], label=name)
        if (name == "trainer" or name.startswith("worker:")) and "anon_kib" in samples[0]:
            ax_rss.plot(steps, [s["anon_kib"] / 1024 for s in samples], linestyle=":", label=f"{name}: anonymous")
        on_this_gpu = [s for s in samples if "gpu_mib" in s]
        if on_gpu and on_this_gpu:
            axes[2].plot([s["step"] for s in on_this_gpu], [s["gpu_mib"] for s in on_this_gpu], label=name)
    if on_gpu:
        axes[2].set(ylabel="GPU memory (MiB)", title="GPU memory per process")
    for ax in axes:
        ax.axvline(run.warmup_end(warmup), color="grey", linestyle="--", label="end of warm-up")
        ax.set_xlabel("outer step")
    ax_rss.set(ylabel="resident memory (MiB)", title=f"Resident memory per process: {title}")
    # The scale of the named processes: the other children's sum (compile workers at the start of a GPU
    # run, gigabytes for a few steps) may run off the top; its peak is in the legend.
    named = [samples for name, samples in run.samples.items() if not name.startswith("other:")]
    named_peak = max((s["rss_kib"] / 1024 for samples in named for s in samples), default=None)
    if named_peak:
        ax_rss.set_ylim(0, 1.15 * named_peak)
    ax_fds.set(ylabel="open file descriptors", title="Open descriptors per process")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def print_figures(report: dict) -> None:
    """The table of per-process figures (and the GPU lines) of a report."""
    rows = [
        [name, f["rss_mib_after_warmup"], f["rss_mib_end"], f["growth"], f["slope_mib_per_step"], f["noise_mib"]]
        + [f"{f['fds_after_warmup']} -> {f['fds_end']:g}"]
        for name, f in report["processes"].items()
    ]
    header = ["process", "RSS after warm-up", "RSS end", "growth", "MiB/step", "noise MiB", "descriptors"]
    print(C.table(rows, header))
    for name, f in report["processes"].items():
        if "anon_slope_mib_per_step" in f and "file_slope_mib_per_step" in f:
            print(
                f"{name} by kind: anonymous {f['anon_mib_after_warmup']} MiB, {f['anon_slope_mib_per_step']} MiB/step "
                f"(noise {f['anon_noise_mib']}); file-backed {f['file_mib_after_warmup']} MiB, "
                f"{f['file_slope_mib_per_step']} MiB/step (noise {f['file_noise_mib']})"
            )
        if "allocated_slope_mib_per_step" in f:
            print(
                f"{name} caching allocator: allocated {f['allocated_mib_after_warmup']} -> "
                f"{f['allocated_mib_end']} MiB "
                f"({f['allocated_slope_mib_per_step']} MiB/step, noise {f['allocated_noise_mib']}); reserved "
                f"{f.get('reserved_mib_after_warmup')} -> {f.get('reserved_mib_end')} MiB"
            )
        if "gpu_growth" in f:
            print(
                f"{name} GPU memory: {f['gpu_mib_after_warmup']} -> {f['gpu_mib_end']} MiB "
                f"(growth {f['gpu_growth']}, {f['gpu_slope_mib_per_step']} MiB/step, noise {f['gpu_noise_mib']} MiB)"
            )
    for g in report["gpus"]:
        print(f"GPU {g['gpu']} in use: {g['used_mib_after_warmup']} -> {g['used_mib_end']} MiB (growth {g['growth']})")
    engine = report.get("engine") or {}
    if engine:
        print(f"over {engine['steps']} steps after warm-up (medians a step unless named):")
        figures = {key: value for key, value in engine.items() if key != "steps" and value is not None}
        print("  " + "; ".join(f"{key.removeprefix('median ')} {value:g}" for key, value in figures.items()))
