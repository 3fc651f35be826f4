"""The fast path over a paged KV cache: one pool of fixed-size pages every running row takes its tokens from.

Modules, one concern each:
- `cache`: the pool of pages and its bookkeeping;
- `model`: the forward over it, attention reading each row's pages in place;
- `batch`: the running batch: pages taken as tokens arrive, admission by pages.
"""
