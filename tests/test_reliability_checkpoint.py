"""A trainer killed in the middle of `save_checkpoint` leaves the previous checkpoint loadable.

A real process saves checkpoint 1, then starts checkpoint 2 with its fsync made slow, announces
it and is SIGKILLed there (the new checkpoint is still a `.tmp-iter_*` directory). A save that
dies after the rename but before the pointer file moves is made in this process (an exception
at that point: one more interpreter start-up would cost 10 s on two busy cores). Either way
`--load` finds checkpoint 1 whole: weights, optimizer, data cursor and RNG states (the RNG
streams continue exactly where the saved process left them). A later save of the same
iteration succeeds over the leftovers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SAVER = textwrap.dedent(
    """
    import json, os, random, sys, time
    import numpy as np, torch
    from transformers import AutoTokenizer
    import slime_meta.artifacts.train_state as ck
    from slime_meta.backends.local.training.trainer import LocalTrainer
    from slime_meta.backends.local.training.settings import TrainerSettings

    model_dir, save_dir = sys.argv[1], ck.Path(sys.argv[2])
    trainer = LocalTrainer(model_dir, TrainerSettings(lr=1e-3, device="cpu"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    random.seed(1); np.random.seed(1); torch.manual_seed(1)
    random.random(); np.random.rand(); torch.rand(1)  # the streams are somewhere in the middle
    state = {"next_rollout_id": 1, "sampler": {"cursor": 17}}
    ck.save_checkpoint(save_dir, 1, trainer=trainer, tokenizer=tokenizer, state=state)
    # What a resumed run must draw next: the continuation of each stream after the save.
    draws = {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(2).tolist()}
    print(json.dumps(draws), flush=True)

    def stall(what):
        print("STALLED " + what, flush=True)
        time.sleep(600)

    ck.os.fsync = lambda fd: stall("fsync")
    trainer.steps_done = 2
    state = {"next_rollout_id": 2, "sampler": {"cursor": 99}}
    ck.save_checkpoint(save_dir, 2, trainer=trainer, tokenizer=tokenizer, state=state)
    print("SAVED 2 (the kill came too late)", flush=True)
    """
)


def test_a_kill_during_save_leaves_the_previous_checkpoint_loadable(tiny_checkpoint, tmp_path, monkeypatch):
    import random

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import slime_meta.artifacts.train_state as ck
    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer

    killed_dir = tmp_path / "killed"
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(tiny_checkpoint), str(killed_dir)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Meanwhile, in this process: a save that fails after the rename, before the pointer moves.
        trainer = LocalTrainer(str(tiny_checkpoint), TrainerSettings(lr=1e-3, device="cpu"))
        tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
        renamed_dir = tmp_path / "renamed"
        ck.save_checkpoint(renamed_dir, 1, trainer=trainer, tokenizer=tokenizer, state={"next_rollout_id": 1})
        real_replace = os.replace

        def replace(src, dst):
            if str(dst).endswith(ck.POINTER):
                raise OSError("disk gone before the pointer moved")
            return real_replace(src, dst)

        with monkeypatch.context() as patch:
            patch.setattr(ck.os, "replace", replace)
            with pytest.raises(OSError, match="pointer"):
                ck.save_checkpoint(renamed_dir, 2, trainer=trainer, tokenizer=tokenizer, state={"next_rollout_id": 2})
        assert (renamed_dir / "iter_0000002").is_dir() and ck.load_checkpoint(renamed_dir).iteration == 1

        continuation = json.loads(saver.stdout.readline() or "null")
        assert continuation, saver.stderr.read()[-3000:]
        assert saver.stdout.readline().strip() == "STALLED fsync"
        saver.send_signal(signal.SIGKILL)
        assert saver.wait(30) == -signal.SIGKILL
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()

    # The new checkpoint never got its final name; the pointer still names checkpoint 1, whole.
    assert (killed_dir / ".tmp-iter_0000002").is_dir() and not (killed_dir / "iter_0000002").exists()
    loaded = ck.load_checkpoint(killed_dir)
    assert loaded.iteration == 1 and loaded.state == {"next_rollout_id": 1, "sampler": {"cursor": 17}}
    assert loaded.trainer_state["steps_done"] == 0 and "optimizer" in loaded.trainer_state
    AutoModelForCausalLM.from_pretrained(loaded.model_dir)
    AutoTokenizer.from_pretrained(loaded.model_dir)
    ck.set_rng_state(loaded.trainer_state["rng"])
    drawn = {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(2).tolist()}
    assert drawn == continuation  # the RNG streams go on exactly where they were saved

    # The next save of iteration 2 goes through over the leftovers and becomes the latest.
    for save_dir in (killed_dir, renamed_dir):
        ck.save_checkpoint(save_dir, 2, trainer=trainer, tokenizer=tokenizer, state={"next_rollout_id": 2})
        assert ck.load_checkpoint(save_dir).iteration == 2
        assert not list(save_dir.glob(".tmp-*"))


class _TouchOnLoad:
    """What a planted trainer.pt could hold: an object whose unpickling runs code (here: creates a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_load_reads_only_tensors_and_plain_values(tiny_checkpoint, tmp_path):
    import torch
    from transformers import AutoTokenizer

    import slime_meta.artifacts.train_state as ck
    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer
    from slime_meta.errors import UserInputError

    trainer = LocalTrainer(str(tiny_checkpoint), TrainerSettings(lr=1e-3, device="cpu"))
    sum(p.float().pow(2).sum() for p in trainer.model.parameters()).backward()
    trainer.optimizer.step()  # the optimizer has state tensors to save
    saved = ck.save_checkpoint(
        tmp_path,
        1,
        trainer=trainer,
        tokenizer=AutoTokenizer.from_pretrained(tiny_checkpoint),
        state={"next_rollout_id": 1},
    )
    # Everything we write loads without allowing a single global: optimizer and RNG states included.
    plain = torch.load(saved / "trainer.pt", map_location="cpu", weights_only=True)
    assert plain["optimizer"]["state"] and plain["rng"]["format"] == ck.RNG_FORMAT

    marker = tmp_path / "code-ran"
    torch.save({**plain, "rng": _TouchOnLoad(marker)}, saved / "trainer.pt")
    with pytest.raises(UserInputError, match=r"--load .*iter_0000001/trainer.pt holds .*pathlib.* not loaded"):
        ck.load_checkpoint(tmp_path)
    assert not marker.exists()


def test_checkpoints_of_the_previous_format_still_load_and_resume_the_rng_streams(tiny_checkpoint, tmp_path):
    import random

    import numpy as np
    import torch
    from transformers import AutoTokenizer

    import slime_meta.artifacts.train_state as ck
    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer

    trainer = LocalTrainer(str(tiny_checkpoint), TrainerSettings(lr=1e-3, device="cpu"))
    saved = ck.save_checkpoint(
        tmp_path,
        1,
        trainer=trainer,
        tokenizer=AutoTokenizer.from_pretrained(tiny_checkpoint),
        state={"next_rollout_id": 1},
    )
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.gauss(0, 1), np.random.randn()  # a cached Gaussian in each state
    # The previous trainer.pt: Python's state as its tuple, NumPy's as a tuple with an ndarray.
    previous_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({**trainer.state_dict(), "rng": previous_rng}, saved / "trainer.pt")
    expected = (random.gauss(0, 1), random.random(), float(np.random.randn()), torch.rand(2).tolist())

    loaded = ck.load_checkpoint(tmp_path)
    trainer.load_state_dict(loaded.trainer_state)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ck.set_rng_state(loaded.trainer_state["rng"])
    assert (random.gauss(0, 1), random.random(), float(np.random.randn()), torch.rand(2).tolist()) == expected


def test_save_retain_interval_keeps_the_multiples_and_the_latest(tiny_checkpoint, tmp_path):
    """--save-retain-interval 2 (Megatron's rule): each save deletes the earlier non-multiples, once
    the pointer names the new checkpoint; a later step's directory from an earlier run stays."""
    from transformers import AutoTokenizer

    import slime_meta.artifacts.train_state as ck
    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer

    trainer = LocalTrainer(str(tiny_checkpoint), TrainerSettings(lr=1e-3, device="cpu"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    save_dir = tmp_path / "ckpt"
    (save_dir / "iter_0000009").mkdir(parents=True)  # an earlier run that went further
    kept_after = {}
    for iteration in range(1, 6):
        state = {"next_rollout_id": iteration, "sampler": {"cursor": iteration}}
        ck.save_checkpoint(save_dir, iteration, trainer=trainer, tokenizer=tokenizer, state=state, retain_interval=2)
        kept_after[iteration] = sorted(p.name for p in save_dir.glob("iter_*"))
    assert kept_after == {
        1: ["iter_0000001", "iter_0000009"],
        2: ["iter_0000002", "iter_0000009"],
        3: ["iter_0000002", "iter_0000003", "iter_0000009"],
        4: ["iter_0000002", "iter_0000004", "iter_0000009"],
        5: ["iter_0000002", "iter_0000004", "iter_0000005", "iter_0000009"],
    }
    loaded = ck.load_checkpoint(save_dir)
    assert loaded.iteration == 5 and loaded.state["sampler"] == {"cursor": 5}
    # Saving the same step again keeps it; without the flag nothing is deleted.
    ck.save_checkpoint(save_dir, 5, trainer=trainer, tokenizer=tokenizer, state=loaded.state, retain_interval=2)
    ck.save_checkpoint(save_dir, 7, trainer=trainer, tokenizer=tokenizer, state=loaded.state)
    assert sorted(p.name for p in save_dir.glob("iter_*")) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000005",
        "iter_0000007",
        "iter_0000009",
    ]


def test_a_save_clears_what_earlier_failed_saves_left(tiny_checkpoint, tmp_path):
    """A save that died leaves `.tmp-iter_*` (a whole model and optimizer): the next save removes them all."""
    from transformers import AutoTokenizer

    import slime_meta.artifacts.train_state as ck
    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer

    trainer = LocalTrainer(str(tiny_checkpoint), TrainerSettings(lr=1e-3, device="cpu"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    save_dir = tmp_path / "ckpt"
    for iteration in (3, 4):  # two saves that died before their rename
        (save_dir / f".tmp-iter_{iteration:07d}" / "model").mkdir(parents=True)
        (save_dir / f".tmp-iter_{iteration:07d}" / "trainer.pt").write_bytes(b"x" * 1024)
    ck.save_checkpoint(save_dir, 5, trainer=trainer, tokenizer=tokenizer, state={"next_rollout_id": 5})
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000005", ck.POINTER]
