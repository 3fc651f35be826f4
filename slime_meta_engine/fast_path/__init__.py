"""The fast decode path: the model's own forward over a preallocated KV cache, rows in slots, steps
replayed as CUDA graphs.

Modules, one concern each:
- `model_support`: which models the fast path runs (the Llama/Qwen2/Qwen3 family), and their shapes;
- `family_forward`: the decoder layers, shared by both cache layouts;
- `fused_weights`: q/k/v and gate/up as one weight each, the model's parameters views into them;
- `slot_batch`: what the static and the paged batch share: rows in slots, logits in row order;
- `decode_graphs`: captured decode graphs and their size buckets;
- `prefill_graphs`: captured prefills of a few prompts and their size buckets;
- `memory_budget`: `--mem-fraction-static`: the weights and the preallocated cache inside F of the GPU;
- `static/`: fixed slots of a preallocated cache (its cache, its forward, its batch);
- `paged/`: one pool of pages that rows take as their tokens arrive (its cache, its forward, its batch).
"""
