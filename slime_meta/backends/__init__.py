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
    raise UserInputError(
        "--backend slime: the cluster backend is not part of this release yet; use --backend local "
        "(one machine, CPU or one GPU)"
    )


BACKENDS: dict[str, Callable] = {"local": _local, "slime": _slime}


def get_backend(name: str) -> Callable:
    return BACKENDS[name]
