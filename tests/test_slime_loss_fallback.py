"""When the loss plugin computes log-probs itself instead of through slime's Megatron code.

Only a missing slime or Megatron (a CPU machine) lets it use its single-rank torch path, and it
says so once, with the import error; under tensor or context parallelism that path would read
one vocabulary shard, so it is refused with the import error. Any other import error inside
slime's modules is raised as it is, not hidden behind the fallback.

slime's Megatron backend cannot be installed here: the `slime` packages below are stand-ins
written to a temporary directory (fakes, named as such), each with one way its import can go.
The real slime and Megatron are hidden from these tests (an import finder that says they are not
installed), so they test the same thing where slime's source is on the path.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys

import pytest
import torch
from test_slime_loss import slime_args, slime_batch, sum_of_sample_mean

from slime_meta.backends.slime import loss as slime_loss

FAKE_LOSS_MODULES = {
    "working": (
        "def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths, "
        "with_entropy, **kwargs):\n"
        "    import torch\n"
        "    log_probs = [torch.full((int(r),), -0.5) for r in response_lengths]\n"
        "    return None, {'log_probs': log_probs, 'entropy': [torch.zeros(int(r)) for r in response_lengths]}\n"
        "def get_rollout_top_p_logprob_kwargs(args, batch):\n"
        "    return {}\n"
    ),
    "megatron_not_installed": "import megatron.core\n",
    "dependency_missing": "import transformer_engine_of_a_broken_install\n",
    "renamed_function": "def get_log_probs_and_entropy(*args, **kwargs):\n    raise AssertionError\n",
}


class NotInstalled(importlib.abc.MetaPathFinder):
    """Imports of the `hidden` top-level packages fail as they do where the package is not installed."""

    def __init__(self, *hidden: str):
        self.hidden = set(hidden)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _loaded(top: str) -> list[str]:
    return [m for m in sys.modules if m == top or m.startswith(top + ".")]


@pytest.fixture
def fake_slime(tmp_path, monkeypatch):
    """slime and Megatron not installed, whatever this machine has; `install(kind)` then puts a
    stand-in `slime` whose megatron_utils.loss is one of FAKE_LOSS_MODULES on the path."""
    not_installed = NotInstalled("slime", "megatron")
    monkeypatch.setattr(sys, "meta_path", [not_installed, *sys.meta_path])

    def install(kind: str) -> None:
        package = tmp_path / kind / "slime" / "backends" / "megatron_utils"
        package.mkdir(parents=True)
        for directory in (package, package.parent, package.parent.parent):
            (directory / "__init__.py").write_text("")
        (package / "loss.py").write_text(FAKE_LOSS_MODULES[kind])
        monkeypatch.syspath_prepend(str(tmp_path / kind))
        not_installed.hidden.discard("slime")  # the stand-in, first on the path; Megatron stays absent

    for name in _loaded("slime") + _loaded("megatron"):
        monkeypatch.delitem(sys.modules, name)
    slime_loss.slime_log_prob_functions.cache_clear()
    slime_loss._warn_single_rank.cache_clear()
    yield install
    for name in _loaded("slime") + _loaded("megatron"):
        del sys.modules[name]
    slime_loss.slime_log_prob_functions.cache_clear()
    slime_loss._warn_single_rank.cache_clear()


def test_without_slime_one_rank_works_and_says_why_once(fake_slime, caplog):
    batch, logits = slime_batch()
    with caplog.at_level(logging.WARNING, logger=slime_loss.__name__):
        for _ in range(2):
            loss, _ = slime_loss.meta_loss(slime_args(), batch, logits, sum_of_sample_mean(batch))
    assert torch.isfinite(loss)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No module named 'slime'" in warnings[0] and "one rank" in warnings[0]


@pytest.mark.parametrize("sizes", [dict(tensor_model_parallel_size=2), dict(context_parallel_size=2)])
def test_without_slime_tensor_or_context_parallel_is_refused_with_the_reason(fake_slime, sizes):
    batch, logits = slime_batch()
    with pytest.raises(NotImplementedError) as refused:
        slime_loss.meta_loss(slime_args(**sizes), batch, logits, sum_of_sample_mean(batch))
    message = str(refused.value)
    assert "slime's log-probs do not import (No module named 'slime')" in message
    assert "tensor and context parallel size 1" in message


def test_slime_without_megatron_is_a_cpu_machine_too(fake_slime):
    fake_slime("megatron_not_installed")
    batch, logits = slime_batch()
    slime_loss.meta_loss(slime_args(), batch, logits, sum_of_sample_mean(batch))  # one rank: allowed
    with pytest.raises(NotImplementedError, match="No module named 'megatron'"):
        slime_loss.meta_loss(slime_args(tensor_model_parallel_size=4), batch, logits, sum_of_sample_mean(batch))


@pytest.mark.parametrize(
    "kind, error", [("dependency_missing", ModuleNotFoundError), ("renamed_function", ImportError)]
)
def test_a_real_import_error_inside_slime_is_raised_not_hidden(fake_slime, kind, error):
    fake_slime(kind)
    batch, logits = slime_batch()
    with pytest.raises(error) as raised:  # before: the single-rank path, silently
        slime_loss.meta_loss(slime_args(), batch, logits, sum_of_sample_mean(batch))
    assert "transformer_engine_of_a_broken_install" in str(raised.value) or "get_rollout_top_p" in str(raised.value)


def test_slime_is_absent_within_these_tests_even_where_it_is_on_the_path(fake_slime, tmp_path, monkeypatch):
    """A `slime` package on sys.path (as where slime's source is checked out) is not found."""
    real = tmp_path / "on-path" / "slime"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(real.parent))
    with pytest.raises(ModuleNotFoundError, match="No module named 'slime'"):
        __import__("slime")
    assert slime_loss.slime_log_prob_functions()[0] is None


def test_slimes_own_log_probs_are_used_where_they_import(fake_slime, caplog):
    fake_slime("working")
    batch, logits = slime_batch()
    with caplog.at_level(logging.WARNING, logger=slime_loss.__name__):
        log_probs, _ = slime_loss.response_log_probs(slime_args(tensor_model_parallel_size=2), batch, logits)
    assert all(torch.equal(lp, torch.full_like(lp, -0.5)) for lp in log_probs) and not caplog.records
