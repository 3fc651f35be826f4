"""Backends: where the outer loop runs. The core never imports slime, ray, megatron or sglang.

local  one machine: embedded inference workers behind the real sglang-router, a torch trainer
slime  a GPU cluster through slime (Ray + Megatron + SGLang), imported only when chosen
"""

from __future__ import annotations

from typing import Callable

from slime_meta.errors import UserInputError


def _local(config):
    from slime_meta.backends.local.run import run

    return run(config)


def _slime(config):
    # slime's flags (Megatron, SGLang, Ray placement) are not ours, so this backend takes the
    # command line, not a config: train.py hands `--backend slime` argv to the slime CLI first.
    raise UserInputError(
        "--backend slime parses its command line with slime's own parser: run it as "
        "`python train.py --backend slime ...` or `python -m slime_meta.backends.slime ...` "
        "(add --dry-run to see the plan without GPUs)"
    )


BACKENDS: dict[str, Callable] = {"local": _local, "slime": _slime}


def get_backend(name: str) -> Callable:
    return BACKENDS[name]
