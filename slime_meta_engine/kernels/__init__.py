"""The engine's Triton kernels. Triton is imported on first use only, so the CPU path never needs it:
`layer_ops` and `paged_attention` import it inside their functions, and the two modules that import
it at their top are imported by their callers on first use.

Modules, one concern each:
- `layer_ops`: a decoder layer's element-wise steps (norms, rotation, gated activation) as one
  kernel each, their torch expressions elsewhere;
- `layer_triton`: the Triton kernels of `layer_ops` (importing it imports triton);
- `sampling_triton`: the Triton kernels of the sampler's token choice (importing it imports triton);
- `paged_attention`: decode attention that reads the paged KV cache in place.
"""
