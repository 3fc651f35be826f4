"""Channel 3 (replay DPO) on slime: each pair as two samples whose advantages carry DPO's gradient.

At the current policy, DPO's loss -log sigmoid(b * margin), margin = (pi_c - ref_c) - (pi_r - ref_r)
(summed response log-probs, temperature 1), has the gradient of a weighted log-likelihood:

    grad = -w * (grad log pi(chosen) - grad log pi(rejected)),   w = b * sigmoid(-b * margin)

so a chosen sample with token advantage +replay_beta * w and a rejected one with -replay_beta * w,
trained by the policy-gradient surrogate at ratio 1 (slime's single step per rollout), give
replay_beta times DPO's gradient; their kind's denominator is the step's pair count
(`train_data.py`), so the step takes DPO's mean over pairs. Everything in w is known at rollout
time: pi_* from the scoring call on the policy's pool (the weights about to be trained), ref_*
under the start weights, computed once per pair by scoring on the frozen pool of the start
checkpoint and cached with the pair decisions (`ReplayPairer.reference_logps_for`), as the local
trainer caches its reference model's values. The loss value is the surrogate's, not DPO's; the
gradient is DPO's (`tests/test_slime_equivalence.py`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Sequence

from slime_meta.types import Chain, PreferencePair, SolverSample

Scorer = Callable[[Sequence[int], Sequence[int]], Awaitable[list[float]]]


@dataclass(frozen=True)
class ReplaySample:
    """One side of a pair, ready for slime: its tokens, the policy's log-probs, its advantage."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    policy_logprobs: tuple[float, ...]
    advantage: float
    pair_index: int
    chosen: bool


def dpo_weight(
    policy_chosen: float, policy_rejected: float, ref_chosen: float, ref_rejected: float, beta: float
) -> float:
    """w = beta * sigmoid(-beta * margin): DPO's gradient weight of one pair at the current policy."""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return beta / (1.0 + math.exp(beta * margin))


def replay_samples(
    pairs: Sequence[PreferencePair],
    policy_logprobs: Sequence[tuple[list[float], list[float]]],
    replay_beta: float,
    dpo_beta: float,
    first_pair: int = 0,
) -> list[ReplaySample]:
    """Two samples per pair (chosen, rejected), each pair with its reference log-probs."""
    out = []
    for n, (pair, (chosen_lp, rejected_lp)) in enumerate(zip(pairs, policy_logprobs)):
        w = dpo_weight(
            sum(chosen_lp), sum(rejected_lp), pair.reference_chosen_logp, pair.reference_rejected_logp, dpo_beta
        )
        for ids, logps, sign in ((pair.chosen_ids, chosen_lp, 1.0), (pair.rejected_ids, rejected_lp, -1.0)):
            out.append(
                ReplaySample(
                    tuple(pair.prompt_ids), tuple(ids), tuple(logps), sign * replay_beta * w, first_pair + n, sign > 0
                )
            )
    return out


async def pairs_by_chain(
    replayer,
    chains: Sequence[Chain],
    solver_by_chain: Sequence[Sequence[SolverSample]],
    tokenizer,
    reference: Scorer,
    reference_id: str,
    loop_run: Callable[[Awaitable[Any]], Any],
):
    """The replay pairs of each chain's solver samples, with reference log-probs (cached)."""
    from slime_meta.replay.pairs import ReplayRequest

    labels = {problem.uid: problem.ground_truth for chain in chains for problem in chain.problems}
    owners, requests = {}, []
    for c, samples in enumerate(solver_by_chain):
        for x in samples:
            request = ReplayRequest.build(x.prompt_text, x.solution_text, x.problem_uid, labels.get(x.problem_uid))
            owners[request.key] = (c, x)
            requests.append(request)
    made: list[tuple[int, PreferencePair]] = []
    for pair in await replayer.pairs_for(requests):
        c, x = owners[pair.key]
        chosen_ids = tuple(tokenizer(pair.chosen, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            chosen_ids += (tokenizer.eos_token_id,)
        made.append((c, PreferencePair(x.prompt_ids, chosen_ids, x.response_ids)))
    if not made:
        return [[] for _ in chains]

    def score_reference(pairs: list[PreferencePair]) -> list[PreferencePair]:  # runs in a worker thread
        async def one(p: PreferencePair) -> PreferencePair:
            chosen, rejected = await asyncio.gather(
                reference(p.prompt_ids, p.chosen_ids), reference(p.prompt_ids, p.rejected_ids)
            )
            return replace(p, reference_chosen_logp=sum(chosen), reference_rejected_logp=sum(rejected))

        async def all_pairs() -> list[PreferencePair]:
            return list(await asyncio.gather(*[one(p) for p in pairs]))

        return loop_run(all_pairs())

    with_reference = await asyncio.to_thread(
        replayer.reference_logps_for, [p for _, p in made], score_reference, reference_id
    )
    out: list[list[PreferencePair]] = [[] for _ in chains]
    for (c, _), pair in zip(made, with_reference):
        out[c].append(pair)
    return out
