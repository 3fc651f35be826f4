"""Prompt search, the two methods: reflective mutation over a Pareto front (GEPA-style), and a fixed
list of hand-written instructions.

benchmarks/prompt_search.py describes the search.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Sequence

from _common import REPO_ROOT
from prompt_search_candidates import (
    Budget,
    Candidate,
    Evaluation,
    attempts_of,
    join_template,
    literal_braces,
    make_template,
    score,
    search_settings,
    split_template,
    written_braces,
)
from prompt_search_reflection import propose

from slime_meta.prompt_templates import read_template_file
from slime_meta.types import Episode

# ----------------------------------------------------------------------------- the two methods


def pareto_front(candidates: Sequence[Candidate]) -> dict[int, int]:
    """Candidate id -> on how many teacher prompts of the Pareto set it is best (ties count for each),
    dominated candidates left out (GEPA's candidate selection)."""
    scored = [c for c in candidates if c.pareto_scores]
    wins: dict[int, int] = {}
    for i in range(len(scored[0].pareto_scores)):
        best = max(c.pareto_scores[i] for c in scored)
        for c in scored:
            if c.pareto_scores[i] >= best - 1e-12:
                wins[c.id] = wins.get(c.id, 0) + 1
    by_id = {c.id: c for c in scored}

    def dominated(a: Candidate) -> bool:
        return any(
            b.id != a.id
            and all(x >= y for x, y in zip(b.pareto_scores, a.pareto_scores))
            and any(x > y for x, y in zip(b.pareto_scores, a.pareto_scores))
            for b in (by_id[i] for i in wins)
        )

    return {i: n for i, n in wins.items() if not dominated(by_id[i])}


class Search:
    """Both methods over one run's rollout, data and budget; every score printed and recorded."""

    def __init__(self, cfg, rollout, seed_template, budget: Budget, pareto, feedback, draw_sizes, opts, reflect, fits):
        self.cfg, self.rollout, self.seed_template, self.budget = cfg, rollout, seed_template, budget
        self.pareto, self.feedback, self.draw_sizes, self.opts = pareto, feedback, draw_sizes, opts
        self.reflect, self.fits = reflect, fits
        self.instruction, self.scaffold = split_template(seed_template.text)
        seed = Candidate(0, "seed", self.instruction, seed_template)
        self.candidates: list[Candidate] = [seed]
        self.rounds: list[dict] = []
        self.refused: list[dict] = []  # hand-written instructions that cannot be used (too long for the context)
        self.evaluations = 0
        self.rng = random.Random(cfg.seed)
        self.started = time.monotonic()

    def cost(self, episodes) -> int:
        return attempts_of(episodes, search_settings(self.rollout.settings))

    def log(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        print(
            f"[prompt search {elapsed:6.0f} s, {self.budget.spent:,}/{self.budget.total:,} student answers] {text}",
            flush=True,
        )

    async def evaluate(self, candidate: Candidate, episodes) -> Evaluation:
        self.evaluations += 1
        return await score(self.rollout, candidate.template, episodes, self.evaluations, self.cfg.seed)

    async def on_pareto(self, candidate: Candidate) -> None:
        evaluation = await self.evaluate(candidate, self.pareto)
        candidate.pareto_scores = evaluation.per_prompt
        self.log(f"candidate {candidate.id} ({candidate.origin}): {candidate.score:.3f} on the Pareto set")

    def minibatch(self) -> list[Episode]:
        return [e for _ in range(self.opts.minibatch_batches) for e in self.feedback.next_episodes(**self.draw_sizes)]

    async def reflect_rounds(self) -> None:
        await self.on_pareto(self.candidates[0])
        failures = 0
        for number in range(1, self.opts.max_rounds + 1):
            batch = self.minibatch()
            if not self.budget.affords(2 * self.cost(batch) + self.cost(self.pareto)):
                self.log(f"stop: round {number} could spend more than the {self.budget.left:,} answers left")
                break
            front = pareto_front(self.candidates)
            parent_id = self.rng.choices(list(front), weights=list(front.values()))[0]
            parent = next(c for c in self.candidates if c.id == parent_id)
            before = await self.evaluate(parent, batch)
            parent.minibatch_scores.append({"round": number, "score": before.score})
            proposal = await propose(
                parent,
                before,
                self.reflect,
                new_id=len(self.candidates),
                scaffold=self.scaffold,
                seed=self.seed_template,
                fits=self.fits,
                examples=self.opts.reflection_examples,
                answers=self.opts.reflection_answers,
                chars=self.opts.reflection_chars,
            )
            record = {"round": number, "parent": parent.id, "parent_minibatch": before.score, "reply": proposal.reply}
            self.rounds.append(record)
            if proposal.candidate is None:
                record["refused"] = proposal.refused
                self.log(f"round {number}: parent {parent.id} {before.score:.3f}; no candidate ({proposal.refused})")
                failures += 1
                if failures >= self.opts.max_failed_proposals:
                    self.log(f"stop: {failures} proposals in a row gave no candidate")
                    break
                continue
            failures = 0
            child = proposal.candidate
            after = await self.evaluate(child, batch)
            child.minibatch_scores.append({"round": number, "score": after.score})
            accepted = after.score > before.score
            record.update(child=child.id, child_minibatch=after.score, accepted=accepted)
            self.log(
                f"round {number}: parent {parent.id} {before.score:.3f}, child {after.score:.3f} on the minibatch: "
                + ("kept" if accepted else "dropped")
            )
            if accepted:
                self.candidates.append(child)
                await self.on_pareto(child)
            else:
                record["dropped"] = child.record()

    async def hand_written(self, instructions: Sequence[str]) -> None:
        """The seed and each hand-written instruction, scored on the same step draws: the Pareto set,
        and as many more draws of its size as the budget pays for with every candidate scored on
        them (candidates past the budget are not scored)."""
        for text in instructions:
            text = text.strip()
            if "{attempts_and_grades}" in text:  # a whole template: its own instruction and slots
                instruction, scaffold = split_template(text)
            else:  # an instruction, its braces literal
                instruction, scaffold = literal_braces(text), self.scaffold
            if any(c.instruction == instruction and c.template.text.endswith(scaffold) for c in self.candidates):
                continue
            number = len(self.candidates)
            template = make_template(self.seed_template, join_template(instruction, scaffold), f"candidate {number}")
            refused = self.fits(template)
            if refused:
                self.refused.append({"instruction": written_braces(instruction), "refused": refused})
                self.log(f"a hand-written instruction is left out: {refused}")
                continue
            self.candidates.append(Candidate(number, "hand-written", instruction, template))
        repeats = max(1, self.budget.left // (self.cost(self.pareto) * len(self.candidates)))
        for _ in range(repeats - 1):
            self.pareto += [
                e for _ in range(self.opts.pareto_batches) for e in self.feedback.next_episodes(**self.draw_sizes)
            ]
        for candidate in self.candidates:
            if not self.budget.affords(self.cost(self.pareto)):
                self.log(f"stop: candidate {candidate.id} could spend more than the {self.budget.left:,} answers left")
                break
            await self.on_pareto(candidate)

    def best(self) -> Candidate:
        scored = [c for c in self.candidates if c.score is not None]
        return max(scored, key=lambda c: (c.score, -c.id))


HAND_WRITTEN = (
    # The project's other hand-written prompt (prompt_templates/teacher_rules.txt) is added from its file.
    "You are a teacher. The student will see only each problem and the additional information you write: not the "
    "rubric, not the grades, not these instructions. Copy into your information every rule, fact, price or answer "
    "format the rubric states and the problems do not, plainly. Then add one sentence on the method. Do not give the "
    "answer to any specific problem.",
    "You are a teacher. Write additional information for a student who will solve problems like the ones below "
    "without seeing the rubric. State the rule or fact the rubric relies on, show one short worked example on a "
    "problem of your own, and say how the final answer must be written. Do not solve the problems shown.",
    "You are a teacher. Read the graded attempts: name the mistakes that lost credit and the right approach, and "
    "state any fact from the rubric the student lacked. At most three short sentences, addressed to the student; "
    "no answers to the problems shown.",
    "You are a teacher. The student is graded against the rubric below, which it cannot see. Tell the student in two "
    "or three sentences exactly what the rubric requires: the facts it gives, the method, and the form of the final "
    "answer (for example one last line 'Answer: <number>'). Do not give answers to specific problems.",
)


def hand_written_instructions(path: str | None) -> list[str]:
    """`--candidates FILE` (instructions, or whole templates, separated by lines of `---`), else the built-in list."""
    if path:
        parts = [p.strip() for p in re.split(r"^---\s*$", Path(path).read_text(encoding="utf-8"), flags=re.M)]
        return [p for p in parts if p]
    rules, _ = split_template(read_template_file(str(REPO_ROOT / "prompt_templates/teacher_rules.txt")))
    return [written_braces(rules), *HAND_WRITTEN]
