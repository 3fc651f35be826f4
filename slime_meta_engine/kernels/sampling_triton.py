"""The Triton kernels of sampling.py's token choice without torch's ops (imported there on first
use: importing this module imports triton). sampling.py says what they compute.

A row's vocabulary is cut into chunks, one program each, so that a few dozen rows still fill the
GPU: `chunk_choice` finds a chunk's largest logits / T, its sum of exp(logits / T - that largest)
and its best Gumbel score with the token holding it; `combine_chunks` merges a row's chunks into
the token and its log-softmax.
"""

import triton
import triton.language as tl


@triton.jit
def _scaled_block(logits_row, start, end, temperature, BLOCK: tl.constexpr):
    """Columns start..start+BLOCK-1 of a row (those before `end`) as float32 logits / T, else -inf."""
    index = start + tl.arange(0, BLOCK)
    inside = index < end
    logits = tl.load(logits_row + index, mask=inside, other=0.0).to(tl.float32)
    return tl.where(inside, tl.math.div_rn(logits, temperature), float("-inf")), index


@triton.jit
def _gumbel_scores(scaled, index, row, VOCAB: tl.constexpr, seed, greedy):
    """logits / T plus Gumbel noise G = -log(-log(U)) (none for a greedy row). argmax of these picks
    a token with probability softmax(logits / T); U = 0 gives -inf, never chosen."""
    uniform = tl.rand(seed, (row * VOCAB + index).to(tl.int32))
    return tl.where(greedy, scaled, scaled - tl.log(-tl.log(uniform)))


# A new seed every call: specialising on its value (Triton does so for integers divisible by 16, or
# equal to 1) would compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["seed"])
def chunk_choice(
    logits_ptr,
    stride_row,
    temperatures_ptr,
    greedy_ptr,
    seed,
    largest_ptr,
    total_ptr,
    best_score_ptr,
    best_index_ptr,
    VOCAB: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, chunk). Each pass starts from the chunk's first block, so every running value
    is a reduction's scalar from the start; the second pass reads what the first left in cache."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    logits_row = logits_ptr + row * stride_row
    first = chunk * CHUNK
    end = tl.minimum(first + CHUNK, VOCAB)

    scaled, index = _scaled_block(logits_row, first, end, temperature, BLOCK)
    largest = tl.max(scaled, 0)
    for offset in range(BLOCK, CHUNK, BLOCK):
        scaled, index = _scaled_block(logits_row, first + offset, end, temperature, BLOCK)
        largest = tl.maximum(largest, tl.max(scaled, 0))

    scaled, index = _scaled_block(logits_row, first, end, temperature, BLOCK)
    total = tl.sum(tl.exp(scaled - largest), 0)
    score = tl.where(index < end, _gumbel_scores(scaled, index, row, VOCAB, seed, greedy), float("-inf"))
    best_score = tl.max(score, 0)
    best_index = first + tl.argmax(score, 0)  # the first of equal maxima, as torch.argmax
    for offset in range(BLOCK, CHUNK, BLOCK):
        scaled, index = _scaled_block(logits_row, first + offset, end, temperature, BLOCK)
        total += tl.sum(tl.exp(scaled - largest), 0)
        score = tl.where(index < end, _gumbel_scores(scaled, index, row, VOCAB, seed, greedy), float("-inf"))
        block_best = tl.max(score, 0)
        better = block_best > best_score  # strictly: an earlier block keeps a tie
        best_index = tl.where(better, first + offset + tl.argmax(score, 0), best_index)
        best_score = tl.maximum(best_score, block_best)

    out = row * CHUNKS + chunk
    tl.store(largest_ptr + out, largest)
    tl.store(total_ptr + out, total)
    tl.store(best_score_ptr + out, best_score)
    tl.store(best_index_ptr + out, best_index)


@triton.jit
def combine_chunks(
    logits_ptr,
    stride_row,
    temperatures_ptr,
    largest_ptr,
    total_ptr,
    best_score_ptr,
    best_index_ptr,
    token_ids_ptr,
    logprobs_ptr,
    CHUNKS: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    """Program (row): the row's largest over its chunks, its sum of exp rescaled to it, the chunk
    with the best score (the first among equals: an earlier chunk holds earlier tokens)."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_BLOCK)
    inside = chunks < CHUNKS
    at = row * CHUNKS + chunks
    largest_C = tl.load(largest_ptr + at, mask=inside, other=float("-inf"))
    total_C = tl.load(total_ptr + at, mask=inside, other=0.0)
    best_score_C = tl.load(best_score_ptr + at, mask=inside, other=float("-inf"))
    largest = tl.max(largest_C, 0)
    total = tl.sum(tl.where(inside, total_C * tl.exp(largest_C - largest), 0.0), 0)
    best_chunk = tl.argmax(best_score_C, 0)
    token = tl.load(best_index_ptr + row * CHUNKS + best_chunk)
    temperature = tl.load(temperatures_ptr + row)
    chosen = tl.math.div_rn(tl.load(logits_ptr + row * stride_row + token).to(tl.float32), temperature)
    tl.store(token_ids_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, (chosen - largest) - tl.log(total))
