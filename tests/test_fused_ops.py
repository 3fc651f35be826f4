"""kernels/layer_ops.py: each Triton kernel against its torch expression, and the decoders with and without them.

Kernel cases: hidden sizes 896, 576 and 1536 (Qwen2.5-0.5B, SmolLM2-135M, Qwen2.5-1.5B), query+kv heads
14+2, 9+3 and 12+2 of 64 and 128, FFN widths 4864, 8960 and 1000, 1, 3 and 64 rows, bf16 and float32
(float16 too on CUDA), inputs that are slices of wider tensors as the decoders pass them, and the
prefill's (rows, heads, cols, D) view of a (rows, cols, heads, D) product. What must hold (kernels/layer_ops.py
says why): the rotation and the residual add equal torch's bit for bit; SiLU-and-multiply too on CUDA
(under the interpreter numpy's exp stands in for expf: bf16 within one ulp in rare elements); RMSNorm
within one ulp of the model dtype before its weight (so two after it), in rare elements, and its weight
multiply rounded exactly as torch rounds it (output == weight * output with a weight of ones).

Then the decoders: with and without the kernels, the same greedy tokens (float32 under the interpreter,
bf16 through captured graphs on CUDA), and a decode step computes each residual add together with
the norm after it (2 x layers - 1 fused add+norm calls, 2 plain norms).

On CPU the kernels run through Triton's interpreter in a child process (TRITON_INTERPRET=1 must be set
before triton is imported, and must not leak into other tests); they skip where triton is not
installed. With CUDA they run compiled in this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_interpreter import run_interpreted

from slime_meta_engine.kernels import layer_ops

HAS_CUDA = torch.cuda.is_available()
TRITON_MISSING = importlib.util.find_spec("triton") is None
needs_triton = pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed (e.g. PYTHONPATH=/tmp/triton_site)")
needs_cuda_and_triton = pytest.mark.skipif(not HAS_CUDA or TRITON_MISSING, reason="needs CUDA and triton")

HIDDEN_SIZES = (896, 576, 1536)
HEAD_SHAPES = ((14, 2), (9, 3), (12, 2))  # (query heads, kv heads)
HEAD_DIMS = (64, 128)
FFN_WIDTHS = (4864, 8960, 1000)
ROWS = (1, 3, 64)
EPS = 1e-6
FAMILIES = ("rotary", "rotate_into_cache", "residual_add", "rms_norm", "rms_norm_weight", "silu_mul")
BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between a and b, elementwise."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(BITS_VIEW[t.dtype]).long()
        magnitude_mask = (1 << (8 * t.element_size() - 1)) - 1
        return torch.where(bits < 0, -(bits & magnitude_mask), bits)

    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return (ordered(a) - ordered(b)).abs()


def compare(kernel: torch.Tensor, reference: torch.Tensor) -> dict:
    distance = ulp_distance(kernel, reference)
    return {
        "elements": reference.numel(),
        "mismatches": int((distance > 0).sum()),
        "max_ulps": int(distance.max()) if distance.numel() else 0,
        "same_strides": kernel.stride() == reference.stride(),
    }


def wide_slice(generator: torch.Generator, rows: int, width: int, dtype, device, scale: float = 1.0) -> torch.Tensor:
    """(rows, width) values with rows of different magnitudes, as a slice of a wider tensor."""
    wide = torch.randn(rows, width + 24, generator=generator) * scale
    wide = wide * 10 ** (torch.rand(rows, 1, generator=generator) * 2 - 1)
    return wide.to(device=device, dtype=dtype)[:, 5 : 5 + width]


def op_results(device: str, dtypes: tuple[torch.dtype, ...]) -> dict[str, dict[str, dict]]:
    """Every case of every family: kernel against torch expression, {family: {case: compare(...)}}."""
    results: dict[str, dict[str, dict]] = {family: {} for family in FAMILIES}
    generator = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for hidden in HIDDEN_SIZES:
            weight_E = (torch.randn(hidden, generator=generator) * 0.3 + 1).to(device=device, dtype=dtype)
            ones_E = torch.ones(hidden, dtype=dtype, device=device)
            shapes = [(rows,) for rows in ROWS] + [(2, 5)]  # the last: prefill's (rows, cols, E)
            for shape in shapes:
                case = f"{name}-E{hidden}-{'x'.join(map(str, shape))}"
                rows = shape[0] * (shape[1] if len(shape) > 1 else 1)
                x = wide_slice(generator, rows, hidden, dtype, device)
                delta = wide_slice(generator, rows, hidden, dtype, device)
                if len(shape) > 1:
                    x, delta = x.contiguous().view(*shape, hidden), delta.contiguous().view(*shape, hidden)
                normed = layer_ops.rms_norm(x, weight_E, EPS, use_kernel=True)
                results["rms_norm"][case] = compare(normed, layer_ops.rms_norm(x, weight_E, EPS, use_kernel=False))
                unscaled = layer_ops.rms_norm(x, ones_E, EPS, use_kernel=True)
                results["rms_norm"][case + "-ones"] = compare(
                    unscaled, layer_ops.rms_norm(x, ones_E, EPS, use_kernel=False)
                )
                results["rms_norm_weight"][case] = compare(normed, weight_E * unscaled)
                total, normed_total = layer_ops.add_rms_norm(x, delta, weight_E, EPS, use_kernel=True)
                total_ref, normed_total_ref = layer_ops.add_rms_norm(x, delta, weight_E, EPS, use_kernel=False)
                results["residual_add"][case] = compare(total, total_ref)
                results["rms_norm"][case + "-after-add"] = compare(normed_total, normed_total_ref)
        for heads, kv_heads in HEAD_SHAPES:
            for head_dim in HEAD_DIMS:
                width = heads + 2 * kv_heads
                for rows in ROWS:
                    case = f"{name}-H{heads}+{kv_heads}-D{head_dim}-R{rows}"
                    # decode: queries and keys side by side in the (rows, H + 2K, D) q/k/v product
                    qkv = torch.randn(rows, width, head_dim, generator=generator).to(device=device, dtype=dtype)
                    cos_B_1_D = torch.randn(rows, 1, head_dim, generator=generator).to(device=device, dtype=dtype)
                    sin_B_1_D = torch.randn(rows, 1, head_dim, generator=generator).to(device=device, dtype=dtype)
                    x = qkv[:, : heads + kv_heads]
                    results["rotary"][case] = compare(
                        layer_ops.rotary(x, cos_B_1_D, sin_B_1_D, use_kernel=True),
                        layer_ops.rotary(x, cos_B_1_D, sin_B_1_D, use_kernel=False),
                    )
                    # decode over a paged layer: the rotation and both cache writes, at scattered slots
                    keys_X_K_D = torch.randn(80, kv_heads, head_dim, generator=generator).to(device=device, dtype=dtype)
                    values_X_K_D = torch.randn(80, kv_heads, head_dim, generator=generator).to(
                        device=device, dtype=dtype
                    )
                    slots_B = torch.randperm(80, generator=generator)[:rows].to(device)
                    cached = {}
                    for use_kernel in (True, False):
                        keys, values = keys_X_K_D.clone(), values_X_K_D.clone()
                        q = layer_ops.rotate_into_cache(
                            qkv, cos_B_1_D, sin_B_1_D, keys, values, slots_B, heads, use_kernel=use_kernel
                        )
                        cached[use_kernel] = (q.new_empty(q.shape).copy_(q), keys, values)  # strides aside
                    for part, kernel, reference in zip(("q", "keys", "values"), cached[True], cached[False]):
                        results["rotate_into_cache"][f"{case}-{part}"] = compare(kernel, reference)
                    if rows > 3:
                        continue
                    # prefill: (rows, cols, H + 2K, D) seen as (rows, heads, cols, D), cos/sin per column
                    columns = 7
                    qkv = torch.randn(rows, columns, width, head_dim, generator=generator)
                    qkv = qkv.to(device=device, dtype=dtype).transpose(1, 2)
                    cos_C_D = torch.randn(columns, head_dim, generator=generator).to(device=device, dtype=dtype)
                    sin_C_D = torch.randn(columns, head_dim, generator=generator).to(device=device, dtype=dtype)
                    for part, x in (("q", qkv[:, :heads]), ("k", qkv[:, heads : heads + kv_heads])):
                        results["rotary"][f"{case}-prefill-{part}"] = compare(
                            layer_ops.rotary(x, cos_C_D, sin_C_D, use_kernel=True),
                            layer_ops.rotary(x, cos_C_D, sin_C_D, use_kernel=False),
                        )
        for ffn in FFN_WIDTHS:
            for shape in [(rows,) for rows in ROWS] + [(2, 3)]:
                case = f"{name}-F{ffn}-{'x'.join(map(str, shape))}"
                rows = shape[0] * (shape[1] if len(shape) > 1 else 1)
                gate_up = wide_slice(generator, rows, 2 * ffn, dtype, device, scale=3.0)
                if len(shape) > 1:
                    gate_up = gate_up.contiguous().view(*shape, 2 * ffn)
                results["silu_mul"][case] = compare(
                    layer_ops.silu_mul(gate_up, use_kernel=True), layer_ops.silu_mul(gate_up, use_kernel=False)
                )
    return results


def failures(results: dict[str, dict], family: str, compiled: bool) -> list[str]:
    """The cases of `family` that break what kernels/layer_ops.py promises, described."""
    bad = []
    for case, result in results[family].items():
        half = not case.startswith("float32")
        exact = family in ("rotary", "rotate_into_cache", "residual_add", "rms_norm_weight") or (
            family == "silu_mul" and compiled
        )
        if exact:
            ok = result["mismatches"] == 0
        elif half:  # one ulp before the weight (two after it), in rare elements
            ulps = 1 if case.endswith("-ones") or family == "silu_mul" else 2
            ok = result["max_ulps"] <= ulps and result["mismatches"] <= max(2, result["elements"] // 500)
        else:  # float32: rounding of a different summation order or exp
            ok = result["max_ulps"] <= 8
        ok = ok and result["same_strides"]
        if not ok:
            bad.append(f"{family}/{case}: {result}")
    return bad


# ----- the decoders with and without the kernels ------------------------------------------------


def qwen2_model(kind: str, dtype: torch.dtype, device: str, layers: int = 3):
    """A random Qwen2 with 0.5B's attention shape (14 heads over 2 of 64) or a small Llama (6 over 2
    of 16, llama3 rope, q/k/v and MLP biases), `layers` layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if kind == "qwen2":
        config = Qwen2Config(
            vocab_size=300,
            hidden_size=896,
            intermediate_size=1000,
            num_hidden_layers=layers,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.05,
            tie_word_embeddings=True,
        )
    else:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        config = LlamaConfig(
            vocab_size=300,
            hidden_size=96,
            intermediate_size=136,
            num_hidden_layers=layers,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.2,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_parameters=rope,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return model


def greedy_both_ways(model, prompt_lengths: list[int], steps: int, graphs: bool, chunk_tokens: int | None = None):
    """Prefill random prompts and decode `steps` greedy tokens with the kernels and without, each
    path on its own tokens. Returns (tokens with, tokens without, largest logit difference over the
    largest logit while the tokens agree)."""
    from slime_meta_engine.fast_path.decode_graphs import DecodeGraphs
    from slime_meta_engine.fast_path.model_support import model_shape
    from slime_meta_engine.fast_path.static.cache import StaticKVCache
    from slime_meta_engine.fast_path.static.model import StaticDecoder

    shape, rows = model_shape(model), len(prompt_lengths)
    generator = torch.Generator().manual_seed(5)
    prompts_N_L = torch.randint(3, 300, (rows, max(prompt_lengths)), generator=generator).to(shape.device)
    lengths_N = torch.tensor(prompt_lengths, device=shape.device)
    tokens, last_logits = {}, {}
    for fused in (True, False):
        cache = StaticKVCache.allocate(shape, num_slots=rows, capacity=256)
        decoder = StaticDecoder(model, cache, fused_kernels=fused)
        stepper = DecodeGraphs(decoder, use_graphs=graphs)
        with torch.inference_mode():
            logits_B_V = decoder.prefill(prompts_N_L, lengths_N, torch.arange(rows, device=shape.device), chunk_tokens)
            positions, picked, seen = list(prompt_lengths), [], []
            for _ in range(steps):
                picked.append(logits_B_V.float().argmax(-1).tolist())
                seen.append(logits_B_V.float().cpu())
                logits_B_V = stepper.step(picked[-1], positions)[:rows].clone()
                positions = [position + 1 for position in positions]
        tokens[fused], last_logits[fused] = picked, seen
    difference = 0.0
    for step, (with_kernels, without) in enumerate(zip(last_logits[True], last_logits[False])):
        if tokens[True][:step] != tokens[False][:step]:  # the inputs differ from here on
            break
        difference = max(difference, float((with_kernels - without).abs().max() / without.abs().max()))
    return tokens[True], tokens[False], difference


def paged_greedy_both_ways(model, prompt_lengths: list[int], steps: int) -> tuple[list, list]:
    """The same over a paged cache of 4-token pages (eager): greedy tokens with the kernels and without."""
    from slime_meta_engine.fast_path.model_support import model_shape
    from slime_meta_engine.fast_path.paged.cache import PagedKVCache
    from slime_meta_engine.fast_path.paged.model import PagedDecoder

    shape, rows, page_size, row_tokens = model_shape(model), len(prompt_lengths), 4, 64
    pages_per_row = row_tokens // page_size
    generator = torch.Generator().manual_seed(5)
    prompts_N_L = torch.randint(3, 300, (rows, max(prompt_lengths)), generator=generator).to(shape.device)
    lengths_N = torch.tensor(prompt_lengths, device=shape.device)
    tokens = {}
    for fused in (True, False):
        cache = PagedKVCache.allocate(shape, num_pages=1 + rows * pages_per_row, page_size=page_size)
        decoder = PagedDecoder(model, cache, num_rows=rows, max_row_tokens=row_tokens, fused_kernels=fused)
        # Row r's pages, in an order that is not the rows': page 0 is the scratch page.
        pages = 1 + torch.randperm(rows * pages_per_row, generator=generator).view(rows, pages_per_row)
        decoder.page_table_R_M[:, :pages_per_row] = pages.to(shape.device)
        with torch.inference_mode():
            logits_B_V = decoder.prefill(prompts_N_L, lengths_N, torch.arange(rows, device=shape.device))
            positions_B, picked = lengths_N.clone(), []
            for _ in range(steps):
                picked.append(logits_B_V.float().argmax(-1).tolist())
                write_pages_B = decoder.page_table_R_M[torch.arange(rows), positions_B // page_size]
                token_ids_B = torch.tensor(picked[-1], device=shape.device)
                logits_B_V = decoder.decode(token_ids_B, positions_B, write_pages_B, row_tokens)
                positions_B = positions_B + 1
        tokens[fused] = picked
    return tokens[True], tokens[False]


def count_norm_calls(monkeypatch, decoder, step) -> dict[str, int]:
    calls = {"rms_norm": 0, "add_rms_norm": 0}
    for name in calls:
        original = getattr(layer_ops, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(layer_ops, name, counted)
    step()
    return calls


# ----- the child process under Triton's interpreter ----------------------------------------------


def interpreted_results() -> dict:
    """What `_interpreted_main` prints, run in a child with TRITON_INTERPRET=1 (once a session)."""
    return run_interpreted(__file__)


def _interpreted_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    decoding = {}
    for kind in ("qwen2", "llama"):
        with_kernels, without, difference = greedy_both_ways(
            qwen2_model(kind, torch.float32, "cpu", layers=2), [3, 9, 6], 5, graphs=False, chunk_tokens=12
        )
        decoding[kind] = {"with": with_kernels, "without": without, "difference": difference}
        with_kernels, without = paged_greedy_both_ways(qwen2_model(kind, torch.float32, "cpu", layers=2), [3, 9, 6], 5)
        decoding[f"paged-{kind}"] = {"with": with_kernels, "without": without}
    results = op_results("cpu", (torch.bfloat16, torch.float32))
    print(json.dumps({"ops": results, "decoding": decoding}))


# ----- tests ---------------------------------------------------------------------------------


@pytest.fixture
def no_cudnn_attention():
    """As in the worker: cuDNN's attention plans anew for every KV length."""
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(previous)


@needs_triton
@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_match_torch_interpreted(family: str) -> None:
    results = interpreted_results()["ops"]
    assert results[family], family
    bad = failures(results, family, compiled=False)
    assert not bad, "\n".join(bad)


@needs_triton
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_decoder_with_kernels_gives_the_same_tokens_interpreted(kind: str) -> None:
    result = interpreted_results()["decoding"][kind]
    assert result["with"] == result["without"]
    assert result["difference"] < 1e-5


@needs_triton
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_paged_decoder_with_kernels_gives_the_same_tokens_interpreted(kind: str) -> None:
    result = interpreted_results()["decoding"][f"paged-{kind}"]
    assert result["with"] == result["without"] and len(result["with"]) == 5


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_paged_decoder_with_kernels_gives_the_same_tokens_on_cuda(kind: str, no_cudnn_attention) -> None:
    with_kernels, without = paged_greedy_both_ways(qwen2_model(kind, torch.bfloat16, "cuda"), [3, 16, 40, 5, 1, 9], 20)
    assert with_kernels == without


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_match_torch_on_cuda(family: str) -> None:
    results = op_results("cuda", (torch.bfloat16, torch.float16, torch.float32))
    bad = failures(results, family, compiled=True)
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_static_decoder_graphs_give_the_same_tokens_on_cuda(kind: str, no_cudnn_attention) -> None:
    """bf16 through captured graphs: greedy tokens with the kernels equal those without."""
    model = qwen2_model(kind, torch.bfloat16, "cuda")
    with_kernels, without, difference = greedy_both_ways(model, [3, 16, 40, 70, 5, 1, 33, 9], 40, graphs=True)
    assert with_kernels == without
    assert difference < 2e-2


def test_decode_step_fuses_each_residual_add_with_the_next_norm(monkeypatch) -> None:
    """No triton needed: the forward's structure is the same with the torch expressions."""
    from slime_meta_engine.fast_path.model_support import model_shape
    from slime_meta_engine.fast_path.static.cache import StaticKVCache
    from slime_meta_engine.fast_path.static.model import StaticDecoder

    model = qwen2_model("llama", torch.float32, "cpu", layers=3)
    cache = StaticKVCache.allocate(model_shape(model), num_slots=2, capacity=32)
    decoder = StaticDecoder(model, cache)
    assert decoder.fused_kernels is False  # the CPU keeps the torch expressions
    with torch.inference_mode():
        calls = count_norm_calls(
            monkeypatch, decoder, lambda: decoder.decode(torch.tensor([5, 7]), torch.tensor([0, 0]), 32)
        )
    assert calls == {"rms_norm": 2, "add_rms_norm": 2 * 3 - 1}
    assert decoder._normed_ahead is None


def test_kernel_switch_and_refusals(monkeypatch) -> None:
    """No triton needed: when the decoders use the kernels, and what they refuse."""
    from slime_meta_engine.fast_path.model_support import model_shape
    from slime_meta_engine.fast_path.static.cache import StaticKVCache
    from slime_meta_engine.fast_path.static.model import StaticDecoder

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not layer_ops.kernels_by_default(torch.device("cpu"), torch.float32)
    assert "CUDA" in layer_ops.kernels_unavailable_reason(torch.device("cpu"), torch.float32)
    assert "dtype" in layer_ops.kernels_unavailable_reason(torch.device("cuda"), torch.float64)
    monkeypatch.setenv(layer_ops.SWITCH_ENV, "0")
    assert not layer_ops.kernels_by_default(torch.device("cuda"), torch.bfloat16)
    monkeypatch.delenv(layer_ops.SWITCH_ENV)
    if not TRITON_MISSING:
        assert layer_ops.kernels_by_default(torch.device("cuda"), torch.bfloat16)
    model = qwen2_model("llama", torch.float32, "cpu", layers=1)
    cache = StaticKVCache.allocate(model_shape(model), num_slots=1, capacity=16)
    with pytest.raises(ValueError, match="fused kernels cannot run.*TRITON_INTERPRET"):
        StaticDecoder(model, cache, fused_kernels=True)


def test_torch_expressions_are_the_decoders_previous_ones() -> None:
    """No triton needed: without the kernels each function is its torch expression, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 40, generator=generator).to(torch.bfloat16)
    weight = torch.randn(40, generator=generator).to(torch.bfloat16)
    expected = weight * torch.nn.functional.rms_norm(x.float(), (40,), eps=EPS).to(torch.bfloat16)
    assert torch.equal(layer_ops.rms_norm(x, weight, EPS, use_kernel=False), expected)
    total, normed = layer_ops.add_rms_norm(x, x.flip(0), weight, EPS, use_kernel=False)
    assert torch.equal(total, x + x.flip(0))
    assert torch.equal(normed, layer_ops.rms_norm(x + x.flip(0), weight, EPS, use_kernel=False))
    cos, sin = x[0, :1], x[1, :1]
    rotated = layer_ops.rotary(x, cos, sin, use_kernel=False)
    assert torch.equal(rotated, x * cos + torch.cat((x[..., 20:], x[..., :20]), -1) * sin)
    gate, up = x[..., :20], x[..., 20:]
    assert torch.equal(layer_ops.silu_mul(x, use_kernel=False), torch.nn.functional.silu(gate) * up)


def test_decode_step_benchmark_quick(tmp_path) -> None:
    """benchmarks/decode_step.py --quick runs on CPU and writes its JSON (no timing checked)."""
    out = tmp_path / "decode_step.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_step.py"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, str(script), "--quick", "--out", str(out)]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip().splitlines()[-1] == f"json: {out}"
    report = json.loads(out.read_text())
    assert report["date"] and report["command"] and report["machine"]
    assert [(row["fused"], row["rows"]) for row in report["results"]] == [(False, 1), (False, 3)]
    assert all(row["step_us"] > 0 and row["fused_kernels_used"] is False for row in report["results"])
    assert "CUDA" in report["fused_skipped"]


def test_decode_loop_benchmark_quick(tmp_path) -> None:
    """benchmarks/decode_loop.py --quick serves every request its tokens on the CPU, splits a step,
    profiles the host and times a prefill (no timing checked beyond the split adding up)."""
    out = tmp_path / "decode_loop.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_loop.py"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [row["rows"] for row in report["results"]] == [1, 3]
    for row in report["results"]:
        assert row["decode_steps"] >= 7 and row["replay_us"] is None  # 8 tokens: the first from the prefill
        assert row["engine_step_us"] == pytest.approx(row["sampling_us"] + row["host_us"])
        assert row["sampling_kernel"] is False and row["host_profile"]
        # The prefill figures: one prefill of the row count's prompts, timed and host-profiled.
        assert row["engine_prefill_ms"] > 0 and row["prefill_ms"] > 0
        assert row["prefill_tokens_per_s"] == pytest.approx(row["rows"] * 16 / (row["prefill_ms"] * 1e-3))
        assert any("prefill" in entry["function"] for entry in row["prefill_host_profile"])


if __name__ == "__main__":
    _interpreted_main()
