"""The KV cache's name in a transformers model call: `cache` from transformers 5 on, `past_key_values` before.

transformers 5 renamed the forward argument and the output field; the old names still work there, but
each logs a deprecation (a FutureWarning naming `past_key_values`, and "`past_key_values`/`cache_params`
are deprecated"), which the demo printed on its console while building its model. The project supports
transformers from 4.56, where only the old name exists, so every call names the cache through here.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    # The forward's own signature: transformers' rename decorator keeps it (functools.wraps).
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands `cache` to `model`'s forward."""
    return {_cache_argument(type(model)): cache}


def cache_of(output: Any) -> Any:
    """The KV cache a forward returned (with use_cache=True)."""
    # `in` with the new name warns about nothing; the old name's attribute exists on transformers 4 only.
    return output["cache"] if "cache" in output else output.past_key_values
