"""The Triton kernel of sampling.py's one-kernel token choice (imported there on first use:
importing this module imports triton). sampling.py says what it computes.
"""

import triton
import triton.language as tl


@triton.jit
def _scaled_block(logits_row, start, vocab, temperature, BLOCK: tl.constexpr):
    """Columns start..start+BLOCK-1 of a row as float32 logits / T, -inf past the vocabulary."""
    index = start + tl.arange(0, BLOCK)
    inside = index < vocab
    logits = tl.load(logits_row + index, mask=inside, other=0.0).to(tl.float32)
    return tl.where(inside, tl.math.div_rn(logits, temperature), float("-inf")), index


@triton.jit
def _gumbel_scores(scaled, index, row, vocab, seed, greedy):
    """logits / T plus Gumbel noise G = -log(-log(U)) (none for a greedy row); U = 0 gives -inf."""
    uniform = tl.rand(seed, (row * vocab + index).to(tl.int32))
    return tl.where(greedy, scaled, scaled - tl.log(-tl.log(uniform)))


@triton.jit
def choose_tokens(
    logits_ptr,
    stride_row,
    temperatures_ptr,
    greedy_ptr,
    seed,
    token_ids_ptr,
    logprobs_ptr,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: the max of logits / T; then, in a second pass, the sum of exp(logits / T - max) and
    the argmax of the Gumbel scores (Gumbel-max: a token with probability softmax(logits / T));
    the chosen token's log-softmax. Each pass starts from its first block, so that every running
    value is a reduction's scalar from the start."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    logits_row = logits_ptr + row * stride_row

    scaled, index = _scaled_block(logits_row, 0, VOCAB, temperature, BLOCK)
    largest = tl.max(scaled, 0)
    for start in range(BLOCK, VOCAB, BLOCK):
        scaled, index = _scaled_block(logits_row, start, VOCAB, temperature, BLOCK)
        largest = tl.maximum(largest, tl.max(scaled, 0))

    scaled, index = _scaled_block(logits_row, 0, VOCAB, temperature, BLOCK)
    total = tl.sum(tl.exp(scaled - largest), 0)
    score = tl.where(index < VOCAB, _gumbel_scores(scaled, index, row, VOCAB, seed, greedy), float("-inf"))
    best_score = tl.max(score, 0)
    best_index = tl.argmax(score, 0).to(tl.int64)  # the first of equal maxima, as torch.argmax
    for start in range(BLOCK, VOCAB, BLOCK):
        scaled, index = _scaled_block(logits_row, start, VOCAB, temperature, BLOCK)
        total += tl.sum(tl.exp(scaled - largest), 0)
        score = tl.where(index < VOCAB, _gumbel_scores(scaled, index, row, VOCAB, seed, greedy), float("-inf"))
        block_best = tl.max(score, 0)
        better = block_best > best_score  # strictly: an earlier block keeps a tie
        best_index = tl.where(better, start + tl.argmax(score, 0).to(tl.int64), best_index)
        best_score = tl.maximum(best_score, block_best)

    chosen = tl.math.div_rn(tl.load(logits_row + best_index).to(tl.float32), temperature)
    tl.store(token_ids_ptr + row, best_index)
    tl.store(logprobs_ptr + row, (chosen - largest) - tl.log(total))
