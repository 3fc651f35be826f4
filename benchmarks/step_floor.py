"""The physical floor of one outer step, and the step's time by phase, for benchmarks/step.py.

Floor: the step's arithmetic at the GPU's bf16 matmul rate, plus its sequential decode steps each
reading the weights once at the memory bandwidth. Nothing overlaps, nothing waits, every matmul
at peak: no schedule reaches it; it says how far the parts are from the hardware.

    floor_s = (train FLOPs + prefill FLOPs) / peak FLOP/s + decode steps x weight bytes / bandwidth
    P = decoder parameters (embedding excluded), L layers, d hidden size, V vocabulary
    train FLOPs = 2 x passes x (P x trained tokens + L x d x sum over sequences of T^2)
                  + 2 x (3 + reference) x d x V x response tokens
        passes = 3 (forward and backward) + 1 with layers recomputed + 1 with a reference forward
        (KL anchor, replay DPO); causal attention counted at half (2 L d T^2 per forward); the
        output projection on the response tokens only (the trainer projects no prompt token)
    prefill FLOPs = 2 x P x prefilled tokens + 2 x L x d x sum over requests of T^2 + 2 x d x V x requests
    decode steps = K x (student + teacher max new tokens) + student max new tokens (K inner rounds
        of student then teacher, then the holdout: dependent phases of at most that many tokens each)
    weight bytes = all parameters x bytes per parameter (bf16: 2)
The sum of T^2 over the trained sequences is taken as trained tokens^2 / sequences (equal
lengths: at most the true sum, so the floor stays a floor).
"""

from __future__ import annotations

from typing import Any

# The bf16 dense matmul rate measured on an H100 and an H200 (benchmarks/trainer.py: 781-790
# TFLOP/s; the datasheet's 989 is not reached), and each card's datasheet memory bandwidth.
DEFAULT_PEAK_TFLOPS = 790.0
BANDWIDTH_TBS = {"H200": 4.8, "H100": 3.35}
DEFAULT_BANDWIDTH_TBS = 3.35
TRAINER_PARTS = ("forward_backward", "reference_forward", "optimizer")


def parameter_counts(shape: dict) -> tuple[int, int]:
    """(decoder parameters, all parameters) of a Qwen2-shaped config: biases on q, k, v only."""
    d, layers, ffn = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    kv = d // shape["num_attention_heads"] * shape["num_key_value_heads"]
    attention = d * d + d + 2 * (d * kv + kv) + d * d
    per_layer = attention + 3 * d * ffn + 2 * d  # + two RMSNorm weights
    decoder = layers * per_layer + d  # + the final norm
    embedding = shape["vocab_size"] * d
    return decoder, decoder + embedding * (1 if shape.get("tie_word_embeddings") else 2)


def default_bandwidth_tbs(device_name: str) -> float:
    return next((tbs for name, tbs in BANDWIDTH_TBS.items() if name in device_name), DEFAULT_BANDWIDTH_TBS)


def physical_floor(
    shape: dict,
    per: dict,
    requests_by_step: list[list[dict]],
    *,
    recompute: bool,
    decode_steps: int,
    peak_tflops: float,
    bandwidth_tbs: float,
    bytes_per_param: int,
) -> dict[str, Any]:
    """The floor of one step (the module docstring), its parts and its inputs; `per`: the step's mean
    metrics, `requests_by_step`: each measured step's generation requests (their prompt ids)."""
    decoder, total = parameter_counts(shape)
    d, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    reference = per.get("perf/train_reference_forward_time", 0.0) > 0  # the trainer read a reference
    passes = 3 + int(recompute) + int(reference)
    tokens, sequences = per["train/tokens"], max(per.get("train/num_sequences", 1.0), 1.0)
    response_tokens = per.get("train/response_tokens", 0.0)
    train_flops = 2 * passes * (decoder * tokens + layers * d * tokens**2 / sequences)
    train_flops += 2 * (3 + int(reference)) * d * vocab * response_tokens
    prefill = [_prefill_flops(requests, decoder, layers, d, vocab) for requests in requests_by_step]
    prefill_flops = sum(prefill) / len(prefill) if prefill else 0.0
    peak = peak_tflops * 1e12
    out = {
        "formula": "(train FLOPs + prefill FLOPs) / peak FLOP/s + decode steps x weight bytes / bandwidth",
        "peak_tflops": peak_tflops,
        "bandwidth_tbs": bandwidth_tbs,
        "bytes_per_param": bytes_per_param,
        "decoder_params": decoder,
        "params": total,
        "train_passes": passes,
        "recompute": recompute,
        "reference_forward": reference,
        "train_flops": train_flops,
        "prefill_flops": prefill_flops,
        "decode_steps": decode_steps,
        "train_s": train_flops / peak,
        "prefill_s": prefill_flops / peak,
        "decode_s": decode_steps * total * bytes_per_param / (bandwidth_tbs * 1e12),
    }
    out["floor_s"] = out["train_s"] + out["prefill_s"] + out["decode_s"]
    out["step_vs_floor"] = per["perf/step_time"] / out["floor_s"] if out["floor_s"] else None
    return out


def _prefill_flops(requests: list[dict], decoder: int, layers: int, d: int, vocab: int) -> float:
    lengths = [len(r["ids"]) for r in requests]
    return 2 * decoder * sum(lengths) + 2 * layers * d * sum(t * t for t in lengths) + 2 * d * vocab * len(lengths)


def phase_breakdown(per: dict, prefill_s: float | None) -> dict[str, Any]:
    """The step's mean time by phase: each dependent phase of the rollout in order, the trainer's
    parts, the push, and idle (what none of them covers: the rollout's tail and bookkeeping, the
    trainer's host work between its parts). With `--max-async-level` >= 1 the next step's rollout
    runs during this step's training, so the parts add up to more than the step: `overlapped` is
    that excess (0 for a synchronous step) and `idle` is then 0. `prefill_replayed_s` is the step's
    prefills replayed on a fresh worker (inside the rollout's phases, not added to them)."""
    rollout = {
        key.removeprefix("perf/rollout_phase_").removesuffix("_time"): value
        for key, value in per.items()
        if key.startswith("perf/rollout_phase_") and not key.endswith("_chain_time")
    }
    order = sorted(rollout, key=_phase_order)
    trainer = {part: per.get(f"perf/train_{part}_time", 0.0) for part in TRAINER_PARTS}
    covered = sum(rollout.values()) + sum(trainer.values()) + per["perf/weight_push_time"]
    return {
        "rollout_phases": {name: rollout[name] for name in order},
        "prefill_replayed_s": prefill_s,
        "trainer": trainer,
        "push": per["perf/weight_push_time"],
        "idle": max(0.0, per["perf/step_time"] - covered),
        "overlapped": max(0.0, covered - per["perf/step_time"]),
        "step": per["perf/step_time"],
    }


def _phase_order(name: str) -> tuple:
    """student_0, teacher_0, student_1, ..., holdout: the order a chain runs them."""
    if name == "holdout" or not name.rpartition("_")[2].isdigit():
        return (1, 0, name)
    kind, _, iteration = name.rpartition("_")
    return (0, int(iteration), kind != "student")
