"""On one GPU: the Megatron local layers' packed causal attention in one FlashAttention call
(`torch.nn.attention.varlen`) against the sequence-by-sequence reference, on a micro-batch shaped as
slime packs one (sequences of a rollout back to back, a padding segment to a multiple of 128).

Outputs and gradients of query, key and value are compared on the sequences (bf16: the largest
difference against the float32 reference is reported for both paths), and forward + backward is
timed for each path. Needs CUDA; installs nothing.

  python benchmarks/packed_attention_check.py --out benchmarks/results/packed_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from slime_meta.backends.slime.megatron_local import varlen_causal_attention


def reference(q_T_H_D, k_T_G_D, v_T_G_D, bounds: list[int]):
    """Sequence by sequence through scaled_dot_product_attention (the fallback path's arithmetic)."""
    groups = q_T_H_D.shape[1] // k_T_G_D.shape[1]
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q = q_T_H_D[start:end].transpose(0, 1)
        k = k_T_G_D[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        v = v_T_G_D[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1))
    return torch.cat(out)


def packed_lengths(total: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    lengths, used = [], 0
    while True:
        length = int(torch.randint(200, 1800, (1,), generator=generator))
        if used + length > total - 128:
            break
        lengths.append(length)
        used += length
    lengths.append(total - used)  # the padding segment, as slime appends it
    return lengths


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=9216, help="a micro-batch (--max-tokens-per-gpu)")
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    ns = parser.parse_args(argv)
    attend = varlen_causal_attention()
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "varlen_available": attend is not None}
    if attend is None:
        print(json.dumps(result))
        return 1
    lengths = packed_lengths(ns.tokens, seed=0)
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    shape_q, shape_kv = (ns.tokens, ns.heads, ns.head_dim), (ns.tokens, ns.kv_heads, ns.head_dim)
    q32, k32, v32 = (torch.randn(s, device="cuda") for s in (shape_q, shape_kv, shape_kv))
    grad_out = torch.randn(shape_q, device="cuda")

    def run(path, dtype):
        q, k, v = (t.detach().to(dtype).clone().requires_grad_() for t in (q32, k32, v32))
        if path == "varlen":
            o = attend(q, k, v, cu_seqlens, max(lengths), None)
        else:
            o = reference(q, k, v, bounds)
        o.backward(grad_out.to(dtype))
        return [x.float() for x in (o, q.grad, k.grad, v.grad)]

    exact = run("loop", torch.float32)
    report = {}
    for path in ("loop", "varlen"):
        got = run(path, torch.bfloat16)
        report[path] = {name: float((g - e).abs().max()) for name, g, e in zip(("out", "dq", "dk", "dv"), got, exact)}
        report[path]["fwd_bwd_ms"] = 1e3 * timed(lambda p=path: run(p, torch.bfloat16), ns.repeats)
    result.update(
        tokens=ns.tokens,
        sequences=len(lengths),
        heads=ns.heads,
        kv_heads=ns.kv_heads,
        head_dim=ns.head_dim,
        max_abs_error_vs_float32_reference=report,
        speedup=report["loop"]["fwd_bwd_ms"] / report["varlen"]["fwd_bwd_ms"],
    )
    # The one-call path may differ from the reference no more than bf16 arithmetic does on its own.
    worst = max(report["varlen"][k] / max(report["loop"][k], 1e-6) for k in ("out", "dq", "dk", "dv"))
    result["varlen_error_over_loop_error"] = worst
    result["ok"] = worst < 4.0
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
