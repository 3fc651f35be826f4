"""Metrics and traces: `metrics.jsonl` always, wandb when asked, `traces.jsonl` for reading runs.

wandb runs offline unless `--wandb-mode online` and WANDB_API_KEY is in the environment; the key
is read by wandb itself from the environment and never passes through this program's files.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from slime_meta.artifacts.atomic_files import drop_torn_tail
from slime_meta.config.tracking import TrackingConfig


def _jsonable(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Tracker:
    def __init__(
        self, config: TrackingConfig, run_dir: Path, full_config: Mapping[str, Any], *, start_step: int | None = 0
    ):
        """`start_step`: the first step this run trains (0: a new run; None: not known here, records are
        appended to what the run dir holds, as on slime, whose trainer knows where a resume starts)."""
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.traces_path = run_dir / "traces.jsonl"
        for path in (self.metrics_path, self.traces_path):
            if drop_torn_tail(path):  # a line cut by a kill: the file goes back to its last whole record
                print(f"[tracking] {path}: dropped a last record cut short by a stop", flush=True)
        if start_step == 0:
            # A new run in a run dir that holds another run's records: those are kept beside, not mixed in.
            for path in (self.metrics_path, self.traces_path):
                _set_aside(path)
        elif start_step is not None:
            # A resumed run redoes the steps after its checkpoint: their old records give way.
            _keep_records_before(self.metrics_path, start_step, key="step")
            _keep_records_before(self.traces_path, start_step, key="rollout_id")
        self._wandb = None
        if config.use_wandb and config.wandb_mode != "disabled":
            import wandb  # optional dependency: pip install -e .[wandb]

            self._wandb = wandb.init(
                project=config.wandb_project,
                group=config.wandb_group,
                mode=config.wandb_mode,
                dir=str(run_dir),
                config=dict(full_config),
            )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _jsonable(float(v)) for k, v in metrics.items()}}
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def write_traces(self, traces: Iterable[Mapping[str, Any]]) -> None:
        with self.traces_path.open("a", encoding="utf-8") as f:
            for trace in traces:
                f.write(json.dumps(trace, ensure_ascii=False) + "\n")

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def _set_aside(path: Path) -> None:
    """Move an earlier run's records out of the way (`NAME.earlier-N`, the first N free): nothing is lost."""
    if not path.exists() or not path.stat().st_size:
        return
    n = 1
    while (aside := path.with_name(f"{path.name}.earlier-{n}")).exists():
        n += 1
    path.replace(aside)
    print(f"[tracking] {path} held an earlier run's records: moved to {aside.name}", flush=True)


def _keep_records_before(path: Path, step: int, *, key: str) -> None:
    """Keep the records of the steps before `step`, and an eval-only record at `step` itself: it
    evaluated the weights the resumed run starts from (the checkpoint's), which it does not redo."""
    if not path.exists():
        return
    lines = jsonl_lines(path.read_text(encoding="utf-8"))
    kept = [
        line
        for line in lines
        if (record := json.loads(line)).get(key, -1) < step or (record.get(key) == step and is_eval_only(record))
    ]
    if len(kept) == len(lines):
        return
    backup = path.with_name(path.name + ".before-resume")
    backup.write_text("\n".join(lines) + "\n", encoding="utf-8")  # nothing is lost
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)


def jsonl_lines(text: str) -> list[str]:
    """The non-empty records of a JSON-lines text. Split on "\n" only: traces keep model text
    unescaped (ensure_ascii=False), and str.splitlines() would also split inside a record at the
    line separators JSON leaves raw (U+2028, U+0085, ...)."""
    return [line for line in text.split("\n") if line.strip()]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in jsonl_lines(path.read_text(encoding="utf-8"))]


def is_eval_only(record: Mapping[str, Any]) -> bool:
    """A record of an eval alone (the final eval, or one done just before a stop), not of a step:
    it holds `step`, `time` and `eval/...` figures and nothing a step logs."""
    return all(key in ("step", "time") or key.startswith("eval/") for key in record)


def step_records(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records of the training steps: what per-step figures and curves are read from."""
    return [record for record in records if not is_eval_only(record)]


class RunProgress:
    """Elapsed time and the ETA of the run's remaining steps, from the mean time of the steps this
    process has done (a resumed run counts from its first step)."""

    def __init__(self, start_step: int, end_step: int):
        self.start_step, self.end_step = start_step, end_step
        self._started = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def eta_s(self, rollout_id: int) -> float:
        """Seconds left after step `rollout_id` (0-based) is done."""
        done = rollout_id + 1 - self.start_step
        return self.elapsed_s() / max(done, 1) * max(self.end_step - rollout_id - 1, 0)


def format_step_line(
    step: int,
    metrics: Mapping[str, float],
    *,
    total: int | None = None,
    elapsed_s: float | None = None,
    eta_s: float | None = None,
    oracle: float | None = None,
) -> str:
    """A one-line summary of an outer step for the console, e.g.

    `step 3/20 [0:09 elapsed, ETA 0:51] holdout 0.875 (no info 0.688, oracle 0.969, gain 0.67) inner 0.812
    loss -0.0123 grad_norm 0.456 kl 0.0012 entropy 1.23 info_len 3.0 | rollout 2.1s train 0.50s step 3.0s`

    `step` is the 0-based rollout id, shown 1-based out of `total` (the run's --num-rollout).
    `oracle` is the student's grade with the reference context (--eval-baseline); with it the line
    shows the normalised gain (holdout - no info) / (oracle - no info). KL, entropy and the mean
    length of the teacher's final info appear when the step's metrics have them; without training
    metrics (slime's rollout, whose trainer logs its own) the line holds the rollout's part only.
    """

    def get(key: str) -> float:
        return float(metrics.get(key, float("nan")))

    position = f"step {step + 1}/{total}" if total else f"step {step + 1}"
    if elapsed_s is not None:
        timing = f"{format_duration(elapsed_s)} elapsed"
        if eta_s is not None:
            timing += f", ETA {format_duration(eta_s)}"
        position += f" [{timing}]"
    holdout, no_info = get("meta_learning/avg_holdout_grade"), get("meta_learning/holdout_grade_no_info")
    control = f"no info {no_info:.3f}"
    if oracle is not None:
        control += f", oracle {oracle:.3f}, gain {format_gain(normalised_gain(holdout, no_info, oracle))}"
    if metrics.get("train/skipped_no_signal"):  # nothing was trained: no loss to show
        trained = f"no signal, update skipped ({get('train/skipped_no_signal_total'):.0f} so far)"
    elif "train/loss" in metrics:
        trained = f"loss {get('train/loss'):+.4f} grad_norm {get('train/grad_norm'):.3f}"
    else:  # the rollout's own line where another process trains (slime: its trainer logs the loss)
        trained = ""
    optional = [
        ("kl", "train/kl_ref", "{:.4f}"),  # KL to the start weights (--kl-loss-coef); 0 when off: not shown
        ("entropy", "train/entropy", "{:.3f}"),
        ("info_len", "meta_learning/info_tokens", "{:.1f}"),  # tokens of the teacher's final info
    ]
    for label, key, form in optional:
        value = metrics.get(key)
        if value is not None and math.isfinite(float(value)) and (key != "train/kl_ref" or value):
            trained += f" {label} {form.format(float(value))}"
    timings = f"rollout {get('meta_learning/inner_loop_time'):.1f}s"
    if "train/step_time" in metrics:
        timings += f" train {get('train/step_time'):.2f}s"
    if "perf/step_time" in metrics:
        timings += f" step {get('perf/step_time'):.1f}s"
    head = f"{position} holdout {holdout:.3f} ({control}) inner {get('meta_learning/avg_inner_grade'):.3f}"
    return " ".join(part for part in (head, trained.strip(), "|", timings) if part) + grader_parse_note(metrics)


def reference_grades(records: list[dict]) -> dict[str, float]:
    """Per data set, the student's grade with the reference context, measured before training."""
    suffix = "/baseline_teacher/avg"
    return {
        key[len("eval/") : -len(suffix)]: value
        for record in records
        for key, value in record.items()
        if key.startswith("eval/") and key.endswith(suffix) and value is not None
    }


def oracle_grade(baseline: Mapping[str, float], run_dir: Path) -> float | None:
    """R_oracle: the student's grade with the reference context (--eval-baseline, measured before
    step 0; a resumed run reads it from the run's earlier records). None when not measured."""
    grades = reference_grades([dict(baseline)])
    if not grades and (run_dir / "metrics.jsonl").is_file():
        grades = reference_grades(read_metrics(run_dir))
    return next(iter(grades.values()), None)


def normalised_gain(holdout: float, no_info: float, oracle: float) -> float:
    """(holdout - no info) / (oracle - no info): 0 is the no-info control, 1 the reference context;
    NaN when the reference is no better than no info (nothing to measure against)."""
    return (holdout - no_info) / (oracle - no_info) if oracle > no_info else float("nan")


def reference_grade_se(records: list[dict]) -> dict[str, float]:
    """Per data set, the standard error of its R_oracle over the problems (--eval-baseline), where recorded."""
    suffix = "/baseline_teacher/se"
    return {
        key[len("eval/") : -len(suffix)]: value
        for record in records
        for key, value in record.items()
        if key.startswith("eval/") and key.endswith(suffix) and value is not None and math.isfinite(value)
    }


def gain_interval(
    holdout: Sequence[float], no_info: Sequence[float], oracle: float, oracle_se: float | None, z: float = 1.96
) -> tuple[float, float, float]:
    """The normalised gain of mean(holdout) against mean(no_info) and R_oracle, with its 95% interval.

    First-order (delta-method) propagation of three standard errors: the holdout's and the control's
    over their steps, R_oracle's over its problems. The holdout and the control of one step grade the
    same problems, so their errors are positively correlated; treating them as independent makes the
    interval wider, not narrower. (NaN, NaN) bounds where an error is unknown."""
    h, n = sum(holdout) / len(holdout), sum(no_info) / len(no_info)
    gain = normalised_gain(h, n, oracle)
    if not math.isfinite(gain) or oracle_se is None or len(holdout) < 2 or len(no_info) < 2:
        return gain, float("nan"), float("nan")
    span = oracle - n

    def se(values: Sequence[float]) -> float:
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))

    variance = (
        (se(holdout) / span) ** 2 + (oracle_se * (h - n) / span**2) ** 2 + (se(no_info) * (h - oracle) / span**2) ** 2
    )
    half = z * math.sqrt(variance)
    return gain, gain - half, gain + half


def summary_line(records: Iterable[Mapping[str, Any]], window: int = 10) -> str | None:
    """The run's result in one line: the holdout grade with the teacher's info over the first and
    the last `window` steps (half the steps each when fewer), the no-info control over all of them
    and, with --eval-baseline's R_oracle, the normalised gain of each window. None without steps."""
    steps = [r for r in step_records(records) if r.get("meta_learning/avg_holdout_grade") is not None]
    if not steps:
        return None
    n = max(1, min(window, len(steps) // 2))
    first = sum(r["meta_learning/avg_holdout_grade"] for r in steps[:n]) / n
    last = sum(r["meta_learning/avg_holdout_grade"] for r in steps[-n:]) / n
    controls = [
        r["meta_learning/holdout_grade_no_info"]
        for r in steps
        if r.get("meta_learning/holdout_grade_no_info") is not None
    ]
    line = f"summary: {len(steps)} steps; holdout with the teacher's info {first:.3f} over the first {n}"
    line += f" -> {last:.3f} over the last {n}"
    if not controls:
        return line
    no_info = sum(controls) / len(controls)
    oracles = reference_grades([dict(steps[0])])
    if len(oracles) != 1:
        return f"{line} (no info {no_info:.3f})"
    oracle = next(iter(oracles.values()))
    oracle_se = next(iter(reference_grade_se([dict(steps[0])]).values()), None)
    holdout = [r["meta_learning/avg_holdout_grade"] for r in steps]
    gains = [
        format_gain_interval(*gain_interval(part, controls, oracle, oracle_se)) for part in (holdout[:n], holdout[-n:])
    ]
    oracle_text = f"oracle {oracle:.3f}" + (f" ± {oracle_se:.3f}" if oracle_se is not None else "")
    return f"{line} (no info {no_info:.3f}, {oracle_text}: normalised gain {gains[0]} -> {gains[1]})"


def format_gain_interval(gain: float, low: float, high: float) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return format_gain(gain)
    return f"{format_gain(gain)} [{low:.2f}, {high:.2f}]"


def format_gain(gain: float) -> str:
    return f"{gain:.2f}" if math.isfinite(gain) else "n/a"


def format_duration(seconds: float) -> str:
    """`m:ss` below an hour, `h:mm:ss` above."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def grader_parse_note(metrics: Mapping[str, float]) -> str:
    """The step line's tail when LLM grader replies had no readable verdict, and a warning line
    when most did: a systematic cause, not a student's doing, is then likely."""
    unparseable, replies = metrics.get("grader/unparseable_replies", 0), metrics.get("grader/replies", 0)
    if not unparseable:
        return ""
    scored_zero = metrics.get("grader/parse_failures", 0)
    note = f" grader unparseable {unparseable:.0f}/{replies:.0f} replies ({scored_zero:.0f} scored 0)"
    if unparseable * 2 > replies:
        note += (
            f"\nwarning: {unparseable:.0f} of {replies:.0f} grader replies this step had no readable verdict; "
            "check that the grader template asks for `GRADE: <a number between 0 and 1>` alone on a line, then "
            "`EXPLANATION:`, and that --grader-max-tokens leaves room for the reply to reach its GRADE line"
        )
    return note


def format_eval_line(step: int, metrics: Mapping[str, float]) -> str:
    """One line per evaluation: each fixed eval set's holdout grade with and without the teacher's info."""
    names = sorted({key.split("/")[1] for key in metrics if key.startswith("eval/") and key.endswith("/gain")})
    parts = [
        f"{name} holdout {metrics[f'eval/{name}/holdout_grade']:.3f} (no info "
        f"{metrics[f'eval/{name}/holdout_grade_no_info']:.3f}, "
        f"gain {metrics[f'eval/{name}/gain']:+.3f})"
        for name in names
    ]
    return f"eval at step {step}: " + "; ".join(parts)
