"""The decode roofline of benchmarks/generation.py: served tokens/s against what the memory bandwidth allows.

A decode step reads every weight once and each row's keys and values at its context, so at R rows
in flight the step cannot take less than (weights + R x context x KV bytes per token) / bandwidth,
and the served rate cannot exceed R tokens per that time. The bandwidth is measured on the device
(a 1 GiB device-to-device copy, read + write).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def hbm_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), the best of 5."""
    source = torch.empty(1 << 29, dtype=torch.int16, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * source.nbytes / best


def decode_roofline(model_dir: Path, args: argparse.Namespace, report: dict, device: torch.device) -> dict:
    """Served tokens/s against rows x bandwidth / bytes per decode step (weights + rows' KV at mean context)."""
    config = json.loads((model_dir / "config.json").read_text())
    element = 2 if report["dtype"] in ("bfloat16", "float16") else 4
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_token = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * element
    context = args.prompt_len + args.new_tokens / 2
    bandwidth = hbm_bandwidth(device)
    bound = lambda rows: rows * bandwidth / (weights + rows * context * kv_token)  # noqa: E731
    sv = report["served"]
    figures = {str(args.concurrency): sv["concurrent"]["tokens_per_s"]}
    figures.update({k: v["tokens_per_s"] for k, v in sv["more_in_flight"].items()})
    return {
        "hbm_bytes_per_s": bandwidth,
        "weights_bytes": weights,
        "kv_bytes_per_token": kv_token,
        "by_in_flight": {
            k: {"served_tokens_per_s": v, "roofline_tokens_per_s": bound(int(k)), "share": v / bound(int(k))}
            for k, v in figures.items()
        },
    }
