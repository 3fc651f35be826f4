"""A stop while a run writes leaves each file whole or as its previous whole version: the plot, the
config, and the metrics and traces (checkpoints: tests/test_reliability_checkpoint.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from slime_meta.artifacts.atomic_files import drop_torn_tail, replace_atomically
from slime_meta.artifacts.plot import plot_run
from slime_meta.artifacts.tracking import Tracker, jsonl_lines, read_metrics
from slime_meta.config.tracking import TrackingConfig

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def tracking_config(run_dir) -> TrackingConfig:
    return TrackingConfig(
        run_dir=str(run_dir), use_wandb=False, wandb_project="p", wandb_group=None, wandb_mode="disabled"
    )


def write_steps(run_dir, count: int) -> None:
    tracker = Tracker(tracking_config(run_dir), run_dir, {})
    for step in range(count):
        tracker.log(step, {"meta_learning/avg_holdout_grade": 0.1 * step, "meta_learning/holdout_grade_no_info": 0.2})


def test_ctrl_c_in_the_middle_of_a_plot_keeps_the_previous_plot(tmp_path, monkeypatch):
    import matplotlib.figure

    write_steps(tmp_path, 3)
    before = plot_run(tmp_path).read_bytes()
    assert before.startswith(PNG_SIGNATURE)
    write_steps(tmp_path, 5)
    real_savefig = matplotlib.figure.Figure.savefig

    def cut_short(self, target, **kwargs):  # the first half of the image written, then Ctrl-C
        real_savefig(self, target, **kwargs)
        data = open(target, "rb").read()
        open(target, "wb").write(data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cut_short)
    with pytest.raises(KeyboardInterrupt):
        plot_run(tmp_path)
    assert (tmp_path / "holdout.png").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


def test_a_failed_rewrite_keeps_the_previous_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": 1}\n')

    def half_then_fail(tmp):
        tmp.write_text('{"a": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_atomically(path, half_then_fail)
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    replace_atomically(path, lambda tmp: tmp.write_text('{"a": 2}\n'))
    assert json.loads(path.read_text()) == {"a": 2}


APPENDER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    path = Path(sys.argv[1])
    record = json.dumps({"step": 0, "text": "x" * 200_000}) + "\\n"
    print("ready", flush=True)
    while True:
        with path.open("a", encoding="utf-8") as f:  # as Tracker.log and write_traces append
            f.write(record)
    """
)


def test_a_kill_while_appending_loses_at_most_the_line_being_written(tmp_path):
    """SIGKILL (nothing in the process runs) while records are appended: the next open of the run dir
    cuts the file back to its last whole record, and every record then reads."""
    path = tmp_path / "traces.jsonl"
    torn = False
    for _ in range(20):  # until a kill lands inside a write
        path.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", APPENDER, str(path)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if not path.read_bytes().endswith(b"\n"):
            torn = True
            break
    if not torn:
        pytest.skip("no kill landed inside a write in 20 tries")
    whole_before = path.read_bytes().count(b"\n")
    Tracker(tracking_config(tmp_path), tmp_path, {}, start_step=None)  # slime's append, as a resume opens it
    assert path.read_bytes().endswith(b"\n") and path.read_bytes().count(b"\n") == whole_before
    assert all(json.loads(line)["step"] == 0 for line in jsonl_lines(path.read_text(encoding="utf-8")))


def test_a_torn_metrics_line_is_dropped_before_the_run_appends(tmp_path, capsys):
    write_steps(tmp_path, 2)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "meta_learning/avg_ho')  # the last record, cut by a kill
    tracker = Tracker(tracking_config(tmp_path), tmp_path, {}, start_step=2)
    tracker.log(2, {"meta_learning/avg_holdout_grade": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert "cut short by a stop" in capsys.readouterr().out
    assert drop_torn_tail(tmp_path / "metrics.jsonl") is False
