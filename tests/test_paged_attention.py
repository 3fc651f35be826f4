"""Decode attention over the paged KV cache in place (kernels/paged_attention.py) and its use in PagedDecoder.

The kernel against attention in float64 over each row's tokens gathered by hand: pages in scrambled
order, every cache slot that no row may read set to NaN (so any read past a row's length or outside
its pages shows), lengths around page boundaries (1, S-1, S, S+1, long), grouped heads of 7, 6 and
3 per kv head, heads of 64 and 128, pages of 16 and 1 tokens, and split counts up to more splits
than a short row has pages. Then PagedDecoder decoding with the kernel and with the gather path
from the same cache: logits close and the same greedy tokens at every step.

On CPU these run through Triton's interpreter, in a child process (TRITON_INTERPRET=1 must be set
before triton is imported, and must not leak into other tests); its bf16 dot multiplies raw bits,
so bf16 is checked on CUDA only. They skip where triton is not installed. With CUDA the kernel
runs compiled, in this process, bf16 and longer rows included, and the decoders also through
captured graphs (fast_path/decode_graphs.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import asdict, dataclass

import pytest
import torch
from helpers_interpreter import run_interpreted

from slime_meta_engine.fast_path.paged.cache import PagedKVCache
from slime_meta_engine.fast_path.paged.model import PagedDecoder
from slime_meta_engine.kernels.paged_attention import (
    choose_num_splits,
    paged_attention_unavailable_reason,
    paged_decode_attention,
)

HAS_CUDA = torch.cuda.is_available()
TRITON_MISSING = importlib.util.find_spec("triton") is None
needs_triton = pytest.mark.skipif(TRITON_MISSING, reason="triton is not installed")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# ||kernel - reference|| / ||reference||: float32 stays at rounding; half types round the weights
# of the value product (as flash attention does) and the output.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.5e-2}


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    lengths: tuple[int, ...]
    splits: int | None  # None: the kernel's own choice
    dtype: str = "float32"


def _cases(name, heads, kv_heads, head_dim, page_size, lengths, splits, dtype="float32") -> list[Case]:
    return [Case(f"{name}-{dtype}-s{n}", heads, kv_heads, head_dim, page_size, lengths, n, dtype) for n in splits]


# Small enough for the interpreter: the whole set runs in a few seconds there.
INTERPRETED_CASES = [
    *_cases("qwen0.5b-S16", 14, 2, 64, 16, (1, 15, 16, 17, 100), (None, 1, 3, 8)),
    *_cases("qwen1.5b-S16", 12, 2, 128, 16, (1, 15, 16, 17, 70), (1, 4)),
    *_cases("smollm-S1", 9, 3, 64, 1, (1, 2, 5, 40), (1, 3, 16)),
    *_cases("qwen0.5b-S16", 14, 2, 64, 16, (1, 17, 100), (3,), "float16"),
]
CUDA_CASES = [
    *INTERPRETED_CASES,
    *_cases("qwen0.5b-S16-long", 14, 2, 64, 16, (1, 15, 16, 17, 300, 1000, 4400), (None, 1, 5, 64), "bfloat16"),
    *_cases("qwen1.5b-S16-long", 12, 2, 128, 16, (1, 16, 17, 300, 4400), (None, 7), "bfloat16"),
    *_cases("smollm-S1-long", 9, 3, 64, 1, (1, 2, 700), (None, 32), "bfloat16"),
    *_cases("qwen1.5b-S16-long", 12, 2, 128, 16, (1, 17, 2000), (None, 3), "float16"),
]


def scrambled_cache(case: Case, device: str, seed: int):
    """q, keys, values, page table and lengths: each row's pages at random places in the pool, one
    spare page-table column, and every slot outside the rows' tokens (scratch page 0, the tail of a
    row's last page, unused pages) NaN."""
    generator = torch.Generator().manual_seed(seed)
    rows, size = len(case.lengths), case.page_size
    width = max(-(-length // size) for length in case.lengths) + 1
    num_pages = rows * width + 3
    shape = (num_pages, size, case.kv_heads, case.head_dim)
    keys_P_S_K_D = torch.randn(shape, generator=generator)
    values_P_S_K_D = torch.randn(shape, generator=generator)
    table_B_M = (torch.randperm(num_pages - 1, generator=generator)[: rows * width] + 1).view(rows, width)
    readable_P_S = torch.zeros(num_pages, size, dtype=torch.bool)
    for row, length in enumerate(case.lengths):
        tokens_T = torch.arange(length)
        readable_P_S[table_B_M[row, tokens_T // size], tokens_T % size] = True
        table_B_M[row, -(-length // size) :] = 0  # unused entries point at the scratch page
    keys_P_S_K_D[~readable_P_S] = float("nan")
    values_P_S_K_D[~readable_P_S] = float("nan")
    q_B_H_D = torch.randn(rows, case.heads, case.head_dim, generator=generator)
    dtype = DTYPES[case.dtype]
    tensors = (q_B_H_D, keys_P_S_K_D, values_P_S_K_D)
    q_B_H_D, keys_P_S_K_D, values_P_S_K_D = (t.to(device=device, dtype=dtype) for t in tensors)
    lengths_B = torch.tensor(case.lengths, dtype=torch.int64, device=device)
    return q_B_H_D, keys_P_S_K_D, values_P_S_K_D, table_B_M.to(device), lengths_B


def reference_attention(q_B_H_D, keys_P_S_K_D, values_P_S_K_D, table_B_M, lengths_B, scale) -> torch.Tensor:
    """Each row's tokens gathered one by one, softmax over them in float64; (B, H x D)."""
    rows, heads, head_dim = q_B_H_D.shape
    size, kv_heads = keys_P_S_K_D.shape[1], keys_P_S_K_D.shape[2]
    out = []
    for row in range(rows):
        tokens_T = torch.arange(int(lengths_B[row]))
        pages_T, slots_T = table_B_M[row].cpu()[tokens_T // size], tokens_T % size
        keys_T_K_D = keys_P_S_K_D.cpu().double()[pages_T, slots_T]
        values_T_K_D = values_P_S_K_D.cpu().double()[pages_T, slots_T]
        q_K_G_D = q_B_H_D[row].cpu().double().view(kv_heads, heads // kv_heads, head_dim)
        weights_K_G_T = (torch.einsum("kgd,tkd->kgt", q_K_G_D, keys_T_K_D) * scale).softmax(-1)
        out.append(torch.einsum("kgt,tkd->kgd", weights_K_G_T, values_T_K_D).reshape(heads * head_dim))
    return torch.stack(out)


def kernel_error(case: Case, device: str, seed: int = 0) -> float:
    """||kernel - reference|| / ||reference|| (inf when the kernel wrote a non-finite value)."""
    q, keys, values, table, lengths = scrambled_cache(case, device, seed)
    scale = case.head_dim**-0.5
    out_B_HD = paged_decode_attention(q, keys, values, table, lengths, scale, num_splits=case.splits)
    assert out_B_HD.dtype == q.dtype and out_B_HD.shape == (len(case.lengths), case.heads * case.head_dim)
    if not bool(torch.isfinite(out_B_HD).all()):
        return float("inf")
    reference_B_HD = reference_attention(q, keys, values, table, lengths, scale)
    return float((out_B_HD.cpu().double() - reference_B_HD).norm() / reference_B_HD.norm())


# ----- decoding with PagedDecoder, kernel against gather ---------------------------------------


def qwen2_model(dtype: torch.dtype, device: str):
    """A random 2-layer Qwen2 with Qwen2.5-0.5B's attention shape: 14 query heads over 2 kv heads of 64."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=14 * 64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.05,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return model


def decode_both_ways(
    model, prompt_lengths: list[int], steps: int, page_size: int, graphs: bool, reference_model=None
) -> dict:
    """Prefill random prompts into scrambled pages and decode `steps` tokens with the kernel and with
    the gather path in lockstep. With `reference_model` (a float32 copy of `model`) a third decoder
    runs it on the gather path and leads; else the gather path leads: every decoder is fed the
    leader's greedy token. Per path: the largest logit difference from the leader over the leader's
    largest logit, and the (step, row) pairs whose greedy token differs from the leader's."""
    from slime_meta_engine.fast_path.decode_graphs import DecodeGraphs
    from slime_meta_engine.fast_path.model_support import model_shape

    shape, rows = model_shape(model), len(prompt_lengths)
    max_row_tokens = 256
    pages_per_row = -(-max_row_tokens // page_size)
    generator = torch.Generator().manual_seed(3)
    table_R_M = (torch.randperm(rows * pages_per_row, generator=generator) + 1).view(rows, pages_per_row)
    paths = [("kernel", model, "kernel"), ("gather", model, "gather")]
    if reference_model is not None:
        paths.append(("reference", reference_model, "gather"))
    leader = paths[-1][0]
    decoders, steppers = {}, {}
    for name, path_model, attention in paths:
        path_shape = model_shape(path_model)
        cache = PagedKVCache.allocate(path_shape, num_pages=rows * pages_per_row + 1, page_size=page_size)
        decoders[name] = PagedDecoder(
            path_model, cache, num_rows=rows, max_row_tokens=max_row_tokens, attention=attention
        )
        assert decoders[name].attention == attention
        # Graphs first: their warm-up steps write page-table column 0 of every row.
        steppers[name] = DecodeGraphs(decoders[name], use_graphs=graphs)
        decoders[name].page_table_R_M.copy_(table_R_M)
    prompts_N_L = torch.randint(3, 300, (rows, max(prompt_lengths)), generator=generator).to(shape.device)
    lengths_N = torch.tensor(prompt_lengths, device=shape.device)
    rows_N = torch.arange(rows, device=shape.device)
    difference = {name: 0.0 for name, _, _ in paths}
    other_tokens: dict[str, list] = {name: [] for name, _, _ in paths}
    with torch.inference_mode():
        logits = {name: decoder.prefill(prompts_N_L, lengths_N, rows_N) for name, decoder in decoders.items()}
        positions = list(prompt_lengths)
        for step in range(steps):
            lead_B_V = logits[leader].float()
            tokens = lead_B_V.argmax(-1).tolist()
            scale = float(lead_B_V.abs().max())
            for name, logits_B_V in logits.items():
                gap = float((logits_B_V.float() - lead_B_V).abs().max()) / scale
                difference[name] = max(difference[name], gap)
                picked = logits_B_V.argmax(-1).tolist()
                other_tokens[name] += [(step, row) for row in range(rows) if picked[row] != tokens[row]]
            write_pages = [int(table_R_M[row, position // page_size]) for row, position in enumerate(positions)]
            for name, stepper in steppers.items():
                logits[name] = stepper.step(tokens, positions, write_pages)[:rows].clone()
            positions = [position + 1 for position in positions]
    return {"relative_logit_difference": difference, "other_tokens": other_tokens}


# ----- the child process under Triton's interpreter ----------------------------------------------


def interpreted_results() -> dict:
    """What `_interpreted_main` prints, run in a child with TRITON_INTERPRET=1 (once a session)."""
    return run_interpreted(__file__)


def _interpreted_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    errors = {case.name: kernel_error(case, "cpu", seed) for seed, case in enumerate(INTERPRETED_CASES)}
    decoding = {
        f"S{page_size}": decode_both_ways(qwen2_model(torch.float32, "cpu"), [3, 16, 40, 70], 6, page_size, False)
        for page_size in (16, 1)
    }
    print(json.dumps({"kernel_errors": errors, "decoding": decoding, "cases": [asdict(c) for c in INTERPRETED_CASES]}))


# ----- tests ---------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("case", INTERPRETED_CASES, ids=lambda case: case.name)
def test_kernel_matches_float64_reference_interpreted(case: Case) -> None:
    error = interpreted_results()["kernel_errors"][case.name]
    assert error < TOLERANCE[case.dtype], f"{case}: relative error {error:.2e}"


@needs_triton
@pytest.mark.parametrize("page_size", [16, 1])
def test_paged_decoder_kernel_equals_gather_interpreted(page_size: int) -> None:
    result = interpreted_results()["decoding"][f"S{page_size}"]
    assert result["other_tokens"]["kernel"] == []
    assert result["relative_logit_difference"]["kernel"] < 1e-5


@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda case: case.name)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or TRITON_MISSING, reason="needs CUDA and triton")
def test_kernel_matches_float64_reference_on_cuda(case: Case) -> None:
    for seed in range(3):  # fresh inputs each time: the same function on any valid input
        error = kernel_error(case, "cuda", seed)
        assert error < TOLERANCE[case.dtype], f"{case} (seed {seed}): relative error {error:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or TRITON_MISSING, reason="needs CUDA and triton")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_decoder_kernel_equals_gather_on_cuda(dtype: str, graphs: bool) -> None:
    """float32: the same greedy token at every step and logits to rounding. bf16: the two paths round
    differently (the kernel rounds the weights of the value product, SDPA in its own order), and a
    random model's near-ties flip either path's token now and then; so both run beside the float32
    model (which picks the tokens), and the kernel must be as close to it as the gather path is."""
    prompt_lengths = [3, 16, 40, 70, 130, 17, 1, 90]
    model = qwen2_model(DTYPES[dtype], "cuda")
    if dtype == "float32":
        result = decode_both_ways(model, prompt_lengths, 40, 16, graphs)
        assert result["other_tokens"]["kernel"] == []
        assert result["relative_logit_difference"]["kernel"] < 1e-4
        return
    result = decode_both_ways(model, prompt_lengths, 40, 16, graphs, reference_model=qwen2_model(torch.float32, "cuda"))
    difference, other_tokens = result["relative_logit_difference"], result["other_tokens"]
    assert difference["kernel"] <= 1.5 * difference["gather"] + 1e-3, result
    assert len(other_tokens["kernel"]) <= 2 * len(other_tokens["gather"]) + 3, result
    assert len(other_tokens["kernel"]) < 0.1 * 40 * len(prompt_lengths), result


def test_kernel_availability_and_the_decoders_choice(monkeypatch) -> None:
    """No triton needed: what the kernel refuses, and that the CPU decoder keeps the gather path."""
    from test_worker_static_decode import tiny_model

    from slime_meta_engine.fast_path.model_support import model_shape

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA" in paged_attention_unavailable_reason(torch.device("cpu"), torch.float32, 64)
    assert "power of two" in paged_attention_unavailable_reason(torch.device("cuda"), torch.bfloat16, 96)
    assert "power of two" in paged_attention_unavailable_reason(torch.device("cuda"), torch.bfloat16, 512)
    assert "dtype" in paged_attention_unavailable_reason(torch.device("cuda"), torch.float64, 64)
    if not TRITON_MISSING:
        assert paged_attention_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128) is None
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert paged_attention_unavailable_reason(torch.device("cpu"), torch.float32, 64) is None
        monkeypatch.delenv("TRITON_INTERPRET")

    model = tiny_model("qwen2")
    cache = PagedKVCache.allocate(model_shape(model), num_pages=9, page_size=16)
    assert PagedDecoder(model, cache, num_rows=2, max_row_tokens=64).attention == "gather"
    with pytest.raises(ValueError, match="cannot run"):
        PagedDecoder(model, cache, num_rows=2, max_row_tokens=64, attention="kernel")
    with pytest.raises(ValueError, match="give one of"):
        PagedDecoder(model, cache, num_rows=2, max_row_tokens=64, attention="flash")


def test_split_count_depends_on_shapes_only() -> None:
    # Few rows: splits until the GPU (132 multiprocessors) is full, never less than a block each
    # (64 tokens for heads of 64) and never more than 64.
    assert choose_num_splits(8, 2, 256, 64, 132) == 4
    assert choose_num_splits(8, 2, 1024, 64, 132) == 16
    assert choose_num_splits(1, 2, 4400, 64, 132) == 64
    assert choose_num_splits(8, 2, 16, 64, 132) == 1
    # Many rows fill the GPU anyway; the longest row still comes in ranges of about 256 tokens.
    assert choose_num_splits(64, 2, 1024, 128, 132) == 5
    assert choose_num_splits(64, 2, 4400, 128, 132) == 18


if __name__ == "__main__":
    _interpreted_main()
