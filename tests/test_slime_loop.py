"""The slime outer loop's order of calls, with --max-async-level 0 and 1.

Ray, Megatron and SGLang cannot run on this machine, so slime's actors are recorders here: each
call is logged, and `ray.get` of a rollout returns the rollout id it was started for. What is
checked is the order slime's own async pattern (train_async.py) prescribes: step n+1's rollout
starts before step n trains, and the new weights go out only once that rollout is collected.
"""

from __future__ import annotations

import sys
import types
from argparse import Namespace

import pytest

from slime_meta.backends.slime import loop


class _Remote:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def remote(self, *args, **kwargs):
        self.log.append((self.name, *args, *kwargs.values()))
        return (self.name, *args, *kwargs.values())


@pytest.fixture
def recorded(monkeypatch):
    log: list[tuple] = []

    def get(ref):
        log.append(("get", *ref) if isinstance(ref, tuple) else ("get", ref))
        return ref

    rollout = types.SimpleNamespace(
        **{
            n: _Remote(log, n)
            for n in ("generate", "eval", "save", "offload", "onload_weights", "onload_kv", "dispose", "check_weights")
        }
    )
    teacher = types.SimpleNamespace(
        async_train=lambda rid, data: log.append(("train", rid, data)) or ("trained", rid),
        update_weights=lambda: log.append(("update_weights",)),
        save_model=lambda *a, **k: log.append(("save_model",)),
        clear_memory=lambda: None,
    )
    modules = {
        "ray": types.SimpleNamespace(get=get),
        "slime.observability.logging_utils": types.SimpleNamespace(
            configure_logger=lambda: None, finish_tracking=lambda a: None, init_tracking=lambda a: None
        ),
        "slime.ray.placement_group": types.SimpleNamespace(
            create_placement_groups=lambda a: {"rollout": None},
            create_rollout_manager=lambda a, pg: (rollout, 3),
            create_training_models=lambda a, pg, r: (teacher, None),
        ),
        "slime.utils.misc": types.SimpleNamespace(should_run_periodic_action=lambda *a: False),
    }
    for name in ("slime", "slime.observability", "slime.ray", "slime.utils"):
        modules.setdefault(name, types.ModuleType(name))
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return log


def args(**overrides):
    values = dict(
        num_rollout=3,
        start_rollout_id=0,
        offload_rollout=False,
        offload_train=True,
        eval_interval=None,
        skip_eval_before_train=True,
        save_interval=None,
        rollout_global_dataset=True,
        max_async_level=0,
        check_weight_update_equal=False,
    )
    return Namespace(**{**values, **overrides})


def events(log, *names):
    return [e for e in log if e[0] in names]


def test_synchronous_loop_trains_each_rollout_before_the_next(recorded):
    loop.train(args())
    assert events(recorded, "generate", "train", "update_weights")[1:] == [
        ("generate", 0),
        ("train", 0, ("generate", 0)),
        ("update_weights",),
        ("generate", 1),
        ("train", 1, ("generate", 1)),
        ("update_weights",),
        ("generate", 2),
        ("train", 2, ("generate", 2)),
        ("update_weights",),
    ]


def test_one_step_ahead_starts_the_next_rollout_before_training(recorded):
    loop.train(args(max_async_level=1))
    order = events(recorded, "generate", "train", "update_weights", "get")
    order = [e for e in order if e[0] != "get" or e[1] == "generate"]
    assert order[1:] == [
        ("generate", 0),
        ("get", "generate", 0),
        ("generate", 1),
        ("train", 0, ("generate", 0)),
        ("get", "generate", 1),
        ("update_weights",),
        ("generate", 2),
        ("train", 1, ("generate", 1)),
        ("get", "generate", 2),
        ("update_weights",),
        ("train", 2, ("generate", 2)),
        ("update_weights",),
    ]


@pytest.mark.parametrize("async_level", [0, 1])
def test_slimes_weight_check_compares_after_the_first_sync_before_any_rollout(recorded, async_level):
    loop.train(args(max_async_level=async_level, check_weight_update_equal=True))
    order = events(recorded, "update_weights", "check_weights", "generate")
    assert order[:3] == [("update_weights",), ("check_weights", "compare"), ("generate", 0)]
    assert events(recorded, "check_weights") == [("check_weights", "compare")]


def test_no_weight_check_unless_asked(recorded):
    loop.train(args())
    assert events(recorded, "check_weights") == []
