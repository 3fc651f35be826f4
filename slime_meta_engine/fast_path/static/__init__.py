"""The fast path over a static KV cache: one preallocated slot of fixed length per running row.

Modules, one concern each:
- `cache`: the preallocated slot KV cache and the capacity it is sized to;
- `model`: the forward over it;
- `batch`: the running batch: slots, prefill into slots, graph decode; and which batch the engine gets.
"""
